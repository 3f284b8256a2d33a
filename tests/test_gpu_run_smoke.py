"""benchmarks/gpu_run.py end to end in its CPU smoke mode: every step runs and writes what the GPU run will.

The real run needs a GPU and gets one try; this checks that each step runs through on a CPU (tiny shapes,
a small pytest selection, gpu_tune.py's smoke run, the tiny GPT) and that the JSON has every key the report
and the plot read.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_run_smoke(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PYTHONUNBUFFERED": "1"}
    # --model-s: the model step's default budget is 0 (measured in the first GPU session), not in the smoke run.
    argv = ["benchmarks/gpu_run.py", "--smoke", "--out", str(tmp_path), "--model-s", "60"]
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) <= 8 and {"gpu_run.json", "gpu_run.md", "gpu_tests_tail.log", "gpu_run.png"} <= set(files)
    result = json.loads((tmp_path / "gpu_run.json").read_text())
    steps = result["steps"]
    assert list(steps) == ["env", "tests", "tune", "kernels", "model"]
    assert all(s["status"] == "ok" for s in steps.values()), {k: s.get("error") for k, s in steps.items()}
    assert result["environment"]["copy_bandwidth_GBps"] > 0

    tests = steps["tests"]
    cases = list(ET.parse(tmp_path / "gpu_tests.xml").getroot().iter("testcase"))
    assert tests["passed"] > 0 and tests["passed"] + tests["skipped"] + tests["failed"] + tests["errors"] == len(cases)

    tune = steps["tune"]  # gpu_tune.py's smoke run, inside this one: its own files and what the step keeps
    assert [r["mode"] for r in tune["head_periods"]] == ["fwd", "fwd+bwd"] and len(tune["best"]) == 1
    tuned = json.loads((tmp_path / "gpu_tune.json").read_text())
    rows = tuned["shapes"][0]["rows"]
    assert rows[0]["rule"] and [r["status"] for r in rows] == ["ok", "ok"]
    assert all(r["fwd_ms"] > 0 and r["bwd_ms"] > 0 for r in rows)
    assert [r["mode"] for r in tuned["head_periods"]] == ["fwd", "fwd+bwd"]
    assert all(r["one"] > 0 and r["heads"] > 0 for r in tuned["head_periods"])
    assert "| tiles | fwd ms |" in (tmp_path / "gpu_tune.md").read_text()

    kernels = steps["kernels"]
    timed = {r["backend"] for r in kernels["rows"] if r.get("ms")}
    assert {"pi", "pi-heads", "pi-union", "local", "sdpa", "sdpa-fp32", "fsa-mask", "flex-16"} <= timed
    for row in kernels["rows"]:
        if row.get("ms"):
            assert row["ms"] > 0 and row["ratio_to_floor"] > 0 and "vs_pi" in row
    assert kernels["checks"]["fsa-mask/float32"]["status"] == "ok"  # the adapter's window_sizes are π's union
    assert all(r["status"] == "ok" for r in kernels["nan_check"]["results"].values())

    model = steps["model"]["rows"]
    assert {r["kind"] for r in model} == {"dense", "local", "pi"}
    for row in model:
        assert row["status"] == "ok", row
        assert row["train_ms"] > 0 and row["prefill_ms"] > 0 and row["decode_ms_per_token"] > 0
        assert {"train_peak_mib", "prefill_peak_mib", "decode_peak_mib"} <= row.keys()

    text = (tmp_path / "gpu_run.md").read_text()
    assert "| step | status |" in text and "## Kernels" in text and "## Model" in text


def test_outcomes_from_a_killed_runs_log():
    """A run killed at its budget writes no junit file: the verbose log's lines still give the counts and
    the failing tests' ids (xdist's and plain pytest's line forms)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_run
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    lines = ["[gw3] [  1%] PASSED tests/ops/test_a.py::test_x[1] ",
             "[gw1] [  2%] FAILED tests/ops/test_a.py::test_y[flex-16] ",
             "tests/ops/test_b.py::test_z SKIPPED (needs CUDA)",
             "tests/ops/test_b.py::test_w PASSED",
             "tests/ops/test_b.py::test_e ERROR",
             "collected 5 items"]
    result = gpu_run.outcomes_from_log(lines)
    assert {k: result[k] for k in ("passed", "failed", "errors", "skipped")} == dict(
        passed=2, failed=1, errors=1, skipped=1)
    assert [f["id"] for f in result["failures"]] == ["tests/ops/test_a.py::test_y[flex-16]",
                                                     "tests/ops/test_b.py::test_e"]
