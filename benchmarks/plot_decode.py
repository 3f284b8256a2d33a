"""Plot decode_bench.json: tokens/s and cache memory against position, one line per attention kind.

    python benchmarks/plot_decode.py benchmarks/results/decode/decode_bench.json   # writes decode_bench.png beside it
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(path: str) -> Path:
    result = json.loads(Path(path).read_text())
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(10, 4))
    for kind in sorted({r["kind"] for r in result["rows"]}):
        rows = sorted((r for r in result["rows"] if r["kind"] == kind), key=lambda r: r["position"])
        pos = [r["position"] for r in rows]
        speed.plot(pos, [r["tokens_per_s"] for r in rows], marker="o", label=kind)
        memory.plot(pos, [r["cache_mib"] for r in rows], marker="o", label=kind)
    for ax, label in ((speed, "decode tokens / s"), (memory, "cache MiB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("position (tokens already seen)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    m = result["machine"]
    fig.suptitle(f"Decoding, GPT {result['config']}, batch 1 ({m['cpu_count']} threads, torch {m['torch']})")
    fig.tight_layout()
    out = Path(path).with_suffix(".png")
    fig.savefig(out, dpi=120)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", help="a decode_bench JSON file; the figure is written beside it (.png)")
    print(main(parser.parse_args().result))
