"""The reachability report of local vs π-Attention: coverage, span, minimum depth, and the paper's Fig. rf_app.

`piattn reach` (piattn.commands.reach) prints it; `piattn demo` shows it first.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from ..safe_files import save_figure
from .reachability import (
    attainable_span,
    coverage,
    min_depth,
    reachability_mask,
    sink_reach_depth,
    span,
    span_bound,
    spans_by_depth,
)


def lag_runs(lags: Iterable[int], *, dash: str = "–", sep: str = ", ") -> str:
    """Lags written as runs of consecutive ones, in order: [2, 3, 4, 9] -> '2–4, 9' ("" for none); `dash` and
    `sep` as the reader wants them ('2-4,9' is the flag syntax of `--mqar-lags`)."""
    runs: list[list[int]] = []
    for lag in sorted(lags):
        if runs and lag == runs[-1][1] + 1:
            runs[-1][1] = lag
        else:
            runs.append([lag, lag])
    return sep.join(f"{a}{dash}{b}" if a != b else f"{a}" for a, b in runs)


def default_lags(n: int, window: int, period: int) -> list[int]:
    """Lags that show where the skip helps, fails to help, or only the skip reaches (all >= 1)."""
    lags = {1, window + 1, period - 1, period, period + window, 2 * period, n - 1}
    return sorted(d for d in lags if d >= 1)


def sink_summary(n: int, window: int, period: int, layers: int, sinks: int, causal: bool = True) -> dict:
    """What `sinks` sink keys add (see `piattn.analysis.reachability`), JSON-friendly:

    {"sinks", "coverage": {"local", "pi"}, "span": {"local", "pi"}   the same numbers with the sinks,
     "hub_depth": {"local", "pi"}   layers after which every token reaches every query (every later one
                                    when causal), None if some token never does (causal: any j >= sinks),
     "tokens_through_sinks": {"local", "pi"}   tokens j that reach all those queries within `layers`}
    """
    out = {"sinks": sinks, "coverage": {}, "span": {}, "hub_depth": {}, "tokens_through_sinks": {}}
    for name, p in (("local", None), ("pi", period)):
        mask = reachability_mask(n, window, p, layers, causal, sinks=sinks)
        depth = sink_reach_depth(n, window, p, sinks, causal)
        out["coverage"][name], out["span"][name] = coverage(mask), span(mask)
        out["hub_depth"][name] = None if None in depth else max(depth)
        out["tokens_through_sinks"][name] = sum(d is not None and d <= layers for d in depth)
    return out


def reach_summary(n: int, window: int, period: int, layers: int, causal: bool = True,
                  lags: list[int] | None = None, sinks: int = 0) -> dict:
    """Plain numbers (JSON-friendly) comparing local-only attention with π-Attention.

    {"n", "window", "period", "layers", "causal",
     "coverage": {"local", "pi"}             fraction of all n² cells reachable after `layers` layers,
     "span": {"local", "pi"}                 largest |i - j| reachable on this length-n sequence,
     "attainable_span": {"local", "pi"}      kL and L·max(k, π): the span on a long enough sequence,
     "span_bound": {"local", "pi"}           kL and the seed's L(k + π) (Eq. rf_pi),
     "min_depth": [{"lag", "local", "pi"}]   fewest layers carrying each lag (None: never),
     "with_sinks": `sink_summary(…)`          only when sinks > 0}
    """
    local = reachability_mask(n, window, None, layers, causal)
    pi = reachability_mask(n, window, period, layers, causal)
    lags = default_lags(n, window, period) if lags is None else lags
    return {
        "n": n, "window": window, "period": period, "layers": layers, "causal": causal,
        "coverage": {"local": coverage(local), "pi": coverage(pi)},
        "span": {"local": span(local), "pi": span(pi)},
        "attainable_span": {"local": attainable_span(layers, window, None),
                            "pi": attainable_span(layers, window, period)},
        "span_bound": {"local": span_bound(layers, window, None), "pi": span_bound(layers, window, period)},
        "min_depth": [{"lag": d, "local": min_depth(d, window, None, causal),
                       "pi": min_depth(d, window, period, causal)} for d in lags],
        **({"with_sinks": sink_summary(n, window, period, layers, sinks, causal)} if sinks else {}),
    }


def format_summary(s: dict) -> str:
    """The summary as a small text table."""
    n, k, p, L = s["n"], s["window"], s["period"], s["layers"]
    cov, sp, att, bound = s["coverage"], s["span"], s["attainable_span"], s["span_bound"]

    def depth(x):
        return "never" if x is None else str(x)

    lines = [
        f"π-Attention reachability: n={n}, window k={k}, period π={p}, L={L} layers, "
        f"{'causal' if s['causal'] else 'bidirectional'}",
        f"coverage: local {cov['local']:.1%} → π {cov['pi']:.1%} of all n² = {n * n} cells"
        + (f" (all causal pairs j ≤ i: {(n + 1) / (2 * n):.1%})" if s["causal"] else ""),
        "",
        f"{'':44}{'local':>8}{'π':>8}",
        f"{'coverage':44}{cov['local']:>8.1%}{cov['pi']:>8.1%}",
        f"{f'span measured on n={n} (at most n−1 = {n - 1})':44}{sp['local']:>8}{sp['pi']:>8}",
        f"{'span on a long sequence: kL | L·max(k,π)':44}{att['local']:>8}{att['pi']:>8}",
        f"{'span bound: kL | L(k+π) (seed Eq. rf_pi)':44}{bound['local']:>8}{bound['pi']:>8}",
        "  (a layer moves a path by one hop, local or skip, so L(k+π) bounds the span but is never reached)",
        "",
        "minimum depth for lag d (layers)",
        f"{'d':>6}{'local ⌈d/k⌉':>14}{'π':>8}",
    ]
    lines += [f"{r['lag']:>6}{depth(r['local']):>14}{depth(r['pi']):>8}" for r in s["min_depth"]]
    if "with_sinks" in s:
        w = s["with_sinks"]
        reach_all = f"all {'later ' if s['causal'] else ''}queries in L={L}"
        lines += [
            "",
            f"with {w['sinks']} sink key(s) (positions 0 … {w['sinks'] - 1}, seen by every query"
            + (" at or after them)" if s["causal"] else ")"),
            f"{'':44}{'local':>8}{'π':>8}",
            f"{'coverage':44}{w['coverage']['local']:>8.1%}{w['coverage']['pi']:>8.1%}",
            f"{'span':44}{w['span']['local']:>8}{w['span']['pi']:>8}",
            f"{f'tokens reaching {reach_all}':44}{w['tokens_through_sinks']['local']:>8}"
            f"{w['tokens_through_sinks']['pi']:>8}",
            f"{'layers until every token does':44}{depth(w['hub_depth']['local']):>8}{depth(w['hub_depth']['pi']):>8}",
        ]
        if s["causal"]:
            lines.append("  (causal: a sink gathers only what precedes it, so only the first tokens use it as a hub)")
        else:
            lines.append("  (a token reaches everything one layer after it reaches a sink's query)")
    return "\n".join(lines)


def plot_receptive_field(n: int, window: int, period: int, layers: int, out: str | Path,
                         causal: bool = True, sinks: int = 0) -> Path:
    """Write the seed's Fig. rf_app to `out` (PNG): (a) local and (b) π reachability after `layers` layers
    (dark = key j can influence query i), (c) span vs depth L = 1 … layers, measured on this length-n
    sequence, with the bounds kL and L(k + π); (a) and (b) include `sinks` sink keys. Needs matplotlib
    (the `plot` extra)."""
    try:
        # a bare Figure renders with Agg and leaves pyplot's global backend and figure list alone
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("the figure needs matplotlib: pip install piattn[plot]") from e

    local = reachability_mask(n, window, None, layers, causal, sinks=sinks)
    pi = reachability_mask(n, window, period, layers, causal, sinks=sinks)
    depths = list(range(1, layers + 1))
    mode = "causal" if causal else "bidirectional"

    fig = Figure(figsize=(14, 4.6), layout="constrained")
    axes = fig.subplots(1, 3)
    for ax, mask, label in ((axes[0], local, f"(a) local, k={window}"),
                            (axes[1], pi, f"(b) π-Attention, k={window}, π={period}")):
        ax.imshow(mask.numpy(), cmap="Greys", vmin=0, vmax=1, interpolation="nearest")
        sink_note = f", {sinks} sinks" if sinks else ""
        ax.set_title(f"{label}{sink_note}\nL={layers}, {mode}: {coverage(mask):.1%} of n²")
        ax.set_xlabel("key j (source)")
        ax.set_ylabel("query i")

    ax = axes[2]
    ax.plot(depths, spans_by_depth(n, window, None, layers, causal), "o-", label="local, measured")
    ax.plot(depths, spans_by_depth(n, window, period, layers, causal), "s-", label="π, measured")
    ax.plot(depths, [span_bound(d, window, None) for d in depths], "--", label="bound kL")
    ax.plot(depths, [span_bound(d, window, period) for d in depths], "--", label="bound L(k+π) (seed)")
    ax.plot(depths, [attainable_span(d, window, period) for d in depths], ":",
            label="L·max(k,π) (long sequence)")
    ax.axhline(n - 1, color="grey", lw=0.8, ls=":", label=f"n−1 = {n - 1} (sequence end)")
    ax.set_title(f"(c) span R(L), measured on n={n}")
    ax.set_xlabel("depth L (layers)")
    ax.set_ylabel("largest reachable |i − j|")
    if layers <= 16:
        ax.set_xticks(depths)
    else:  # one tick per layer would be an unreadable band (`piattn reach` allows 512 layers)
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=8)

    return save_figure(fig, out)
