"""benchmarks/gpu_overhead.py end to end in its CPU smoke mode (Triton interpreter, one tiny shape): it runs
through and writes its JSON and markdown (on a CPU without compiled or graph rows: they need CUDA)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # a script run by hand on a GPU; `make gpu`'s own run is test_gpu_run_smoke.py
def test_gpu_overhead_smoke(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "benchmarks/gpu_overhead.py", "--smoke", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_overhead.json").read_text())
    assert [r["mode"] for r in result["rows"]] == ["fwd", "fwd+bwd"]
    for row in result["rows"]:
        for label in ("eager", "no_gate_check"):
            assert row[f"{label}_ms"] > 0 and row[f"{label}_host_us"] > 0
        assert row["graph_capture"] == "needs CUDA"
    assert "| B | H | T | D | mode |" in (tmp_path / "gpu_overhead.md").read_text()
