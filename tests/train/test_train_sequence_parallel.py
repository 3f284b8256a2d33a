"""`piattn train --sequence-parallel N` under torchrun (CPU, Gloo) trains like one process with the same batch.

One process with a batch of 2 sequences of 32 tokens is the reference. With `--sequence-parallel 2` on 2
processes both ranks take the same 2 sequences, each its 16 positions; on 4 processes (2 data-parallel
replicas × 2 ranks per sequence) each replica takes 1 of the 2 sequences (replica r takes every 2nd of
the shared order). Losses, gradient norms and validation loss must agree to fp32 round-off, the weights
closely. The learning rate is high (0.02) so that a subtly wrong model (say, RoPE at shard-local
positions) moves the losses of later steps far beyond the tolerance; the first Adam step amplifies
round-off in near-zero gradient entries, hence the absolute weight tolerance of a few lr · 1e-3.
"""

from __future__ import annotations

import pytest
import torch
from distributed_runs import assert_same_training, common_args, parse, stopped_at, torchrun

from piattn.cli import main
from piattn.commands.train import train_config
from piattn.train.checkpoint import load_trainer_state, read_latest

pytestmark = [pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed"),
              # one pytest worker runs this file (make test: --dist loadgroup), so that its module fixture's
              # process group is started once, not once per worker
              pytest.mark.xdist_group("test_train_sequence_parallel")]


@pytest.fixture(scope="module")
def sequence_parallel_run(corpus):
    out = corpus.parent / "sp2"
    done = torchrun(2, common_args(corpus, out, "--batch-size", "2", "--sequence-parallel", "2"))
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def two_by_two_run(corpus):
    out = corpus.parent / "dp2_sp2"
    done = torchrun(4, common_args(corpus, out, "--batch-size", "1", "--sequence-parallel", "2"))
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_two_ranks_per_sequence_match_one_process(sequence_parallel_run, reference):
    assert_same_training(sequence_parallel_run, reference)


@pytest.mark.slow  # a combination of what the other tests cover one at a time; seconds of process groups
def test_two_replicas_of_two_ranks_per_sequence_match_one_process(two_by_two_run, reference):
    assert_same_training(two_by_two_run, reference)
    state = load_trainer_state(read_latest(two_by_two_run / "checkpoints"))
    assert (state["world_size"], state["data_parallel"]) == (4, 2)


def test_a_sequence_parallel_checkpoint_resumes_on_one_process(sequence_parallel_run, reference, corpus, tmp_path):
    """Written by 2 ranks sharing each sequence (1 data-parallel replica), resumed by 1 process (1 replica):
    the batches of every step are the same, so the run continues exactly (to round-off)."""
    run = stopped_at(sequence_parallel_run, 2, tmp_path / "run")
    assert load_trainer_state(read_latest(run / "checkpoints"))["world_size"] == 2
    train_config(parse(common_args(corpus, run, "--batch-size", "2", "--resume")))
    assert_same_training(run, reference)


@pytest.mark.slow  # the refusal of test_train_sequence_parallel's layouts, after seconds of process groups
def test_resume_refuses_another_data_parallel_size(two_by_two_run, corpus, tmp_path):
    """Written by 2 replicas × 2 ranks per sequence, a step took 2 × 1 sequences; one process with
    --batch-size 1 would take 1: the batches would differ, so the resume is refused (with the fix)."""
    run = stopped_at(two_by_two_run, 2, tmp_path / "run")
    with pytest.raises(ValueError, match=r"^--resume: the run was saved with 2 data-parallel replica\(s\) .*this "
                                         r"one has 1.*resume on 2 × --sequence-parallel processes$"):
        train_config(parse(common_args(corpus, run, "--batch-size", "1", "--resume")))


@pytest.mark.parametrize("extra, message", [
    (["--seq-len", "30", "--sequence-parallel", "4"],
     "--seq-len 30 must be divisible by --sequence-parallel 4: each rank of a sequence group takes seq-len / N "
     "positions"),
    (["--attention", "dense", "--sequence-parallel", "2"],
     "--sequence-parallel applies to --attention local / pi only, not 'dense'"),
    (["--task", "listops", "--sequence-parallel", "2"],
     "--sequence-parallel applies to --task lm only, not 'listops'"),
    (["--sequence-parallel", "0"], "--sequence-parallel must be >= 1, got 0"),
])
def test_bad_layouts_are_refused_in_one_line(extra, message, corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(common_args(corpus, out, "--batch-size", "2", *extra, attention=())) == 2
    assert capsys.readouterr().err == f"piattn train: error: {message}\n"
    assert not out.exists()


def test_a_world_size_not_divisible_by_the_sequence_group_is_refused(corpus, tmp_path, capsys, monkeypatch):
    """Checked from the torchrun environment before any process group starts, so every rank refuses alike
    (nothing waits for a peer: this process alone claims to be rank 0 of 3)."""
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "3"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    out = tmp_path / "run"
    assert main(common_args(corpus, out, "--batch-size", "2", "--sequence-parallel", "2")) == 2
    assert capsys.readouterr().err == ("piattn train: error: --sequence-parallel 2 must divide the number of "
                                       "processes, 3 (start a multiple of 2 with torchrun --nproc_per_node)\n")
    assert not out.exists()
