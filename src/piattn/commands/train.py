"""`piattn train`: train a model on a task, with checkpoints and exact resume.

    piattn train --config tiny --attention pi --data ../shared/data/books --tokenizer byte \\
        --seq-len 1024 --batch-size 8 --steps 2000 --out runs/pi-tiny
    piattn train --task listops --attention pi --seq-len 2000 --steps 5000 --out runs/listops-pi
    piattn train --task reach --attention local --window 2 --n-layer 2 --lag 8 --out runs/reach-local

The flags are the fields of `piattn.config.TrainConfig` (sections model, data, task, optim, run) with those
the tasks declare (`piattn.tasks.config_class()`); a flag given to a task or attention kind that ignores it
is an error. Tasks: `piattn.tasks.TASKS`.

    piattn train --out runs/pi-tiny --resume                 # the run's own settings, from its checkpoint
    piattn train --out runs/pi-tiny --resume --steps 4000    # extended: the LR follows the new schedule

`--resume` takes every setting from the run's latest checkpoint; a flag given again must have the stored
value unless it may change (`--steps`, `--cache-dir`, the run group: `--eval-every`, `--device`, …).
`--threads` sets torch's CPU threads (default 1 on the CPU). The settings are printed as one block at the
start; the end prints a summary for a person (the loss, speed, mean gate by layer, validation metrics,
checkpoint), writes every number of it to RUN/summary.json (gate statistics condensed: every one is in
RUN/metrics.jsonl) and draws RUN/metrics.png. A loss, gradient norm or weight that stops being finite
stops the run with a one-line error, and nothing of that state is saved. `--stop-at accuracy>=0.99` ends the
run at the first validation that meets it (that step checkpointed, `stopped_at` in summary.json).

Multi-GPU: `torchrun --nproc_per_node 8 -m piattn.cli train ...` (one process per GPU, DDP). Long sequences:
`--sequence-parallel N` splits each sequence over N ranks (--task lm, --attention pi or local; the world
is N ranks per sequence × world / N data-parallel replicas; docs/sequence_parallel.md §5).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from ..config import TrainConfig
from ..config.model import PERIOD_SCHEDULES, is_geometry_period
from ..config.training import period_text
from ..data.tokenizers import KINDS as TOKENIZER_KINDS
from ..layers import attention_registry
from ..ops.pi import BACKENDS
from ..safe_files import atomic_write_text
from ..tasks import TASKS, config_class, task_class
from ..train import checkpoint as ckpt
from ..train.gates import condensed
from ..train.loop import MicroStepHook, resumed_config, train
from .common import add_threads_argument, torch_threads
from .paths import output_folder

# The configuration with the flags of every registered task.
CONFIG = config_class()
# The allowed values of flags whose choices are registries above `piattn.config`.
REGISTRIES = {"attention": attention_registry(), "task": tuple(TASKS), "tokenizer": tuple(TOKENIZER_KINDS),
              "backend": BACKENDS}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    groups = CONFIG.add_arguments(parser, REGISTRIES)
    add_threads_argument(groups["run"])  # a property of this process, not of the run: not in TrainConfig


def checked_config(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with every flag checked (ValueError naming the flag) and the task's --seq-len filled in, so that
    checkpoints record the length used."""
    cfg.check(REGISTRIES)
    if is_geometry_period(cfg.model.period) and "raster" not in task_class(cfg.task.task).capabilities:
        raster = [name for name, task in TASKS.items() if "raster" in task.capabilities]
        raise ValueError(f"--period {cfg.model.period} applies to the tasks on images ({', '.join(raster)}), whose "
                         f"data gives the width, not to --task {cfg.task.task}; give a number of tokens")
    if cfg.data.seq_len is None:
        seq_len = task_class(cfg.task.task).resolve_seq_len(cfg)
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=seq_len))
    if cfg.data.seq_len % cfg.run.sequence_parallel:
        raise ValueError(f"--seq-len {cfg.data.seq_len} must be divisible by --sequence-parallel "
                         f"{cfg.run.sequence_parallel}: each rank of a sequence group takes seq-len / N positions")
    if cfg.model.sinks and cfg.model.sinks >= cfg.data.seq_len:
        # every key of a sequence would be a sink: the window and the skip would have nothing left to add
        raise ValueError(f"--sinks must be smaller than --seq-len ({cfg.data.seq_len}), got {cfg.model.sinks}")
    if cfg.run.sequence_parallel > 1 and (cfg.data.pack_documents or cfg.model.sinks):
        # The halo exchange carries window and skip rows only: documents and sink keys would cross shards.
        raise ValueError(f"--{'pack-documents' if cfg.data.pack_documents else 'sinks'} does not run with "
                         "--sequence-parallel > 1")
    return cfg


def build_task(cfg, run_dir, ctx, checkpoint):
    task = task_class(cfg.task.task).from_config(cfg, run_dir, ctx, checkpoint)
    if ctx.is_main:  # one process says it
        announce_schedule(cfg.model.period, task.model_config.period)
    return task


def announce_schedule(period: str | None, resolved) -> None:
    """On stderr, the periods a named schedule (--period cover, geometric:8) resolved to for this model, in
    --period's own syntax: the name alone does not say them, and the line repeats the run without it."""
    if period is None or (period.split(":")[0] not in PERIOD_SCHEDULES and not is_geometry_period(period)):
        return
    print(f"piattn train: --period {period} -> --period {period_text(resolved)} (',' between heads, '/' between "
          "layers)", file=sys.stderr)


def train_config(cfg: TrainConfig, on_micro_step: MicroStepHook | None = None) -> dict:
    """Check `cfg` and train it: what `piattn train` does after parsing."""
    return train(checked_config(cfg), build_task, on_micro_step)


def config_of(args: argparse.Namespace) -> TrainConfig:
    """The configuration `piattn train` runs: the flags given, the defaults for the others; with --resume,
    the run's stored settings for the others (`resumed_config`)."""
    cfg = CONFIG.from_args(args)
    return resumed_config(cfg, CONFIG.given(args)) if cfg.run.resume else cfg


SUMMARY_FILE = "summary.json"  # in the run folder: the end-of-run summary as JSON (`summary_json`)


def summary_json(summary: dict) -> str:
    """The end-of-run summary as indented JSON, the training record's gate statistics condensed to a few
    per-layer lists (`condensed`), and each list on one line."""
    return _dumps({**summary, **({"train": condensed(summary["train"])} if "train" in summary else {})})


def _dumps(value, indent: int = 0) -> str:
    """JSON: objects indented one key a line, anything else (lists included) on one line."""
    if not (isinstance(value, dict) and value):
        return json.dumps(value)
    pad = " " * (indent + 2)
    items = ",\n".join(f"{pad}{json.dumps(str(k))}: {_dumps(v, indent + 2)}" for k, v in value.items())
    return "{\n" + items + "\n" + " " * indent + "}"


def _number(value) -> str:
    return f"{value:,.0f}" if abs(value) >= 1e4 else f"{value:.4g}"


def _validation_lines(result: dict, checkpoint: Path) -> list[str]:
    """The validation metrics as `piattn eval` shows them (with their units), else every number, one line."""
    from .eval_report import metric_lines  # the eval command's summary, imported when a run ends

    try:
        lines = metric_lines(result, ckpt.read_config(checkpoint))
    except (KeyError, TypeError, ValueError):
        lines = []
    if lines:
        return lines
    numbers = [f"{key} {_number(value)}" for key, value in result.items()
               if isinstance(value, (int, float)) and not isinstance(value, bool)]
    return ["  " + ", ".join(numbers)] if numbers else []


def summary_lines(summary: dict, out: Path) -> list[str]:
    """The end of a run for a person: the step reached (and the --stop-at that stopped it there), the last logged
    training loss and speed, the mean gate by layer, the validation metrics, the checkpoint and where the whole
    summary (summary.json) went."""
    stopped = f" (--stop-at {summary['stopped_at']['condition']})" if "stopped_at" in summary else ""
    lines = [f"piattn train: done at step {summary.get('step')}{stopped}, run folder {out}"]
    train = condensed(summary["train"]) if summary.get("train") else {}
    if train:
        parts = [f"loss {train['loss']:.4f}" if "loss" in train else None,
                 f"{train['tokens_per_second']:,.0f} tokens/s" if "tokens_per_second" in train else None,
                 f"gate α mean by layer {', '.join(f'{a:.2f}' for a in train['alpha']['mean'])}"
                 if train.get("alpha", {}).get("mean") else None]
        lines.append("  training (last logged step): " + "; ".join(p for p in parts if p))
    if summary.get("validation"):
        lines += ["  validation:", *("  " + line for line in _validation_lines(summary["validation"],
                                                                              Path(summary["checkpoint"])))]
    lines.append(f"  checkpoint  {summary['checkpoint']}")
    lines.append(f"  all numbers in {out / SUMMARY_FILE}, every logged step in {out / 'metrics.jsonl'}")
    return lines


def run(args: argparse.Namespace) -> int:
    output_folder(args.out, "--out")  # before any work: '' (the current folder) or /proc are refused
    cfg = config_of(args)
    with torch_threads(args.threads, cfg.run.device):
        summary = train_config(cfg)
    if summary.get("checkpoint") is not None:  # rank 0, the one that saves, reports
        summary["checkpoint"] = str(summary["checkpoint"])
        out = Path(cfg.run.out)
        atomic_write_text(out / SUMMARY_FILE, summary_json(summary) + "\n")
        print("\n".join(summary_lines(summary, out)))
    return 0
