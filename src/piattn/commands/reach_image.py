"""`piattn reach --image HxW`: which pixels one pixel of a raster-scanned image reaches, per kind and depth.

    piattn reach --image 7x7 --layers 4 [--window 4] [--period W] [--radius 1] [--stride W] [--out DIR]

The pixel is the bottom-centre one, (H − 1, W // 2): the last row, so every causal path has the whole image
above it, and the middle column, so the neighbourhood's window meets the left and right sides as late as it
can. For each kind (dense, local, π, neighbourhood, strided) and depth 1 … L the kind's own reach
(`AttentionLayer.lag_reach`, the analysis behind `piattn eval`'s reach marks) gives the lags this pixel
reaches, laid back on the image as Δ = Δrow·W + Δcol (`piattn.analysis.raster`). Causal attention only.
"""

from __future__ import annotations

import argparse
import re

import torch

from ..analysis.raster import raster_grid
from ..analysis.raster_report import format_image_reach, plot_image_reach
from ..layers import ATTENTION

IMAGE_KINDS = ("dense", "local", "pi", "neighbourhood", "strided")
IMAGE_NAME = "image_reach.png"
DEFAULT_LAYERS = 4
# keys per query is counted on each kind's [T, T] mask (64 MiB at 8,192 positions): H·W is kept to the
# reach report's own n cap; the text grids are one character a pixel.
MAX_PIXELS = 4096
MAX_LAYERS = 64


def parse_image(text: str) -> tuple[int, int]:
    """"HxW" -> (H, W), each >= 1 and H·W <= MAX_PIXELS; a one-line ValueError naming --image otherwise."""
    match = re.fullmatch(r"\s*(\d+)\s*[xX×]\s*(\d+)\s*", text)
    if not match or min(int(match[1]), int(match[2])) < 1:
        raise ValueError(f"--image must be HxW, the image's height and width in pixels (e.g. 7x7), got {text!r}")
    height, width = int(match[1]), int(match[2])
    if height * width > MAX_PIXELS:
        raise ValueError(f"--image {text}: at most {MAX_PIXELS} pixels (H·W), got {height * width}")
    return height, width


def image_settings(args: argparse.Namespace, width: int) -> dict:
    """The model settings of every kind (by `ModelConfig` field), checked: period and stride default to W."""
    settings = dict(window=args.window, period=width if args.period is None else args.period, radius=args.radius,
                    stride=width if args.stride is None else args.stride, image_width=width, n_head=1, sinks=0)
    for flag, low in (("window", 0), ("period", 1), ("radius", 0), ("stride", 1)):
        if settings[flag] < low:
            raise ValueError(f"--{flag} must be >= {low}, got {settings[flag]}")
    return settings


def bottom_centre(height: int, width: int) -> int:
    """The raster position of the pixel analysed: row H − 1, column W // 2."""
    return (height - 1) * width + width // 2


def image_grids(height: int, width: int, layers: int, settings: dict) -> dict[str, list[torch.Tensor]]:
    """{kind: [bool [H, W] grid of the pixels the bottom-centre pixel reaches after 1, …, layers layers]}."""
    position = bottom_centre(height, width)
    return {kind: [raster_grid(ATTENTION[kind].lag_reach({**settings, "n_layer": depth}, position).reachable,
                               width, position) for depth in range(1, layers + 1)]
            for kind in IMAGE_KINDS}


def kind_labels(settings: dict, pixels: int) -> dict[str, str]:
    """{kind: "pi (window 4, period 7): 5.8 keys per query"}, the mean over the image's queries."""
    shown = {"dense": (), "local": ("window",), "pi": ("window", "period"), "neighbourhood": ("radius",),
             "strided": ("stride",)}
    labels = {}
    for kind in IMAGE_KINDS:
        keys = ATTENTION[kind].keys_per_query({**settings, "n_layer": 1}, pixels)
        described = ", ".join(f"{name} {settings[name]}" for name in shown[kind])
        labels[kind] = f"{kind}{f' ({described})' if described else ''}: {keys:.1f} keys per query"
    return labels


def run_image(args: argparse.Namespace, out_path) -> int:
    """--image: refuse what does not apply, then print the grids and write the figure to out_path(name)."""
    height, width = parse_image(args.image)
    if args.bidirectional:
        raise ValueError("--bidirectional does not apply with --image: the 2D reach is of causal attention (a "
                         "pixel reads the pixels before it in raster order)")
    if args.sinks:
        raise ValueError(f"--sinks does not apply with --image, got {args.sinks}")
    layers = DEFAULT_LAYERS if args.layers is None else args.layers
    if not 1 <= layers <= MAX_LAYERS:
        raise ValueError(f"--layers must be in 1 … {MAX_LAYERS} with --image, got {layers}")
    settings = image_settings(args, width)
    out = out_path(IMAGE_NAME)
    position = bottom_centre(height, width)
    grids = image_grids(height, width, layers, settings)
    labels = kind_labels(settings, height * width)
    title = (f"reach of the bottom-centre pixel (row {height - 1}, column {width // 2}) of a {height}×{width} "
             f"image, causal, depth 1 … {layers}")
    print(f"{title}\n'{'o'}' the pixel, '#' a pixel it reaches, '.' one it does not; keys per query: the mean over "
          f"the image's {height * width} positions\n")
    print(format_image_reach(grids, labels, position, height))
    try:
        path = plot_image_reach(grids, labels, position, height, out, title)
    except ImportError as e:
        print(f"\nno figure: {e}")
        return 0
    print(f"\nfigure: {path}")
    return 0
