"""benchmarks/cpu_bench.py: the slope fit, and a tiny end-to-end run writing JSON and markdown."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "cpu_bench.py"


def _load():
    spec = importlib.util.spec_from_file_location("cpu_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_slope_recovers_power_laws():
    bench = _load()
    rows = [dict(case="x", mode="fwd", T=T, ms=3.0 * T**2, peak_mib=5.0 * T) for T in (256, 1024, 4096)]
    assert math.isclose(bench.slope(rows, "x", "fwd", "ms"), 2.0, rel_tol=1e-9)
    assert math.isclose(bench.slope(rows, "x", "fwd", "peak_mib"), 1.0, rel_tol=1e-9)
    assert bench.slope(rows[:1], "x", "fwd", "ms") is None


def test_small_run_writes_json_and_markdown(tmp_path):
    bench = _load()
    assert bench.main(["--lengths", "128", "--cases", "reference", "torch", "--repeats", "1",
                       "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "cpu_bench.json").read_text())
    assert result["checks"]["torch"] <= 1e-9
    timed = [r for r in result["rows"] if "ms" in r]
    assert {(r["case"], r["mode"], r["T"]) for r in timed} == {
        (c, m, 128) for c in ("reference", "torch") for m in ("fwd", "fwd+bwd")}
    assert all(r["ms"] > 0 for r in timed)
    table = (tmp_path / "cpu_bench.md").read_text()
    assert "| 128 | torch |" in table and "time slope" in table
