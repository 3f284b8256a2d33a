"""Small command-line fixes: `--threads` beyond the cores, `piattn reach --design` arguments whose analysis
would run for minutes or hours, `--period` values that start with '-', and the periods a named schedule
(`--period cover`) or `piattn reach --design` resolves to, printed in `--period`'s own syntax."""

from __future__ import annotations

import time

import pytest

from piattn.cli import main
from piattn.commands.common import available_cores, check_threads_fit

# --- --threads -------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", [["train", "--out", "OUT"], ["demo", "--out", "OUT"],
                                     ["eval", "--checkpoint", "OUT"]])
def test_threads_beyond_the_cores_is_refused_before_any_work(command, tmp_path, capsys):
    """`--threads 999` on a 2-core machine was taken silently: 999 threads competing for 2 cores."""
    cores = available_cores()
    command = [str(tmp_path / "run") if a == "OUT" else a for a in command]
    assert main([*command, "--threads", str(cores + 1)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # refused before the command printed (demo's section 1) or did anything
    assert "--threads" in captured.err and str(cores + 1) in captured.err
    assert f"{cores} core" in captured.err


def test_the_check_passes_every_core_and_no_more():
    """The check the command line runs, callable in-process (notebooks driving a command's `run`)."""
    check_threads_fit(None)
    check_threads_fit(available_cores())
    with pytest.raises(ValueError, match=f"--threads {available_cores() + 1} is more than"):
        check_threads_fit(available_cores() + 1)


# --- piattn reach --design: bounded ----------------------------------------------------------------

@pytest.mark.parametrize("args, named", [
    # the geometric row's gap-free reach grows about 16-fold per 4 more layers and heads: past 2⁶⁴ lags here
    (["--layers", "64", "--heads", "64", "--target", "65536"], ["--heads", "--layers"]),
    (["--layers", "4", "--heads", "1000000", "--target", "100"], ["--heads", "1024"]),
    (["--layers", "512", "--heads", "4", "--window", "100000", "--target", "65536"], ["--window", "--target"]),
])
def test_reach_design_that_ran_for_minutes_is_refused_in_seconds(args, named, tmp_path, capsys):
    """Each of these ran past 240 s (or filled the memory); now each is refused with the argument named (in this
    process: the refusal comes before any design runs)."""
    start = time.perf_counter()
    assert main(["reach", "--design", "--window", "4", *args, "--out", f"{tmp_path}/"]) == 2
    assert time.perf_counter() - start < 30
    err = capsys.readouterr().err
    assert all(name in err for name in named), err


# --- --period with a leading '-' ----------------------------------------------------------------------

def test_period_starting_with_minus_gets_piattns_own_error(tmp_path, capsys):
    """argparse took '-1,16' for an option: "expected one argument", not what --period allows."""
    assert main(["train", "--task", "reach", "--lag", "8", "--period", "-1,16", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "expected one argument" not in err
    assert "--period must be an int >= 1" in err and "'-1,16'" in err


def test_periods_starting_with_minus_gets_reachs_own_error(tmp_path, capsys):
    assert main(["reach", "--periods", "-1,16", "--target", "10", "--out", f"{tmp_path}/"]) == 2
    err = capsys.readouterr().err
    assert "expected one argument" not in err and "got '-1,16'" in err


def test_option_after_period_is_still_an_option(capsys):
    """Only a value that looks like numbers is joined to --period: a missing value stays argparse's error."""
    with pytest.raises(SystemExit):
        main(["train", "--period", "--steps", "1"])
    assert "expected one argument" in capsys.readouterr().err


# --- the periods a schedule resolves to ---------------------------------------------------------------

def pasted_period(text: str) -> str:
    """The value of the `--period X` the output offers to paste."""
    line = next(line for line in text.splitlines() if "--period " in line and "->" in line)
    return line.split("->")[1].split()[1]


def test_reach_design_prints_the_period_to_paste(tmp_path, capsys):
    from piattn.analysis.multiscale import design_periods, periods_per_layer
    from piattn.config.training import parse_period

    assert main(["reach", "--design", "--target", "64", "--window", "4", "--layers", "2", "--heads", "4",
                 "--out", f"{tmp_path}/"]) == 0
    pasted = parse_period(pasted_period(capsys.readouterr().out))  # train --period's own parser
    assert periods_per_layer(pasted, 2, 4) == design_periods(4, 2, 4, 64).periods


def test_train_period_cover_prints_what_it_resolved(tmp_path, capsys, one_thread):
    from piattn.analysis.multiscale import design_periods, periods_per_layer
    from piattn.config.training import parse_period

    assert main(["train", "--task", "reach", "--lag", "8", "--attention", "pi", "--period", "cover", "--n-layer",
                 "2", "--steps", "1", "--warmup", "0", "--eval-batches", "1", "--no-progress",
                 "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert err.count("--period cover ->") == 1
    # the reach task's sequences are 64 tokens: cover reaches every lag up to 63
    assert periods_per_layer(parse_period(pasted_period(err)), 2, 4) == design_periods(4, 2, 4, 63).periods


def test_size_is_another_name_for_the_config_preset():
    from piattn.cli import build_parser

    argv = ["train", "--size", "small", "--out", "runs/x"]
    assert build_parser(argv).parse_args(argv).config == "small"
    train = build_parser(["train"])._subparsers._group_actions[0].choices["train"]
    assert "--size" in train.format_help() and "model size preset" in train.format_help()
