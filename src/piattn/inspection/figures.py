"""The figures of `piattn inspect`: gate dynamics over training, the skip prior by phase, token flow and
attention mass per layer.

Each takes plain data (metrics records, `Inspector.result()` dicts) and write a PNG with a bare matplotlib
`Figure` (Agg, pyplot's global state untouched). Needs matplotlib (the `plot` extra).
"""

from __future__ import annotations

import re
from pathlib import Path

from ..analysis.multiscale import periods_per_layer
from ..safe_files import save_figure
from .probes import KEY_CLASSES

CLASS_COLOURS = {"local": "#4c72b0", "skip": "#dd8452", "sink": "#55a868", "all": "#8c8c8c"}
_ALPHA_KEY = re.compile(r"^alpha/layer(\d+)/mean$")


def _figure(**kwargs):
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("the figures need matplotlib: pip install piattn[plot]") from e
    return Figure(layout="constrained", **kwargs)


def gate_series(records: list[dict]) -> dict[int, dict[str, list[float]]]:
    """{layer: {"step": […], "mean": […], "q05": …, "q25", "q75", "q95"}} from the train records of a
    metrics.jsonl that carry gate statistics (`piattn.train.gates`); {} when none do."""
    series: dict[int, dict[str, list[float]]] = {}
    for r in records:
        if r.get("split") != "train":
            continue
        for key in r:
            match = _ALPHA_KEY.match(key)
            if match is None:
                continue
            layer = int(match.group(1))
            s = series.setdefault(layer, {"step": [], "mean": [], "q05": [], "q25": [], "q75": [], "q95": []})
            s["step"].append(r["step"])
            for stat in ("mean", "q05", "q25", "q75", "q95"):
                s[stat].append(r.get(f"alpha/layer{layer}/{stat}", float("nan")))
    return dict(sorted(series.items()))


def plot_gate_dynamics(runs: list[tuple[str, list[dict]]], out: str | Path) -> Path | None:
    """One panel per run that logged gate statistics: α per layer over training steps, the mean as a line,
    the 25–75 % quantiles as a band and 5–95 % as a lighter one. None (nothing written) if no run has any."""
    panels = [(label, gate_series(records)) for label, records in runs]
    panels = [(label, series) for label, series in panels if series]
    if not panels:
        return None
    fig = _figure(figsize=(6.5 * len(panels), 4.2))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (label, series) in zip(axes, panels, strict=True):
        colours = [f"C{i % 10}" for i in range(len(series))]
        for colour, (layer, s) in zip(colours, series.items(), strict=True):
            ax.fill_between(s["step"], s["q05"], s["q95"], color=colour, alpha=0.08, lw=0)
            ax.fill_between(s["step"], s["q25"], s["q75"], color=colour, alpha=0.22, lw=0)
            ax.plot(s["step"], s["mean"], color=colour, lw=1.6, marker="o" if len(s["step"]) < 12 else None,
                    ms=3, label=f"layer {layer}")
        # zoomed to the data (the gate starts at 0.5 and moves slowly), never outside [0, 1]
        lo = min(min(v for v in s["q05"] if v == v) for s in series.values())
        hi = max(max(v for v in s["q95"] if v == v) for s in series.values())
        pad = max(0.08 * (hi - lo), 0.01)
        ax.set_ylim(max(0.0, lo - pad), min(1.0, hi + pad))
        if lo - pad < 0.5 < hi + pad:
            ax.axhline(0.5, color="grey", lw=0.7, ls=":")
        ax.set_xlabel("training step")
        ax.set_ylabel("gate α  (→ 1: prior on local keys, → 0: on the skip key)")
        ax.set_title(f"{label}: gate α per layer\nline: mean; bands: 25–75 % and 5–95 % of tokens × heads",
                     fontsize=10)
        ax.legend(fontsize=8, ncol=2 if len(series) > 6 else 1, loc="best")
    return save_figure(fig, out)


def plot_skip_prior_by_phase(runs: list[tuple[str, dict]], out: str | Path) -> Path | None:
    """The paper's gate figure (d): one panel per run with gated layers (`Inspector.result()` dicts), the
    mean skip prior 1 − α against the query's position modulo π, a line per layer (per layer and period
    with per-head periods). None (nothing written) if no run has a gated layer."""
    panels = [(label, report, [line for e in report["layers"] for line in _phase_lines(e)]) for label, report in runs]
    panels = [panel for panel in panels if panel[2]]
    if not panels:
        return None
    fig = _figure(figsize=(6.2 * len(panels), 4.2))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (label, report, layers) in zip(axes, panels, strict=True):
        for name, by_phase in layers:
            seen = [(phase, v) for phase, v in enumerate(by_phase) if v is not None]
            ax.plot([p for p, _ in seen], [v for _, v in seen], marker="o", ms=3, lw=1.4, label=name)
        ax.set_xlabel("query position mod π (position counted from its document's start)")
        ax.set_ylabel("skip prior 1 − α  (mean over heads and queries)")
        ax.set_title(f"{label}: {_describe(report)}\nskip prior by phase ({report['tokens']:,} tokens)", fontsize=10)
        ax.legend(fontsize=8, ncol=2 if len(layers) > 6 else 1, loc="best")
    return save_figure(fig, out)


def _periods(model: dict) -> set[int]:
    """The distinct periods of a report's model settings (its `period` in any stored form, read for its
    n_layer layers of n_head heads by `periods_per_layer`)."""
    return {p for heads in periods_per_layer(model.get("period"), model["n_layer"], model["n_head"]) for p in heads}


def _phase_lines(entry: dict) -> list[tuple[str, list]]:
    """(label, skip prior by phase) of one layer's entry: one line, one per period with per-head periods,
    none for a layer without a gate."""
    if "skip_prior_by_phase" in entry:
        return [(f"layer {entry['layer']}", entry["skip_prior_by_phase"])]
    return [(f"layer {entry['layer']}, π={g['period']} (heads {','.join(map(str, g['heads']))})", g["by_phase"])
            for g in entry.get("skip_prior_by_period", ())]


def _describe(report: dict) -> str:
    m = report.get("model", {})
    kind = m.get("attention", report["layers"][0]["kind"])
    if kind == "pi":
        return f"π (k={m.get('window')}, π={m.get('period')}, {m.get('variant')})"
    if kind == "local":
        return f"local (k={m.get('window')})"
    return kind


def plot_token_flow(runs: list[tuple[str, dict]], out: str | Path) -> Path:
    """Per run (a column each, side by side): the token flow into one query after each layer (a heat map
    of influence against offset j − p, log colour scale shared by all runs) above the attention mass per
    layer as stacked bars of key classes."""
    from matplotlib.colors import LogNorm

    fig = _figure(figsize=(6.2 * len(runs), 7.6))
    axes = fig.subplots(2, len(runs), squeeze=False, height_ratios=[1.25, 1])
    norm = LogNorm(vmin=1e-4, vmax=1.0)
    image = None
    for col, (label, report) in enumerate(runs):
        ax = axes[0][col]
        flow = report.get("flow")
        name = f"{label}: {_describe(report)}"
        if flow:
            import numpy as np

            influence = np.ma.masked_less_equal(np.array(flow["influence"]), 0.0)
            offsets = flow["offsets"]
            L = influence.shape[0]
            image = ax.imshow(influence, aspect="auto", origin="lower", norm=norm, cmap="viridis",
                              interpolation="nearest",
                              extent=(offsets[0] - 0.5, offsets[-1] + 0.5, -0.5, L - 0.5))
            ax.set_facecolor("#f2f2f2")
            ax.set_yticks(range(L))
            if report.get("model", {}).get("attention") == "pi":
                marks = {sign * mult * period for period in _periods(report["model"])
                         for mult in range(1, L + 1) for sign in ((-1,) if flow["causal"] else (-1, 1))}
                for d in sorted(marks):
                    if offsets[0] <= d <= offsets[-1]:
                        ax.axvline(d, color="white", lw=0.6, ls=":")
            cut = flow["window"][1] - flow["window"][0] < flow["sequence_length"] and not flow["causal"]
            ax.set_xlabel("offset j − p of input position j" + ("; paths leaving the window are cut" if cut else ""))
            ax.set_ylabel("output of layer")
            n = flow["sequences"]
            ax.set_title(f"{name}\ntoken flow into position p = {flow['position']} "
                         f"(mean of {n} sequence{'s' if n != 1 else ''})", fontsize=10)
        else:
            ax.text(0.5, 0.5, "no flow captured", ha="center", va="center", transform=ax.transAxes)
            ax.set_title(name, fontsize=10)
        ax = axes[1][col]
        layers = report["layers"]
        xs = [entry["layer"] for entry in layers]
        bottom = [0.0] * len(layers)
        for cls in KEY_CLASSES:
            heights = [entry["mass"].get(cls, 0.0) for entry in layers]
            if not any(cls in entry["mass"] for entry in layers):
                continue
            ax.bar(xs, heights, bottom=bottom, color=CLASS_COLOURS[cls], label=cls, width=0.7)
            for x, b, h in zip(xs, bottom, heights, strict=True):
                if h >= 0.04:
                    ax.text(x, b + h / 2, f"{h:.0%}", ha="center", va="center", fontsize=7, color="white")
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        for x, entry in zip(xs, layers, strict=True):
            if "alpha_mean" in entry:
                ax.plot([x - 0.35, x + 0.35], [entry["alpha_mean"]] * 2, color="black", lw=1.2)
        ax.set_ylim(0, 1.0)
        ax.set_xticks(xs)
        ax.set_xlabel("layer")
        ax.set_ylabel("share of attention probability")
        gated = any("alpha_mean" in entry for entry in layers)
        ax.set_title("attention mass per key class" + (" (black line: mean gate α)" if gated else "")
                     + "\nmean |i − j|: " + ", ".join(f"{e['mean_distance']:.1f}" for e in layers), fontsize=10)
        ax.legend(fontsize=8, loc="lower right")
    if image is not None:
        fig.colorbar(image, ax=[a for a in axes[0]], label="influence (log scale)", shrink=0.9)
    return save_figure(fig, out)
