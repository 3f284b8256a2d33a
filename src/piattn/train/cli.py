"""`piattn train`: train a model on a task, with checkpoints and exact resume.

    piattn train --config tiny --attention pi --data ../shared/data/books --tokenizer byte \\
        --seq-len 1024 --batch-size 8 --steps 2000 --out runs/pi-tiny
    piattn train --task listops --attention pi --seq-len 2000 --steps 5000 --out runs/listops-pi
    piattn train --task reach --attention local --window 2 --n-layer 2 --lag 8 --out runs/reach-local

Tasks: `lm` (language modelling on --data) and the classification tasks of `piattn.train.classification`
(listops, pathfinder, retrieval, reach), whose own flags are in the group "classification tasks".

Multi-GPU: `torchrun --nproc_per_node 8 -m piattn.cli train ...` (one process per GPU, DDP).
"""

from __future__ import annotations

import argparse
import json

from ..data.tokenizers import KINDS as TOKENIZER_KINDS
from ..layers import ATTENTION
from ..models import SIZES
from .classification import CLASSIFICATION_TASKS
from .distributed import DEVICES
from .loop import PRECISIONS, train
from .tasks import TASKS, task_class

LM_SEQ_LEN = 1024  # --seq-len of --task lm when not given
# Flags that apply to some tasks only: giving one to another task is an error, not silently ignored.
TASK_FLAGS = {
    "train_size": tuple(CLASSIFICATION_TASKS), "eval_size": tuple(CLASSIFICATION_TASKS),
    "listops_min_len": ("listops",), "listops_max_len": ("listops",),
    "image_size": ("pathfinder",), "contour_length": ("pathfinder",),
    "lag": ("reach",), "reach_vocab": ("reach",), "causal": ("reach",),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    # Names are checked in `run` (not argparse `choices`), so a bad value is one ValueError line.
    model = p.add_argument_group("model")
    model.add_argument("--task", default="lm", help=f"what to learn, one of {sorted(TASKS)}")
    model.add_argument("--config", default="tiny", help=f"model size, one of {sorted(SIZES)}")
    model.add_argument("--attention", default="pi", help=f"attention kind, one of {sorted(ATTENTION)}")
    model.add_argument("--window", type=int, help="local window k (default: the config's, 4)")
    model.add_argument("--period", type=int, help="π, the distance of the long-range key (default 16)")
    model.add_argument("--variant", help="π-Attention fusion variant (default adaptive)")
    model.add_argument("--prior", type=float, help="the fixed local prior α of --variant fixed (default 0.5)")
    model.add_argument("--n-layer", type=int, help="override the config's number of layers")
    model.add_argument("--n-head", type=int, help="override the config's number of heads")
    model.add_argument("--d-model", type=int, help="override the config's width")
    model.add_argument("--d-ff", type=int, help="override the feed-forward width (default 4 × d-model)")
    model.add_argument("--backend", help="π operator backend (default auto)")
    model.add_argument("--dropout", type=float, default=0.1, help="residual, attention and FFN dropout")

    data = p.add_argument_group("data")
    data.add_argument("--data", help="lm (required): a folder with train/ validation/ test/ text files, books:<dir>, "
                      "wikitext:<dir>, hf:<name>; listops: a folder with LRA's basic_{train,val,test}.tsv "
                      "(default: generated); retrieval (required): a folder with LRA's new_aan_pairs.*.tsv")
    data.add_argument("--tokenizer", default="byte", help=f"one of {list(TOKENIZER_KINDS)}")
    data.add_argument("--vocab-size", type=int, help="BPE vocabulary size (bpe only)")
    data.add_argument("--seq-len", type=int, help=f"tokens per sequence (default: lm {LM_SEQ_LEN}, listops 2000, "
                      "retrieval 4000 per text, pathfinder image-size², reach 64)")
    data.add_argument("--cross-documents", action="store_true", help="let sequences span document boundaries")
    data.add_argument("--cache-dir", help="where tokenized corpora are cached (default: OUT/cache)")

    tasks = p.add_argument_group("classification tasks")
    tasks.add_argument("--train-size", type=int, help="training examples: generated (default 10000) or read at most "
                       "(default all)")
    tasks.add_argument("--eval-size", type=int, help="examples of the validation and of the test split: generated "
                       "(default 1000) or read at most (default all)")
    tasks.add_argument("--data-seed", type=int, default=0, help="seed of generated splits (each split its own)")
    tasks.add_argument("--listops-min-len", type=int, help="fewest tokens of a generated ListOps expression "
                       "(default seq-len / 4 + 1)")
    tasks.add_argument("--listops-max-len", type=int, help="most tokens of a generated ListOps expression "
                       "(default seq-len - 1)")
    tasks.add_argument("--image-size", type=int, help="Pathfinder image side in pixels (default 32)")
    tasks.add_argument("--contour-length", type=int, help="Pathfinder paddles per target curve (LRA: 6, 9, 14; "
                       "default 14)")
    tasks.add_argument("--lag", type=int, help="reach: positions from the answer to the query (required)")
    tasks.add_argument("--reach-vocab", type=int, help="reach: symbols in a sequence (default 8; chance 1/vocab)")
    tasks.add_argument("--causal", action=argparse.BooleanOptionalAction,
                       help="reach: a causal GPT read at the query (default) or, with --no-causal, a bidirectional "
                       "Encoder")

    optim = p.add_argument_group("optimisation (paper defaults)")
    optim.add_argument("--batch-size", type=int, default=8, help="sequences per micro batch on each process")
    optim.add_argument("--grad-accum", type=int, default=1, help="micro batches per optimiser step")
    optim.add_argument("--steps", type=int, default=2000, help="optimiser steps in the whole run")
    optim.add_argument("--lr", type=float, default=3e-4, help="peak learning rate")
    optim.add_argument("--min-lr", type=float, default=3e-5, help="learning rate at the end of the cosine")
    optim.add_argument("--warmup", type=int, default=100, help="linear warmup steps (the paper: 2000 of 200k)")
    optim.add_argument("--weight-decay", type=float, default=0.1, help="AdamW decay of Linear weights")
    optim.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip (0: none)")
    optim.add_argument("--seed", type=int, default=0)

    run = p.add_argument_group("run")
    run.add_argument("--out", required=True, help="run directory (checkpoints, metrics.jsonl, tokenizer, cache)")
    run.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    run.add_argument("--eval-every", type=int, default=500, help="validate every N steps and at the end (0: never)")
    run.add_argument("--eval-batches", type=int, default=20, help="validation batches per process (0: all)")
    run.add_argument("--save-every", type=int, default=1000, help="checkpoint every N steps (0: at the end only)")
    run.add_argument("--keep", type=int, default=3, help="checkpoints to keep")
    run.add_argument("--log-every", type=int, default=10, help="write training metrics every N steps")
    run.add_argument("--device", default="auto", help=f"one of {list(DEVICES)} or cuda:N")
    run.add_argument("--precision", default="auto", help=f"one of {list(PRECISIONS)} (auto: bf16 on capable GPUs)")
    run.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bar")


def check_numbers(args: argparse.Namespace) -> None:
    """ValueError naming the flag for numbers outside their range."""
    at_least = {"seq_len": 1, "batch_size": 1, "grad_accum": 1, "steps": 1, "log_every": 1, "keep": 1,
                "warmup": 0, "eval_every": 0, "eval_batches": 0, "save_every": 0, "seed": 0, "data_seed": 0}
    for name, low in at_least.items():
        if getattr(args, name) < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    for name in ("lr", "min_lr", "weight_decay", "clip"):
        if not getattr(args, name) >= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")


def check_task_flags(args: argparse.Namespace) -> None:
    """ValueError for a task-specific flag given to another task, or --data missing where it is required."""
    task_class(args.task)  # an unknown --task first
    for name, tasks in TASK_FLAGS.items():
        if getattr(args, name) is not None and args.task not in tasks:
            flag = "--causal / --no-causal" if name == "causal" else f"--{name.replace('_', '-')}"
            raise ValueError(f"{flag} applies to --task {' / '.join(tasks)} only, not {args.task!r}")
    if args.task == "lm" and args.data is None:
        raise ValueError("--data is required with --task lm")


def resolve_seq_len(args: argparse.Namespace) -> None:
    """Fill in the task's --seq-len when it was not given, so checkpoints record the length used."""
    if args.seq_len is None:
        args.seq_len = LM_SEQ_LEN if args.task == "lm" else CLASSIFICATION_TASKS[args.task].resolve_seq_len(args)


def check_arguments(args: argparse.Namespace) -> None:
    """Every check of the parsed flags that needs no data; fills in the task's default --seq-len."""
    check_task_flags(args)
    resolve_seq_len(args)
    check_numbers(args)
    for flag, value, allowed in (("--config", args.config, sorted(SIZES)),
                                 ("--attention", args.attention, sorted(ATTENTION))):
        if value not in allowed:
            raise ValueError(f"{flag} must be one of {allowed}, got {value!r}")


def run(args: argparse.Namespace) -> int:
    check_arguments(args)
    summary = train(args)
    if summary.get("checkpoint") is not None:  # rank 0, the one that saves, reports
        summary["checkpoint"] = str(summary["checkpoint"])
        print(json.dumps(summary, indent=2))
    return 0
