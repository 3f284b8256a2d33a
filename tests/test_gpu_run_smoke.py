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

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_run_smoke(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PYTHONUNBUFFERED": "1"}
    argv = ["benchmarks/gpu_run.py", "--smoke", "--out", str(tmp_path)]
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) <= 8 and {"gpu_run.json", "gpu_run.md", "gpu_tests_tail.log", "gpu_run.png"} <= set(files)
    result = json.loads((tmp_path / "gpu_run.json").read_text())
    steps = result["steps"]
    assert list(steps) == ["env", "tests", "kernels", "d128", "tune", "overhead", "model"]
    assert all(s["status"] == "ok" for s in steps.values()), {k: s.get("error") for k, s in steps.items()}
    assert result["environment"]["copy_bandwidth_GBps"] > 0
    assert sum(result["budgets_s"].values()) <= 420

    tests = steps["tests"]
    cases = list(ET.parse(tmp_path / "gpu_tests.xml").getroot().iter("testcase"))
    assert tests["passed"] > 0 and tests["passed"] + tests["skipped"] + tests["failed"] + tests["errors"] == len(cases)

    tune = steps["tune"]  # gpu_tune.py's smoke run, inside this one: its own files and what the step keeps
    assert [r["mode"] for r in tune["head_periods"]] == ["fwd", "fwd+bwd"] and len(tune["best"]) == 1
    tuned = json.loads((tmp_path / "gpu_tune.json").read_text())
    rows = tuned["shapes"][0]["rows"]
    assert rows[0]["rule"] and [r["status"] for r in rows] == ["ok", "ok"]
    assert all(r["fwd_ms"] > 0 and r["bwd_ms"] > 0 for r in rows)
    assert "| tiles | fwd ms |" in (tmp_path / "gpu_tune.md").read_text()

    kernels = steps["kernels"]
    timed = {r["backend"] for r in kernels["rows"] if r.get("ms")}
    assert {"pi", "pi-heads", "pi-union", "local", "sdpa", "sdpa-fp32", "fsa-mask", "fsa-window-mask",
            "flex-16"} <= timed
    for row in kernels["rows"]:
        if row.get("ms"):
            assert row["ms"] > 0 and row["ratio_to_floor"] > 0 and "vs_pi" in row
        if row["backend"] in ("pi", "pi-heads", "pi-union", "local"):  # the design's floor beside the one-pass one
            assert row["design_floor_ms"] > row["floor_ms"] if row["mode"] == "fwd+bwd" else row["design_floor_ms"]
            assert row["ratio_to_design_floor"] > 0 and row["target_x_floor"] in (1.5, 2.5)
    # the adapter's window_sizes are π's union, and without the skip a sliding window (π's local)
    assert kernels["checks"]["fsa-mask/float32"]["status"] == "ok"
    assert kernels["checks"]["fsa-window-mask/float32"]["status"] == "ok"
    assert all(r["status"] == "ok" for r in kernels["nan_check"]["results"].values())
    assert {t["met"] for t in kernels["targets"]} == {"unmeasured"}  # no bf16 row at T >= 8K on a CPU
    d128 = {(r["backend"], r["D"]) for r in steps["d128"]["rows"] if r.get("ms")}
    assert {b for b, _ in d128} == {"pi", "pi-union", "local", "sdpa", "fsa-mask", "fsa-window-mask"}
    assert {D for _, D in d128} == {32}  # the smoke's stand-in for D 128

    overhead = steps["overhead"]
    assert [r["mode"] for r in overhead["rows"]] == ["fwd", "fwd+bwd"]
    assert all(r["eager_ms"] > 0 and r["no_gate_check_ms"] > 0 for r in overhead["rows"])
    assert overhead["train_graph"]["status"] == "needs CUDA"

    model = steps["model"]
    assert {r["kind"] for r in model["rows"]} == {"dense", "local", "pi", "pi-ms"}
    for row in model["rows"]:
        assert row["status"] == "ok", row
        assert row["batch"] >= 2 and row["train_ms"] > 0 and row["train_tokens_per_s"] > 0
    assert {r["kind"] for r in model["decode_rows"]} == {"dense", "local+sinks", "pi+sinks"}
    for row in model["decode_rows"]:
        assert row["status"] == "ok", row
        assert row["decode_ms_per_token"] > 0 and row["cache_mib"] > 0

    text = (tmp_path / "gpu_run.md").read_text()
    assert "| step | status |" in text and "## Kernels (D 64)" in text and "## Model: decoding" in text


def test_one_step_alone_and_a_selection_of_ops(tmp_path):
    """--steps reruns one step by itself (the others absent from the record); --ops narrows the kernel ops."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PYTHONUNBUFFERED": "1"}
    argv = ["benchmarks/gpu_run.py", "--smoke", "--out", str(tmp_path), "--steps", "d128", "--ops", "pi,fsa"]
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_run.json").read_text())
    assert list(result["steps"]) == ["d128"]
    assert {r["backend"] for r in result["steps"]["d128"]["rows"]} == {"pi", "fsa-mask", "fsa-window-mask"}


def test_an_unknown_step_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        _import_gpu_run().main(["--smoke", "--out", str(tmp_path), "--steps", "kernel"])
    assert stop.value.code == 2 and "unknown ['kernel']" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_budgets_have_one_home():
    """The steps' budgets add up to at most the run's 420 s, the figure docs/gpu.md states; `make gpu` needs
    an OUT folder (no default into benchmarks/results)."""
    gpu_run = _import_gpu_run()
    assert sum(gpu_run.BUDGETS.values()) <= gpu_run.RUN_S == 420
    assert list(gpu_run.BUDGETS) == ["env", "tests", "kernels", "d128", "tune", "overhead", "model"]
    assert "at most 7 minutes (420 s" in (ROOT / "docs" / "gpu.md").read_text()
    makefile = (ROOT / "Makefile").read_text()
    assert "--out benchmarks/results" not in makefile.split("\ngpu:")[1].split("\n\n")[0]


def test_baselines_come_from_the_committed_run():
    """Dense SDPA and flash-sparse-attn's union at B 8, H 16, D 64 were measured in the second session: read
    from its JSON, not timed again; the targets table reads them as measured rows."""
    gpu_run = _import_gpu_run()
    known = gpu_run.measured_baselines()
    assert known[("sdpa", 8, 16, 32768, 64, "bfloat16", "fwd+bwd")] > 0
    assert known[("fsa-union", 8, 16, 8192, 64, "bfloat16", "fwd")] > 0
    assert not any(key[0] not in gpu_run.BASELINES for key in known)
    rows = [dict(backend="pi", B=8, H=16, T=32768, D=64, dtype="bfloat16", mode="fwd+bwd", ms=2.0,
                 ratio_to_floor=3.0, ratio_to_design_floor=2.2),
            dict(backend="sdpa", B=8, H=16, T=32768, D=64, dtype="bfloat16", mode="fwd+bwd", ms=50.0)]
    by_name = {t["target"]: t for t in gpu_run.targets(rows)}
    sdpa = next(t for name, t in by_name.items() if "dense flash SDPA" in name)
    assert sdpa["met"] == "yes" and "25.00" in sdpa["measured"]
    floor = next(t for name, t in by_name.items() if name.startswith("π fwd+bwd ≤ 2.5×"))
    assert floor["met"] == "no" and "3.00" in floor["measured"]


def _import_gpu_run():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_run
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return gpu_run


def test_outcomes_from_a_killed_runs_log():
    """A run killed at its budget writes no junit file: the verbose log's lines still give the counts and
    the failing tests' ids (xdist's and plain pytest's line forms)."""
    gpu_run = _import_gpu_run()
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
