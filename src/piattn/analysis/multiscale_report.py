"""The multi-scale report of `piattn reach --design` / `--periods`: which lags 1 … R a schedule of per-layer
head periods reaches, beside local attention and single-period π, as a table and a figure.

Every number comes from `multiscale.depths_multi` (exact bit-set reachability over lags): a path takes at
most one hop per layer, a local hop 0 … k or one of that layer's skip periods, in the layers' order.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..safe_files import save_figure
from .multiscale import Schedule, depths_multi, design_periods, gap_free_reach, periods_per_layer, schedule


@dataclass(frozen=True)
class Row:
    """One schedule's reach over lags 1 … R: name, periods, reached (lags of 1 … R reached), gap_free (every
    lag 1 … gap_free is reached), depths ([d] = the first layers that reach lag d, None: not within L)."""

    name: str
    periods: Schedule
    reached: int
    gap_free: int
    depths: tuple[int | None, ...]


def compare_schedules(window: int, n_layer: int, n_head: int, period: int, target: int,
                      periods: Schedule | None = None) -> tuple[list[Row], Schedule]:
    """Rows for local (no skip), single π = period, the geometric heads π, 2π, 4π, … and the designed (or
    the given `periods`) schedule, over lags 1 … target. Returns (rows, the schedule under study)."""
    studied = periods if periods is not None else design_periods(window, n_layer, n_head, target).periods
    schedules = {
        f"local k={window}": tuple(() for _ in range(n_layer)),
        f"single π={period}": periods_per_layer(period, n_layer, n_head),
        f"geometric from π={period}": schedule("geometric", window, n_layer, n_head, period=period),
        "given periods" if periods is not None else f"designed (target {target})": studied,
    }
    rows = []
    for name, periods_ in schedules.items():
        depths = depths_multi(window, periods_, target)
        rows.append(Row(name, periods_, sum(d is not None for d in depths[1:]), gap_free_reach(window, periods_),
                        tuple(depths)))
    return rows, studied


def format_schedules(rows: list[Row], window: int, target: int) -> str:
    """The table `piattn reach --design` prints: per schedule its periods per layer, lags of 1 … target
    reached, the gap-free reach and the first unreached lag."""
    lines = [f"multi-scale π: window k={window}, L={len(rows[0].periods)} layers, lags 1 … {target}", ""]
    width = max(len(r.name) for r in rows) + 2
    lines.append(f"{'schedule':{width}}{'reached':>16}{'gap-free reach':>16}{'first gap':>11}")
    for r in rows:
        gap = next((d for d in range(1, target + 1) if r.depths[d] is None), None)
        share = f"{r.reached}/{target} ({r.reached / target:.0%})"
        lines.append(f"{r.name:{width}}{share:>16}{r.gap_free:>16}{'none' if gap is None else gap:>11}")
    lines.append("")
    studied = rows[-1]
    lines.append(f"{studied.name}, periods per layer (heads):")
    lines.extend(f"  layer {layer}: {', '.join(map(str, heads)) or '(local only)'}"
                 for layer, heads in enumerate(studied.periods))
    return "\n".join(lines)


def plot_schedules(rows: list[Row], window: int, target: int, out: str | Path) -> Path:
    """Write the figure: for each schedule, the depth at which each lag 1 … target is first reached (a
    marker per lag; unreached lags drawn on a row of their own above the deepest layer). Needs matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("the figure needs matplotlib: pip install piattn[plot]") from e

    n_layer = len(rows[0].periods)
    fig = Figure(figsize=(12, 1.1 + 1.3 * len(rows)), layout="constrained")
    axes = fig.subplots(len(rows), 1, sharex=True, squeeze=False)[:, 0]
    lags = range(1, target + 1)
    for ax, row in zip(axes, rows, strict=True):
        hit = [(d, row.depths[d]) for d in lags if row.depths[d] is not None]
        miss = [d for d in lags if row.depths[d] is None]
        if hit:
            lag, depth = zip(*hit, strict=True)
            ax.scatter(lag, depth, s=6, color="tab:blue", label="reached at depth")
        if miss:
            ax.scatter(miss, [n_layer + 1] * len(miss), s=6, color="tab:red", marker="x", label="not reached")
        ax.set_yticks(range(n_layer + 2), [*map(str, range(n_layer + 1)), "—"])
        ax.set_ylim(-0.5, n_layer + 1.5)
        ax.set_ylabel("depth")
        ax.set_title(f"{row.name}: {row.reached}/{target} lags, gap-free to {row.gap_free}", fontsize=9, loc="left")
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("lag d (query i reads key i − d after the layers)")
    axes[0].legend(fontsize=8, loc="upper right")
    fig.suptitle(f"Which lags L={n_layer} layers reach, window k={window}", fontsize=10)
    return save_figure(fig, out)
