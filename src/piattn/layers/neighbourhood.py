"""`NeighbourhoodAttention`: 2D neighbourhood attention on raster-scanned images (`masks.raster`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..analysis.copy_distance import Reach
from ..analysis.raster import neighbourhood_reach
from ..config import ModelConfig
from ..masks import MaskMod
from ..masks.raster import check_radius, neighbourhood_mask
from .masked import MaskedAttention


def require_width(kind: str, image_width) -> int:
    """image_width, or a one-line ValueError naming the setting when it is missing."""
    if image_width is None:
        raise ValueError(f"image_width must be set for {kind} attention (the width of the raster-scanned images "
                         "in the sequence; image tasks set it from the data), got None")
    return image_width


class NeighbourhoodAttention(MaskedAttention):
    """Query pixel (row, col) attends the pixels within `radius` rows and columns of it, on images
    `image_width` pixels wide scanned row by row; causal: only those at or before it in raster order, so
    r rows of 2r+1 keys above and r+1 keys of its own row (itself included): 2r² + 2r + 1 inside the image,
    (2r+1)² bidirectionally. NATTEN's pattern without its border shift (the window is clipped at the sides
    and top, not moved inward). A sequence longer than one image continues the rows at the same width.

    Exact: dense SDPA under the pattern's mask (`MaskedAttention`), T <= 8,192.
    """

    def __init__(self, d_model: int, n_heads: int, *, image_width: int | None = None, radius: int = 1,
                 causal: bool = True, dropout: float = 0.0, rotary: bool = False, rope_base: float = 10000.0):
        super().__init__(d_model, n_heads, causal=causal, dropout=dropout, rotary=rotary, rope_base=rope_base)
        self.settings = dict(image_width=require_width("neighbourhood", image_width), radius=radius)
        self.pattern(self.settings, causal)  # checks both

    @classmethod
    def config_kwargs(cls, cfg: ModelConfig, layer: int) -> dict:
        return dict(image_width=cfg.image_width, radius=cfg.radius)

    @classmethod
    def pattern(cls, settings: Mapping[str, Any], causal: bool) -> MaskMod:
        return neighbourhood_mask(require_width("neighbourhood", settings.get("image_width")),
                                  settings.get("radius", 1), causal)

    @classmethod
    def lag_reach(cls, model: Mapping[str, Any], max_lag: int) -> Reach:
        """The lags the query at position max_lag (column max_lag mod image_width) reaches, exactly: unlike the
        1D kinds, a query near the image's left or right side reaches fewer lags than one inside (the window
        is clipped there), so this is the reach of the last query of a length max_lag + 1 sequence."""
        radius = model.get("radius", 1)
        check_radius(radius)
        return neighbourhood_reach(require_width("neighbourhood", model.get("image_width")), radius,
                                   model["n_layer"], max_lag)
