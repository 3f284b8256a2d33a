"""One progress-bar style for every command: a tqdm bar on stderr, named by what it counts.

    train:  40%|████      | 800/2000 [01:10<01:45, 11.4step/s, loss=1.2345, tok_s=52,113]
    eval:   75%|███████▌  | 24/32 [00:03<00:01, 7.9batch/s]

`piattn train`, `piattn eval` and tokenizing all draw theirs through `progress_bar`.
"""

from __future__ import annotations

import sys

from tqdm import tqdm


def progress_bar(total: int | None, *, desc: str, unit: str, initial: int = 0, enabled: bool = True,
                 file=None, iterable=None, unit_scale: bool = False) -> tqdm:
    """A bar counting `unit`s up to `total` (None: a count without a bar), labelled `desc`; drawn on `file`
    (default stderr) where `enabled`, at most ten redraws a second. With `iterable`, iterating the bar
    iterates it and counts each item. `unit_scale`: counts shown with SI prefixes (15.7MB for bytes)."""
    return tqdm(iterable, total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True, mininterval=0.1,
                disable=not enabled, file=sys.stderr if file is None else file, unit_scale=unit_scale)
