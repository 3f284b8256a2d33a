"""Sliding-window attention (Eq. Nr) as a FlexAttention mask_mod.

Query i may see key j when the offset j - i lies in {-window, …, 0} (causal) or {-window, …, window}
(bidirectional). Positions outside [0, T) never reach a mask_mod: FlexAttention only evaluates in-range
indices, and `dense_mask` only passes in-range ones.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..checks import is_int

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def check_window(window: int) -> None:
    if not is_int(window) or window < 0:
        raise ValueError(f"window must be an integer >= 0, got {window!r}")


def local_mask(window: int, causal: bool = True) -> MaskMod:
    """mask_mod(b, h, q_idx, kv_idx) -> bool, broadcasting over integer index tensors.

    Only elementwise tensor ops, so it runs under vmap, `create_block_mask` and compiled flex_attention;
    `causal` is a Python constant fixed when the closure is built, not a branch on tensor values.
    """
    check_window(window)

    def mask_mod(b, h, q_idx, kv_idx):
        offset = kv_idx - q_idx
        if causal:
            return (offset <= 0) & (offset >= -window)
        return offset.abs() <= window

    mask_mod.__name__ = f"local_w{window}_{'causal' if causal else 'bidirectional'}"
    return mask_mod
