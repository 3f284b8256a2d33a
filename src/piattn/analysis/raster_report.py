"""The 2D reach report: per attention kind and depth, which pixels of an image one pixel reaches.

The grids come from `piattn.analysis.raster` (lags laid back on the image); this module only prints and
draws them. `piattn reach --image HxW` (piattn.commands.reach_image) puts the two together.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from ..safe_files import save_figure

PIXEL, REACHED, NOT_REACHED = "o", "#", "."


def grid_lines(grid: torch.Tensor, position: int, height: int) -> list[str]:
    """The text rows of one reach grid (bool [rows, W] from `raster_grid`) on an image `height` rows tall:
    'o' the pixel at `position`, '#' a pixel it reaches, '.' one it does not (rows below it: none reached)."""
    width = grid.shape[1]
    full = torch.zeros(height, width, dtype=torch.bool)
    full[: grid.shape[0]] = grid
    lines = ["".join(REACHED if cell else NOT_REACHED for cell in row.tolist()) for row in full]
    row, column = divmod(position, width)
    lines[row] = lines[row][:column] + PIXEL + lines[row][column + 1:]
    return lines


def format_image_reach(grids: Mapping[str, Sequence[torch.Tensor]], labels: Mapping[str, str], position: int,
                       height: int) -> str:
    """One block per kind: its label, then its grids at depth 1, 2, … side by side, each headed by its depth
    and the number of pixels reached (the pixel itself included)."""
    width = next(iter(grids.values()))[0].shape[1]
    column_width = max(width, 10)
    blocks = []
    for kind, by_depth in grids.items():
        heads = [f"L={d} {int(g.sum())}px".ljust(column_width) for d, g in enumerate(by_depth, 1)]
        panels = [grid_lines(g, position, height) for g in by_depth]
        rows = ["   ".join(p[r].ljust(column_width) for p in panels).rstrip() for r in range(height)]
        blocks.append("\n".join([labels[kind], "   ".join(heads).rstrip(), *rows]))
    return "\n\n".join(blocks)


def plot_image_reach(grids: Mapping[str, Sequence[torch.Tensor]], labels: Mapping[str, str], position: int,
                     height: int, out: str | Path, title: str) -> Path:
    """Write a PNG (or .pdf, .svg) of panels, one row per kind and one column per depth: reached pixels dark,
    the pixel red. Needs matplotlib (the `plot` extra)."""
    try:
        from matplotlib.colors import ListedColormap
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("the figure needs matplotlib: pip install piattn[plot]") from e

    kinds = list(grids)
    depths = len(grids[kinds[0]])
    width = grids[kinds[0]][0].shape[1]
    row, column = divmod(position, width)
    colours = ListedColormap(["#f4f4f4", "#303030", "#d62728"])  # not reached, reached, the pixel
    side = 1.6 * max(1.0, width / height) ** 0.5
    fig = Figure(figsize=(side * depths + 1.5, 1.6 * len(kinds) + 0.8), layout="constrained")
    axes = fig.subplots(len(kinds), depths, squeeze=False)
    for k, kind in enumerate(kinds):
        for d, grid in enumerate(grids[kind]):
            image = torch.zeros(height, width, dtype=torch.long)
            image[: grid.shape[0]] = grid.long()
            image[row, column] = 2
            ax = axes[k][d]
            ax.imshow(image.numpy(), cmap=colours, vmin=0, vmax=2, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if k == 0:
                ax.set_title(f"depth {d + 1}")
            if d == 0:
                # "pi (window 4, period 9): 5.7 keys per query" on three short lines beside the row
                ax.set_ylabel(labels[kind].replace(" (", "\n(").replace(": ", "\n"), fontsize=8)
    fig.suptitle(textwrap.fill(title, 36 * depths + 20), fontsize=9)  # narrow figures wrap it
    return save_figure(fig, out)
