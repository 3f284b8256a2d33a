"""Plot the JSON of `gpu_bench.py` or `gpu_run.py`: operator time against T, one panel per (B, H, D, dtype)
and mode, every backend beside the bandwidth floor.

    python benchmarks/plot_gpu.py benchmarks/results/gpu/gpu_bench.json    # writes gpu_bench.png beside it
    python benchmarks/plot_gpu.py benchmarks/results/gpu/gpu_run.json     # its "kernels" step
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


def _panel(row: dict) -> tuple:
    """(B, H, D, dtype): gpu_bench's rows are all bf16 and carry no dtype."""
    return row["B"], row["H"], row["D"], row.get("dtype", "bfloat16")


def plot(result: dict, path: Path) -> Path:
    """Write the figure to `path` (PNG); returns it. result: {rows, environment[, title]}."""
    rows = [r for r in result["rows"] if r.get("ms")]
    panels = sorted({_panel(r) for r in result["rows"]})
    modes = list(dict.fromkeys(r["mode"] for r in result["rows"]))
    backends = list(dict.fromkeys(r["backend"] for r in result["rows"]))
    fig, axes = plt.subplots(len(modes), len(panels), figsize=(4 * len(panels), 3.4 * len(modes)),
                             squeeze=False, sharex=True)
    for i, mode in enumerate(modes):
        for j, (B, H, D, dtype) in enumerate(panels):
            ax = axes[i][j]
            same = [r for r in result["rows"] if _panel(r) == (B, H, D, dtype) and r["mode"] == mode]
            floor = sorted({(r["T"], r["floor_ms"]) for r in same})
            ax.plot(*zip(*floor, strict=True), "k--", label="floor (bytes ÷ copy bandwidth)")
            for backend in backends:
                pts = sorted((r["T"], r["ms"]) for r in rows if r in same and r["backend"] == backend)
                if pts:
                    ax.plot(*zip(*pts, strict=True), "o-", label=backend)
            ax.set(yscale="log", title=f"{mode}, B={B} H={H} D={D} {dtype}", xlabel="T",
                   ylabel="ms (median)")
            ax.set_xscale("log", base=2)
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    env = result["environment"]
    title = result.get("title", "π-Attention, bf16, causal, window 4, period 16")
    fig.suptitle(f"{title}\n{env['device']}, torch {env['torch']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", type=Path, help="gpu_bench.json (gpu_bench.py) or gpu_run.json (gpu_run.py)")
    p.add_argument("--out", type=Path, help="PNG to write (default: gpu_bench.png beside the JSON)")
    a = p.parse_args(argv)
    result = json.loads(a.json.read_text())
    if "steps" in result:  # gpu_run.json: the kernel table is its "kernels" step
        result = dict(rows=result["steps"]["kernels"]["rows"], environment=result["environment"],
                      title=result["steps"]["kernels"].get("title"))
    out = plot(result, a.out or a.json.with_suffix(".png"))
    print(out)


if __name__ == "__main__":
    main()
