"""`piattn eval`: score a checkpoint on a split; prints the metrics as JSON and writes them to a file.

    piattn eval --checkpoint runs/pi-tiny --split test
    {"loss": …, "bpb": …, "perplexity": …, "tokens": …, "tokens_per_second": …, …}

For language models: loss in nats per token, bits per byte of the evaluated text (total nats / (ln 2 ·
its UTF-8 bytes)), perplexity per token. Two more views of a language model:

    piattn eval --checkpoint runs/pi --position-bins 16      # + "position_bins": mean loss by position
    piattn eval --checkpoint runs/pi --compare runs/local    # + "compare": A − B on the same windows

`--position-bins N` splits the target positions 0 … T − 1 of every window into N near-equal ranges and
reports the mean loss (nats per token) of each. `--compare B` scores checkpoint B on exactly the windows
A was scored on (A's data, tokenization and context; B must share A's tokenizer) and reports, per bin and
over all positions, the mean over windows of the per-window difference of mean losses A − B with a 95%
t-interval over windows. Adjacent windows of one text are not independent, so read the interval as
optimistic rather than exact.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

import torch

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
    p.add_argument("--position-bins", type=int, help="language models: mean loss in this many equal ranges "
                   "of positions of each window (default: off; 1 with --compare)")
    p.add_argument("--compare", help="language models: a second checkpoint (run directory or folder) to score on "
                   "the same windows; reports A − B per position bin with a 95%% t-interval over windows")
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
    if args.position_bins is not None and args.position_bins < 1:
        raise ValueError(f"--position-bins must be >= 1, got {args.position_bins}")
    split = normalize_split(args.split)
    folder = ckpt.resolve_checkpoint(args.checkpoint)
    by_position = args.position_bins is not None or args.compare is not None
    if by_position:
        language_model(folder, "--checkpoint")
    other = None
    if args.compare is not None:
        other = ckpt.resolve_checkpoint(args.compare)
        language_model(other, "--compare")
    amp = autocast_dtype(args.precision, ctx.device)
    task, model, cfg = restore(folder, ctx, data=args.data, batch_size=args.batch_size, cache_dir=args.cache_dir)
    start = time.perf_counter()
    with autocast(ctx.device, amp):
        if not by_position:
            metrics = task.evaluate(model, split, args.batches)
        else:
            bins = args.position_bins or 1
            metrics, windows = task.evaluate_by_position(model, split, args.batches, bins)
            if other is not None:
                metrics["compare"] = compare(task, windows, other, split, bins, args, ctx)
    step = ckpt.read_config(folder).get("step")
    return {"checkpoint": str(folder), "step": step, "data": cfg.data.data, "split": split, **metrics,
            "seconds": time.perf_counter() - start}


def language_model(folder, flag: str) -> None:
    """ValueError unless the checkpoint `folder` holds a language model."""
    task = ckpt.read_config(folder).get("task")
    if task != "lm":
        raise ValueError(f"{flag}: {folder} holds a {task!r} model; --position-bins and --compare need a "
                         "language model (task 'lm')")


def compare(task, windows: torch.Tensor, other, split: str, bins: int, args: argparse.Namespace,
            ctx: DistContext) -> dict:
    """Checkpoint `other` scored on the windows `task` gave A (`windows`: A's [W, bins] losses), and the
    paired differences A − B per bin and over all positions."""
    task_b, model_b, _ = restore(other, ctx, batch_size=args.batch_size, cache_dir=args.cache_dir)
    if task_b.tokenizer_digest != task.tokenizer_digest:
        raise ValueError(f"--compare: {other} has another tokenizer than --checkpoint; the two must score the "
                         "same tokens")
    context = task_b.model_config.block_size
    if context < task.cfg.data.seq_len:
        raise ValueError(f"--compare: {other} takes at most {context} positions, fewer than the "
                         f"{task.cfg.data.seq_len} of --checkpoint's windows")
    metrics_b, windows_b = task.evaluate_by_position(model_b, split, args.batches, bins)
    if len(windows) < 2:
        raise ValueError(f"--compare needs at least 2 windows for an interval, got {len(windows)}; "
                         "raise --batches or --batch-size")
    widths = torch.tensor([b["end"] - b["start"] for b in metrics_b["position_bins"]], dtype=torch.float64)
    difference = windows - windows_b  # [W, bins]
    whole = (difference * widths).sum(1) / widths.sum()  # per-window difference over all positions
    return {"checkpoint": str(other), "step": ckpt.read_config(other).get("step"),
            **{k: metrics_b[k] for k in ("loss", "bpb", "perplexity")}, "windows": len(windows),
            "interval": "95% t-interval over windows of the per-window mean loss difference A − B (nats/token)",
            "total": paired_interval(whole),
            "position_bins": [{"start": b["start"], "end": b["end"], **paired_interval(difference[:, i])}
                              for i, b in enumerate(metrics_b["position_bins"])]}


def paired_interval(differences: torch.Tensor) -> dict:
    """Mean of [W] paired differences and its 95% t-interval (W >= 2): mean ± t(0.975, W − 1)·sd/√W."""
    n = len(differences)
    mean = differences.mean().item()
    half = t_quantile_975(n - 1) * differences.std().item() / math.sqrt(n)
    return {"difference": mean, "low": mean - half, "high": mean + half}


def t_quantile_975(df: int) -> float:
    """The 0.975 quantile of Student's t with `df` degrees of freedom: exact for 1 and 2, else the
    Cornish-Fisher expansion in 1/df about the normal quantile (Abramowitz & Stegun 26.7.5), within
    0.2% at df = 3 and closer beyond."""
    if df == 1:
        return math.tan(math.pi * 0.475)
    if df == 2:
        return 0.95 / math.sqrt(2 * 0.975 * 0.025)
    z = 1.959963984540054
    return (z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3)
            + (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / (92160 * df**4))


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
