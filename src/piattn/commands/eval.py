"""`piattn eval`: score a checkpoint on a split; prints the metrics as JSON and writes them to a file.

    piattn eval --checkpoint runs/pi-tiny --split test
    {"loss": …, "bpb": …, "perplexity": …, "tokens": …, "tokens_per_second": …, …}

For language models: loss in nats per token, bits per byte of the evaluated text (total nats / (ln 2 ·
its UTF-8 bytes)), perplexity per token.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from ..config import PRECISIONS
from ..data.text import normalize_split
from ..tasks import restore
from ..train import checkpoint as ckpt
from ..train.distributed import DEVICES, DistContext, setup, teardown
from ..train.loop import autocast, autocast_dtype, writable_folder


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="a run directory (its latest checkpoint) or a checkpoint folder")
    p.add_argument("--data", help="text source to score (default: the one the model was trained on)")
    p.add_argument("--split", default="test", help="train, validation (valid) or test")
    p.add_argument("--batches", type=int, default=0, help="batches per process to score (0: the whole split)")
    p.add_argument("--batch-size", type=int, help="sequences per batch (default: the training micro batch)")
    p.add_argument("--cache-dir", help="where tokenized corpora are cached (default: RUN/cache; never a folder "
                   "named inside the checkpoint)")
    p.add_argument("--device", default="auto", help=f"one of {list(DEVICES)} or cuda:N")
    p.add_argument("--precision", default="auto", help=f"one of {list(PRECISIONS)}")
    p.add_argument("--output", help="JSON file to write (default: RUN/eval/<checkpoint>_<split>[_<data>].json)")


def default_name(checkpoint: Path, args: argparse.Namespace) -> str:
    """`step_…_<split>.json`, with the data source appended when it is not the training one."""
    data = "" if args.data is None else "_" + re.sub(r"[^A-Za-z0-9.]+", "-", args.data).strip("-")[-48:]
    return f"{checkpoint.name}_{args.split}{data}.json"


def evaluate_checkpoint(args: argparse.Namespace, ctx: DistContext) -> dict:
    """Metrics of the checkpoint `args.checkpoint` on `args.split` of `args.data` (or its training data).

    Files are written only where the user says: the tokenized cache goes to `--cache-dir` or the run
    directory's cache/, whatever folder the checkpoint's config names.
    """
    if args.batches < 0:
        raise ValueError(f"--batches must be >= 0 (0: the whole split), got {args.batches}")
    if args.batch_size is not None and args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    split = normalize_split(args.split)
    folder = ckpt.resolve_checkpoint(args.checkpoint)
    amp = autocast_dtype(args.precision, ctx.device)
    task, model, cfg = restore(folder, ctx, data=args.data, batch_size=args.batch_size, cache_dir=args.cache_dir)
    start = time.perf_counter()
    with autocast(ctx.device, amp):
        metrics = task.evaluate(model, split, args.batches)
    step = ckpt.read_config(folder).get("step")
    return {"checkpoint": str(folder), "step": step, "data": cfg.data.data, "split": split, **metrics,
            "seconds": time.perf_counter() - start}


def output_file(path: str | Path) -> Path:
    """The --output path, checked before the (long) evaluation: a file in a writable folder."""
    output = Path(path)
    if output.is_dir():
        raise ValueError(f"--output {output} is a folder; name a .json file")
    writable_folder(output.parent, "--output folder")
    return output


def run(args: argparse.Namespace) -> int:
    chosen_output = output_file(args.output) if args.output else None
    ctx = setup(args.device)
    try:
        result = evaluate_checkpoint(args, ctx)
    finally:
        teardown(ctx)
    if not ctx.is_main:  # under torchrun every rank scores its share; rank 0 reports
        return 0
    folder = Path(result["checkpoint"])
    output = chosen_output or output_file(ckpt.run_dir_of(folder) / "eval" / default_name(folder, args))
    text = json.dumps(result, indent=2)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text + "\n")
    print(text)
    print(f"written to {output}", file=sys.stderr)
    return 0
