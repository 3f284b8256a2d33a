"""Which tokens can influence which after L stacked attention layers (Eqs. reachable, rf_pi, lmin).

One layer lets output i read the layer input at every j its pattern allows (the dense mask, self included).
Stacking L layers composes these one-step graphs, so the L-layer reachability is the L-th boolean power of
the one-step mask. Everything here reads the pattern from `piattn.masks`; nothing re-derives the offsets.

Two facts the seed gets wrong, checked by the tests against breadth-first search:
- A layer takes ONE hop per path: either a local offset or the skip, never both. The attainable span is
  therefore L·max(k, π); the seed's bound L(k + π) (Eq. rf_pi) holds but is not tight.
- Eq. (lmin) minimises over all b >= 0 and so lets a backward π-hop overshoot the lag; the true minimum
  ranges b over 0 … ⌊d/π⌋ (for k=4, π=16: L_min(15) = 4, not 1).

Sinks (`sinks` = s > 0, one document starting at position 0): every query also reads keys 0 … s − 1 (only
those at or before it when causal). Information flows from a key to the queries that read it, so a sink
position passes on what it has itself gathered, and a sink gathers, as a query, only its own window and
skip keys (and the other sinks). Hence, with R_L the reachability without sinks and d(j) the fewest layers
after which input j has reached the query of some sink position m < s without sinks (d(j) = 0 for j < s):

    j reaches i after L layers with sinks  ⇔  R_L[i, j]  or  (L >= d(j) + 1 and, when causal, j <= i).

Any path that uses a sink edge first reaches a sink on window and skip hops alone (d(j) layers), then one
layer of sink edges reaches every query (every later one when causal), and the self offset keeps it there.
- Causal: a path only moves forward, so from j >= s it never meets a sink position: d(j) is infinite and
  the sinks change nothing for j >= s; each j < s reaches every i >= j after ONE layer. The sinks are
  hubs for the first s tokens only; they do not connect a later token to anything it did not reach.
- Bidirectional: every j reaches every position after d(j) + 1 layers, i.e. a token within the window
  of a sink (or ±π of one) reaches the whole document in two layers. `sink_reach_depth` gives d(j) + 1.
`reachability_with_sinks` evaluates this rule; the tests check it against breadth-first search over the
layer graph, and `reachability_mask(…, sinks=s)` computes the same by matrix powers.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from ..checks import is_int
from ..masks import dense_mask, local_mask, pi_mask
from ..masks.local import check_window
from ..masks.pi import check_period


def step_mask(n: int, window: int, period: int | None, causal: bool = True, sinks: int = 0) -> torch.Tensor:
    """bool [n, n]: the one-layer graph, [i, j] = query i attends key j. period=None: local window only;
    sinks: every query also attends keys 0 … sinks − 1 (those at or before it when causal)."""
    mod = local_mask(window, causal) if period is None else pi_mask(window, period, causal)
    mask = dense_mask(mod, n)
    if sinks:
        _check_sinks(sinks)
        sink = torch.zeros(n, n, dtype=torch.bool)
        sink[:, :sinks] = True
        mask |= sink.tril() if causal else sink
    return mask


def _check_sinks(sinks) -> None:
    if not is_int(sinks) or sinks < 0:
        raise ValueError(f"sinks must be an int >= 0 (0: no sink keys), got {sinks!r}")


def _powers(step: torch.Tensor, layers: int) -> Iterator[torch.Tensor]:
    """Yield the reachability after 0, 1, …, layers layers (bool [n, n] each)."""
    if layers < 0:
        raise ValueError(f"layers must be >= 0, got {layers}")
    reach = torch.eye(step.shape[0], dtype=torch.bool, device=step.device)
    a = step.float()
    yield reach
    for _ in range(layers):
        # i reaches j in l+1 layers iff i attends some m that reaches j in l layers. The float product
        # counts such m, at most n, so it is exact in float32 for any n that fits in memory.
        reach = (a @ reach.float()) > 0
        yield reach


def reachability_mask(n: int, window: int, period: int | None, layers: int,
                      causal: bool = True, sinks: int = 0) -> torch.Tensor:
    """bool [n, n]: [i, j] = token j can influence output i after `layers` layers (layers=0: identity).

    period=None gives local-window attention only; sinks > 0 adds the sink keys (module docstring). Dense
    boolean matrix powers: O(layers·n³) time and O(n²) memory, meant for analysis-sized n (a few thousand
    at most).
    """
    *_, last = _powers(step_mask(n, window, period, causal, sinks), layers)
    return last


def sink_reach_depth(n: int, window: int, period: int | None, sinks: int, causal: bool = True) -> list[int | None]:
    """Per input position j: d(j) + 1, the fewest layers after which j reaches every query the sinks reach
    (all of them; when causal, all at or after j), or None if it never does on this length-n sequence
    (every j >= sinks when causal). See the module docstring for why."""
    _check_sinks(sinks)
    depth: list[int | None] = [None] * n
    if not sinks:
        return depth
    # d(j) <= n - 1: a shortest path visits each position at most once.
    for layers, reach in enumerate(_powers(step_mask(n, window, period, causal), n)):
        hit = reach[: min(sinks, n)].any(0)  # [n]: j has reached the query of some sink position
        for j in hit.nonzero().flatten().tolist():
            if depth[j] is None:
                depth[j] = layers + 1
        if all(d is not None for d in depth):
            break
    return depth


def reachability_with_sinks(n: int, window: int, period: int | None, layers: int, sinks: int,
                            causal: bool = True) -> torch.Tensor:
    """bool [n, n]: the rule of the module docstring, R_L[i, j] or (L >= d(j) + 1 and, when causal, j <= i),
    from the reachability without sinks and `sink_reach_depth`; equal to `reachability_mask(…, sinks)`."""
    plain = reachability_mask(n, window, period, layers, causal)
    depth = sink_reach_depth(n, window, period, sinks, causal)
    hub = torch.tensor([d is not None and layers >= d for d in depth], dtype=torch.bool)
    via_sink = hub[None, :].expand(n, n)
    return plain | (via_sink.tril() if causal else via_sink)


def coverage(mask: torch.Tensor) -> float:
    """Fraction of all cells of a bool [n, n] mask that are True (the seed's Fig. rf_app counts all n²)."""
    return mask.sum().item() / mask.numel()


def span(mask: torch.Tensor) -> int:
    """Largest |i - j| over the True cells of a bool [n, n] mask (0 if none)."""
    idx = torch.arange(mask.shape[0], device=mask.device)
    dist = (idx[:, None] - idx[None, :]).abs()
    return int(dist.masked_fill(~mask, 0).max()) if mask.numel() else 0


def spans_by_depth(n: int, window: int, period: int | None, layers: int, causal: bool = True) -> list[int]:
    """[span after 1 layer, …, span after `layers` layers] on a length-n sequence (capped by n - 1)."""
    powers = _powers(step_mask(n, window, period, causal), layers)
    next(powers)  # depth 0 is the identity
    return [span(r) for r in powers]


def span_bound(layers: int, window: int, period: int | None) -> int:
    """The seed's upper bound on the span: L(k + π) (Eq. rf_pi), or kL for local attention (Eq. rf_local)."""
    return layers * (window + (0 if period is None else period))


def attainable_span(layers: int, window: int, period: int | None) -> int:
    """The largest span L layers actually reach on a long enough sequence: L·max(k, π) (kL if local).

    Each layer moves a path by one offset of the pattern, whose largest magnitude is max(k, π).
    """
    return layers * max(window, 0 if period is None else period)


def min_depth(d: int, window: int, period: int | None, causal: bool = True) -> int | None:
    """Fewest layers after which lag d is reachable (key i - d influences query i); None if never.

    Causal: d >= 0. A path uses b skip hops (π each) and local hops (<= k each), so the depth is
    min over 0 <= b <= ⌊d/π⌋ of b + ⌈(d - bπ)/k⌉; with k = 0 only d - bπ = 0 works. Bidirectional: d may
    have either sign (only |d| matters) and skips may overshoot and come back with forward local hops, so
    b ranges over 0 … ⌈|d|/π⌉ with cost b + ⌈|d - bπ|/k⌉; this is on an unbounded sequence (near its
    ends a path may have no room to overshoot). Once reachable, a lag stays reachable at every greater
    depth, since the self offset 0 lets a layer stand still.
    """
    check_window(window)
    if period is not None:
        check_period(period)
    if causal and d < 0:
        raise ValueError(f"a causal lag must be >= 0, got {d}")
    d = abs(d)
    if period is None:
        candidates = [0]
    else:
        # f(b) = b + ⌈r/k⌉ with r = d - bπ is monotone in b: one more skip hop saves ⌊π/k⌋ or ⌈π/k⌉ local
        # hops, so f(b+1) - f(b) <= 1 - ⌊π/k⌋ <= 0 when π >= k and >= 1 - ⌈π/k⌉ >= 0 when π <= k. The
        # minimum therefore sits at an end of the range of b (both ends are tried; the overshooting end
        # only exists without causality).
        top = d // period if causal else -(-d // period)
        candidates = sorted({0, d // period, top})
    best = None
    for b in candidates:
        rest = abs(d - b * (period or 0))
        if rest and window == 0:
            continue  # no local hops to cover the rest
        depth = b + (math.ceil(rest / window) if rest else 0)
        best = depth if best is None else min(best, depth)
    return best
