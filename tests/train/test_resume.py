"""Exact resume: a run stopped at step N and resumed reaches the same losses and weights as one never stopped.

On the CPU, with dropout 0.1 (so the random generators must be restored) and gradient accumulation 2 (so
the loader position inside a step matters), losses are compared with ==.
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors.torch import load_file

from piattn.commands.train import add_arguments, train_config
from piattn.config import TrainConfig
from piattn.train.checkpoint import load_trainer_state, read_latest
from piattn.train.metrics import read_metrics
from utils import write_word_corpus

STEPS = 6


def write_corpus(root):
    """About 6 KB of training text."""
    return write_word_corpus(root, {"train": [400] * 3, "validation": [400], "test": [400]})


def parse(corpus, out, *extra) -> TrainConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return TrainConfig.from_args(parser.parse_args([
        "--data", str(corpus), "--out", str(out), "--attention", "pi", "--n-layer", "2", "--d-model", "32",
        "--n-head", "2", "--seq-len", "64", "--batch-size", "2", "--grad-accum", "2", "--dropout", "0.1",
        "--steps", str(STEPS), "--warmup", "2", "--eval-every", "0", "--save-every", "0", "--log-every", "1",
        "--device", "cpu", "--precision", "fp32", "--no-progress", *extra]))


def fail_at(step: int, micro: int, error: BaseException):
    def hook(s, m):
        if (s, m) == (step, micro):
            raise error
    return hook


def train_losses(run_dir) -> list[tuple[int, float, float]]:
    return [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(run_dir) if r["split"] == "train"]


def final_weights(run_dir) -> dict[str, torch.Tensor]:
    return load_file(read_latest(run_dir / "checkpoints") / "model.safetensors")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, one_thread):
    root = tmp_path_factory.mktemp("resume")
    corpus = write_corpus(root / "corpus")
    train_config(parse(corpus, root / "straight"))
    return corpus, root / "straight"


def assert_same_run(resumed, straight):
    assert train_losses(resumed) == train_losses(straight)  # exact, every step
    assert [s for s, *_ in train_losses(resumed)] == list(range(1, STEPS + 1))
    a, b = final_weights(resumed), final_weights(straight)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_interrupted_mid_step_saves_then_resumes_bit_for_bit(uninterrupted, tmp_path):
    corpus, straight = uninterrupted
    run = tmp_path / "run"
    # Ctrl-C during the second micro batch of step 4: one micro batch and its dropout draws already spent.
    with pytest.raises(KeyboardInterrupt):
        train_config(parse(corpus, run), on_micro_step=fail_at(3, 1, KeyboardInterrupt()))
    saved = read_latest(run / "checkpoints")
    assert saved.name == "step_00000003" and load_trainer_state(saved)["step"] == 3
    with (run / "metrics.jsonl").open("a") as f:  # as if a killed run had logged past its last checkpoint
        f.write(json.dumps({"step": 5, "split": "train", "loss": 0.0, "grad_norm": 0.0}) + "\n")
    train_config(parse(corpus, run, "--resume"))
    assert_same_run(run, straight)


def test_error_after_a_periodic_checkpoint_resumes_from_it(uninterrupted, tmp_path):
    corpus, straight = uninterrupted
    run = tmp_path / "run"
    with pytest.raises(RuntimeError, match="injected"):
        train_config(parse(corpus, run, "--save-every", "2"), on_micro_step=fail_at(4, 0, RuntimeError("injected")))
    assert [p.name for p in sorted((run / "checkpoints").glob("step_*"))] == ["step_00000002", "step_00000004"]
    train_config(parse(corpus, run, "--save-every", "2", "--resume"))
    assert_same_run(run, straight)


def test_resume_refuses_changed_run_arguments(uninterrupted):
    corpus, straight = uninterrupted
    with pytest.raises(ValueError, match="--seq-len: stored 64, given 32"):
        train_config(parse(corpus, straight, "--resume", "--seq-len", "32"))
