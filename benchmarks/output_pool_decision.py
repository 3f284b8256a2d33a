"""The output pool's worth in a user's loop: the fused backend with `piattn.output_pool` on and off, call after
call in one process (one thread, fp32, B 1, H 8, D 64, adaptive, causal).

Two loops, each as a user writes it: through `piattn.pi_attention` with autograd and fresh gradients each step,
(a) the cotangent allocated in the loop (a new tensor written once, as an upstream layer's gradient is), and
(b) the cotangent preallocated once (what `cpu_bench.py`'s "fused" rows did). Medians of interleaved repeats.

    OMP_WAIT_POLICY=passive python benchmarks/output_pool_decision.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import piattn
from piattn import output_pool
from piattn.benchmarking import machine_info, save_results


def step(q, k, v, gate, dy_once: torch.Tensor | None) -> float:
    for t in (q, k, v, gate):
        t.grad = None
    start = time.perf_counter()
    y = piattn.pi_attention(q, k, v, gate, window=4, period=16, backend="fused")
    dy = dy_once if dy_once is not None else torch.empty_like(y).copy_(q.detach())
    y.backward(dy)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for T in args.lengths:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 8, T, 64, generator=g).requires_grad_() for _ in range(3))
        gate = (0.05 + 0.9 * torch.rand(1, 8, T, generator=g)).requires_grad_()
        dy_once = torch.randn(1, 8, T, 64, generator=g)
        times = {(pool, loop): [] for pool in (True, False) for loop in ("cotangent in loop", "cotangent once")}
        for _ in range(2):  # warm-up
            for pool, loop in times:
                output_pool.reuse_outputs(pool)
                step(q, k, v, gate, dy_once if loop == "cotangent once" else None)
        for r in range(args.repeats):
            for pool, loop in times:
                output_pool.reuse_outputs(pool)
                times[pool, loop].append(step(q, k, v, gate, dy_once if loop == "cotangent once" else None))
            print(f"T={T} repeat {r + 1}/{args.repeats}", file=sys.stderr)
        for (pool, loop), ms in times.items():
            rows.append(dict(T=T, pool=pool, loop=loop, ms=statistics.median(ms), ms_all=ms))
    result = dict(rows=rows, machine=machine_info(), load=os.getloadavg()[0], command=" ".join(sys.argv),
                  repeats=args.repeats)
    lines = ["# The output pool in a user's loop (fused backend, fwd+bwd through pi_attention)", "",
             f"One thread, fp32, B 1, H 8, D 64, window 4, period 16, adaptive, causal; medians of {args.repeats} "
             f"interleaved repeats in one process. torch {result['machine']['torch']}; load average "
             f"{result['load']:.2f} (other processes shared the 2 cores). Command: `{result['command']}`", "",
             "| T | loop | pool on ms | pool off ms | off / on |", "|---:|---|---:|---:|---:|"]
    for T in args.lengths:
        for loop in ("cotangent in loop", "cotangent once"):
            on, off = (next(r["ms"] for r in rows if r["T"] == T and r["loop"] == loop and r["pool"] == p)
                       for p in (True, False))
            lines.append(f"| {T} | {loop} | {on:.1f} | {off:.1f} | {off / on:.2f} |")
    save_results(Path(args.out), "output_pool_decision", result, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
