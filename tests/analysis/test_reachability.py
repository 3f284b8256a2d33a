"""reachability_mask, spans and min_depth against breadth-first search over the token graph.

The BFS here is written from the offset definition of docs/design.md (causal {0, -1, …, -window} ∪ {-period},
bidirectional {-window, …, window} ∪ {±period}), not from piattn's masks.
"""

from __future__ import annotations

import itertools
import math
from collections import deque

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from piattn.analysis import (
    attainable_span,
    coverage,
    min_depth,
    reachability_mask,
    span,
    span_bound,
    spans_by_depth,
)


def offsets(window, period, causal):
    local = range(-window, 1) if causal else range(-window, window + 1)
    skips = [] if period is None else ([-period] if causal else [-period, period])
    return sorted(set(local) | set(skips))


def bfs_reach(n, window, period, layers, causal):
    """bool [n, n]: [i, j] = j is exactly `layers` hops of the pattern away from i, staying inside [0, n)."""
    offs = offsets(window, period, causal)
    out = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        frontier = {i}
        for _ in range(layers):
            frontier = {m + o for m in frontier for o in offs if 0 <= m + o < n}
        out[i, sorted(frontier)] = True
    return out


def bfs_depths(window, period, causal, max_lag):
    """{lag d: fewest hops from position 0 to -d} on an unbounded line, for 0 <= d <= max_lag (absent: never).

    Hops can be reordered so every partial sum stays within one largest offset M of [-d, 0], so searching
    [-max_lag - M, M] is exact for these lags.
    """
    offs = offsets(window, period, causal)
    m = max(abs(o) for o in offs)
    lo, hi = -max_lag - m, m
    dist = {0: 0}
    queue = deque([0])
    while queue:
        x = queue.popleft()
        for o in offs:
            y = x + o
            if lo <= y <= hi and y not in dist:
                dist[y] = dist[x] + 1
                queue.append(y)
    return {-x: dist[x] for x in dist if -max_lag <= x <= 0}


def paper_lmin(d, window, period):
    """Eq. (lmin) as printed: b ranges over all b >= 0 and max(0, ·) lets a skip overshoot d."""
    return min(b + math.ceil(max(0, d - b * period) / window) for b in range(d // period + 2))


# --- reachability_mask -------------------------------------------------------------------------------

GRID = [
    # (n, window, period, layers, causal)
    (48, 4, 16, 6, True), (48, 4, 16, 6, False), (48, 4, None, 6, True), (48, 4, None, 6, False),
    (20, 0, 3, 4, True), (20, 0, 3, 4, False), (20, 0, None, 3, True),   # window = 0
    (15, 2, 1, 3, True), (15, 2, 1, 3, False), (15, 0, 1, 5, True),      # period = 1
    (25, 5, 3, 2, True), (25, 5, 5, 2, False), (25, 3, 3, 3, True),      # period <= window
    (10, 2, 16, 4, True), (10, 2, 16, 4, False), (1, 3, 2, 2, True),     # n < period, n = 1
    (30, 1, 7, 0, True), (30, 3, 5, 1, False), (33, 1, 11, 9, True),     # layers = 0, 1, many
]


@pytest.mark.parametrize("n,window,period,layers,causal", GRID)
def test_reachability_matches_bfs(n, window, period, layers, causal):
    expected = bfs_reach(n, window, period, layers, causal)
    assert torch.equal(reachability_mask(n, window, period, layers, causal), expected)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 36), window=st.integers(0, 6), period=st.one_of(st.none(), st.integers(1, 40)),
       layers=st.integers(0, 5), causal=st.booleans())
def test_reachability_matches_bfs_random(n, window, period, layers, causal):
    expected = bfs_reach(n, window, period, layers, causal)
    assert torch.equal(reachability_mask(n, window, period, layers, causal), expected)


def test_shape_dtype_and_identity_at_depth_zero():
    r = reachability_mask(7, 2, 3, 0)
    assert r.dtype == torch.bool and r.shape == (7, 7)
    assert torch.equal(r, torch.eye(7, dtype=torch.bool))


def test_rejects_negative_layers():
    with pytest.raises(ValueError):
        reachability_mask(8, 2, 3, -1)


# --- coverage: the seed's Fig. rf_app ------------------------------------------------------------------

def test_coverage_reproduces_the_seed_figure():
    local = coverage(reachability_mask(48, 4, None, 6, causal=True))
    pi = coverage(reachability_mask(48, 4, 16, 6, causal=True))
    assert round(100 * local, 1) == 39.1
    assert round(100 * pi, 1) == 51.0
    # by hand: local reaches j in [i - 24, i], i.e. min(i, 24) + 1 keys per query; the π pattern reaches every
    # causal pair, the whole lower triangle 48·49/2
    assert local == sum(min(i, 24) + 1 for i in range(48)) / 48**2 == 900 / 2304
    assert pi == 48 * 49 / 2 / 48**2


def test_coverage_counts_all_cells():
    assert coverage(torch.tensor([[True, False], [True, True]])) == 0.75


# --- spans -----------------------------------------------------------------------------------------

def bfs_span(n, window, period, layers, causal):
    r = bfs_reach(n, window, period, layers, causal)
    return max(abs(i - j) for i in range(n) for j in range(n) if r[i, j])


@pytest.mark.parametrize("n,window,period,layers,causal", [g for g in GRID if g[0] > 1])
def test_span_matches_bfs(n, window, period, layers, causal):
    expected = bfs_span(n, window, period, layers, causal)
    assert span(reachability_mask(n, window, period, layers, causal)) == expected


@pytest.mark.parametrize("window,period,layers,causal", [(4, 16, 6, True), (2, 5, 4, False), (0, 3, 3, True),
                                                         (3, 2, 4, True), (4, None, 5, True)])
def test_spans_by_depth_match_bfs(window, period, layers, causal):
    n = 40
    assert spans_by_depth(n, window, period, layers, causal) == [
        bfs_span(n, window, period, depth, causal) for depth in range(1, layers + 1)]


@pytest.mark.parametrize("window,period,layers,causal", [(4, 16, 3, True), (4, 16, 3, False), (5, 3, 4, True),
                                                         (0, 7, 3, True), (2, None, 4, False)])
def test_attainable_span_on_a_long_sequence(window, period, layers, causal):
    n = 60  # longer than any span here, so the ends do not cap it
    measured = bfs_span(n, window, period, layers, causal)
    assert attainable_span(layers, window, period) == measured
    assert span_bound(layers, window, period) >= measured


def test_span_bound_values():
    assert span_bound(6, 4, 16) == 120   # L(k + π), Eq. rf_pi
    assert span_bound(6, 4, None) == 24  # kL
    assert attainable_span(6, 4, 16) == 96


def test_seed_span_bound_is_not_tight():
    # one layer moves a path by one offset, so k + π in a single layer never happens
    assert bfs_span(40, 4, 16, 1, True) == 16 < span_bound(1, 4, 16)


# --- min_depth -------------------------------------------------------------------------------------

def test_seed_counterexample():
    assert min_depth(15, 4, 16) == 4
    assert bfs_depths(4, 16, True, 15)[15] == 4
    assert paper_lmin(15, 4, 16) == 1  # the printed Eq. (lmin) is wrong here


MAX_LAG = 70


@pytest.mark.parametrize("window,period,causal", list(itertools.product(
    [0, 1, 2, 4, 5], [None, 1, 2, 3, 4, 5, 6, 7, 16, 33], [True, False])))
def test_min_depth_matches_bfs(window, period, causal):
    truth = bfs_depths(window, period, causal, MAX_LAG)
    for d in range(MAX_LAG + 1):
        assert min_depth(d, window, period, causal) == truth.get(d), d
        if not causal:
            assert min_depth(-d, window, period, causal) == truth.get(d), -d


@settings(max_examples=60, deadline=None)
@given(window=st.integers(0, 8), period=st.one_of(st.none(), st.integers(1, 60)), causal=st.booleans(),
       d=st.integers(0, 150))
def test_min_depth_matches_bfs_random(window, period, causal, d):
    assert min_depth(d, window, period, causal) == bfs_depths(window, period, causal, d).get(d)


def test_min_depth_is_the_first_depth_that_reaches_on_a_sequence():
    # causal paths never leave [i - d, i], so the sequence ends do not matter for causal lags
    n, window, period = 64, 3, 10
    for d in (0, 1, 9, 10, 13, 29, 63):
        depth = min_depth(d, window, period)
        assert reachability_mask(n, window, period, depth)[n - 1, n - 1 - d]
        if depth > 0:
            assert not reachability_mask(n, window, period, depth - 1)[n - 1, n - 1 - d]


def test_min_depth_special_cases():
    assert min_depth(0, 0, None) == 0
    assert min_depth(5, 0, None) is None          # window 0 and no skip: never
    assert min_depth(30, 0, 10) == 3               # window 0: only multiples of π
    assert min_depth(31, 0, 10) is None
    assert min_depth(9, 4, None) == 3              # ⌈9/4⌉
    assert min_depth(47, 4, 16, causal=False) == 4  # 3 skips back, 1 local step forward


@pytest.mark.parametrize("args", [(-1, 4, 16), (3, -1, 16), (3, 4, 0)])
def test_min_depth_rejects_bad_arguments(args):
    with pytest.raises(ValueError):
        min_depth(*args)
