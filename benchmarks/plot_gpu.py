"""Plot the JSON of `gpu_bench.py`: operator time against T, one panel per (B, H, D) and mode, every
backend beside the bandwidth floor.

    python benchmarks/plot_gpu.py benchmarks/results/gpu_bench.json        # writes gpu_bench.png beside it
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


def plot(result: dict, path: Path) -> Path:
    """Write the figure to `path` (PNG); returns it."""
    rows = [r for r in result["rows"] if r.get("ms")]
    panels = sorted({(r["B"], r["H"], r["D"]) for r in result["rows"]})
    modes = list(dict.fromkeys(r["mode"] for r in result["rows"]))
    backends = list(dict.fromkeys(r["backend"] for r in result["rows"]))
    fig, axes = plt.subplots(len(modes), len(panels), figsize=(4 * len(panels), 3.4 * len(modes)),
                             squeeze=False, sharex=True)
    for i, mode in enumerate(modes):
        for j, (B, H, D) in enumerate(panels):
            ax = axes[i][j]
            same = [r for r in result["rows"] if (r["B"], r["H"], r["D"], r["mode"]) == (B, H, D, mode)]
            floor = sorted({(r["T"], r["floor_ms"]) for r in same})
            ax.plot(*zip(*floor, strict=True), "k--", label="floor (bytes ÷ copy bandwidth)")
            for backend in backends:
                pts = sorted((r["T"], r["ms"]) for r in rows if r in same and r["backend"] == backend)
                if pts:
                    ax.plot(*zip(*pts, strict=True), "o-", label=backend)
            ax.set(yscale="log", title=f"{mode}, B={B} H={H} D={D}", xlabel="T",
                   ylabel="ms (median)")
            ax.set_xscale("log", base=2)
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    env = result["environment"]
    fig.suptitle(f"π-Attention, bf16, causal, window 4, period 16\n{env['device']}, torch {env['torch']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", type=Path, help="gpu_bench.json written by gpu_bench.py")
    p.add_argument("--out", type=Path, help="PNG to write (default: gpu_bench.png beside the JSON)")
    a = p.parse_args(argv)
    out = plot(json.loads(a.json.read_text()), a.out or a.json.with_suffix(".png"))
    print(out)


if __name__ == "__main__":
    main()
