"""benchmarks/gpu_tune.py in its CPU smoke mode (Triton interpreter, one tiny shape): it runs through, writes its
JSON and markdown, restores the tile rule it overrides, and reports a tile setting whose results differ from the
rule's instead of timing it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _gpu_tune():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_tune
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return gpu_tune


def test_gpu_tune_smoke(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "benchmarks/gpu_tune.py", "--smoke", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_tune.json").read_text())
    rows = result["shapes"][0]["rows"]
    assert rows[0]["rule"] and [r["status"] for r in rows] == ["ok", "ok"]
    assert all(r["fwd_ms"] > 0 and r["bwd_ms"] > 0 for r in rows)
    assert [r["mode"] for r in result["head_periods"]] == ["fwd", "fwd+bwd"]
    assert all(r["one"] > 0 and r["heads"] > 0 for r in result["head_periods"])
    assert "| tiles | fwd ms |" in (tmp_path / "gpu_tune.md").read_text()


def test_wrong_results_are_reported_and_the_rule_restored(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gpu_tune = _gpu_tune()
    from piattn.ops.pi import triton as triton_backend

    rule = triton_backend._tiles
    xs = gpu_tune.make_inputs(1, 2, 40, 16, torch.device("cpu"), grad=False, dtype=torch.float32)
    timing, got = gpu_tune.time_config(xs, (32, 16, 4, 1), lambda fn: 1.0)
    assert timing["status"] == "ok" and triton_backend._tiles is rule
    wrong = [got[0] + 1.0, *got[1:]]
    timing, _ = gpu_tune.time_config(xs, (32, 16, 4, 1), lambda fn: 1.0, expected=wrong)
    assert timing["status"].startswith("wrong: y") and triton_backend._tiles is rule
