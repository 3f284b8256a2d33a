"""`piattn reach` end to end, through piattn.cli.main."""

from __future__ import annotations

import sys

import pytest

from piattn import cli
from piattn.analysis.report import reach_summary

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def reach_only(monkeypatch):
    # the other subcommands are tested beside their own code; loading them here would fail this test
    # for their reasons
    monkeypatch.setattr(cli, "COMMANDS", {"reach": cli.COMMANDS["reach"]})


def test_reach_defaults_reproduce_the_seed_figure(reach_only, tmp_path, capsys):
    out = tmp_path / "sub" / "rf.png"
    argv = ["reach", "--n", "48", "--window", "4", "--period", "16", "--layers", "6", "--out", str(out)]
    rc = cli.main(argv)
    text = capsys.readouterr().out
    assert rc == 0
    assert "local 39.1% → π 51.0%" in text
    data = out.read_bytes()
    assert len(data) > 10_000 and data.startswith(PNG_MAGIC)
    assert str(out) in text
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines() if line[:6].strip().isdigit()}
    assert rows["15"] == ["4", "4"]  # lag 15: ⌈15/4⌉ local, and 4 with π (not the seed's 1)
    assert rows["16"] == ["4", "1"]
    assert rows["32"] == ["8", "2"]


def test_reach_bidirectional(reach_only, tmp_path, capsys):
    out = tmp_path / "rf.png"
    assert cli.main(["reach", "--bidirectional", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "bidirectional" in text
    # |i - j| <= 24 on n = 48: 48 + 2·Σ_{d=1..24} (48 - d) = 1752 of 2304 cells
    assert f"{1752 / 2304:.1%}" == "76.0%"
    assert "local 76.0%" in text
    assert out.stat().st_size > 0


def test_reach_without_matplotlib_still_prints_the_table(reach_only, tmp_path, capsys, monkeypatch):
    # a None entry makes the import raise ImportError; submodules too, in case an earlier test loaded them
    for name in ["matplotlib", *(m for m in sys.modules if m.startswith("matplotlib."))]:
        monkeypatch.setitem(sys.modules, name, None)
    out = tmp_path / "rf.png"
    assert cli.main(["reach", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "local 39.1% → π 51.0%" in text
    assert "pip install piattn[plot]" in text
    assert not out.exists()


def test_reach_rejects_bad_arguments(reach_only, capsys):
    assert cli.main(["reach", "--period", "0"]) == 2
    assert "period" in capsys.readouterr().err


def test_reach_summary_numbers():
    s = reach_summary(48, 4, 16, 6)
    assert s["coverage"] == {"local": 900 / 2304, "pi": 1176 / 2304}
    assert s["span"] == {"local": 24, "pi": 47}
    assert s["span_bound"] == {"local": 24, "pi": 120}
    assert s["attainable_span"] == {"local": 24, "pi": 96}
    assert {r["lag"]: (r["local"], r["pi"]) for r in s["min_depth"]}[15] == (4, 4)
    assert reach_summary(10, 0, 3, 2, lags=[2, 3])["min_depth"] == [
        {"lag": 2, "local": None, "pi": None}, {"lag": 3, "local": None, "pi": 1}]
