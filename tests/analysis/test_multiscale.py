"""Multi-scale π (a period per head and per layer) against breadth-first search over token positions.

The BFS here walks positions of a sequence backwards from its last query, one layer's offsets at a time
({0, …, window} ∪ that layer's periods, docs/design.md §3.1 with one skip per head); it shares no code
with piattn.analysis.multiscale, and every figure quoted below is computed by it, not by the code tested.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from piattn.analysis.multiscale import (
    SCHEDULES,
    constructed_reach,
    coverage_multi,
    depths_multi,
    design_periods,
    gap_free_reach,
    geometric_periods,
    lag_routes,
    layer_hops,
    min_depth_multi,
    periods_per_layer,
    reachable_lags,
    schedule,
)
from piattn.analysis.reachability import min_depth, reachability_mask


def bfs_first_layer(window, periods, max_lag):
    """{lag d <= max_lag: the fewest first layers after which key n-1-d reaches query n-1} (absent: never),
    on a sequence of n = max_lag + 1 tokens: the set of positions reachable after each layer."""
    query = max_lag
    positions = {query}
    first = {0: 0}
    for layer, heads in enumerate(periods, 1):
        offsets = set(range(window + 1)) | set(heads)
        positions = {m - o for m in positions for o in offsets if m - o >= 0}
        for m in positions:
            first.setdefault(query - m, layer)
    return first


def longest(window, periods):
    return sum(max([window, *heads]) for heads in periods)


def bfs_gap_free(window, periods):
    """Largest R with every lag 1 … R reached after all layers (lags never exceed `longest`)."""
    reached = bfs_first_layer(window, periods, longest(window, periods))
    r = 0
    while r + 1 in reached:
        r += 1
    return r


def bfs_count(window, periods, lo, hi):
    reached = bfs_first_layer(window, periods, hi)
    return sum(d in reached for d in range(lo, hi + 1))


schedules_st = st.integers(1, 4).flatmap(lambda h: st.lists(
    st.lists(st.integers(1, 40), min_size=h, max_size=h), min_size=0, max_size=4))


# --- reachability against BFS ---------------------------------------------------------------------

def check_against_bfs(window, periods, max_lag):
    truth = bfs_first_layer(window, periods, max_lag)
    lags = reachable_lags(window, periods, max_lag)
    assert lags.dtype == torch.bool and lags.shape == (max_lag + 1,)
    assert lags.tolist() == [d in truth for d in range(max_lag + 1)]
    assert depths_multi(window, periods, max_lag) == [truth.get(d) for d in range(max_lag + 1)]
    for d in {0, max_lag // 2, max_lag}:
        assert min_depth_multi(d, window, periods) == truth.get(d)
    if max_lag >= 1:
        assert coverage_multi(window, periods, max_lag) == pytest.approx(
            sum(d in truth for d in range(1, max_lag + 1)) / max_lag)
    assert gap_free_reach(window, periods) == bfs_gap_free(window, periods)


@settings(max_examples=60, deadline=None)
@given(window=st.integers(0, 6), periods=schedules_st, max_lag=st.integers(0, 150))
def test_matches_bfs_random(window, periods, max_lag):
    check_against_bfs(window, periods, max_lag)


@pytest.mark.parametrize("window,periods,max_lag", [
    (4, [[16]] * 4, 100),                           # single π
    (4, [[]] * 4, 30),                              # no skip head: local only
    (0, [[3, 5], [7, 2]], 25),                      # window 0: periods only
    (5, [[2, 5, 3]] * 3, 20),                       # every period <= window: nothing new
    (2, [[1], [50], [3, 9]], 70),                   # layers with different head counts
    (3, [], 5),                                     # no layer: lag 0 only
])
def test_matches_bfs_grid(window, periods, max_lag):
    check_against_bfs(window, periods, max_lag)


def test_first_layers_order_matters():
    # the same two layers in both orders reach the same lags after both, but not after the first one
    assert min_depth_multi(16, 4, [[8], [16]]) == 2
    assert min_depth_multi(16, 4, [[16], [8]]) == 1
    assert torch.equal(reachable_lags(4, [[8], [16]], 40), reachable_lags(4, [[16], [8]], 40))


def test_large_periods_stay_cheap():
    # lags beyond the longest path are answered without a bit set that long
    assert gap_free_reach(4, [[10**9]] * 4) == 16
    assert min_depth_multi(10**12, 4, [[16]] * 4) is None


def test_layer_hops():
    assert layer_hops(4, (16, 2, 4)) == (0, 1, 2, 3, 4, 16)
    assert layer_hops(0, ()) == (0,)


# --- one period everywhere is today's π --------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(window=st.integers(0, 6), period=st.integers(1, 40), n_layer=st.integers(0, 5), n_head=st.integers(1, 4))
def test_single_period_reproduces_reachability(window, period, n_layer, n_head):
    periods = periods_per_layer(period, n_layer, n_head)
    max_lag = 120
    single = [min_depth(d, window, period) for d in range(max_lag + 1)]
    expected = [depth if depth is not None and depth <= n_layer else None for depth in single]
    assert depths_multi(window, periods, max_lag) == expected
    assert reachable_lags(window, periods, max_lag).tolist() == [depth is not None for depth in expected]


@pytest.mark.parametrize("window,period,n_layer", [(4, 16, 4), (2, 5, 3), (3, 2, 2), (0, 7, 4), (1, 30, 2)])
def test_single_period_matches_reachability_mask(window, period, n_layer):
    n = 70
    row = reachability_mask(n, window, period, n_layer)[n - 1].flip(0)  # [d] = key n-1-d reaches query n-1
    assert torch.equal(reachable_lags(window, periods_per_layer(period, n_layer, 3), n - 1), row)


# --- the project's setting: k = 4, L = 4, H = 4, context 256 ---------------------------------------

K, L, H, TARGET = 4, 4, 4, 256


def test_project_setting_figures():
    single = [[16] * H] * L
    # docs/results.md: single π = 16 reaches 43 of the lags 1 … 64 (first gap 29) and 17 % of 1 … 255
    assert bfs_count(K, single, 1, 64) == 43
    assert bfs_count(K, single, 1, 255) == 43 and round(100 * 43 / 255) == 17
    assert bfs_gap_free(K, single) == 28
    assert bfs_count(K, [[]] * L, 1, 255) == 16                # local k = 4: 16 lags
    assert bfs_count(5, [[]] * L, 1, 255) == 20                # local k = 5 (equal slots): 20, 8 %
    geometric = [[16, 32, 64, 128]] * L
    assert bfs_count(K, geometric, 1, 255) == 142 and bfs_gap_free(K, geometric) == 28

    design = design_periods(K, L, H, TARGET)
    assert design.periods == ((5, 6, 7, 8), (9, 14, 19, 24), (19, 34, 49, 64), (48, 92, 136, 180))
    assert design.method == "construction" and design.covers and design.uncovered == ()
    assert bfs_count(K, design.periods, 1, TARGET) == TARGET    # every lag 1 … 256
    assert bfs_gap_free(K, design.periods) == design.reach == 276
    assert bfs_first_layer(K, design.periods, 255).get(255) == 4

    # the code under test agrees with every figure above
    assert coverage_multi(K, single, 255) == pytest.approx(43 / 255)
    assert int(reachable_lags(K, single, 64)[1:].sum()) == 43
    assert gap_free_reach(K, single) == 28
    assert coverage_multi(K, geometric, 255) == pytest.approx(142 / 255)
    assert coverage_multi(K, design.periods, 255) == 1.0
    assert constructed_reach(K, L, H) == 1248


# --- the designer ----------------------------------------------------------------------------------

def check_design(window, n_layer, n_head, target):
    design = design_periods(window, n_layer, n_head, target)
    periods = design.periods
    assert len(periods) == n_layer and all(len(heads) == n_head and min(heads) >= 1 for heads in periods)
    top = longest(window, periods)
    reached = bfs_first_layer(window, periods, max(top, target))
    assert all(d in reached for d in range(1, design.reach + 1))     # gap-free up to the claim …
    assert design.reach + 1 not in reached                           # … and not one lag further
    assert design.uncovered == tuple(d for d in range(1, target + 1) if d not in reached)
    assert design.covers == (design.reach >= target)
    full = constructed_reach(window, n_layer, n_head)
    if full >= target:
        assert design.covers and design.method == "construction"
        # a covering design never reads further back than it needs (nor than one layer's first offsets)
        assert max((p for heads in periods for p in heads), default=0) <= max(target, window + n_head)
    elif design.method == "construction":
        assert design.reach == full
    else:
        assert design.method == "search" and design.reach > full
    return design


@pytest.mark.parametrize("window,n_layer,n_head,target", list(itertools.product(
    [0, 1, 2, 4], [0, 1, 2, 3, 4], [1, 2, 4], [1, 9, 64, 256, 700])))
def test_designer_gap_free_grid(window, n_layer, n_head, target):
    check_design(window, n_layer, n_head, target)


@settings(max_examples=40, deadline=None)
@given(window=st.integers(0, 6), n_layer=st.integers(0, 4), n_head=st.integers(1, 5), target=st.integers(1, 400))
def test_designer_gap_free_random(window, n_layer, n_head, target):
    check_design(window, n_layer, n_head, target)


@pytest.mark.parametrize("window,n_layer,n_head", list(itertools.product([0, 1, 3, 4], [0, 1, 2, 3], [1, 2, 3, 4])))
def test_construction_at_full_stride_reaches_exactly_its_formula(window, n_layer, n_head):
    full = constructed_reach(window, n_layer, n_head)
    # the recurrence of the docstring, independently of the closed form
    r = 0
    for _ in range(n_layer):
        r = r + window + n_head * (r + 1)
    assert full == r
    design = design_periods(window, n_layer, n_head, max(full, 1))
    reached = bfs_first_layer(window, design.periods, longest(window, design.periods))
    assert set(reached) == set(range(full + 1))  # exactly the interval [0, R_L]


@pytest.mark.parametrize("window,n_layer", [(k, n) for k in range(1, 5) for n in range(1, 5) if (k + 1) ** n <= 625])
def test_base_k_plus_1_claim(window, n_layer):
    # layer l's k heads at (k+1)^l · {1 … k}: the lags are exactly 0 … (k+1)^L − 1 (layer 0's heads
    # repeat its window); the designer's construction reaches further with the same H = k heads
    base = [[(window + 1) ** layer * j for j in range(1, window + 1)] for layer in range(n_layer)]
    reached = bfs_first_layer(window, base, longest(window, base))
    assert set(reached) == set(range((window + 1) ** n_layer))
    assert constructed_reach(window, n_layer, window) > (window + 1) ** n_layer - 1


def test_fewer_heads_than_window():
    # H < k: no base-(k+1) system exists, the construction still has no gap
    assert constructed_reach(4, 4, 2) == 240  # ((2+1)^4·(2+4) − 4)/2 − 1
    design = check_design(4, 4, 2, 200)
    assert design.covers and bfs_gap_free(4, design.periods) >= 200


def test_search_beats_construction():
    # k = 2, H = 1, L = 2: the construction reaches 9; the search finds hops {0,1,2,5} then {0,1,2,8}
    assert constructed_reach(2, 2, 1) == 9
    design = check_design(2, 2, 1, 10)
    assert design.method == "search" and design.periods == ((5,), (8,)) and design.covers
    assert bfs_gap_free(2, [[5], [8]]) == 10


def test_designer_is_not_optimal():
    # k = 2, H = 2, L = 2: the designer stops at 16, yet periods (5, 6) then (9, 11) reach 17 (BFS)
    design = check_design(2, 2, 2, 17)
    assert design.reach == 16 and design.uncovered == (17,)
    assert bfs_gap_free(2, [[5, 6], [9, 11]]) == 17


def test_no_layer_covers_nothing():
    design = design_periods(4, 0, 4, 3)
    assert design.periods == () and design.reach == 0 and design.uncovered == (1, 2, 3)


# --- routes -------------------------------------------------------------------------------------------

def brute_routes(window, periods, max_lag):
    """[d]: hop sequences summing to d, one hop per layer from 0 … k or a head's period > k (by enumeration)."""
    counts = [0] * (max_lag + 1)
    for hops in itertools.product(*([*range(window + 1), *(p for p in heads if p > window)] for heads in periods)):
        if sum(hops) <= max_lag:
            counts[sum(hops)] += 1
    return counts


@settings(max_examples=60, deadline=None)
@given(window=st.integers(0, 5), periods=st.integers(1, 3).flatmap(lambda h: st.lists(
    st.lists(st.integers(1, 30), min_size=h, max_size=h), min_size=0, max_size=3)), max_lag=st.integers(0, 90))
def test_lag_routes_count_every_hop_sequence(window, periods, max_lag):
    routes = lag_routes(window, periods, max_lag)
    assert routes.dtype == torch.int64 and routes.tolist() == brute_routes(window, periods, max_lag)
    assert (routes > 0).tolist() == reachable_lags(window, periods, max_lag).tolist()


def test_lag_routes_saturate_at_the_cap():
    assert lag_routes(4, [[16, 16, 16, 16]] * 6, 60, cap=7).max().item() == 7
    assert lag_routes(4, [[16, 16, 16, 16]] * 6, 60)[60].item() == brute_routes(4, [[16] * 4] * 6, 60)[60] > 7


@pytest.mark.parametrize("window,n_layer,n_head,target,routes", [
    (4, 4, 4, 63, 2), (4, 3, 4, 63, 2), (4, 4, 4, 255, 4), (2, 3, 2, 40, 2), (4, 3, 4, 95, 2)])
def test_designer_gives_every_lag_the_routes_asked_or_says_how_many(window, n_layer, n_head, target, routes):
    tight = design_periods(window, n_layer, n_head, target)
    design = design_periods(window, n_layer, n_head, target, routes=routes)
    fewest = min(brute_routes(window, design.periods, target)[1:])
    assert design.covers and design.routes == fewest
    assert tight.routes == min(brute_routes(window, tight.periods, target)[1:])
    if fewest < routes:  # none of the ratios scanned has them: the most found, at least the tight design's
        assert design.routes >= tight.routes
    assert design.routes >= min(routes, tight.routes)


def test_the_tight_design_of_the_recall_setting_leaves_one_route_and_two_routes_fix_it():
    # 64 tokens, 4 layers of 4 heads, k = 4 (docs/results.md §7c): lags 60 … 63 have one route each
    tight = design_periods(4, 4, 4, 63)
    assert tight.routes == 1 and lag_routes(4, tight.periods, 63)[63].item() == 1
    assert design_periods(4, 4, 4, 63, routes=2).periods == ((5, 6, 7, 8), (6, 8, 10, 12), (8, 12, 16, 20),
                                                             (10, 16, 22, 28))


# --- named schedules ---------------------------------------------------------------------------------

def test_named_schedules():
    assert schedule("single", 4, 2, 3, period=16) == ((16, 16, 16), (16, 16, 16))
    assert schedule("geometric", 4, 2, 4, period=16) == ((16, 32, 64, 128),) * 2
    assert geometric_periods(3, 3) == (3, 6, 12)
    assert schedule("cover", K, L, H, target=TARGET) == design_periods(K, L, H, TARGET).periods
    assert set(SCHEDULES) >= {"single", "geometric", "cover"}


@pytest.mark.parametrize("kwargs,message", [
    (dict(name="octave", period=16), "unknown schedule 'octave'; choose one of single, geometric, cover"),
    (dict(name="single"), "schedule 'single' needs period"),
    (dict(name="cover"), "schedule 'cover' needs target"),
    (dict(name="cover", target=64, period=16), "schedule 'cover' takes target, not period"),
    (dict(name="geometric", period=16, target=64), "schedule 'geometric' takes period, not target"),
    (dict(name="single", period=0), "period must be an int >= 1"),
])
def test_named_schedule_errors(kwargs, message):
    name = kwargs.pop("name")
    with pytest.raises(ValueError, match=message):
        schedule(name, 4, 2, 2, **kwargs)


# --- periods_per_layer ------------------------------------------------------------------------------

def test_periods_per_layer_forms():
    assert periods_per_layer(16, 2, 3) == ((16, 16, 16),) * 2
    assert periods_per_layer([8, 16], 3, 2) == ((8, 16),) * 3
    assert periods_per_layer([[8, 16], (32, 64)], 2, 2) == ((8, 16), (32, 64))
    assert periods_per_layer((5,), 0, 1) == ()
    assert periods_per_layer([], 0, 2) == ()


@pytest.mark.parametrize("periods,n_layer,n_head,message", [
    (0, 2, 2, r"^period must be an int >= 1 \(a skip distance in tokens\), got 0$"),
    (-3, 2, 2, "period must be an int >= 1"),
    (True, 2, 2, "periods must be an int >= 1, a list of n_head=2 ints"),
    (16.0, 2, 2, "periods must be an int >= 1, a list of n_head=2 ints .*; got 16.0"),
    ("16", 2, 2, "periods must be an int >= 1"),
    ([8, 16, 32], 2, 2, "periods has 3 entries: a list of ints needs one per head, n_head=2"),
    ([[8, 16]] * 3, 2, 2, "periods has 3 layers, the model n_layer=2"),
    ([[8, 16], [8]], 2, 2, r"periods\[1\] has 1 periods, one per head needs n_head=2"),
    ([[8, 16], [8, 0]], 2, 2, r"periods\[1\]\[1\] must be an int >= 1"),
    ([8, 2.5], 2, 2, r"periods\[1\] must be an int >= 1 .*got 2.5"),
    ([8, False], 2, 2, r"periods\[1\] must be an int >= 1"),
    ([8, [16]], 2, 2, "periods mixes ints and lists"),
    ([], 2, 2, "periods has 0 entries"),
    (16, -1, 2, "n_layer must be an int >= 0, got -1"),
    (16, 2, 0, "n_head must be an int >= 1, got 0"),
])
def test_periods_per_layer_errors(periods, n_layer, n_head, message):
    with pytest.raises(ValueError, match=message) as info:
        periods_per_layer(periods, n_layer, n_head)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("call,message", [
    (lambda: reachable_lags(4, 16, 10), "periods must be a list of per-layer lists"),
    (lambda: reachable_lags(4, [[16, 0]], 10), r"periods\[0\]\[1\] must be an int >= 1"),
    (lambda: reachable_lags(-1, [[16]], 10), "window must be an integer >= 0"),
    (lambda: reachable_lags(4, [[16]], -1), "max_lag must be an int >= 0"),
    (lambda: coverage_multi(4, [[16]], 0), "max_lag must be an int >= 1"),
    (lambda: min_depth_multi(-2, 4, [[16]]), "a causal lag must be >= 0, got -2"),
    (lambda: design_periods(4, 4, 4, 0), "target must be an int >= 1, got 0"),
    (lambda: design_periods(4, 4, 0, 10), "n_head must be an int >= 1, got 0"),
    (lambda: design_periods(4, 4, 4, 10, routes=0), "routes must be an int >= 1, got 0"),
    (lambda: lag_routes(4, [[16]], 10, cap=0), "cap must be an int >= 1, got 0"),
])
def test_argument_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()
