"""`piattn inspect`: what a trained model attends to, per layer; its token flow; its gate over training.

    piattn inspect --checkpoint runs/pi-books --out runs/pi-books/inspect [--compare runs/local-books]
    → DIR/inspect.json, DIR/token_flow.png, DIR/gate_dynamics.png (when a run logged gate statistics),
      DIR/skip_prior_by_phase.png (when a run has a gated π layer)

The model runs over `--batches` batches of `--split` (default: the validation split of the data it was
trained on, or `--data`), as `piattn eval` would score them; hooks on its attention layers
(`piattn.inspection`) average the share of attention probability on each key class, read from the
operator's own weights (`pi_attention_weights`, with the model's grouped-query heads, sinks and packed
documents). Key classes: "local" (the window i − k … i, … i + k) and "skip" (i ± π) for `pi`; everything
but the sinks is "local" for `local`; "sink" (the first `sinks` keys of each document) for models with
attention sinks; "all" for `dense` and the other kinds, whose keys are not split that way. Each layer's
shares sum to 1. For gated π layers the skip prior 1 − α is averaged by position modulo π (the paper's
gate figure (d)): "skip_prior_by_phase" per layer and skip_prior_by_phase.png.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..data.text import normalize_split
from ..inspection import Inspector, plot_gate_dynamics, plot_skip_prior_by_phase, plot_token_flow
from ..safe_files import Folder
from ..tasks import restore
from ..train import checkpoint as ckpt
from ..train.distributed import DEVICES, DistContext, setup, teardown
from ..train.loop import writable_folder
from ..train.metrics import METRICS_FILE, read_metrics
from .common import add_threads_argument, torch_threads

MODEL_FIELDS = ("attention", "layers", "nope_global", "n_layer", "n_head", "n_kv_head", "d_model", "window", "period",
                "variant", "sinks")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="a run directory (its latest checkpoint) or a checkpoint folder")
    p.add_argument("--out", required=True, help="folder for inspect.json, token_flow.png, gate_dynamics.png and "
                   "skip_prior_by_phase.png")
    p.add_argument("--compare", help="a second run (e.g. local beside π), inspected on the same flags and drawn "
                   "side by side")
    p.add_argument("--data", help="data to run the model on (default: the data each run was trained on)")
    p.add_argument("--split", default="validation", help="train, validation (default) or test")
    p.add_argument("--batches", type=int, default=4, help="batches to average over (0: the whole split; default 4)")
    p.add_argument("--batch-size", type=int, help="sequences per batch (default: the training micro batch)")
    p.add_argument("--position", type=int, help="query position of the token flow (default: the last position of "
                   "a causal model, the first of a cls-pooled encoder, else the middle)")
    p.add_argument("--flow-window", type=int, default=64, help="positions the token flow is computed on (default 64)")
    p.add_argument("--cache-dir", help="where tokenized corpora are cached (default: RUN/cache)")
    p.add_argument("--device", default="cpu", help=f"one of {list(DEVICES)} or cuda:N (default cpu)")
    add_threads_argument(p)


def inspect_checkpoint(checkpoint: str, args: argparse.Namespace, ctx: DistContext) -> tuple[dict, list[dict]]:
    """(the report of one checkpoint, the train records of its run's metrics.jsonl)."""
    folder = ckpt.resolve_checkpoint(checkpoint)
    config = ckpt.read_config(folder)
    task, model, cfg = restore(folder, ctx, data=args.data, batch_size=args.batch_size, cache_dir=args.cache_dir)
    model.eval()
    run_dir = ckpt.run_dir_of(folder)
    split = normalize_split(args.split)
    with Inspector(model, position=args.position, flow_window=args.flow_window) as inspector:
        metrics = task.evaluate(model, split, args.batches)
    report = {"checkpoint": str(folder), "step": config.get("step"), "task": config.get("task"),
              "model": {k: config["model"].get(k) for k in MODEL_FIELDS}, "data": cfg.data.data, "split": split,
              "metrics": metrics, **inspector.result()}
    records = read_metrics(run_dir) if (run_dir / METRICS_FILE).is_file() else []
    return report, records


def run(args: argparse.Namespace) -> int:
    with torch_threads(args.threads, args.device):
        return inspect(args)


def inspect(args: argparse.Namespace) -> int:
    if args.batches < 0:
        raise ValueError(f"--batches must be >= 0 (0: the whole split), got {args.batches}")
    if args.batch_size is not None and args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.flow_window < 1:
        raise ValueError(f"--flow-window must be >= 1, got {args.flow_window}")
    out = writable_folder(Path(args.out), "--out")
    ctx = setup(args.device)
    if ctx.distributed:
        teardown(ctx)
        raise ValueError("piattn inspect runs in one process; start it without torchrun")
    try:
        report, records = inspect_checkpoint(args.checkpoint, args, ctx)
        runs = [("run", report, records)]
        if args.compare:
            other, other_records = inspect_checkpoint(args.compare, args, ctx)
            runs.append(("compare", other, other_records))
    finally:
        teardown(ctx)
    labels = [Path(r["checkpoint"]).parent.parent.name or name for name, r, _ in runs]
    if len(set(labels)) < len(labels):
        labels = [name for name, _, _ in runs]
    # --out is the user's to name (it may be a link); what is written in it goes through the folder opened
    # once, each file replaced atomically (a link planted at a file's name is replaced, never written through).
    with Folder.open(out, create=True, follow_links=True) as folder:
        named = [(label, r, rec) for label, (_, r, rec) in zip(labels, runs, strict=True)]
        try:
            flow_png = plot_token_flow([(label, r) for label, r, _ in named], folder.local("token_flow.png"))
            gate_png = plot_gate_dynamics([(label, rec) for label, _, rec in named], folder.local("gate_dynamics.png"))
            phase_png = plot_skip_prior_by_phase([(label, r) for label, r, _ in named],
                                                 folder.local("skip_prior_by_phase.png"))
        except ImportError as e:
            print(f"piattn inspect: no figures: {e}", file=sys.stderr)
            flow_png = gate_png = phase_png = None
        report["figures"] = {"token_flow": flow_png and flow_png.name, "gate_dynamics": gate_png and gate_png.name,
                             "skip_prior_by_phase": phase_png and phase_png.name}
        if gate_png is None:
            report["figures"]["gate_dynamics_note"] = "no run logged gate statistics (alpha/… keys in metrics.jsonl)"
        if args.compare:
            report["compare"] = runs[1][1]
        folder.write_text("inspect.json", json.dumps(report, indent=1) + "\n")
    for label, (_, r, _) in zip(labels, runs, strict=True):
        shares = "; ".join(f"layer {e['layer']}: " + ", ".join(f"{c} {v:.1%}" for c, v in e["mass"].items())
                           + (f", α {e['alpha_mean']:.3f}" if "alpha_mean" in e else "") for e in r["layers"])
        print(f"{label} ({r['model'].get('layers') or r['model']['attention']}, {r['tokens']:,} tokens): {shares}")
    written = ["inspect.json", *(p.name for p in (flow_png, gate_png, phase_png) if p is not None)]
    print(f"written to {out}: {', '.join(written)}", file=sys.stderr)
    return 0
