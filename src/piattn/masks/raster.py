"""Patterns of raster-scanned images (row by row, `width` pixels a row) as FlexAttention mask_mods.

Position p sits at row p // width, column p % width. A sequence longer than one image (or whose length is
not a multiple of the width) simply continues the rows at the same width: rows are cut every `width`
positions, the last one may be partial, and nothing wraps or restarts.

- `neighbourhood_mask`: 2D neighbourhood attention of radius r (Hassani et al. 2023, NATTEN's pattern
  *without* its border shift: NATTEN moves a border pixel's window inward so that every query sees
  (2r+1)² keys; here the window is clipped at the image's sides and top, so border pixels see fewer).
  Bidirectional: |Δrow| <= r and |Δcol| <= r. Causal: additionally key <= query in raster order, so the
  r rows above contribute 2r+1 keys each and the query's own row r+1 (itself included).
- `strided_mask`: the strided pattern of the Sparse Transformer (Child et al. 2019) with stride l.
  Causal: j <= i and (i − j < l or (i − j) % l == 0); bidirectional: |i − j| < l or |i − j| % l == 0.
  With l = the image width its second part is the column above (and below): every pixel of the column.
"""

from __future__ import annotations

from ..checks import is_int
from .local import MaskMod


def check_positive(name: str, value) -> None:
    """ValueError naming `name` unless value is an int >= 1."""
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def check_radius(radius) -> None:
    if not is_int(radius) or radius < 0:
        raise ValueError(f"radius must be an integer >= 0, got {radius!r}")


def neighbourhood_mask(width: int, radius: int, causal: bool = True) -> MaskMod:
    """mask_mod(b, h, q_idx, kv_idx) -> bool: key within `radius` rows and columns of the query on an image
    `width` pixels wide (module docstring), causal: not after the query. Elementwise ops only (vmap-safe)."""
    check_positive("image_width", width)
    check_radius(radius)

    def mask_mod(b, h, q_idx, kv_idx):
        near = ((q_idx // width - kv_idx // width).abs() <= radius) & \
               ((q_idx % width - kv_idx % width).abs() <= radius)
        return near & (kv_idx <= q_idx) if causal else near

    mask_mod.__name__ = f"neighbourhood_w{width}_r{radius}_{'causal' if causal else 'bidirectional'}"
    return mask_mod


def strided_mask(stride: int, causal: bool = True) -> MaskMod:
    """mask_mod(b, h, q_idx, kv_idx) -> bool: the Sparse Transformer's strided pattern (module docstring)."""
    check_positive("stride", stride)

    def mask_mod(b, h, q_idx, kv_idx):
        lag = q_idx - kv_idx
        distance = lag if causal else lag.abs()
        hit = (distance < stride) | (distance % stride == 0)
        return hit & (lag >= 0) if causal else hit

    mask_mod.__name__ = f"strided_l{stride}_{'causal' if causal else 'bidirectional'}"
    return mask_mod
