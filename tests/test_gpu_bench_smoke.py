"""benchmarks/gpu_bench.py end to end in its CPU smoke mode (tiny shapes, forward only), then the plot.

The real run needs a GPU; this checks that the script runs through and writes the JSON and markdown
that the GPU run will write, with every key the report and the plot read.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow  # a script run by hand on a GPU; `make gpu`'s own run is test_gpu_run_smoke.py
def test_gpu_bench_smoke(tmp_path):
    proc = _run("benchmarks/gpu_bench.py", "--smoke", "--out", str(tmp_path), timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert {"device", "torch", "triton", "cuda"} <= result["environment"].keys()
    assert result["copy_bandwidth_GBps"] > 0
    assert result["flex_smallest_block"] == 16
    labels = ("reference", "torch", "flex-128", "flex-16", "sdpa-math")
    for label in labels:
        assert result["checks"][label]["status"] == "ok", (label, result["checks"][label])
    assert {r["backend"] for r in result["rows"]} == set(labels)
    for row in result["rows"]:
        assert {"B", "H", "T", "D", "mode", "ms", "floor_ms", "ratio_to_floor", "speedup_vs_flex128",
                "speedup_vs_sdpa"} <= row.keys()
        assert row["status"] == "ok" and row["ms"] > 0 and row["ratio_to_floor"] > 0
    assert all(r["status"] == "ok" for r in result["nan_check"]["results"].values())
    assert {r["layer"] for r in result["layer_rows"]} == {"PiAttention[torch]", "dense[math]"}
    assert all(r["ms"] > 0 for r in result["layer_rows"])
    text = (tmp_path / "gpu_bench.md").read_text()
    assert "| B | H | T | D | mode | floor ms |" in text and text in proc.stdout

    plot = _run("benchmarks/plot_gpu.py", str(tmp_path / "gpu_bench.json"), timeout=60)
    assert plot.returncode == 0, plot.stderr[-3000:]
    assert (tmp_path / "gpu_bench.png").stat().st_size > 0
