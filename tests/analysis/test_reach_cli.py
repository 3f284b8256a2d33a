"""`piattn reach` refuses what it cannot do in one line naming the flag, before any work, and writes its
figure where --out says (a file, or a folder)."""

from __future__ import annotations

import os
import time

import pytest

from piattn import cli
from piattn.commands import reach

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL = ["--n", "12", "--window", "2", "--period", "4", "--layers", "2"]


@pytest.fixture
def reach_only(monkeypatch):
    # as in test_report.py: the other subcommands are tested beside their own code
    monkeypatch.setattr(cli, "COMMANDS", {"reach": cli.COMMANDS["reach"]})


def refused(capsys, *argv) -> str:
    start = time.perf_counter()
    assert cli.main(["reach", *argv]) == 2
    assert time.perf_counter() - start < 5  # refused up front, not after computing
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and lines[0].startswith("piattn reach: error: "), (out, lines)
    return lines[0]


@pytest.mark.parametrize(("argv", "message"), [
    (["--n", "0"], "--n must be in 1 … 4096"),
    (["--n", "100000"], "--n must be in 1 … 4096 (the reachability is an n × n matrix), got 100000"),
    (["--layers", "0"], "--layers must be in 1 … 512, got 0"),
    (["--layers", "-1"], "--layers must be in 1 … 512"),
    (["--n", "4096", "--layers", "9"], "--layers 9 at --n 4096 is too much work (n³ per layer per matrix); "
                                       "at --n 4096 take at most --layers 8"),
    (["--window", "-1"], "--window must be >= 0"),
    (["--period", "0"], "--period must be >= 1"),
    (["--sinks", "49"], "--sinks must be in 0 … --n (48), got 49"),
    (["--n", "2048", "--sinks", "1", "--layers", "2"], "--n must be <= 1024 with --sinks"),
    (["--out", ""], "--out must name a figure file or a folder, got ''"),
    (["--out", "figure"], "--out figure: a figure file must end in .png, .pdf, .svg"),
])
def test_bad_values_are_one_line_naming_the_flag(reach_only, capsys, tmp_path, argv, message):
    argv = ["--out", str(tmp_path / "rf.png"), *argv]  # a later --out wins
    assert message in refused(capsys, *argv)
    assert list(tmp_path.iterdir()) == []


def test_an_out_below_a_file_is_refused(reach_only, capsys, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    line = refused(capsys, *SMALL, "--out", str(afile / "x.png"))
    assert f"--out {afile / 'x.png'}: {afile} is a file, not a folder" in line
    assert afile.read_text() == "x"


@pytest.mark.skipif(os.geteuid() != 0, reason="as root os.access says /proc is writable; the probe must not")
def test_an_out_where_nothing_can_be_created_is_refused_even_as_root(reach_only, capsys):
    assert "--out /proc/piattn/x.png: cannot create anything in /proc" in refused(capsys, "--out",
                                                                                  "/proc/piattn/x.png")


@pytest.mark.parametrize("form", ["existing", "slash"])
def test_a_folder_gets_the_figure_inside_it(reach_only, capsys, tmp_path, form):
    folder = tmp_path / "figs"
    if form == "existing":
        folder.mkdir()
    out = str(folder) + ("/" if form == "slash" else "")
    assert cli.main(["reach", *SMALL, "--out", out]) == 0
    written = folder / reach.FIGURE_NAME
    assert written.read_bytes().startswith(PNG_MAGIC)
    assert f"figure: {written}" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["figs"]  # no figs.png beside it


def test_many_layers_still_draw_a_figure(reach_only, capsys, tmp_path):
    out = tmp_path / "deep.svg"
    assert cli.main(["reach", "--n", "8", "--window", "1", "--period", "3", "--layers", "40", "--out", str(out)]) == 0
    assert out.read_text().lstrip().startswith("<?xml")
