"""`piattn train --resume` continues a run from the run alone: its settings come from the checkpoint, a flag
given again that would change the run is refused (stored vs given), `--steps` may extend it, and an --out
without checkpoints is an error rather than a fresh start. Each test failed before its fix."""

from __future__ import annotations

import shutil

import pytest

from piattn.cli import main
from piattn.train.checkpoint import read_config, read_latest
from piattn.train.metrics import read_metrics
from piattn.train.optim import lr_at

# Settings far from the defaults (task, model, optimiser, run): a resume that fell back to any default shows.
FLAGS = ["--task", "reach", "--lag", "4", "--window", "2", "--attention", "pi", "--period", "4", "--variant",
         "union", "--n-layer", "2", "--d-model", "16", "--n-head", "2", "--seq-len", "16", "--train-size", "32",
         "--eval-size", "8", "--batch-size", "4", "--steps", "4", "--lr", "2e-3", "--min-lr", "1e-4", "--warmup",
         "1", "--eval-every", "2", "--eval-batches", "1", "--save-every", "2", "--log-every", "1",
         "--device", "cpu", "--no-progress"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 4-step run (checkpoints at steps 2 and 4); copy it before changing it."""
    run = tmp_path_factory.mktemp("finished") / "run"
    assert main(["train", *FLAGS, "--out", str(run)]) == 0
    return run


def copy(finished, tmp_path):
    return shutil.copytree(finished, tmp_path / "run")


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("piattn train: error: "), err
    return err[0]


def test_resume_takes_every_setting_from_the_run_and_extends_it_on_the_new_schedule(finished, tmp_path, capsys):
    run = copy(finished, tmp_path)
    stored = read_config(read_latest(run / "checkpoints"))["train_args"]
    capsys.readouterr()
    # before: the lm task's defaults, then "--data is required"; --steps was refused as run-defining
    assert main(["train", "--out", str(run), "--resume", "--steps", "8", "--eval-every", "4"]) == 0
    assert "--steps 4 -> 8" in capsys.readouterr().err
    now = read_config(read_latest(run / "checkpoints"))["train_args"]
    assert read_latest(run / "checkpoints").name == "step_00000008"
    changed = {"steps": 8, "eval_every": 4, "resume": True, "out": str(run)}  # the run was copied here
    assert now == {**stored, **changed}
    records = read_metrics(run)
    train = {r["step"]: r for r in records if r["split"] == "train"}
    assert sorted(train) == list(range(1, 9))
    # the LR after the resume is that of the 8-step schedule, stretched from the 4-step one
    for step in range(5, 9):
        assert train[step]["lr"] == pytest.approx(lr_at(step - 1, peak=2e-3, minimum=1e-4, warmup=1, total=8))
    assert train[4]["lr"] == pytest.approx(lr_at(3, peak=2e-3, minimum=1e-4, warmup=1, total=4))
    assert [r["step"] for r in records if r["split"] == "validation"] == [2, 4, 8]


@pytest.mark.parametrize(("flags", "shown"), [
    (["--seq-len", "32"], "--seq-len: stored 16, given 32"),
    (["--lr", "0.01"], "--lr: stored 0.002, given 0.01"),
    (["--task", "lm"], "--task: stored 'reach', given 'lm'"),
])
def test_a_flag_that_defines_the_run_given_otherwise_is_one_line_stored_vs_given(finished, tmp_path, capsys, flags,
                                                                                  shown):
    run = copy(finished, tmp_path)
    assert main(["train", "--out", str(run), "--resume", *flags]) == 2
    line = one_error_line(capsys)
    assert shown in line and "--resume" in line
    assert read_latest(run / "checkpoints").name == "step_00000004"


def test_the_same_flags_given_again_are_accepted(finished, tmp_path, capsys):
    run = copy(finished, tmp_path)
    assert main(["train", *FLAGS, "--out", str(run), "--resume", "--steps", "5"]) == 0
    assert [r["step"] for r in read_metrics(run) if r["split"] == "train"] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("state", ["missing", "empty"])
def test_resume_without_a_run_is_an_error_not_a_fresh_start(tmp_path, capsys, state):
    out = tmp_path / "run"
    if state == "empty":
        (out / "checkpoints").mkdir(parents=True)
    assert main(["train", *FLAGS, "--out", str(out), "--resume"]) == 2
    line = one_error_line(capsys)
    assert "--resume: no run to continue in --out" in line
    assert not (out / "metrics.jsonl").exists()


def test_steps_below_the_step_reached_is_refused_and_equal_is_nothing_to_do(finished, tmp_path, capsys):
    run = copy(finished, tmp_path)
    assert main(["train", "--out", str(run), "--resume", "--steps", "3"]) == 2
    assert "--steps 3: the run is at step 4 already" in one_error_line(capsys)
    before = read_metrics(run)
    assert main(["train", "--out", str(run), "--resume"]) == 0
    assert "nothing to train" in capsys.readouterr().err
    assert read_metrics(run) == before
