"""`piattn demo` end to end at a small size: the analysis, the correctness gate, the timing table."""

from __future__ import annotations

from piattn.cli import main


def test_demo_runs_and_reports(tmp_path, capsys):
    assert main(["demo", "--lengths", "256", "--backends", "reference", "torch", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "local 39.1% → π 51.0%" in out
    assert (tmp_path / "receptive_field.png").stat().st_size > 10_000
    assert "check torch vs reference" in out and "[ok]" in out
    rows = [line for line in out.splitlines() if line.startswith("| torch | 256 |")]
    assert len(rows) == 1 and "error" not in rows[0]
