"""`MaskedAttention`: a kind whose pattern is a fixed boolean mask, run exactly as dense SDPA under that mask.

At the lengths of the image studies (a few thousand positions) a [T, T] boolean mask costs little (T² bytes:
64 MiB at 8,192) and SDPA with it is exact, forward and backward, on every device; a sparse kernel of each
2D pattern would buy speed, not a different function. Longer sequences are refused (`MAX_POSITIONS`) rather
than allowed to build a mask of gigabytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ..analysis.cost import mean_keys
from ..masks import MaskMod, dense_mask
from .base import ATTENTION, AttentionLayer

# A [T, T] boolean mask of 8,192² is 64 MiB, and SDPA's masked math path also materialises [B, H, T, T]
# scores: beyond this the dense mask, not the pattern, would set the cost.
MAX_POSITIONS = 8192


class MaskedAttention(AttentionLayer):
    """Base of the kinds that are one boolean pattern: `pattern(settings, causal)` gives its mask_mod from
    the kind's settings (by `ModelConfig` field name), `settings` holds the layer's own.

    `attend` runs `scaled_dot_product_attention` under the dense mask, built once per (T, device) and kept
    for the last one asked for. Every pattern here contains the diagonal (a query sees itself), so no row
    of the mask is empty and no softmax is over nothing.
    """

    settings: dict[str, Any]

    @classmethod
    def pattern(cls, settings: Mapping[str, Any], causal: bool) -> MaskMod:
        """The mask_mod of this kind under `settings` (its model settings by field name)."""
        raise NotImplementedError

    @classmethod
    def kind_name(cls) -> str:
        return next((n for n, kind in ATTENTION.items() if kind is cls), cls.__name__)

    @classmethod
    def keys_per_query(cls, model: Mapping[str, Any], n: int, causal: bool = True) -> float:
        """The mean number of keys a query of a length-n sequence sees (the pattern's mask, counted)."""
        return mean_keys(dense_mask(cls.pattern(model, causal), check_length(cls.kind_name(), n)))

    def mask(self, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """bool [n, n]: [i, j] = query i sees key j; kept for the last (n, device) asked for."""
        key = (n, torch.device(device))
        cached = getattr(self, "_mask", None)
        if cached is None or cached[0] != key:
            mask = dense_mask(self.pattern(self.settings, self.causal), check_length(self.kind_name(), n), key[1])
            self._mask = cached = key, mask
        return cached[1]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """q, k, v [B, H, T, D] -> [B, H, T, D]: softmax attention over the keys the pattern allows."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask(q.shape[2], q.device),
                                              dropout_p=self.attention_dropout)


def check_length(kind: str, n: int) -> int:
    """n, or a one-line ValueError when the [n, n] mask would be too large (`MAX_POSITIONS`)."""
    if n > MAX_POSITIONS:
        raise ValueError(f"{kind} attention takes at most {MAX_POSITIONS} positions (it runs dense attention "
                         f"under a T × T mask), got T = {n}")
    return n

