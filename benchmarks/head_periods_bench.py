"""What per-head periods (multi-scale π) cost: fwd+bwd of `pi_attention` with one period against the same
call with a period per head, "torch" backend, fp32, B 1, H 8, T 8192, D 64, window 4, adaptive.

Per-head periods run the backend once per distinct period on that period's heads (`piattn.ops.pi.heads`),
so the cases are: one period (16, the int call), eight equal periods (the same call, through the sequence
path), two groups of four heads (16 and 64), and eight distinct periods (8, 16, …, 64). Runs of the cases
are interleaved in one process so that load on a shared machine hits each alike; medians are reported, with
the ratio to one period, in wall time and in process CPU time (with one thread, CPU time leaves out the
waits for a core of a shared machine). Peak memory: on CUDA, torch's peak allocation of one step; on a CPU, the peak
resident-memory growth of one step in a fresh process per case (Linux VmHWM, reset before it).

    PYTHONPATH=src python benchmarks/head_periods_bench.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import piattn
from piattn.benchmarking import command_line, machine_info, reset_peak_rss, rss_kib, save_results

SHAPE = dict(B=1, H=8, T=8192, D=64)
WINDOW = 4
CASES = {
    "one period 16": 16,
    "8 x 16 (equal)": [16] * 8,
    "two groups 16 / 64": [16] * 4 + [64] * 4,
    "8 distinct 8 ... 64": [8 * (h + 1) for h in range(8)],
}


def _step(period, device: str):
    """One forward + backward of the case, fresh inputs made once (seeded)."""
    g = torch.Generator().manual_seed(0)
    B, H, T, D = SHAPE.values()
    q, k, v = (torch.randn(B, H, T, D, generator=g).to(device).requires_grad_() for _ in range(3))
    gate = (0.05 + 0.9 * torch.rand(B, H, T, generator=g)).to(device).requires_grad_()
    dy = torch.randn(B, H, T, D, generator=g).to(device)

    def step():
        piattn.pi_attention(q, k, v, gate, window=WINDOW, period=period, backend="torch").backward(dy)
        for t in (q, k, v, gate):
            t.grad = None
        if device == "cuda":
            torch.cuda.synchronize()

    return step


def peak_mib(case: str, device: str) -> float:
    """Peak memory growth (MiB) of one step after a warm-up step; on a CPU run in a fresh process."""
    step = _step(CASES[case], device)
    step()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    reset_peak_rss()
    before = rss_kib("VmRSS")
    step()
    return (rss_kib("VmHWM") - before) / 1024


def peak_isolated(case: str, device: str) -> float:
    if device == "cuda":
        return peak_mib(case, device)
    # A fixed mmap threshold: every large tensor is mapped afresh and unmapped when freed, so the resident set
    # follows the live tensors (as in features_bench.py).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    proc = subprocess.run([sys.executable, __file__, "--peak", json.dumps([case, device])], capture_output=True,
                          text=True, env=env, check=True)
    return float(proc.stdout.strip().splitlines()[-1])


def run(repeats: int, device: str) -> list[dict]:
    steps = {case: _step(period, device) for case, period in CASES.items()}
    times = {case: ([], []) for case in steps}
    for step in steps.values():  # warm-up
        step()
    for _ in range(repeats):
        for case, step in steps.items():
            w0, c0 = time.perf_counter(), time.process_time()
            step()
            times[case][0].append((time.perf_counter() - w0) * 1e3)
            times[case][1].append((time.process_time() - c0) * 1e3)
    base_wall, base_cpu = (statistics.median(t) for t in times["one period 16"])
    peaks = {case: peak_isolated(case, device) for case in CASES}
    return [dict(case=case, period=CASES[case], ms=statistics.median(wall), ms_min=min(wall),
                 ratio=statistics.median(wall) / base_wall, cpu_ms=statistics.median(cpu),
                 cpu_ratio=statistics.median(cpu) / base_cpu, peak_mib=peaks[case],
                 peak_ratio=peaks[case] / peaks["one period 16"], repeats=repeats)
            for case, (wall, cpu) in times.items()]


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"# Per-head periods: fwd+bwd cost ({result['device']})", "",
             f"`{result['command']}`", "",
             f"{m['processor']}, {result['device_name']}, torch {m['torch']}, piattn {m['piattn']}, python "
             f"{m['python']}, {result['threads']} threads; B {SHAPE['B']}, H {SHAPE['H']}, T {SHAPE['T']}, "
             f"D {SHAPE['D']}, fp32, window {WINDOW}, adaptive, backend torch; median of {result['repeats']} "
             f"interleaved runs; load average before / after {result['load_before']} / {result['load_after']}.", "",
             "| case | wall ms (median) | wall ms (min) | × one period | CPU ms (median) | × one period | "
             "peak MiB | × one period |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['case']} | {r['ms']:.1f} | {r['ms_min']:.1f} | {r['ratio']:.2f} | {r['cpu_ms']:.1f} | "
                     f"{r['cpu_ratio']:.2f} | {r['peak_mib']:.0f} | {r['peak_ratio']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    parser.add_argument("--peak", help=argparse.SUPPRESS)  # the child process measuring one case's peak
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.peak:
        print(peak_mib(*json.loads(args.peak)))
        return
    load_before = [round(x, 1) for x in os.getloadavg()]
    rows = run(args.repeats, args.device)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    result = dict(machine=machine_info(), device=args.device, device_name=name, threads=torch.get_num_threads(),
                  command=command_line("benchmarks/head_periods_bench.py", None, from_source=True),
                  repeats=args.repeats, load_before=load_before,
                  load_after=[round(x, 1) for x in os.getloadavg()], shape=SHAPE, window=WINDOW, rows=rows)
    save_results(args.out, "head_periods", result, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
