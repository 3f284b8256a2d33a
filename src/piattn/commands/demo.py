"""`piattn demo`: the main job on built-in data.

1. The reachability analysis of the paper's default setting (n=48, k=4, π=16, L=6): table and figure.
2. What the long-range key buys: tiny causal `local` and `pi` models trained on the generated reach task
   (the answer sits exactly `lag` tokens back) at lags on both sides of what each can reach, beside the
   analysis's prediction; table and figure.
3. A quick measured comparison of the operator's backends on this machine: correctness against the
   reference first, then fwd+bwd time and peak memory growth, each case in a fresh process.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

import torch

from ..analysis.report import format_summary, plot_receptive_field, reach_summary
from ..benchmarking import CHECK_TOLERANCE, error_vs_reference, machine_info, measure_isolated
from ..config import TrainConfig
from ..data.reach import reachable
from ..ops.pi import BACKENDS
from ..ops.pi.backends import REGISTRY
from ..safe_files import save_figure
from ..tasks import config_class
from ..tasks.reach_setting import REACH
from .common import child_threads, torch_threads
from .train import train_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("runs/demo"), help="folder for the figures and runs")
    p.add_argument("--lags", type=int, nargs="+", default=[3, 4, 5, 8], help="reach-task lags to train at")
    p.add_argument("--reach-steps", type=int, default=300, help="training steps per reach-task run")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096], help="sequence lengths to time")
    p.add_argument("--backends", nargs="+", default=["reference", "torch", "fused", "sdpa"],
                   choices=[b for b in BACKENDS if b != "auto"] + ["sdpa"],
                   help="cases to time (pi_attention backends, or sdpa = dense causal attention)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch CPU threads of the reach-task runs and of the timed backend cases (default 1: as "
                        "training runs, and so that no case's threads fight each other on a busy machine)")


def run(args: argparse.Namespace) -> int:
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    print("== 1. Reachability (paper Fig. rf_app: n=48, k=4, π=16, L=6, causal)")
    print(format_summary(reach_summary(48, 4, 16, 6)))
    path = plot_receptive_field(48, 4, 16, 6, args.out / "receptive_field.png")
    print(f"figure: {path}\n")

    print(f"== 2. What the long-range key buys: reach task, causal, window {REACH['window']}, "
          f"{REACH['layers']} layers, π = {REACH['period']}, {REACH['vocab']} symbols (chance "
          f"{1 / REACH['vocab']:.2f}), {args.reach_steps} steps per run")
    results = reach_runs(args)
    print(reach_table(results))
    print(f"figure: {plot_reach(results, args.out / 'reach_accuracy.png')}\n")

    info = machine_info()
    print(f"== 3. Backends on this machine ({info['processor']}, {info['cpu_count']} threads, "
          f"torch {info['torch']}): B=1 H=8 D=64 fp32, window=4 period=16, adaptive, fwd+bwd; timed with "
          f"{args.threads or 1} thread(s) each, load average {os.getloadavg()[0]:.1f} (other work on the machine slows "
          f"every row alike)")
    cases = []
    for case in args.backends:
        if case in ("reference", "sdpa"):
            cases.append(case)
            continue
        refused = REGISTRY[case].refusal(device="cpu", dtype=torch.float64, head_dim=32, needs_grad=True,
                                         dropout_p=0.0)
        if refused is not None:  # e.g. "fused" on a machine without a C compiler: said, not timed
            print(f"{case}: not run here: {refused}")
            continue
        err = error_vs_reference(case)
        status = "ok" if err <= CHECK_TOLERANCE else "FAILED: not timed"
        print(f"check {case} vs reference (fp64, fwd + all grads): max abs diff {err:.1e} [{status}]")
        if err <= CHECK_TOLERANCE:
            cases.append(case)
    rows = []
    with child_threads(args.threads or 1):
        for T in args.lengths:
            for case in cases:
                print(f"  timing {case:9s} T={T:6d} …", end="", flush=True)
                r = measure_isolated(case, B=1, H=8, T=T, D=64, mode="fwd+bwd", repeats=3)
                print(f" {r['ms']:9.1f} ms" if "error" not in r else f" error: {r['error']}", flush=True)
                rows.append(r)
    print()
    print(_table(rows))
    return 0


def reach_config(attention: str, lag: int, steps: int, out: Path) -> TrainConfig:
    """The `piattn train --task reach` run of one demo cell."""
    return config_class().from_flat(dict(
        attention=attention, window=REACH["window"], n_layer=REACH["layers"], d_model=64, n_head=2,
        period=REACH["period"] if attention == "pi" else None, dropout=0.0,
        seq_len=REACH["seq_len"],
        task="reach", lag=lag, reach_vocab=REACH["vocab"],
        batch_size=32, steps=steps, lr=3e-3, min_lr=3e-4, warmup=20, weight_decay=0.0, seed=0,
        out=str(out), eval_every=steps, eval_batches=0, save_every=0, device="cpu", progress=False))


def reach_runs(args: argparse.Namespace) -> list[dict]:
    """Train `local` and `pi` at each lag through `piattn train --task reach`; validation accuracy of each."""
    results = []
    with torch_threads(args.threads, "cpu"):  # default 1: tiny models, see --threads
        for lag in args.lags:
            for attention in ("local", "pi"):
                start = time.perf_counter()
                out = args.out / "reach" / f"{attention}-lag{lag}"
                shutil.rmtree(out, ignore_errors=True)  # the demo's own run of an earlier demo
                accuracy = train_config(reach_config(attention, lag, args.reach_steps, out))["validation"]["accuracy"]
                period = REACH["period"] if attention == "pi" else None
                results.append(dict(lag=lag, attention=attention, accuracy=accuracy,
                                    seconds=time.perf_counter() - start,
                                    reachable=reachable(lag, REACH["window"], period, REACH["layers"])))
                print(f"  {attention:5s} lag {lag:2d}: accuracy {accuracy:.3f} "
                      f"({results[-1]['seconds']:.0f} s)", flush=True)
    return results


def reach_table(results: list[dict]) -> str:
    by = {(r["attention"], r["lag"]): r for r in results}
    lines = ["| lag | local: reachable | local accuracy | π: reachable | π accuracy |", "|---:|:---:|---:|:---:|---:|"]
    for lag in sorted({r["lag"] for r in results}):
        loc, pi = by[("local", lag)], by[("pi", lag)]
        lines.append(f"| {lag} | {'yes' if loc['reachable'] else 'no'} | {loc['accuracy']:.3f} | "
                     f"{'yes' if pi['reachable'] else 'no'} | {pi['accuracy']:.3f} |")
    return "\n".join(lines)


def plot_reach(results: list[dict], path: Path) -> Path:
    """Accuracy against lag per attention kind; hollow markers where the analysis says unreachable."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for attention, colour in (("local", "tab:blue"), ("pi", "tab:orange")):
        rows = sorted((r for r in results if r["attention"] == attention), key=lambda r: r["lag"])
        ax.plot([r["lag"] for r in rows], [r["accuracy"] for r in rows], color=colour, label=attention)
        for r in rows:
            ax.scatter(r["lag"], r["accuracy"], s=50, color=colour,
                       facecolors=colour if r["reachable"] else "none", zorder=3)
    ax.axhline(1 / REACH["vocab"], color="grey", ls=":", label="chance")
    ax.set_xlabel("lag d (tokens between answer and query)")
    ax.set_ylabel("validation accuracy")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"Reach task, window {REACH['window']}, {REACH['layers']} layers, π = {REACH['period']} "
                 "(hollow: unreachable)", fontsize=9)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return path


def _table(rows: list[dict]) -> str:
    ref = {r["T"]: r for r in rows if r["case"] == "reference" and "error" not in r}
    lines = ["| case | T | fwd+bwd ms | peak MiB | speed-up vs reference | memory vs reference |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['T']} | error | | | |")
            continue
        base = ref.get(r["T"])
        speed = f"{base['ms'] / r['ms']:.1f}×" if base else "–"
        mem = (f"{r['peak_mib'] / base['peak_mib']:.2f}" if base and r["peak_mib"] and base["peak_mib"]
               else "–")
        peak = f"{r['peak_mib']:.0f}" if r["peak_mib"] is not None else "n/a"
        lines.append(f"| {r['case']} | {r['T']} | {r['ms']:.1f} | {peak} | {speed} | {mem} |")
    return "\n".join(lines)
