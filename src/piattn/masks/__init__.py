"""Sparse attention patterns as FlexAttention mask_mods, and a dense oracle that evaluates any of them.

A mask_mod is `mask_mod(b, h, q_idx, kv_idx) -> bool tensor`: True where query q_idx may attend key kv_idx.
The same functions feed FlexAttention's block masks, the dense oracles in tests and the reachability
analysis, so each pattern is defined exactly once.
"""

from __future__ import annotations

import torch

from .bigbird import bigbird_mask, random_blocks
from .local import MaskMod, local_mask
from .longformer import longformer_mask
from .pi import pi_mask, skip_mask
from .raster import neighbourhood_mask, strided_mask

__all__ = ["MaskMod", "bigbird_mask", "dense_mask", "local_mask", "longformer_mask", "neighbourhood_mask", "pi_mask",
           "random_blocks", "skip_mask", "strided_mask"]


def dense_mask(mask_mod: MaskMod, n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """bool [n, n]: [i, j] = mask_mod(0, 0, i, j), i.e. query i may attend key j (one batch, one head)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    idx = torch.arange(n, device=device)
    zero = torch.zeros((), dtype=idx.dtype, device=device)
    out = mask_mod(zero, zero, idx[:, None], idx[None, :])
    # a mask_mod that ignores q_idx or kv_idx returns a smaller broadcastable tensor
    return torch.broadcast_to(out, (n, n)).clone()
