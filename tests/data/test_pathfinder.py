"""Pathfinder images checked with a flood fill over lit pixels written here, independent of the generator."""

from __future__ import annotations

import itertools
import random
from collections import deque

import numpy as np
import pytest
import torch

from piattn.data import pathfinder


def lit_distances(image: np.ndarray, start: tuple[int, int]) -> dict[tuple[int, int], int]:
    """Breadth-first search over lit pixels (8-neighbours): {pixel: steps from start}."""
    size = image.shape[0]
    dist = {start: 0}
    queue = deque([start])
    while queue:
        r, c = queue.popleft()
        for dr in (-1, 0, 1):
            for dc in (-1, 0, 1):
                p = (r + dr, c + dc)
                if 0 <= p[0] < size and 0 <= p[1] < size and image[p] > 0 and p not in dist:
                    dist[p] = dist[(r, c)] + 1
                    queue.append(p)
    return dist


def test_shapes_dtypes_and_balance():
    images, labels = pathfinder.generate(40, seed=0)
    assert images.shape == (40, 32, 32) and images.dtype == torch.uint8
    assert labels.shape == (40,) and labels.dtype == torch.int64
    assert int(labels.sum()) == 20 and set(labels.tolist()) == {0, 1}
    assert set(images.unique().tolist()) == {0, pathfinder.LIT}
    images, labels = pathfinder.generate(7, seed=0, size=48, contour_length=6)
    assert images.shape == (7, 48, 48) and abs(int(labels.sum()) * 2 - 7) == 1


def test_deterministic_per_seed():
    a, la = pathfinder.generate(6, seed=5, contour_length=9)
    b, lb = pathfinder.generate(6, seed=5, contour_length=9)
    c, _ = pathfinder.generate(6, seed=6, contour_length=9)
    assert torch.equal(a, b) and torch.equal(la, lb)
    assert not torch.equal(a, c)


@pytest.mark.parametrize("contour_length", [6, 14])
def test_markers_connected_iff_label_one(contour_length):
    rng = random.Random(contour_length)
    for i in range(60):
        ex = pathfinder.sample(rng, label=i % 2, contour_length=contour_length)
        a, b = ex.markers
        for r, c in ex.markers:  # a full 3×3 marker inside the image
            assert 1 <= r <= 30 and 1 <= c <= 30 and (ex.image[r - 1:r + 2, c - 1:c + 2] == pathfinder.LIT).all()
        assert (b in lit_distances(ex.image, a)) == bool(ex.label)
        # The generator's own curves: 8-connected, lit, with the markers on the ends of the target curves.
        for curve in ex.curves:
            steps = np.abs(np.diff(np.array(curve), axis=0)).max(axis=1)
            assert (steps == 1).all() and all(ex.image[p] == pathfinder.LIT for p in curve)
        first, second = ex.curves[0], ex.curves[1]
        assert 2 * contour_length + 1 <= len(first) <= 3 * contour_length + 1
        if ex.label:
            assert {a, b} == {first[0], first[-1]}
        else:
            assert a in (first[0], first[-1]) and b in (second[0], second[-1])


def square(r, c):
    return {(r + dr, c + dc) for dr in (-1, 0, 1) for dc in (-1, 0, 1)}


def test_curves_and_markers_keep_clear_of_each_other():
    for label in (0, 1):
        ex = pathfinder.sample(random.Random(3), label=label)
        assert len(ex.curves) == 2 + 20 // (14 // 3)
        shapes = [set(curve) for curve in ex.curves]  # each curve with the markers on its ends
        for marker in ex.markers:
            next(s for s, curve in zip(shapes, ex.curves, strict=True) if marker in (curve[0], curve[-1])).update(
                square(*marker))
        for i, j in itertools.combinations(range(len(shapes)), 2):
            clearance = set().union(*(square(*p) for p in shapes[i]))
            assert clearance.isdisjoint(shapes[j]), f"curves {i} and {j} touch"


def test_pixel_counts_do_not_reveal_the_label():
    images, labels = pathfinder.generate(400, seed=1)
    lit = (images > 0).sum(dim=(1, 2)).double()
    mean0, mean1 = lit[labels == 0].mean(), lit[labels == 1].mean()
    assert abs(mean0 - mean1) < 0.03 * mean0
    # The best threshold on the lit-pixel count classifies no better than a coin, up to sampling noise.
    above = [((lit > t) == labels.bool()).double().mean().item() for t in lit.unique().tolist()]
    assert max(max(above), 1 - min(above)) < 0.6


@pytest.mark.parametrize("contour_length", [6, 14])
def test_marker_distance_does_not_reveal_the_label(contour_length):
    rng = random.Random(4)
    examples = [pathfinder.sample(rng, label=i % 2, contour_length=contour_length) for i in range(300)]
    dist = np.array([np.hypot(*np.subtract(*ex.markers)) for ex in examples])
    labels = np.array([ex.label for ex in examples])
    best = max(max(((dist < t) == labels).mean(), ((dist >= t) == labels).mean()) for t in np.unique(dist))
    assert best < 0.66


def test_longer_contours_are_harder():
    """Label-1 markers lie further apart along the lit path as contour_length grows (6 < 9 < 14)."""
    mean_path = []
    for contour_length in (6, 9, 14):
        rng = random.Random(0)
        lengths = []
        for _ in range(40):
            ex = pathfinder.sample(rng, label=1, contour_length=contour_length)
            lengths.append(lit_distances(ex.image, ex.markers[0])[ex.markers[1]])
        mean_path.append(np.mean(lengths))
    assert mean_path[0] < mean_path[1] < mean_path[2]


def test_as_sequences():
    images, _ = pathfinder.generate(3, seed=2)
    seq = pathfinder.as_sequences(images)
    assert seq.shape == (3, 1024) and seq.dtype == torch.int64
    assert seq[1, 32 * 5 + 7] == images[1, 5, 7]
    with pytest.raises(ValueError, match="uint8"):
        pathfinder.as_sequences(images.float())


@pytest.mark.parametrize("kwargs", [dict(n=-1), dict(n=2, size=4), dict(n=2, contour_length=0),
                                    dict(n=2, contour_length=2.5)])
def test_bad_arguments_raise(kwargs):
    with pytest.raises(ValueError):
        pathfinder.generate(**kwargs)


def test_impossible_layout_raises():
    with pytest.raises(ValueError, match="could not fit"):
        pathfinder.generate(1, size=8, contour_length=40)
