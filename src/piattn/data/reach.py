"""A synthetic reach task: recall the token that sat exactly `lag` positions before a query marker.

One sequence of length seq_len, with query_pos = seq_len - 1:

    tokens[:query_pos]  independent uniform symbols 0 … vocab-1 (filler and answer alike)
    tokens[query_pos]   the query marker, id `vocab` (a model needs vocab + 1 input ids)
    target              tokens[query_pos - lag]

Every token but the one at query_pos - lag is independent of the target, so anything better than chance
(1/vocab) needs the output at query_pos to depend on the input at query_pos - lag: in the terms of
`piattn.analysis`, query i = query_pos must reach key j = query_pos - lag, a lag of d = lag.

Read the answer out at query_pos, nowhere else. A causal LM predicts the target from its logits at the
last position; an encoder classifier must pool the last position too. Mean pooling would void the
analysis: positions are fixed, so a per-position MLP at j could carry tokens[j] into the pool with no
attention at all.
"""

from __future__ import annotations

import torch

from ..analysis import min_depth
from ..checks import is_int


def _check(name: str, value: object, low: int, high: int | None = None) -> None:
    bad = not is_int(value) or value < low or (high is not None and value > high)
    if bad:
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an integer {allowed}, got {value!r}")


def generate(n: int, seq_len: int, lag: int, vocab: int = 16,
             seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(tokens int64 [n, seq_len], targets int64 [n], query_pos); query_pos = seq_len - 1.

    tokens[:, query_pos] is the query marker `vocab`; targets = tokens[:, query_pos - lag]. Needs
    1 <= lag <= seq_len - 1. Deterministic per seed.
    """
    _check("n", n, 0)
    _check("seq_len", seq_len, 2)
    _check("lag", lag, 1, seq_len - 1)
    _check("vocab", vocab, 2)
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n, seq_len), generator=generator, dtype=torch.int64)
    query_pos = seq_len - 1
    tokens[:, query_pos] = vocab
    return tokens, tokens[:, query_pos - lag].clone(), query_pos


def reachable(lag: int, window: int, period: int | None, layers: int, causal: bool = True) -> bool:
    """Whether `layers` attention layers let the query read the answer `lag` positions back.

    period=None is local-window attention alone. Uses `piattn.analysis.min_depth`, which is exact for
    causal models. For bidirectional ones it assumes a skip may overshoot the answer and come back, which
    needs up to period - 1 positions before it: exact when query_pos - lag >= period - 1.
    """
    _check("lag", lag, 1)
    _check("layers", layers, 0)
    depth = min_depth(lag, window, period, causal)
    return depth is not None and depth <= layers
