"""`piattn demo`: the main job on built-in data.

1. The reachability analysis of the paper's default setting (n=48, k=4, π=16, L=6): table and figure.
2. A quick measured comparison of the operator's backends on this machine: correctness against the
   reference first, then fwd+bwd time and peak memory growth, each case in a fresh process.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import piattn
from piattn.analysis.report import format_summary, plot_receptive_field, reach_summary
from piattn.benchmarking import CHECK_TOLERANCE, error_vs_reference, machine_info, measure_isolated


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("runs/demo"), help="folder for the figure")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096], help="sequence lengths to time")
    p.add_argument("--backends", nargs="+", default=["reference", "torch", "sdpa"],
                   choices=[b for b in piattn.BACKENDS if b != "auto"] + ["sdpa"],
                   help="cases to time (pi_attention backends, or sdpa = dense causal attention)")


def run(args: argparse.Namespace) -> int:
    print("== 1. Reachability (paper Fig. rf_app: n=48, k=4, π=16, L=6, causal)")
    print(format_summary(reach_summary(48, 4, 16, 6)))
    path = plot_receptive_field(48, 4, 16, 6, args.out / "receptive_field.png")
    print(f"figure: {path}\n")

    info = machine_info()
    print(f"== 2. Backends on this machine ({info['processor']}, {info['cpu_count']} threads, "
          f"torch {info['torch']}): B=1 H=8 D=64 fp32, window=4 period=16, adaptive, fwd+bwd")
    cases = []
    for case in args.backends:
        if case in ("reference", "sdpa"):
            cases.append(case)
            continue
        err = error_vs_reference(case)
        status = "ok" if err <= CHECK_TOLERANCE else "FAILED: not timed"
        print(f"check {case} vs reference (fp64, fwd + all grads): max abs diff {err:.1e} [{status}]")
        if err <= CHECK_TOLERANCE:
            cases.append(case)
    rows = []
    for T in args.lengths:
        for case in cases:
            print(f"  timing {case:9s} T={T:6d} …", end="", flush=True)
            r = measure_isolated(case, B=1, H=8, T=T, D=64, mode="fwd+bwd", repeats=3)
            print(f" {r['ms']:9.1f} ms" if "error" not in r else f" error: {r['error']}", flush=True)
            rows.append(r)
    print()
    print(_table(rows))
    return 0


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
