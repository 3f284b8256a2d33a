"""The π-Attention pattern U(i) = N_r(i) ∪ N_π(i) (Eqs. Nr, Npi, U) as a FlexAttention mask_mod.

Offsets j - i: causal {0, -1, …, -window} ∪ {-period}; bidirectional {-window, …, window} ∪ {±period}.
A skip offset that is already local (period <= window) adds nothing to the pattern.
"""

from __future__ import annotations

from ..checks import is_int
from .local import MaskMod, check_window, local_mask


def check_period(period: int) -> None:
    if not is_int(period) or period < 1:
        raise ValueError(f"period must be an integer >= 1, got {period!r}")


def pi_mask(window: int, period: int, causal: bool = True) -> MaskMod:
    """mask_mod(b, h, q_idx, kv_idx) -> bool: the local window of `local_mask` plus the key(s) at ±period.

    Elementwise tensor ops only (see `local_mask`), so it works under vmap and compiled flex_attention.
    """
    local, skip = local_mask(window, causal), skip_mask(window, period, causal)

    def mask_mod(b, h, q_idx, kv_idx):
        return local(b, h, q_idx, kv_idx) | skip(b, h, q_idx, kv_idx)

    mask_mod.__name__ = f"pi_w{window}_p{period}_{'causal' if causal else 'bidirectional'}"
    return mask_mod


def skip_mask(window: int, period: int, causal: bool = True) -> MaskMod:
    """mask_mod(b, h, q_idx, kv_idx) -> bool: the skip key(s) N_π(i) at -period (and +period when
    bidirectional) that are not already in the local window (none when period <= window)."""
    check_window(window)
    check_period(period)
    folded = period <= window

    def mask_mod(b, h, q_idx, kv_idx):
        offset = kv_idx - q_idx
        hit = (offset == -period) if causal else (offset.abs() == period)
        return hit & (not folded)

    mask_mod.__name__ = f"skip_w{window}_p{period}_{'causal' if causal else 'bidirectional'}"
    return mask_mod
