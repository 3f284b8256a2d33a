"""Reach on raster-scanned images: the lags of `piattn.analysis` laid back on the image as (Δrow, Δcol).

An image of width W is scanned row by row, so the key Δrow rows up and Δcol columns left of a query is
lag Δ = Δrow·W + Δcol back (Δcol may be negative: the pixel up and to the right). A 1D kind (dense, local,
π, strided) reaches the same lags from every position, and `raster_grid` turns them into pixels. The 2D
neighbourhood does not: its window is clipped at the image's left and right sides, so a pixel near a side
reaches fewer lags, and `neighbourhood_reach` follows the pixel's column exactly instead of composing a
fixed lag set (which would wrap around the sides).

Only causal attention is analysed here, as in `Reach`: lags run from the query back to the key.
"""

from __future__ import annotations

import torch

from ..checks import is_int
from ..masks.raster import check_positive, check_radius
from .copy_distance import Reach


def _check_lag(max_lag) -> int:
    if not is_int(max_lag) or max_lag < 0:
        raise ValueError(f"max_lag must be an int >= 0, got {max_lag!r}")
    return int(max_lag)


def _causal_dilation(reached: torch.Tensor, radius: int) -> torch.Tensor:
    """bool [rows, W] -> the pixels a causal neighbourhood layer lets the reached pixels read: key (y, x) of
    query (y + dy, x + dx) for dy in 0 … r, |dx| <= r, and dx >= 0 when dy = 0 (a key of the same row is at
    or left of its query). Zero padding clips the window at the image's sides: nothing wraps."""
    rows, width = reached.shape
    padded = torch.zeros(rows + radius, width + 2 * radius, dtype=torch.bool)
    padded[:rows, radius:radius + width] = reached
    out = torch.zeros_like(reached)
    for dy in range(radius + 1):
        for dx in range(0 if dy == 0 else -radius, radius + 1):
            out |= padded[dy:dy + rows, radius + dx:radius + dx + width]
    return out


def neighbourhood_reach(width: int, radius: int, n_layer: int, max_lag: int) -> Reach:
    """The Reach of n_layer causal neighbourhood layers (radius r, images `width` wide) for the query at
    position max_lag (row max_lag // width, column c = max_lag % width), exactly: the reached pixels are
    dilated layer by layer on the image, clipped at its sides and top.

    Its span is the longest lag of any path on an image tall enough: L·r rows up and min(c, L·r) columns
    left, L·r·W + min(c, L·r)."""
    check_positive("image_width", width)
    check_radius(radius)
    if not is_int(n_layer) or n_layer < 0:
        raise ValueError(f"n_layer must be an int >= 0, got {n_layer!r}")
    max_lag = _check_lag(max_lag)
    rows, column = max_lag // width + 1, max_lag % width
    reached = torch.zeros(rows, width, dtype=torch.bool)
    reached[-1, column] = True
    for _ in range(n_layer):
        reached = _causal_dilation(reached, radius)
    # position j = max_lag − d: reversing positions 0 … max_lag gives lags 0 … max_lag
    lags = reached.flatten()[: max_lag + 1].flip(0)
    hops = n_layer * radius
    return Reach(lags, hops * width + min(column, hops))


def raster_grid(reachable: torch.Tensor, width: int, position: int) -> torch.Tensor:
    """bool [position // width + 1, width]: the pixels of the image (rows 0 … the query's) that the query at
    `position` reaches, from reachable [>= position + 1] over lags ([d] = key position − d is reached).
    Pixels after the query (the rest of its row) are False: causal attention never reads them."""
    check_positive("image_width", width)
    position = _check_lag(position)
    if reachable.dim() != 1 or reachable.numel() <= position:
        raise ValueError(f"reachable must cover the lags 0 … {position}, got shape {tuple(reachable.shape)}")
    rows = position // width + 1
    grid = torch.zeros(rows * width, dtype=torch.bool)
    grid[: position + 1] = reachable[: position + 1].flip(0)
    return grid.view(rows, width)


def raster_offsets(grid: torch.Tensor, position: int) -> list[tuple[int, int]]:
    """The (Δrow, Δcol) of every reached pixel of `raster_grid`'s grid relative to the query at `position`:
    Δrow rows up (>= 0), Δcol columns left (negative: right), so that lag = Δrow·W + Δcol; sorted."""
    width = grid.shape[1]
    row, column = divmod(position, width)
    ys, xs = grid.nonzero(as_tuple=True)
    return sorted(zip((row - ys).tolist(), (column - xs).tolist(), strict=True))
