"""`StridedAttention`: the Sparse Transformer's strided pattern (Child et al. 2019), `masks.raster`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..analysis.copy_distance import Reach, reach
from ..config import ModelConfig
from ..masks import MaskMod
from ..masks.raster import check_positive, strided_mask
from .masked import MaskedAttention


def stride_of(settings: Mapping[str, Any]) -> int:
    """The stride l: `stride`, else `image_width`; a one-line ValueError naming both when neither is set."""
    stride = settings.get("stride")
    stride = settings.get("image_width") if stride is None else stride
    if stride is None:
        raise ValueError("stride must be set for strided attention, or image_width (its default: the width of "
                         "the raster-scanned images, which image tasks set from the data), got neither")
    check_positive("stride", stride)
    return stride


class StridedAttention(MaskedAttention):
    """Query i attends the keys less than `stride` positions away and those a multiple of `stride` away
    (causal: j <= i and (i − j < l or (i − j) % l == 0); bidirectional: |i − j| < l or |i − j| % l == 0),
    Child et al.'s two strided heads merged into one pattern. With l = image_width (the default) that is
    the previous row's worth of pixels plus every pixel of the column above: l + ⌊i / l⌋ keys for causal
    query i, O(√T) on a square image.

    Exact: dense SDPA under the pattern's mask (`MaskedAttention`), T <= 8,192.
    """

    def __init__(self, d_model: int, n_heads: int, *, image_width: int | None = None, stride: int | None = None,
                 causal: bool = True, dropout: float = 0.0, rotary: bool = False, rope_base: float = 10000.0):
        super().__init__(d_model, n_heads, causal=causal, dropout=dropout, rotary=rotary, rope_base=rope_base)
        self.settings = dict(stride=stride_of(dict(image_width=image_width, stride=stride)))

    @classmethod
    def config_kwargs(cls, cfg: ModelConfig, layer: int) -> dict:
        return dict(image_width=cfg.image_width, stride=cfg.stride)

    @classmethod
    def pattern(cls, settings: Mapping[str, Any], causal: bool) -> MaskMod:
        return strided_mask(stride_of(settings), causal)

    @classmethod
    def lag_reach(cls, model: Mapping[str, Any], max_lag: int) -> Reach:
        """Layer hops 0 … l − 1 and every multiple of l up to max_lag (the same at every position): π's
        analysis with window l − 1 and the multiples as periods. Its span is that of hops capped at max_lag."""
        stride = stride_of(model)
        multiples = tuple(range(stride, max_lag + 1, stride))
        return reach(stride - 1, (multiples,) * model["n_layer"], max_lag)
