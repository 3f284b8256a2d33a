"""Pathfinder (Linsley et al. 2018; LRA's pathfinder32): are the two marked dots on the same curve?

Each image holds two target curves of `contour_length` paddles and distractor curves of contour_length // 3
paddles (20 // that many of them, LRA's setting), lit at 255 on black. A curve is a walk of straight
paddles, each about PADDLE_LENGTH pixels long, in one of HEADINGS directions, turning by at most
MAX_TURN headings (45°) from one paddle to the next. Two 3×3 markers sit on curve ends: label 1 puts them
on both ends of the first target curve, label 0 on one end of each target curve (the pair of ends whose
distance is nearest to that of the first curve's own ends). Both target curves are drawn for either
label, so pixel counts do not give the label away, and the distance between the markers gives little
away; following a curve does. Longer contours (LRA's difficulties: 6 easy, 9 intermediate, 14 hard)
separate the markers by more pixels along the curve.

Simplifications against the original generator, chosen so the label is exact in pixels and generation
is fast: paddles join pixel to pixel (no gap, no anti-aliasing), so every curve is 8-connected; no two
curves (markers included) come within one pixel of each other, so a flood fill from one marker reaches
the other iff the label is 1; and paddles run between pixel centres in 16 directions, so each direction's
pixels are computed once. A curve is grown depth first: a paddle that would leave the image or touch
another curve is redrawn with another turn, and a dead end backtracks.
"""

from __future__ import annotations

import math
import random
import sys
from dataclasses import dataclass

import numpy as np
import torch

from ..checks import is_int

PADDLE_LENGTH = 3  # pixels; LRA's pathfinder32 has paddles of 2 pixels plus a 1-pixel margin
HEADINGS = 16  # paddle directions, 22.5° apart
MAX_TURN = 2  # in headings: at most 45° between consecutive paddles
LIT = 255
_DISTRACTOR_PADDLES = 20  # LRA: num_distractor_snakes = 20 // distractor_length
_TRIES_PER_PADDLE = 4  # turns tried at each paddle before backtracking
_PADDLES_PER_START = 10  # search budget of one start, per paddle of the curve
_STARTS_PER_CURVE = 20
_START_DRAWS = 20
_ATTEMPTS_PER_IMAGE = 50
_MAX_CONTOUR = 500  # the depth-first walk recurses once per paddle

Pixel = tuple[int, int]  # (row, column)


def _paddle_offsets(heading: int) -> tuple[Pixel, ...]:
    """Pixels (row, col) of a paddle leaving (0, 0) in direction `heading`, its end last and (0, 0) left
    out; sampled at most one pixel apart, so consecutive pixels are 8-neighbours."""
    angle = 2 * math.pi * heading / HEADINGS
    end_r, end_c = round(PADDLE_LENGTH * math.sin(angle)), round(PADDLE_LENGTH * math.cos(angle))
    steps = max(abs(end_r), abs(end_c))
    return tuple((round(end_r * s / steps), round(end_c * s / steps)) for s in range(1, steps + 1))


_PADDLES = tuple(_paddle_offsets(h) for h in range(HEADINGS))


@dataclass(frozen=True)
class Example:
    """One image with what drew it.

    image: uint8 [size, size]. curves: the pixels of each curve in drawing order (targets 0 and 1 first,
    then distractors), each curve 8-connected. markers: centres (row, col) of the two 3×3 markers.
    """

    image: np.ndarray
    label: int
    curves: tuple[tuple[Pixel, ...], ...]
    markers: tuple[Pixel, Pixel]


def _square(centre: Pixel) -> list[Pixel]:
    """The 3×3 block around `centre` (a marker, or the one-pixel clearance around a curve pixel)."""
    r, c = centre
    return [(r + dr, c + dc) for dr in (-1, 0, 1) for dc in (-1, 0, 1)]


def _walk(rng: random.Random, heading: int, paddles: int, size: int, blocked: set[Pixel], pixels: list[Pixel],
          budget: list[int]) -> bool:
    """Append `paddles` more paddles to the curve `pixels` (which ends at its last pixel), depth first.

    Paddle ends stay in [1, size - 2] so a 3×3 marker on a curve end fits in the image. budget[0] counts
    the paddles this search may still try.
    """
    if paddles == 0:
        return True
    r, c = pixels[-1]
    for _ in range(_TRIES_PER_PADDLE):
        if budget[0] <= 0:
            return False
        budget[0] -= 1
        turn = (heading + rng.randint(-MAX_TURN, MAX_TURN)) % HEADINGS
        paddle = [(r + dr, c + dc) for dr, dc in _PADDLES[turn]]
        end_r, end_c = paddle[-1]
        if not (1 <= end_r <= size - 2 and 1 <= end_c <= size - 2) or not blocked.isdisjoint(paddle):
            continue
        pixels += paddle
        if _walk(rng, turn, paddles - 1, size, blocked, pixels, budget):
            return True
        del pixels[-len(paddle):]
    return False


def _grow_curve(rng: random.Random, size: int, paddles: int, blocked: set[Pixel],
                marked_ends: bool) -> list[Pixel] | None:
    """Pixels of a curve of `paddles` paddles that avoids `blocked` (None if no start worked).

    With marked_ends the 3×3 marker squares on both ends must avoid `blocked` too.
    """
    for _ in range(_STARTS_PER_CURVE):
        # A few draws find a free start pixel even in a crowded image, so a start is seldom wasted.
        for _ in range(_START_DRAWS):
            start = (rng.randint(1, size - 2), rng.randint(1, size - 2))
            if start not in blocked:
                break
        else:
            continue
        pixels = [start]
        budget = [_PADDLES_PER_START * paddles]
        if not _walk(rng, rng.randrange(HEADINGS), paddles, size, blocked, pixels, budget):
            continue
        if not marked_ends or blocked.isdisjoint(_square(pixels[0]) + _square(pixels[-1])):
            return pixels
    return None


def _place_curves(rng: random.Random, size: int, contour_length: int) -> list[list[Pixel]] | None:
    """Two target curves then the distractors, each kept one pixel clear of those before it."""
    distractor_length = max(contour_length // 3, 1)
    lengths = [contour_length] * 2 + [distractor_length] * (_DISTRACTOR_PADDLES // distractor_length)
    blocked: set[Pixel] = set()
    curves = []
    for index, paddles in enumerate(lengths):
        is_target = index < 2
        curve = _grow_curve(rng, size, paddles, blocked, marked_ends=is_target)
        if curve is None:
            return None
        curves.append(curve)
        taken = curve + _square(curve[0]) + _square(curve[-1]) if is_target else curve
        for p in taken:
            blocked.update(_square(p))
    return curves


def sample(rng: random.Random, label: int, size: int = 32, contour_length: int = 14) -> Example:
    """Draw one example with the given label (0 or 1) from `rng`."""
    if label not in (0, 1):
        raise ValueError(f"label must be 0 or 1, got {label!r}")
    _check_image(size, contour_length)
    for _ in range(_ATTEMPTS_PER_IMAGE):
        curves = _place_curves(rng, size, contour_length)
        if curves is not None:
            break
    else:
        raise ValueError(f"could not fit two curves of contour_length={contour_length} and the distractors into "
                         f"a {size}×{size} image; use a larger size or a shorter contour")
    first, second = curves[0], curves[1]
    if label == 1:
        markers = (first[0], first[-1])
    else:
        # Of the four end pairs across the two curves, take the one whose distance is nearest to that of
        # the first curve's own ends (the label-1 pair), so the marker distance gives little away.
        same = math.dist(first[0], first[-1])
        pairs = [(a, b) for a in (first[0], first[-1]) for b in (second[0], second[-1])]
        markers = min(pairs, key=lambda pair: abs(math.dist(*pair) - same))
    image = np.zeros((size, size), dtype=np.uint8)
    lit = [p for curve in curves for p in curve] + _square(markers[0]) + _square(markers[1])
    rows, cols = zip(*lit, strict=True)
    image[list(rows), list(cols)] = LIT
    return Example(image, label, tuple(tuple(c) for c in curves), markers)


def _check(name: str, value: object, low: int, high: int) -> None:
    if not is_int(value) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")


def _check_image(size: int, contour_length: int) -> None:
    _check("size", size, 8, 4096)
    _check("contour_length", contour_length, 1, _MAX_CONTOUR)


def generate(n: int, seed: int = 0, size: int = 32, contour_length: int = 14) -> tuple[torch.Tensor, torch.Tensor]:
    """(images uint8 [n, size, size], labels int64 [n]); deterministic per seed.

    Labels are a shuffled list of ⌈n/2⌉ zeros and ⌊n/2⌋ ones: exactly balanced for even n.
    """
    _check("n", n, 0, sys.maxsize)
    _check_image(size, contour_length)
    rng = random.Random(seed)
    labels = [i % 2 for i in range(n)]
    rng.shuffle(labels)
    images = np.zeros((n, size, size), dtype=np.uint8)
    for i, label in enumerate(labels):
        images[i] = sample(rng, label, size, contour_length).image
    return torch.from_numpy(images), torch.tensor(labels, dtype=torch.int64)


def as_sequences(images: torch.Tensor) -> torch.Tensor:
    """int64 [n, size·size]: images uint8 [n, size, size] flattened row by row; pixel values are token ids."""
    if images.dtype != torch.uint8 or images.dim() != 3:
        raise ValueError(f"images must be uint8 [n, size, size], got {images.dtype} {tuple(images.shape)}")
    return images.reshape(images.shape[0], -1).long()
