"""DDP through torchrun: 2 CPU processes (Gloo) train like 1 process given the same global batch.

Rank r takes every 2nd sequence of the shared shuffled order, so 2 ranks × 2 micro batches of 1 sequence
cover the same 4 sequences as one process with a batch of 4; with dropout off the averaged gradients, and so
the weights after each step, must agree up to float rounding.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from piattn.cli import main
from piattn.train.metrics import read_metrics
from utils import write_word_corpus

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")


def write_corpus(root):
    return write_word_corpus(root, {"train": [300] * 3, "validation": [300], "test": [300]})


def common_args(corpus):
    return ["train", "--data", str(corpus), "--attention", "pi", "--n-layer", "2", "--d-model", "32", "--n-head", "2",
            "--seq-len", "64", "--steps", "2", "--warmup", "1", "--dropout", "0", "--eval-every", "0",
            "--save-every", "1", "--keep", "2", "--log-every", "1", "--device", "cpu", "--precision", "fp32",
            "--no-progress"]


def weights(run, step):
    return load_file(run / "checkpoints" / f"step_{step:08d}" / "model.safetensors")


def test_two_ranks_match_one_process_with_the_same_global_batch(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    ddp, single = tmp_path / "ddp", tmp_path / "single"
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
              "-m", "piattn.cli", *common_args(corpus), "--batch-size", "1", "--grad-accum", "2", "--out", str(ddp)]
    done = subprocess.run(launch, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main([*common_args(corpus), "--batch-size", "4", "--grad-accum", "1", "--out", str(single)]) == 0
    finally:
        torch.set_num_threads(threads)

    for step in (1, 2):
        a, b = weights(ddp, step), weights(single, step)
        assert a.keys() == b.keys()
        for name in a:
            # Rounding differs between the paths (batch 1 per rank and averaged gradients against batch 4), and
            # Adam's first step divides by |g|, so a tiny gradient's rounding moves a weight by up to ~1e-6 of a
            # 3e-4 step (1.02e-6 seen with "fused", which "auto" runs on a CPU): atol 3e-6, 1 % of a step.
            torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=3e-6, msg=f"step {step}: {name}")
    moved = max(float((weights(single, 2)[k] - weights(single, 1)[k]).abs().max()) for k in a)
    assert moved > 1e-4  # a step changes the weights far beyond the tolerance above

    ddp_log, single_log = read_metrics(ddp), read_metrics(single)
    assert [r["step"] for r in ddp_log] == [r["step"] for r in single_log] == [1, 2]
    for r, s in zip(ddp_log, single_log, strict=True):
        assert r["tokens"] == s["tokens"]  # global tokens per step: 2 ranks × 2 micro × 1 × 64
        assert r["loss"] == pytest.approx(s["loss"], rel=1e-5)
        assert r["grad_norm"] == pytest.approx(s["grad_norm"], rel=1e-4)  # gradients averaged, not summed
