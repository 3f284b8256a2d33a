"""benchmarks/cpu_bench.py: the floor's byte counts, the slope fit, and tiny end-to-end runs writing JSON and
markdown (no timing is asserted)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from utils import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "cpu_bench.py"


def _load():
    return load_script(SCRIPT, "cpu_bench")


def test_floor_bytes_count_each_tensor_once():
    """fp32: the forward reads q, k, v, gate and writes y and one statistic per row; the backward adds reading
    q, k, v, gate, y, dy, the statistic and writing dq, dk, dv, dgate (the issue's ≈ 203 MB at T 8192)."""
    bench = _load()
    B, H, T, D = 1, 8, 8192, 64
    tensor, row = 4 * B * H * T * D, 4 * B * H * T
    assert bench.floor_bytes("fwd", B=B, H=H, T=T, D=D) == 3 * tensor + row + tensor + row
    both = bench.floor_bytes("fwd+bwd", B=B, H=H, T=T, D=D)
    assert both == (4 * tensor + 2 * row) + (5 * tensor + 2 * row) + (3 * tensor + row)
    assert round(both / 1e6) == 203


def test_slope_recovers_power_laws():
    bench = _load()
    rows = [dict(case="x", mode="fwd", T=T, threads=1, ms=3.0 * T**2, peak=5.0 * T) for T in (256, 1024, 4096)]
    rows.append(dict(case="x", mode="fwd", T=512, threads=2, ms=1.0, peak=1.0))  # another thread count: ignored
    assert math.isclose(bench.slope(rows, "x", "fwd", "ms"), 2.0, rel_tol=1e-9)
    assert math.isclose(bench.slope(rows, "x", "fwd", "peak"), 1.0, rel_tol=1e-9)
    assert bench.slope(rows[:1], "x", "fwd", "ms") is None


def test_small_run_writes_json_and_markdown(tmp_path):
    bench = _load()
    assert bench.main(["--lengths", "64", "96", "--threads", "1", "2", "--repeats", "1", "--copy-mib", "8",
                       "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "cpu_bench.json").read_text())
    assert result["checks"]["torch"] <= 1e-9 and set(result["checks"]) <= {"torch", "fused"}
    timed = {(r["case"], r["mode"], r["T"], r["threads"]) for r in result["rows"]}
    fused = ["fused", "fused-kernel"] if "fused" in result["checks"] else []
    cases = ["reference", "torch", *fused, "user", "outputs"]
    expected = {(c, m, T, 1) for c in cases for m in ("fwd", "fwd+bwd") for T in (64, 96)}
    expected |= {(c, m, T, 2) for c in ("torch", *fused, "user") for m in ("fwd", "fwd+bwd") for T in (64, 96)}
    assert timed == expected
    for r in result["rows"]:
        assert r["ms"] > 0 and r["ms_all"] == [r["ms"]] == [r["ms_min"]]
        assert r["bytes"] == bench.floor_bytes(r["mode"], B=1, H=8, T=r["T"], D=64)
        assert math.isclose(r["x_floor"], r["ms"] / r["floor_ms"]) and r["x_floor_min"] == r["x_floor"]
    assert set(result["copy_gb_s"]) == {"1", "2"} and all(b > 0 for b in result["copy_gb_s"].values())
    table = (tmp_path / "cpu_bench.md").read_text()
    assert "| 64 |" in table and "best × floor" in table and "speed-up ×2" in table and "## fwd+bwd" in table


def test_fused_without_its_kernels_is_not_timed(tmp_path, monkeypatch):
    """Without its compiled kernels "fused" refuses every call: reported as unavailable, not timed."""
    bench = _load()
    monkeypatch.setattr(bench.fused, "unavailable", lambda: "no C compiler")
    assert bench.main(["--lengths", "64", "--threads", "1", "--cases", "torch", "fused", "--repeats", "1",
                       "--copy-mib", "8", "--no-outputs", "--no-user", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "cpu_bench.json").read_text())
    assert result["not_timed"] == {"fused": "unavailable (no C compiler)"}
    assert {r["case"] for r in result["rows"]} == {"torch"}
    assert "Not timed: fused: unavailable (no C compiler)." in (tmp_path / "cpu_bench.md").read_text()
