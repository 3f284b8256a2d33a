"""What per-head periods (multi-scale π) cost: `pi_attention` with one period against the same call with a
period per head, on the "fused" CPU backend (C kernels, per-head periods inside one call) and on "torch";
fwd+bwd and forward alone; fp32, B 1, H 8, T 8192, D 64, window 4, adaptive.

"fused" declares `per_head_periods`: `pi_attention` hands it every head's period in one call. "torch" runs
once per distinct period on that period's heads (`piattn.ops.pi.heads.by_period`). The cases: one period
(16, the int call), eight equal periods (the same call, through the sequence path), two groups of four heads
(16 and 64), four periods twice (16, 32, 64, 128, 16, …), eight distinct periods (8, 16, …, 64) and the
designer's first layer (`piattn.analysis.multiscale.design_periods` with window 4, 8 heads: 5, 6, …, 12).
Runs of every case are interleaved in one process, alternating, so that load on a shared machine hits each
alike; medians are reported, with the ratio to one period on the same backend and pass, in wall time and in
process CPU time (with one thread, CPU time leaves out the waits for a core of a shared machine). Peak
memory (fwd+bwd): on CUDA, torch's peak allocation of one step; on a CPU, the peak resident-memory growth of
one step in a fresh process per case (Linux VmHWM, reset before it). OMP_WAIT_POLICY is set to passive
(unless set), so that idle OpenMP threads do not spin on a shared machine, and the timing process runs
with glibc keeping freed memory for reuse (`--fresh-pages` leaves it mapping each step's tensors afresh).

    OMP_WAIT_POLICY=passive PYTHONPATH=src python benchmarks/head_periods_bench.py --threads 1 \
        --out benchmarks/results/head_periods
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

os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # before torch and the fused kernels start OpenMP

import torch  # noqa: E402

import piattn  # noqa: E402
from piattn.allocator import keep_freed_pages  # noqa: E402
from piattn.benchmarking import command_line, machine_info, reset_peak_rss, rss_kib, save_results  # noqa: E402

SHAPE = dict(B=1, H=8, T=8192, D=64)
WINDOW = 4
PERIODS = {
    "one period 16": 16,
    "8 x 16 (equal)": [16] * 8,
    "two groups 16 / 64": [16] * 4 + [64] * 4,
    "16 / 32 / 64 / 128 x 2": [16, 32, 64, 128] * 2,
    "8 distinct 8 ... 64": [8 * (h + 1) for h in range(8)],
    "designer 5 ... 12": list(range(5, 13)),
}
BACKENDS = ("fused", "torch")
MODES = ("fwd+bwd", "fwd")
BASE = "one period 16"


def _step(period, device: str, backend: str = "torch", mode: str = "fwd+bwd"):
    """One forward (+ backward) of the case, fresh inputs made once (seeded)."""
    g = torch.Generator().manual_seed(0)
    B, H, T, D = SHAPE.values()
    q, k, v = (torch.randn(B, H, T, D, generator=g).to(device).requires_grad_() for _ in range(3))
    gate = (0.05 + 0.9 * torch.rand(B, H, T, generator=g)).to(device).requires_grad_()
    dy = torch.randn(B, H, T, D, generator=g).to(device)

    def step():
        if mode == "fwd":
            with torch.no_grad():
                piattn.pi_attention(q, k, v, gate, window=WINDOW, period=period, backend=backend)
        else:
            piattn.pi_attention(q, k, v, gate, window=WINDOW, period=period, backend=backend).backward(dy)
            for t in (q, k, v, gate):
                t.grad = None
        if device == "cuda":
            torch.cuda.synchronize()

    return step


def peak_mib(case: str, device: str, backend: str = "torch") -> float:
    """Peak memory growth (MiB) of one fwd+bwd step after a warm-up step; on a CPU run in a fresh process."""
    step = _step(PERIODS[case], device, backend)
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


def peak_isolated(case: str, device: str, backend: str, threads: int) -> float:
    if device == "cuda":
        return peak_mib(case, device, backend)
    # A fixed mmap threshold: every large tensor is mapped afresh and unmapped when freed, so the resident set
    # follows the live tensors (as in features_bench.py).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    proc = subprocess.run([sys.executable, __file__, "--threads", str(threads), "--peak",
                           json.dumps([case, device, backend])], capture_output=True, text=True, env=env, check=True)
    return float(proc.stdout.strip().splitlines()[-1])


def available_backends(device: str) -> tuple[str, ...]:
    """The backends timed: "fused" only on a CPU with its compiled kernels (else it refuses every call)."""
    if device != "cpu":
        return ("torch",)
    from piattn.ops.pi import fused

    return BACKENDS if fused.unavailable() is None else ("torch",)


def run(repeats: int, device: str, backends: tuple[str, ...], peaks: bool) -> list[dict]:
    keys = [(backend, mode, case) for backend in backends for mode in MODES for case in PERIODS]
    steps = {key: _step(PERIODS[key[2]], device, key[0], key[1]) for key in keys}
    times = {key: ([], []) for key in keys}
    for step in steps.values():  # warm-up (and the fused kernels' build)
        step()
    for r in range(repeats):
        for key in keys if r % 2 == 0 else keys[::-1]:  # alternating order: no case always runs first
            w0, c0 = time.perf_counter(), time.process_time()
            steps[key]()
            times[key][0].append((time.perf_counter() - w0) * 1e3)
            times[key][1].append((time.process_time() - c0) * 1e3)
    threads = torch.get_num_threads()
    peak = {(backend, case): peak_isolated(case, device, backend, threads) if peaks else float("nan")
            for backend in backends for case in PERIODS}
    rows = []
    for (backend, mode, case), (wall, cpu) in times.items():
        base_wall, base_cpu = (statistics.median(t) for t in times[backend, mode, BASE])
        row = dict(backend=backend, mode=mode, case=case, period=PERIODS[case], ms=statistics.median(wall),
                   ms_min=min(wall), ratio=statistics.median(wall) / base_wall,
                   ratio_min=min(wall) / min(times[backend, mode, BASE][0]), cpu_ms=statistics.median(cpu),
                   cpu_ratio=statistics.median(cpu) / base_cpu, repeats=repeats)
        if mode == "fwd+bwd":
            row.update(peak_mib=peak[backend, case], peak_ratio=peak[backend, case] / peak[backend, BASE])
        rows.append(row)
    return rows


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"# Per-head periods: what they cost against one period ({result['device']})", "",
             f"`{result['command']}`", "",
             f"{m['processor']}, {result['device_name']}, torch {m['torch']}, piattn {m['piattn']}, python "
             f"{m['python']}, {result['threads']} threads, OMP_WAIT_POLICY={result['omp_wait_policy']}, "
             f"{', '.join(f'{k}={v}' for k, v in result['malloc'].items())}; "
             f"B {SHAPE['B']}, H {SHAPE['H']}, T {SHAPE['T']}, D {SHAPE['D']}, fp32, window {WINDOW}, adaptive; "
             f"median of {result['repeats']} interleaved runs (alternating order); load average before / after "
             f"{result['load_before']} / {result['load_after']}. {result.get('note', '')}", "",
             "× one period: the ratio to the one-period call on the same backend and pass, measured side by side. "
             "\"fused\" runs per-head periods in one call; \"torch\" once per distinct period. The minimum is the "
             "run least disturbed by the machine's other work. Each step allocates its outputs and gradients anew; "
             "unless --fresh-pages, glibc keeps freed memory for the next step "
             "(`piattn.allocator.keep_freed_pages`), since how many pages of fresh mappings fault varies from "
             "step to step (4,000 to 16,000 minor faults per \"fused\" "
             "fwd+bwd step when checked without) and would dominate the spread.", ""]
    for backend in result["backends"]:
        for mode in MODES:
            rows = [r for r in result["rows"] if r["backend"] == backend and r["mode"] == mode]
            peak = mode == "fwd+bwd"
            lines += [f"## {backend}, {mode}", "",
                      "| case | wall ms (median) | × one period | wall ms (min) | × one period (min) | CPU ms (median) "
                      "| × one period |" + (" peak MiB | × one period |" if peak else ""),
                      "|---|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if peak else "")]
            for r in rows:
                lines.append(f"| {r['case']} | {r['ms']:.1f} | {r['ratio']:.2f} | {r['ms_min']:.1f} | "
                             f"{r['ratio_min']:.2f} | {r['cpu_ms']:.1f} | {r['cpu_ratio']:.2f} |"
                             + (f" {r['peak_mib']:.0f} | {r['peak_ratio']:.2f} |" if peak else ""))
            lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/head_periods"))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    parser.add_argument("--no-peak", action="store_true", help="skip the peak-memory child processes")
    parser.add_argument("--fresh-pages", action="store_true",
                        help="leave glibc's malloc as it is (each step's tensors mapped afresh, page faults timed)")
    parser.add_argument("--note", default="", help="a sentence added to the report (e.g. what else ran)")
    parser.add_argument("--peak", help=argparse.SUPPRESS)  # the child process measuring one case's peak
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.peak:
        print(peak_mib(*json.loads(args.peak)))
        return
    if not args.fresh_pages:
        # glibc keeps freed tensors (16 MiB each here) in its heap for the next step instead of mapping them
        # afresh: a varying number of first-touch page faults per step otherwise dominates the spread of the
        # fused steps. The same for every case; the peak-memory children set their own.
        keep_freed_pages()
    load_before = [round(x, 1) for x in os.getloadavg()]
    backends = available_backends(args.device)
    rows = run(args.repeats, args.device, backends, not args.no_peak)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    result = dict(machine=machine_info(), device=args.device, device_name=name, threads=torch.get_num_threads(),
                  omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
                  malloc={"keep_freed_pages": not args.fresh_pages},
                  command=f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']} "
                          + command_line("benchmarks/head_periods_bench.py", None, from_source=True),
                  repeats=args.repeats, load_before=load_before, note=args.note, backends=list(backends),
                  load_after=[round(x, 1) for x in os.getloadavg()], shape=SHAPE, window=WINDOW, rows=rows)
    save_results(args.out, "head_periods", result, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
