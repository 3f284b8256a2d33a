"""`piattn train`: train a model on a task, with checkpoints and exact resume.

    piattn train --config tiny --attention pi --data ../shared/data/books --tokenizer byte \\
        --seq-len 1024 --batch-size 8 --steps 2000 --out runs/pi-tiny
    piattn train --task listops --attention pi --seq-len 2000 --steps 5000 --out runs/listops-pi
    piattn train --task reach --attention local --window 2 --n-layer 2 --lag 8 --out runs/reach-local

The flags are the fields of `piattn.config.TrainConfig` (sections model, data, task, optim, run); a flag
given to a task or attention kind that ignores it is an error. Tasks: `piattn.tasks.TASKS`.

Multi-GPU: `torchrun --nproc_per_node 8 -m piattn.cli train ...` (one process per GPU, DDP). Long sequences:
`--sequence-parallel N` splits each sequence over N ranks (--task lm, --attention pi or local; the world
is N ranks per sequence × world / N data-parallel replicas; docs/sequence_parallel.md §5).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from ..config import TrainConfig
from ..data.tokenizers import KINDS as TOKENIZER_KINDS
from ..layers import ATTENTION
from ..ops.pi import BACKENDS
from ..tasks import TASKS, task_class
from ..train.loop import MicroStepHook, train

# The allowed values of flags whose choices are registries above `piattn.config`.
REGISTRIES = {"attention": tuple(ATTENTION), "task": tuple(TASKS), "tokenizer": tuple(TOKENIZER_KINDS),
              "backend": BACKENDS}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    TrainConfig.add_arguments(parser)


def checked_config(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with every flag checked (ValueError naming the flag) and the task's --seq-len filled in, so that
    checkpoints record the length used."""
    cfg.check(REGISTRIES)
    if cfg.data.seq_len is None:
        seq_len = task_class(cfg.task.task).resolve_seq_len(cfg)
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=seq_len))
    if cfg.data.seq_len % cfg.run.sequence_parallel:
        raise ValueError(f"--seq-len {cfg.data.seq_len} must be divisible by --sequence-parallel "
                         f"{cfg.run.sequence_parallel}: each rank of a sequence group takes seq-len / N positions")
    if cfg.run.sequence_parallel > 1 and (cfg.data.pack_documents or cfg.model.sinks):
        # The halo exchange carries window and skip rows only: documents and sink keys would cross shards.
        raise ValueError(f"--{'pack-documents' if cfg.data.pack_documents else 'sinks'} does not run with "
                         "--sequence-parallel > 1")
    return cfg


def build_task(cfg, run_dir, ctx, checkpoint):
    return task_class(cfg.task.task).from_config(cfg, run_dir, ctx, checkpoint)


def train_config(cfg: TrainConfig, on_micro_step: MicroStepHook | None = None) -> dict:
    """Check `cfg` and train it: what `piattn train` does after parsing."""
    return train(checked_config(cfg), build_task, on_micro_step)


def run(args: argparse.Namespace) -> int:
    summary = train_config(TrainConfig.from_args(args))
    if summary.get("checkpoint") is not None:  # rank 0, the one that saves, reports
        summary["checkpoint"] = str(summary["checkpoint"])
        print(json.dumps(summary, indent=2))
    return 0
