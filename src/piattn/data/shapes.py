"""Generated image-text data: two coloured shapes far apart on black, five captions naming both and their relation.

Each image (S × S pixels, RGB) holds two objects of different (colour, shape), drawn from COLOURS × SHAPES,
each 0.3·S wide, and placed far apart along one axis: their centres differ by at least S/2 along it
(at 32 pixels in patches of 4, four patch rows or columns) and by at most half as much along the other. The relation is
read along that axis ("above" / "below" with y growing downwards, "to the left of" / "to the right of").
Four captions state the relation, in both orders; one names the two objects only:

    a red circle above a blue square         a blue square below a red circle
    the red circle is above the blue square  the blue square is below the red circle
    a red circle and a blue square

Relating the two objects means relating patches several rows (or columns) apart, which is what a
model's attention has to carry. Everything is drawn from `numpy.random.default_rng(seed)`: the same seed
gives the same images and captions, bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch

from .images import ImageTensor
from .vl import CaptionedImages

COLOURS = {"red": (230, 40, 40), "green": (40, 190, 60), "blue": (50, 90, 245), "yellow": (240, 220, 50),
           "magenta": (220, 60, 220), "cyan": (60, 220, 230)}
SHAPES = ("circle", "square", "triangle")
INVERSE = {"above": "below", "below": "above", "to the left of": "to the right of",
           "to the right of": "to the left of"}
# Object half-width, a fraction of the side: smaller objects leave images so alike (mostly background) that
# a freshly initialised CLIP sits on the log(batch) plateau for hundreds of steps.
RADIUS = 0.15
MIN_GAP = 0.5  # least distance of the centres along the relation's axis, a fraction of the side


def _mask(shape: str, cx: float, cy: float, r: float, size: int) -> np.ndarray:
    """bool [size, size]: the pixels (centres at i + 0.5) inside the shape centred at (cx, cy)."""
    y, x = np.mgrid[0:size, 0:size] + 0.5
    if shape == "circle":
        return (x - cx) ** 2 + (y - cy) ** 2 <= r * r
    if shape == "square":  # about a circle's area
        return np.maximum(abs(x - cx), abs(y - cy)) <= 0.9 * r
    top = cy - r  # a triangle pointing up, base 2r at cy + r
    return (y >= top) & (y <= cy + r) & (abs(x - cx) <= (y - top) / 2)


def _centres(rng: np.random.Generator, size: int) -> np.ndarray:
    """float [2, 2] (x, y) of two centres far apart along one axis (rejection sampling)."""
    r = RADIUS * size
    while True:
        centres = rng.uniform(r, size - r, size=(2, 2))
        dx, dy = np.abs(centres[1] - centres[0])
        along, across = max(dx, dy), min(dx, dy)
        if along >= MIN_GAP * size and across <= along / 2:
            return centres


def relation(first: np.ndarray, second: np.ndarray) -> str:
    """Where centre `first` (x, y) lies relative to `second`, along the axis they differ most on."""
    dx, dy = first - second
    if abs(dy) >= abs(dx):
        return "above" if dy < 0 else "below"
    return "to the left of" if dx < 0 else "to the right of"


def captions(a: str, b: str, rel: str) -> list[str]:
    """The five captions of objects `a` and `b` (e.g. "red circle"), `a` `rel` `b`."""
    inv = INVERSE[rel]
    return [f"a {a} {rel} a {b}", f"a {b} {inv} a {a}", f"the {a} is {rel} the {b}", f"the {b} is {inv} the {a}",
            f"a {a} and a {b}"]


def generate(n: int, seed: int, size: int = 32) -> CaptionedImages:
    """n images uint8 [3, size, size] with five captions each (image i's are captions 5i … 5i + 4)."""
    if n < 1 or size < 8:
        raise ValueError(f"shapes needs n >= 1 and an image size >= 8 pixels, got n={n}, size={size}")
    rng = np.random.default_rng(seed)
    kinds = [(colour, shape) for colour in COLOURS for shape in SHAPES]
    images = np.zeros((n, size, size, 3), dtype=np.uint8)
    texts = []
    for i in range(n):
        first, second = rng.choice(len(kinds), size=2, replace=False)
        centres = _centres(rng, size)
        names = []
        for kind, (cx, cy) in zip((kinds[first], kinds[second]), centres, strict=True):
            colour, shape = kind
            images[i][_mask(shape, cx, cy, RADIUS * size, size)] = COLOURS[colour]
            names.append(f"{colour} {shape}")
        texts += captions(names[0], names[1], relation(centres[0], centres[1]))
    return CaptionedImages(ImageTensor(torch.from_numpy(images).permute(0, 3, 1, 2).contiguous()), texts,
                           torch.arange(n).repeat_interleave(5))
