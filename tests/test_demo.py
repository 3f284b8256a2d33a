"""`piattn demo` end to end at a small size: the analysis, the correctness gate, the timing table."""

from __future__ import annotations

from piattn.cli import main


def test_demo_runs_and_reports(tmp_path, capsys):
    assert main(["demo", "--lengths", "256", "--backends", "reference", "torch", "--out", str(tmp_path),
                 "--lags", "3", "8", "--reach-steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "local 39.1% → π 51.0%" in out
    # lag 3 is within window·layers = 4; lag 8 only π reaches, in one hop of π = 8
    assert "| 3 | yes |" in out and "| 8 | no |" in out and out.count("| yes |") >= 2
    assert (tmp_path / "reach_accuracy.png").stat().st_size > 10_000
    assert (tmp_path / "receptive_field.png").stat().st_size > 10_000
    assert "check torch vs reference" in out and "[ok]" in out
    rows = [line for line in out.splitlines() if line.startswith("| torch | 256 |")]
    assert len(rows) == 1 and "error" not in rows[0]


def test_a_backend_that_cannot_run_here_is_said_not_timed(tmp_path, capsys, monkeypatch):
    """"fused" refused (as on a machine without a C compiler): the demo says why and times the others."""
    from piattn.ops.pi import backends

    monkeypatch.setattr(backends, "_probe", lambda module, function: "its C kernels do not build: no compiler (test)")
    assert main(["demo", "--lengths", "128", "--backends", "torch", "fused", "--out", str(tmp_path),
                 "--lags", "3", "--reach-steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "fused: not run here: its C kernels do not build: no compiler (test)" in out
    assert not [line for line in out.splitlines() if line.startswith("| fused |")]
    assert [line for line in out.splitlines() if line.startswith("| torch | 128 |")]
