"""Longformer attention (Beltagy et al. 2020, "Longformer: The Long-Document Transformer") as a mask_mod.

Sliding window plus global tokens (§3.1 of the paper): query i sees key j when
- the offset j - i lies in the window: {-window, …, 0} (causal) or {-window, …, window} (bidirectional), or
- j is a global token (j < n_global): every query attends the global tokens, or
- i is a global token (i < n_global): a global query attends every key.
Causal mode additionally requires j <= i everywhere, so a global key is seen only by queries at or after it
and a global query sees only the keys at or before it. The global tokens are the first n_global positions
(the paper lets the task pick them, e.g. [CLS]; a fixed prefix is what a causal model can use).
"""

from __future__ import annotations

from ..checks import is_int
from .local import MaskMod, check_window


def check_count(name: str, value: int) -> None:
    """ValueError naming `name` unless value is an integer >= 0."""
    if not is_int(value) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")


def longformer_mask(window: int, n_global: int, causal: bool = True) -> MaskMod:
    """mask_mod(b, h, q_idx, kv_idx) -> bool: the sliding window of radius `window` plus n_global tokens.

    Only elementwise tensor ops on broadcasting index tensors, so FlexAttention (vmap, create_block_mask,
    compiled kernels) and `dense_mask` can all evaluate it.
    """
    check_window(window)
    check_count("n_global", n_global)

    def mask_mod(b, h, q_idx, kv_idx):
        offset = kv_idx - q_idx
        in_window = (offset >= -window) & (offset <= 0) if causal else offset.abs() <= window
        allowed = in_window | (kv_idx < n_global) | (q_idx < n_global)
        return allowed & (offset <= 0) if causal else allowed

    mask_mod.__name__ = f"longformer_w{window}_g{n_global}_{'causal' if causal else 'bidirectional'}"
    return mask_mod
