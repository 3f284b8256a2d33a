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
