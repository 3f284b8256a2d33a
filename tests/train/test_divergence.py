"""A run whose loss, gradients or weights stop being finite stops with one line saying so, and never saves
that state: the checkpoints `--keep` holds stay the last finite ones. Each test failed before its fix."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from safetensors.torch import load_file

from piattn.cli import main
from piattn.train.loop import Trainer
from piattn.train.metrics import read_metrics

STEPS = 6


def reach_argv(out, *extra):
    return ["train", "--task", "reach", "--lag", "4", "--window", "2", "--n-layer", "2", "--d-model", "16",
            "--n-head", "2", "--seq-len", "16", "--train-size", "32", "--eval-size", "8", "--batch-size", "4",
            "--steps", str(STEPS), "--warmup", "1", "--eval-every", "0", "--device", "cpu", "--no-progress",
            "--attention", "pi", "--period", "4", "--out", str(out), *extra]


def poison_weights_after_update(monkeypatch, at_call: int):
    """The `at_call`-th AdamW update leaves a NaN in the weights, as an overflowing update would."""
    original, calls = torch.optim.AdamW.step, [0]

    def step(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        calls[0] += 1
        if calls[0] == at_call:
            with torch.no_grad():
                self.param_groups[0]["params"][0].view(-1)[0] = float("nan")
        return result

    monkeypatch.setattr(torch.optim.AdamW, "step", step)


def last_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("piattn train: error: training diverged: "), err
    assert not any("Traceback" in line or "saved step" in line for line in err), err
    return err[-1]


def checkpoint_steps(run) -> list[int]:
    return sorted(int(p.name.removeprefix("step_")) for p in (run / "checkpoints").glob("step_*"))


def all_finite(run) -> bool:
    return all(torch.isfinite(t).all() for p in (run / "checkpoints").glob("step_*")
               for t in load_file(p / "model.safetensors").values())


@pytest.mark.parametrize(("variant", "extra", "named"), [
    # saved every step: the save after the poisoned update finds the weights non-finite
    ("union", ["--save-every", "1", "--keep", "2"], "the weights are not finite after step 3"),
    # no save before the end, logged every step: the next step's loss is NaN
    ("fixed", ["--save-every", "0", "--log-every", "1"], "the loss is not finite at step 4"),
])
def test_an_ungated_run_that_diverges_stops_and_keeps_its_finite_checkpoints(tmp_path, monkeypatch, capsys, variant,
                                                                              extra, named):
    run = tmp_path / "run"
    poison_weights_after_update(monkeypatch, at_call=3)
    assert main(reach_argv(run, "--variant", variant, *extra)) == 2  # was 0, after training on NaN to the end
    error = last_error(capsys)
    assert named in error and "--lr" in error
    assert all_finite(run)
    if "--keep" in extra:  # before: steps 5 and 6, both NaN; the finite ones rotated away
        assert checkpoint_steps(run) == [1, 2] and "step_00000002" in error
    else:
        assert checkpoint_steps(run) == [] and "no checkpoint had been saved" in error
    assert all(r["loss"] == r["loss"] for r in read_metrics(run))  # no NaN record in metrics.jsonl


def test_a_gated_run_whose_weights_turn_nan_reports_divergence_not_the_gate_check(tmp_path, monkeypatch, capsys):
    """The next forward meets NaN gates. Before, the π operator's gate check raised and that error was shown
    after "interrupted; saved step 3", the saved step holding the NaN weights; the layer's own gate is no longer
    value-checked (no host sync), so the NaN reaches the loss, which reports the divergence."""
    run = tmp_path / "run"
    poison_weights_after_update(monkeypatch, at_call=3)
    assert main(reach_argv(run, "--variant", "adaptive", "--save-every", "2", "--log-every", "10")) == 2
    error = last_error(capsys)
    assert "training diverged" in error and "is not finite at step 4" in error and "gate values" not in error
    assert checkpoint_steps(run) == [2] and all_finite(run)


def test_finite_weights_whose_forward_overflows_are_reported_as_divergence(tmp_path, capsys):
    """A learning rate far too high: the weights stay finite but the next forward overflows to NaN. Before:
    "interrupted; saved step N" and the gate check's error; now the loss's check reports the divergence."""
    run = tmp_path / "run"
    assert main(reach_argv(run, "--variant", "adaptive", "--lr", "1e4", "--clip", "0", "--save-every", "0",
                           "--log-every", "10")) == 2
    error = last_error(capsys)
    assert "training diverged" in error and "is not finite at step" in error and "--lr" in error
    assert not (run / "checkpoints").exists()


def test_a_second_ctrl_c_during_evaluation_is_evaluated_on_resume(tmp_path, monkeypatch):
    """Ctrl-C twice while step 2 is being evaluated: step 2 is saved, and the resumed run evaluates it
    before training on (before: the validation record of step 2 was lost)."""
    run = tmp_path / "run"
    argv = reach_argv(run, "--variant", "union", "--eval-every", "2", "--eval-batches", "1", "--save-every", "0")
    original = Trainer.evaluate

    def interrupted(self, split="validation"):
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # the second one raises KeyboardInterrupt here
        return original(self, split)

    monkeypatch.setattr(Trainer, "evaluate", interrupted)
    assert main(argv) == 130
    monkeypatch.undo()
    assert checkpoint_steps(run) == [2] and not [r for r in read_metrics(run) if r["split"] == "validation"]
    assert main([*argv, "--resume"]) == 0
    assert [r["step"] for r in read_metrics(run) if r["split"] == "validation"] == [2, 4, 6]
