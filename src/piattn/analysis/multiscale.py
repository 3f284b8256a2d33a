"""Reachability of multi-scale π: a skip period per head and per layer (causal).

Every query still reads its k + 1 local keys (offsets 0 … k back) and one skip key per head; head h of
layer l skips π_{l,h} back. The heads of a layer mix through the residual stream, so for reachability
layer l offers the hop set

    S_l = {0, 1, …, k} ∪ {π_{l,h} : h}        (a hop d carries information from position i − d to i)

and a path takes one hop per layer, layer l's hop from S_l (hop 0 = stay). Lag d is reachable after the
first l layers iff d ∈ S_0 + … + S_{l−1} (a sum set; the order of the layers does not change it, but
"after the first l layers" does depend on which layers come first). A period ≤ k adds nothing: it is one
of the local hops already. With one period π everywhere this is the single-π pattern of
`piattn.analysis.reachability` (tested against it). Causal paths never leave [i − d, i], so the lags here
hold for every query at least d tokens into a sequence: the ends of the sequence do not matter.

A schedule is a tuple of L tuples (one per layer) of H periods (`periods_per_layer` builds one);
`design_periods` proposes one that reaches every lag up to a target (see there for the construction and
why it has no gaps). Sets of lags are held as Python ints used as bit sets (bit d: lag d reachable),
so a sum set is one shift-and-or per hop, exact at any size; results come back as torch tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..checks import is_int
from ..masks.local import check_window

Schedule = tuple[tuple[int, ...], ...]
"""Periods per layer: schedule[l][h] = π_{l,h}, the skip distance of head h of layer l (an int >= 1)."""

SCHEDULES = ("single", "geometric", "cover")

# design_periods runs its search only when n_layer·n_head·(target + 1) candidate periods stay below this,
# which keeps it under about a second; beyond it the construction alone answers.
SEARCH_BUDGET = 200_000
# gap_free_reach's budget, in bits shifted: it measures the reach on growing prefixes of the lags, each
# prefix costing one shift of a prefix-long bit set per hop below it per layer. A geometric schedule's reach
# grows about 16-fold per 4 more layers and heads (24 × 24 from π = 16: 33,554,428 lags, 10¹¹ bits, 4 s;
# 64 × 64: past 2⁶⁴ lags, never done), so past the budget (under a second) it stops with ReachBudgetError.
# design_periods measures its schedule here too: a deep, wide "cover" design may stop on it.
REACH_BUDGET = 1 << 34
# The balanced construction shrinks every layer's stride by the same ratio m / _RATIO_STEPS.
_RATIO_STEPS = 256
# design_periods(routes > 1) scans stride ratios while the route counts it computes, n_layer·(n_head + 2)
# passes over target + 1 lags per ratio, stay below this many lag visits (about a second).
ROUTES_BUDGET = 200_000_000


# --- schedules -------------------------------------------------------------------------------------


def _is_seq(value) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def _check_count(name: str, value, minimum: int) -> None:
    if not is_int(value) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _period(value, where: str) -> int:
    if not is_int(value) or value < 1:
        raise ValueError(f"{where} must be an int >= 1 (a skip distance in tokens), got {value!r}")
    return int(value)


def periods_per_layer(periods, n_layer: int, n_head: int) -> Schedule:
    """Normalise a period description into a Schedule: L tuples of H ints.

    periods: an int (every head of every layer, today's single π), a list of n_head ints (the same heads
    in every layer), or a list of n_layer lists of n_head ints. An empty list means n_layer = 0 layers.
    Anything else (a float, a bool, a period < 1, a wrong length) raises a one-line ValueError.
    """
    _check_count("n_layer", n_layer, 0)
    _check_count("n_head", n_head, 1)
    allowed = (f"an int >= 1, a list of n_head={n_head} ints (each layer alike) or a list of "
               f"n_layer={n_layer} lists of {n_head} ints")
    if not _is_seq(periods):
        if not is_int(periods):
            raise ValueError(f"periods must be {allowed}; got {periods!r}")
        return ((_period(periods, "period"),) * n_head,) * n_layer
    if len(periods) == 0 and n_layer == 0:
        return ()
    if all(_is_seq(p) for p in periods) and len(periods) > 0:
        if len(periods) != n_layer:
            raise ValueError(f"periods has {len(periods)} layers, the model n_layer={n_layer}")
        for layer, heads in enumerate(periods):
            if len(heads) != n_head:
                raise ValueError(f"periods[{layer}] has {len(heads)} periods, one per head needs n_head={n_head}")
        return tuple(tuple(_period(p, f"periods[{layer}][{h}]") for h, p in enumerate(heads))
                     for layer, heads in enumerate(periods))
    if any(_is_seq(p) for p in periods):
        raise ValueError(f"periods mixes ints and lists; it must be {allowed}")
    if len(periods) != n_head:
        raise ValueError(f"periods has {len(periods)} entries: a list of ints needs one per head, "
                         f"n_head={n_head} (or give {allowed})")
    heads = tuple(_period(p, f"periods[{h}]") for h, p in enumerate(periods))
    return (heads,) * n_layer


def _check_schedule(schedule) -> Schedule:
    """A Schedule from any sequence of per-layer sequences of periods; a layer may have no period (local
    attention only), and layers may differ in head count (reachability does not care)."""
    if not _is_seq(schedule) or not all(_is_seq(layer) for layer in schedule):
        raise ValueError(f"periods must be a list of per-layer lists of periods (see periods_per_layer), "
                         f"got {schedule!r}")
    return tuple(tuple(_period(p, f"periods[{layer}][{h}]") for h, p in enumerate(heads))
                 for layer, heads in enumerate(schedule))


def geometric_periods(period: int, n_head: int) -> tuple[int, ...]:
    """(π, 2π, 4π, …, 2^(H−1)·π): one octave per head."""
    return tuple(_period(period, "period") << h for h in range(n_head))


def schedule(name: str, window: int, n_layer: int, n_head: int, period: int | None = None,
             target: int | None = None) -> Schedule:
    """A named Schedule of n_layer layers of n_head periods.

    "single": every head π = period (today's π-Attention); "geometric": heads at π, 2π, 4π, … in every
    layer; "cover": `design_periods(window, n_layer, n_head, target).periods`. "single" and "geometric"
    take `period` and no target, "cover" takes `target` and no period.
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    check_window(window)
    _check_count("n_layer", n_layer, 0)
    _check_count("n_head", n_head, 1)
    wanted, other = ("target", "period") if name == "cover" else ("period", "target")
    given = {"period": period, "target": target}
    if given[wanted] is None:
        raise ValueError(f"schedule {name!r} needs {wanted}")
    if given[other] is not None:
        raise ValueError(f"schedule {name!r} takes {wanted}, not {other} (got {other}={given[other]!r})")
    if name == "single":
        return periods_per_layer(period, n_layer, n_head)
    if name == "geometric":
        return periods_per_layer(list(geometric_periods(period, n_head)), n_layer, n_head)
    return design_periods(window, n_layer, n_head, target).periods


# --- reachability ----------------------------------------------------------------------------------

def layer_hops(window: int, periods: Sequence[int]) -> tuple[int, ...]:
    """Sorted hop set {0, …, window} ∪ periods of one layer (a period <= window is already there)."""
    return tuple(sorted(set(range(window + 1)) | set(periods)))


def _step(bits: int, hops: Sequence[int], mask: int) -> int:
    """The lag set after one more layer: bits + hops (a sum set), cut to `mask`. Cutting is exact because
    hops are >= 0: a lag beyond the cut never comes back below it (so hops past it are skipped, not
    shifted: a period of 10⁹ would build a 10⁹-bit int)."""
    out = 0
    for d in hops:
        if d < mask.bit_length():
            out |= bits << d
    return out & mask


def _layer_bits(window: int, schedule: Schedule, max_lag: int) -> list[int]:
    """[lags reachable after 0, 1, …, L layers] as bit sets of lags 0 … max_lag."""
    mask = (1 << (max_lag + 1)) - 1
    sets = [1]  # no layer: only lag 0, the query itself
    for periods in schedule:
        sets.append(_step(sets[-1], layer_hops(window, periods), mask))
    return sets


def _to_tensor(bits: int, n: int) -> torch.Tensor:
    """bool [n]: [d] = bit d of `bits`."""
    raw = np.frombuffer(bits.to_bytes((n + 7) // 8, "little"), dtype=np.uint8)
    return torch.from_numpy(np.unpackbits(raw, bitorder="little")[:n].astype(bool))


def _gap_free(bits: int) -> int:
    """Largest R with lags 0 … R all in the bit set (bit 0 is always set here): trailing ones − 1."""
    return (~bits & (bits + 1)).bit_length() - 2


def _check_lag(name: str, value) -> int:
    _check_count(name, value, 0)
    return int(value)


def reachable_lags(window: int, schedule, max_lag: int) -> torch.Tensor:
    """bool [max_lag + 1]: [d] = some path through the L layers (layer l taking one hop of S_l) has lag d,
    i.e. key i − d can influence query i after all the layers. [0] is always True (every hop may be 0).

    schedule: periods per layer (a Schedule, or any list of per-layer lists of periods)."""
    check_window(window)
    max_lag = _check_lag("max_lag", max_lag)
    return _to_tensor(_layer_bits(window, _check_schedule(schedule), max_lag)[-1], max_lag + 1)


def depths_multi(window: int, schedule, max_lag: int) -> list[int | None]:
    """[d] = the smallest l such that the first l layers of the schedule reach lag d (0 for d = 0), or None
    when all L layers do not, for d = 0 … max_lag. Reachable after l layers stays reachable after more,
    since every layer can stay (hop 0)."""
    check_window(window)
    max_lag = _check_lag("max_lag", max_lag)
    depth: list[int | None] = [None] * (max_lag + 1)
    reached = 0
    for layers, bits in enumerate(_layer_bits(window, _check_schedule(schedule), max_lag)):
        for d in _to_tensor(bits & ~reached, max_lag + 1).nonzero().flatten().tolist():
            depth[d] = layers
        reached |= bits
    return depth


def min_depth_multi(d: int, window: int, schedule) -> int | None:
    """Smallest l such that the first l layers of the schedule reach lag d; None if all L layers do not.

    The multi-scale counterpart of `reachability.min_depth` (fewest layers), except that layers are not
    interchangeable any more: "fewest" is of the first layers, in the schedule's order."""
    if is_int(d) and d < 0:
        raise ValueError(f"a causal lag must be >= 0, got {d}")
    d = _check_lag("d", d)
    check_window(window)
    schedule = _check_schedule(schedule)
    if d > sum(max(layer_hops(window, periods)) for periods in schedule):
        return None  # beyond the longest path: answer without a bit set of d bits
    return depths_multi(window, schedule, d)[d]


def coverage_multi(window: int, schedule, max_lag: int) -> float:
    """Fraction of the lags 1 … max_lag that all L layers reach (max_lag >= 1)."""
    _check_count("max_lag", max_lag, 1)
    return reachable_lags(window, schedule, max_lag)[1:].float().mean().item()


def lag_routes(window: int, schedule, max_lag: int, cap: int = 1 << 32) -> torch.Tensor:
    """int64 [max_lag + 1]: [d] = the number of routes of lag d through the L layers, at most `cap`.

    A route takes one hop per layer: a local offset 0 … k (one route each), or a head's skip period beyond
    the window (one route per head: two heads with the same period are two routes, since either can learn
    to carry it; a period <= k is a local key already counted). Reachable means at least one route
    (`reachable_lags`); a lag with one route can be learned only by the one head per layer on it, which
    is what makes a tight design slow to learn (docs/results.md §7c)."""
    check_window(window)
    max_lag = _check_lag("max_lag", max_lag)
    _check_count("cap", cap, 1)
    counts = np.zeros(max_lag + 1, dtype=np.int64)
    counts[0] = 1
    lags = np.arange(max_lag + 1)
    for periods in _check_schedule(schedule):
        prefix = np.concatenate(([0], np.cumsum(counts)))  # counts <= cap: no overflow below 2^31 lags
        new = prefix[1:] - prefix[np.maximum(lags - window, 0)]  # the local offsets: counts[d − k … d]
        for p in periods:
            if window < p <= max_lag:
                new[p:] += counts[:max_lag + 1 - p]
        counts = np.minimum(new, cap)
    return torch.from_numpy(counts)


class ReachBudgetError(ValueError):
    """`gap_free_reach` stopped at REACH_BUDGET: the reach is longer than it measures."""


def _prefix_cost(window: int, schedule: Schedule, max_lag: int) -> int:
    """Bits `_layer_bits(window, schedule, max_lag)` shifts, at most: a max_lag-bit set per hop up to max_lag
    per layer."""
    return sum(min(window, max_lag) + 1 + sum(p <= max_lag for p in periods) for periods in schedule) * max_lag


def gap_free_reach(window: int, schedule) -> int:
    """The largest R such that all L layers reach every lag 1 … R (0 if they miss lag 1). ReachBudgetError
    (a ValueError) when measuring it takes more than REACH_BUDGET bits shifted."""
    check_window(window)
    schedule = _check_schedule(schedule)
    # The longest path takes every layer's largest hop, so R <= top; look at growing prefixes of the
    # lags rather than all of 0 … top at once (a period of 10⁹ must not allocate 10⁹ bits).
    top = sum(max(layer_hops(window, periods)) for periods in schedule)
    cap, spent, known = 1024, 0, 0  # known: every lag 1 … known reached (the last prefix measured)
    while True:
        spent += _prefix_cost(window, schedule, min(cap, top))
        if spent > REACH_BUDGET:
            raise ReachBudgetError(f"the gap-free reach is at least {known:,} lags, and measuring further would "
                                   f"take more than REACH_BUDGET = 2^{REACH_BUDGET.bit_length() - 1} bits shifted")
        reach = _gap_free(_layer_bits(window, schedule, min(cap, top))[-1])
        if reach < min(cap, top) or cap >= top:
            return reach
        known, cap = reach, cap * 2


# --- the designer ----------------------------------------------------------------------------------

def constructed_reach(window: int, n_layer: int, n_head: int) -> int:
    """The gap-free reach of `design_periods`' construction at full stride: R_L with R_0 = 0 and
    R_{l+1} = R_l + k + H·(R_l + 1), i.e. R_L = ((H + 1)^L·(H + k) − k)/H − 1 (1,248 for k = H = L = 4)."""
    check_window(window)
    _check_count("n_layer", n_layer, 0)
    _check_count("n_head", n_head, 1)
    return ((n_head + 1) ** n_layer * (n_head + window) - window) // n_head - 1


def _construct(window: int, n_layer: int, n_head: int, ratio: int) -> tuple[Schedule, int]:
    """The construction with every stride s_l = ⌈ratio/_RATIO_STEPS · (R_l + 1)⌉: (schedule, its reach)."""
    reach, layers = 0, []
    for _ in range(n_layer):
        stride = max(1, -(-ratio * (reach + 1) // _RATIO_STEPS))
        layers.append(tuple(window + j * stride for j in range(1, n_head + 1)))
        reach += window + n_head * stride
    return tuple(layers), reach


def _balanced_ratio(window: int, n_layer: int, n_head: int, target: int) -> int:
    """The smallest common stride ratio whose construction reaches >= target (a binary search: the reach
    grows with the ratio). Requires constructed_reach >= target, the reach at ratio _RATIO_STEPS."""
    lo, hi = 1, _RATIO_STEPS
    while lo < hi:
        mid = (lo + hi) // 2
        if _construct(window, n_layer, n_head, mid)[1] >= target:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _fewest_routes(window: int, schedule: Schedule, target: int) -> int:
    """The fewest routes of any lag 1 … target (0: some lag is unreachable)."""
    return int(lag_routes(window, schedule, target, cap=1 << 16)[1:].min())


def _routed(window: int, n_layer: int, n_head: int, target: int, routes: int) -> Schedule:
    """The construction with the smallest ratio, from the balanced one up, that gives every lag 1 … target
    at least `routes` routes; where none does within ROUTES_BUDGET, the one with the most (smallest ratio
    among equals). The route count is not monotone in the ratio (a longer reach can thin the middle lags),
    hence a scan, not a search."""
    per_ratio = n_layer * (n_head + 2) * (target + 1)
    first = _balanced_ratio(window, n_layer, n_head, target)
    last = min(_RATIO_STEPS, first + max(0, ROUTES_BUDGET // per_ratio - 1))
    best, best_routes = None, -1
    for ratio in range(first, last + 1):
        periods = _construct(window, n_layer, n_head, ratio)[0]
        fewest = _fewest_routes(window, periods, target)
        if fewest >= routes:
            return periods
        if fewest > best_routes:
            best, best_routes = periods, fewest
    return best


def _spread(bits: int, slack: int) -> int:
    """bits + {0, …, slack}: the lags later layers' local windows could still add (doubling: O(log slack))."""
    width = 1  # bits + {0, …, width − 1} so far
    while width <= slack:
        step = min(width, slack + 1 - width)
        bits |= bits << step
        width += step
    return bits


def _search(window: int, n_layer: int, n_head: int, target: int) -> Schedule:
    """Greedy, one head at a time in order: the period p <= target that maximises the gap-free reach,
    counting the local windows of the layers still to come as slack (their hops 0 … k fill small gaps,
    which the construction never leaves). Smallest p among equals, so a head with nothing left to add
    (the target already reached) gets period 1. Lags are cut at target."""
    mask = (1 << (target + 1)) - 1
    bits, layers = 1, []
    for layer in range(n_layer):
        slack = window * (n_layer - layer - 1)
        now = _step(bits, range(window + 1), mask)
        heads = []
        for _ in range(n_head):
            best_reach, best = -1, 1
            for p in range(1, min(_gap_free(_spread(now, slack) & mask) + 1, target) + 1):
                reach = _gap_free(_spread(now | ((bits << p) & mask), slack) & mask)
                if reach > best_reach:
                    best_reach, best = reach, p
            heads.append(best)
            now |= (bits << best) & mask
        layers.append(tuple(heads))
        bits = now
    return tuple(layers)


@dataclass(frozen=True)
class Design:
    """What `design_periods` proposes.

    periods: the Schedule (L tuples of H periods); reach: its gap-free reach (every lag 1 … reach is
    reachable after all L layers, computed by `gap_free_reach`, not by the construction's formula);
    uncovered: the lags 1 … target it misses (empty when it covers the target); method: "construction"
    (the proven one) or "search" (the greedy search did better; checked by `reachable_lags`); routes: the
    fewest routes of any lag 1 … target (`lag_routes`; 0 when a lag is uncovered)."""

    periods: Schedule
    reach: int
    uncovered: tuple[int, ...]
    method: str
    routes: int

    @property
    def covers(self) -> bool:
        return not self.uncovered


def design_periods(window: int, n_layer: int, n_head: int, target: int, routes: int = 1) -> Design:
    """Per-layer head periods that reach every lag 1 … target within n_layer layers (window k, n_head = H).

    Construction. If the first l layers reach exactly the lags [0, R] and layer l puts its heads at
    π_j = k + j·s (j = 1 … H) with a stride 1 <= s <= R + 1, the first l + 1 layers reach exactly
    [0, R + k + H·s]: the new lag set is [0, R] + S_l = [0, R + k] ∪ ⋃_j [π_j, π_j + R]; the first of these
    intervals starts at π_1 = k + s <= (R + k) + 1 and each next one at π_{j+1} = π_j + s <= (π_j + R) + 1,
    so none leaves a gap and the union ends at π_H + R. From [0, 0] (no layer) induction gives a gap-free
    reach of R_L. At full stride s = R + 1 this is `constructed_reach`: R_{l+1} + 1 = (H + 1)(R_l + 1) + k,
    a number system whose layer-l digit is a head (H choices) or a local hop (k + 1 more, of which k
    extend the range). It needs no H >= k: any H >= 1 works. The base-(k + 1) system (layer l's heads at
    (k + 1)^l·{1 … k}, H >= k) reaches (k + 1)^L − 1 = 624 for k = H = L = 4; this one 1,248, because it
    uses layer 0's heads beyond the window and every later layer's window as well.

    When R_L >= target, every layer's stride is shrunk by one common ratio ρ = m/256, s_l = ⌈ρ(R_l + 1)⌉,
    the smallest m that still reaches the target: all L layers share the work, no head reads beyond the
    target (no period exceeds max(target, k + H), checked in the tests) and the overlapping intervals
    give most lags several paths, but not the last ones: reached only through the longest hops, they may
    have one route (`lag_routes`), which learns slowly (docs/results.md §7c). routes > 1 asks for at least
    that many routes to every lag 1 … target: the ratio grows from the balanced one until every lag has
    them (a scan, since the count is not monotone in the ratio; periods may then pass the target), or,
    where none does within ROUTES_BUDGET, the ratio with the most. Design.routes says what was reached.
    When R_L < target the construction runs at full stride, and if
    n_layer·n_head·(target + 1) <= SEARCH_BUDGET a greedy search (`_search`) is tried too and kept if it
    reaches further: the construction is not optimal (k = 2, H = 1, L = 2: it reaches 9, hops
    {0, 1, 2, 5} then {0, 1, 2, 8} reach 10), and neither is the search (k = 2, H = 2, L = 2: both stop at
    16, periods (5, 6) then (9, 11) reach 17). Whatever is returned, its reach and uncovered lags are
    measured by `reachable_lags`.
    """
    check_window(window)
    _check_count("n_layer", n_layer, 0)
    _check_count("n_head", n_head, 1)
    _check_count("target", target, 1)
    _check_count("routes", routes, 1)
    target = int(target)
    method = "construction"
    if constructed_reach(window, n_layer, n_head) >= target:
        periods = (_routed(window, n_layer, n_head, target, routes) if routes > 1 else
                   _construct(window, n_layer, n_head, _balanced_ratio(window, n_layer, n_head, target))[0])
    else:
        periods, full = _construct(window, n_layer, n_head, _RATIO_STEPS)
        if n_layer * n_head * (target + 1) <= SEARCH_BUDGET:
            found = _search(window, n_layer, n_head, target)
            if gap_free_reach(window, found) > full:
                periods, method = found, "search"
    lags = reachable_lags(window, periods, target)
    uncovered = tuple((~lags[1:]).nonzero().flatten().add(1).tolist())
    return Design(periods, gap_free_reach(window, periods), uncovered, method, _fewest_routes(window, periods, target))

