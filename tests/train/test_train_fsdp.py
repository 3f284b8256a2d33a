"""`piattn train --fsdp` under torchrun (CPU, Gloo): FSDP2 sharding trains like one process, and its
checkpoints are the plain ones.

One process with a batch of 2 sequences is the reference; 2 processes with `--fsdp` take 1 sequence each
(rank r every 2nd of the shared order) while weights, gradients and Adam state are sharded over both; with
`--sequence-parallel 2` as well, both take the same 2 sequences, each its half of every sequence, and FSDP
shards over both ranks of the sequence group.
Losses and gradient norms (the global norm over the shards, clipped at 1) must agree to fp32 round-off,
the weights after every step closely. Checkpoints are gathered onto rank 0 and written as without
`--fsdp`, so they resume on one process without it, and a plain one resumes under `--fsdp`.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from distributed_runs import STEPS, assert_same_training, checkpoint, common_args, parse, stopped_at, torchrun, weights
from safetensors import safe_open

from piattn.cli import main
from piattn.commands.train import train_config
from piattn.train.checkpoint import load_trainer_state
from piattn.train.metrics import read_metrics

pytestmark = [pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed"),
              # one pytest worker runs this file (make test: --dist loadgroup), so that its module fixture's
              # process group is started once, not once per worker
              pytest.mark.xdist_group("test_train_fsdp")]


@pytest.fixture(scope="module")
def fsdp_run(corpus):
    out = corpus.parent / "fsdp2"
    done = torchrun(2, common_args(corpus, out, "--batch-size", "1", "--fsdp"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "sharded (FSDP2)" in done.stderr
    return out


@pytest.fixture(scope="module")
def fsdp_sequence_parallel_run(corpus):
    out = corpus.parent / "fsdp_sp2"
    done = torchrun(2, common_args(corpus, out, "--batch-size", "2", "--sequence-parallel", "2", "--fsdp"))
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_fsdp_on_two_ranks_matches_one_process(fsdp_run, reference):
    assert_same_training(fsdp_run, reference)


@pytest.mark.slow  # a combination of what the other tests cover one at a time; seconds of process groups
def test_fsdp_over_a_sequence_group_matches_one_process(fsdp_sequence_parallel_run, reference):
    assert_same_training(fsdp_sequence_parallel_run, reference)


def test_fsdp_checkpoints_have_the_plain_format(fsdp_run, reference):
    """The tied LM head is stored once, as the plain model stores it; the optimiser state is a plain
    `state_dict()` (parameters numbered, full tensors), in the same layout as one process writes."""
    for run in (fsdp_run, reference):
        with safe_open(str(checkpoint(run, 1) / "model.safetensors"), framework="pt") as f:
            assert "embed.weight" in f.keys() and "head.weight" not in f.keys()  # noqa: SIM118 (not a dict)
    got, want = load_trainer_state(checkpoint(fsdp_run, 2)), load_trainer_state(checkpoint(reference, 2))
    assert (got["world_size"], got["data_parallel"]) == (2, 2)
    g, w = got["optimizer"], want["optimizer"]
    assert [grp["params"] for grp in g["param_groups"]] == [grp["params"] for grp in w["param_groups"]]
    assert g["state"].keys() == w["state"].keys()
    for i in w["state"]:
        assert g["state"][i].keys() == w["state"][i].keys()
        for key in w["state"][i]:
            assert type(g["state"][i][key]) is torch.Tensor and g["state"][i][key].shape == w["state"][i][key].shape
            torch.testing.assert_close(g["state"][i][key], w["state"][i][key], rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # a second process group's run (seconds); the checkpoint's format is checked above
def test_an_fsdp_checkpoint_resumes_on_one_process_without_fsdp(fsdp_sequence_parallel_run, reference, corpus,
                                                                tmp_path):
    """Written by 2 ranks with --fsdp sharing each sequence (1 data-parallel replica), resumed by 1 plain
    process: the same batches per step, so the run continues exactly (to round-off)."""
    run = stopped_at(fsdp_sequence_parallel_run, 2, tmp_path / "run")
    train_config(parse(common_args(corpus, run, "--batch-size", "2", "--resume")))
    assert_same_training(run, reference)


def test_an_fsdp_checkpoint_of_two_replicas_is_refused_on_one_process(fsdp_run, corpus, tmp_path):
    """One process would take other batches per step than the 2 replicas that wrote it: refused, as without
    --fsdp."""
    run = stopped_at(fsdp_run, 2, tmp_path / "run")
    with pytest.raises(ValueError, match="saved with 2 data-parallel replica"):
        train_config(parse(common_args(corpus, run, "--batch-size", "1", "--resume")))


@pytest.mark.slow  # a combination of what the other tests cover one at a time; seconds of process groups
def test_an_fsdp_checkpoint_resumes_under_ddp(fsdp_run, reference, corpus, tmp_path):
    """Written by 2 replicas with --fsdp, resumed by 2 replicas without it (DDP); (one process would take
    other batches per step and is refused, as without --fsdp)."""
    run = stopped_at(fsdp_run, 2, tmp_path / "run")
    done = torchrun(2, common_args(corpus, run, "--batch-size", "1", "--resume"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_training(run, reference)


@pytest.mark.slow  # a combination of what the other tests cover one at a time; seconds of process groups
def test_a_plain_checkpoint_resumes_under_fsdp(reference, corpus, tmp_path):
    """Written by 1 process, resumed by 2 ranks with --fsdp (one sequence group: still 1 replica)."""
    run = stopped_at(reference, 2, tmp_path / "run")
    done = torchrun(2, common_args(corpus, run, "--batch-size", "2", "--sequence-parallel", "2", "--fsdp",
                                   "--resume"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_training(run, reference)


def test_fsdp_on_one_process_changes_nothing(reference, corpus, tmp_path, capsys):
    """One process has nothing to shard over: --fsdp is accepted (the same command line scales to torchrun)
    and the run is the plain one, bit for bit."""
    out = tmp_path / "run"
    assert main(common_args(corpus, out, "--batch-size", "2", "--fsdp")) == 0
    assert "--fsdp: one process, nothing to shard" in capsys.readouterr().err
    for step in range(1, STEPS + 1):
        a, b = weights(out, step), weights(reference, step)
        assert all(torch.equal(a[k], b[k]) for k in b)
    assert [r["loss"] for r in read_metrics(out)] == [r["loss"] for r in read_metrics(reference)]


FAILING_RUN = """
import argparse, sys
from piattn.commands.train import add_arguments, train_config
from piattn.config import TrainConfig

def fail(step, micro):
    if (step, micro) == (3, 0):  # every rank fails alike, at the start of step 4: step 3 is complete
        raise RuntimeError("injected")

parser = argparse.ArgumentParser()
add_arguments(parser)
train_config(TrainConfig.from_args(parser.parse_args(sys.argv[2:])), on_micro_step=fail)
"""


@pytest.mark.slow  # the crash test of one process, under FSDP: seconds of process groups
def test_a_crash_under_fsdp_saves_nothing_and_names_the_latest_checkpoint(corpus, tmp_path):
    """Saving gathers from every rank, which could hang after a failure: the last periodic checkpoint
    (step 2) stays the latest, step 3 is not written."""
    script = tmp_path / "failing_run.py"
    script.write_text(FAILING_RUN)
    out = tmp_path / "run"
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
              *common_args(corpus, out, "--batch-size", "1", "--fsdp", "--save-every", "2")]
    done = subprocess.run(launch, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode != 0
    assert "RuntimeError: injected" in done.stderr
    latest = checkpoint(out, 2)
    assert f"not saved (with --fsdp a save gathers from every rank, which could hang now); the latest " \
           f"checkpoint is {latest}" in done.stderr
    assert (out / "checkpoints" / "latest").read_text().strip() == latest.name
    assert not checkpoint(out, 3).exists()
