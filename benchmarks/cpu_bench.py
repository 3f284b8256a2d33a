"""CPU benchmark of the π-Attention backends against the paper's offset loop and dense SDPA.

Every case runs in a fresh process (`piattn.benchmarking.measure_isolated`): median time over repeats and
peak resident-memory growth of the first call. Ratios are taken between cases of the same run. A backend
whose forward or gradients differ from the reference is reported as failed and not timed.

    python benchmarks/cpu_bench.py --out benchmarks/results            # T = 1K … 32K, ~10 min on 2 cores
    python benchmarks/cpu_bench.py --lengths 1024 2048 --out /tmp/b    # quick
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from piattn.benchmarking import CHECK_TOLERANCE, error_vs_reference, machine_info, measure_isolated, save_results

SHAPE = dict(B=1, H=8, D=64)


def slope(rows: list[dict], case: str, mode: str, key: str) -> float | None:
    """Least-squares slope of log(key) against log(T): 1.0 means linear in T."""
    pts = [(math.log(r["T"]), math.log(r[key])) for r in rows
           if r["case"] == case and r["mode"] == mode and r.get(key)]
    if len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


def markdown(result: dict) -> str:
    rows = result["rows"]
    out = [f"# CPU benchmark: π-Attention backends ({result['machine']['processor']}, "
           f"{result['machine']['cpu_count']} threads, torch {result['machine']['torch']})", "",
           f"B={SHAPE['B']} H={SHAPE['H']} D={SHAPE['D']} fp32, window=4, period=16, adaptive, causal. "
           "Median of the repeats, each case in a fresh process; peak = resident-memory growth of the "
           "first call (inputs excluded, outputs and gradients included).", "",
           f"Command: `{result['command']}`", ""]
    for mode in ("fwd", "fwd+bwd"):
        out += [f"## {mode}", "", "| T | case | ms | peak MiB | speed-up vs reference | memory vs reference |",
                "|---:|---|---:|---:|---:|---:|"]
        for T in result["lengths"]:
            base = next((r for r in rows if r["T"] == T and r["mode"] == mode and r["case"] == "reference"
                         and "ms" in r), None)
            for r in rows:
                if r["T"] != T or r["mode"] != mode:
                    continue
                if "ms" not in r:
                    out.append(f"| {T} | {r['case']} | {r.get('error', 'skipped')} | | | |")
                    continue
                speed = f"{base['ms'] / r['ms']:.1f}×" if base else "–"
                mem = f"{r['peak_mib'] / base['peak_mib']:.2f}" if base and r["peak_mib"] else "–"
                out.append(f"| {T} | {r['case']} | {r['ms']:.1f} | {r['peak_mib']:.0f} | {speed} | {mem} |")
        out.append("")
    out += ["## Growth with T (log-log slope over the measured lengths; 1.0 = linear, 2.0 = quadratic)", "",
            "| case | mode | time slope | memory slope |", "|---|---|---:|---:|"]
    for s in result["slopes"]:
        fmt = lambda x: "–" if x is None else f"{x:.2f}"  # noqa: E731
        out.append(f"| {s['case']} | {s['mode']} | {fmt(s['time'])} | {fmt(s['memory'])} |")
    checks = ", ".join(f"{b}: {e:.1e}" for b, e in result["checks"].items())
    out += ["", f"Correctness before timing (max abs diff to reference, fp64, fwd + all grads): {checks}."]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    p.add_argument("--cases", nargs="+", default=["reference", "torch", "sdpa"])
    p.add_argument("--sdpa-max", type=int, default=16384, help="longest T for dense SDPA (it is quadratic)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)

    checks = {b: error_vs_reference(b) for b in args.cases if b not in ("reference", "sdpa")}
    cases = [c for c in args.cases if checks.get(c, 0.0) <= CHECK_TOLERANCE]
    rows = []
    t_start = time.time()
    for T in args.lengths:
        for mode in ("fwd", "fwd+bwd"):
            for case in cases:
                if case == "sdpa" and args.sdpa_max < T:
                    rows.append(dict(case=case, mode=mode, T=T, error=f"skipped (T > --sdpa-max {args.sdpa_max})"))
                    continue
                r = measure_isolated(case, **SHAPE, T=T, mode=mode, repeats=args.repeats)
                rows.append(r)
                shown = f"{r['ms']:9.1f} ms  peak {r['peak_mib']:7.0f} MiB" if "ms" in r else r["error"]
                print(f"[{time.time() - t_start:6.0f}s] T={T:6d} {mode:8s} {case:9s} {shown}", flush=True)
    for case, err in checks.items():
        if err > CHECK_TOLERANCE:
            rows.append(dict(case=case, mode="all", T=0, error=f"failed correctness check ({err:.1e}); not timed"))
    result = dict(machine=machine_info(), shape=SHAPE, lengths=args.lengths, checks=checks, rows=rows,
                  command="python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
                  slopes=[dict(case=c, mode=m, time=slope(rows, c, m, "ms"), memory=slope(rows, c, m, "peak_mib"))
                          for c in cases for m in ("fwd", "fwd+bwd")])
    table = markdown(result)
    save_results(args.out, "cpu_bench", result, table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
