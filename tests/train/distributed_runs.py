"""What the multi-process training tests share: one tiny run's flags, torchrun in a subprocess, and the
comparison of a run's metrics and weights with a one-process reference."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from piattn.commands.train import add_arguments
from piattn.config import TrainConfig
from piattn.train.metrics import read_metrics

STEPS = 4
EXPECTED_RECORDS = [(1, "train"), (2, "train"), (3, "train"), (4, "train"), (4, "validation")]


PI = ("--attention", "pi", "--window", "2", "--period", "8")


def common_args(corpus, out, *extra, attention=PI):
    return ["train", "--data", str(corpus), "--out", str(out), *attention, "--n-layer", "2", "--d-model", "32",
            "--n-head", "2", "--seq-len", "32", "--steps", str(STEPS), "--lr", "0.02", "--min-lr", "0.01",
            "--warmup", "1", "--dropout", "0",
            "--eval-every", str(STEPS), "--eval-batches", "2", "--save-every", "1", "--keep", str(STEPS),
            "--log-every", "1", "--device", "cpu", "--precision", "fp32", "--no-progress", *extra]


def torchrun(nproc: int, args: list[str]) -> subprocess.CompletedProcess:
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
              "-m", "piattn.cli", *args]
    return subprocess.run(launch, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)


def checkpoint(run, step):
    return run / "checkpoints" / f"step_{step:08d}"


def weights(run, step):
    return load_file(checkpoint(run, step) / "model.safetensors")


def assert_same_training(run, reference):
    got, want = read_metrics(run), read_metrics(reference)
    assert [(r["step"], r["split"]) for r in got] == [(r["step"], r["split"]) for r in want] == EXPECTED_RECORDS
    for r, s in zip(got, want, strict=True):
        where = f"step {r['step']} {r['split']}"
        assert r["tokens"] == s["tokens"], where  # global tokens: sequence shards and replicas add up
        assert r["loss"] == pytest.approx(s["loss"], rel=1e-5), where
        if r["split"] == "train":
            assert r["grad_norm"] == pytest.approx(s["grad_norm"], rel=1e-5), where
    for step in range(1, STEPS + 1):
        a, b = weights(run, step), weights(reference, step)
        assert a.keys() == b.keys()
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=5e-5, msg=f"step {step}: {name}")
    moved = max(float((weights(reference, STEPS)[k] - weights(reference, 1)[k]).abs().max()) for k in a)
    assert moved > 1e-2  # training moves the weights far beyond the tolerance


def stopped_at(run, step, into):
    """A copy of `run` as if it had stopped after checkpoint `step`."""
    shutil.copytree(run, into)
    root = into / "checkpoints"
    for later in range(step + 1, STEPS + 1):
        shutil.rmtree(root / f"step_{later:08d}")
    (root / "latest").write_text(f"step_{step:08d}\n")
    return into


def parse(args: list[str]) -> TrainConfig:
    """The TrainConfig of a `piattn train ...` argument list (`args[0]` is "train")."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return TrainConfig.from_args(parser.parse_args(args[1:]))
