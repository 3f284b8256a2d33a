"""`piattn reach --design / --periods`: the multi-scale table and figure, and their refusals. The numbers
come from `analysis.multiscale` (tested against breadth-first search in test_multiscale.py); here a row is
recounted from a brute-force walk over lags written in this file."""

from __future__ import annotations

import pytest

from piattn.analysis.multiscale_report import compare_schedules
from piattn.cli import main


def reached_by_walk(window: int, schedule, target: int) -> set[int]:
    """Lags 1 … target some path reaches: layer by layer, each lag plus each hop of that layer."""
    lags = {0}
    for periods in schedule:
        hops = set(range(window + 1)) | set(periods)
        lags = {d + h for d in lags for h in hops if d + h <= target}
    return lags - {0}


def test_design_reaches_the_target_and_draws(tmp_path, capsys):
    assert main(["reach", "--design", "--target", "256", "--window", "4", "--layers", "4", "--heads", "4",
                 "--out", f"{tmp_path}/"]) == 0
    out = capsys.readouterr().out
    assert "designed (target 256)" in out and "256/256 (100%)" in out
    assert "single π=16" in out and "43/256 (17%)" in out  # the project's measured gaps of single π
    assert (tmp_path / "multiscale_reach.png").stat().st_size > 0


@pytest.mark.parametrize("spec", ["16", "8,16,32", "5,6,7/9,14,19"])
def test_given_periods_rows_match_a_walk(spec):
    from piattn.commands.reach import parse_periods

    schedule = parse_periods(spec, 2, 3)
    rows, studied = compare_schedules(3, 2, 3, 16, 80, schedule)
    assert studied == schedule
    for row in rows:
        assert row.reached == len(reached_by_walk(3, row.periods, 80)), row.name


@pytest.mark.parametrize(("argv", "message"), [
    (["--design"], "--target must be in 1"),
    (["--design", "--target", "0"], "--target must be in 1"),
    (["--design", "--target", "10", "--heads", "0"], "--heads must be >= 1"),
    (["--periods", "5,x", "--target", "10"], "--periods must be an int >= 1, per-head ints"),
    (["--periods", "5,6/7", "--target", "10", "--layers", "2"], "--periods 5,6/7 with --layers 2"),
    (["--periods", "4/5/6", "--target", "10", "--layers", "2"], "--periods 4/5/6 with --layers 2"),
    (["--periods", "-3", "--target", "10"], "--periods must be an int >= 1"),
])
def test_bad_input_is_one_line(argv, message, capsys, tmp_path):
    assert main(["reach", *argv, "--out", f"{tmp_path}/"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert not any(tmp_path.iterdir())
