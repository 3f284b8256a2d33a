"""The reach task at the size `piattn demo` and experiments/reach.py train it: one home for both."""

from __future__ import annotations

# Trains in ~15 s per run on one CPU thread (docs/results.md, reach task): window 2 and 2 layers reach 4
# tokens back locally; π = 8 adds lag 8 in one hop. Lag 5 neither reaches.
REACH = dict(window=2, period=8, layers=2, vocab=4, seq_len=32)
