"""CPU benchmark of the "torch" backend's grouped-query attention and of what sinks and documents cost.

Two tables:

1. GQA: H = 9 query heads on H_kv = 3 key/value heads, native (the operator reads each key head for its
   3 query heads) against repeat-then-attend (k and v repeated to 9 heads with repeat_interleave, then the
   operator with H_kv = H; the repeat's backward sums the gradients back). Forward + backward time (runs of
   the two interleaved) and the peak resident-memory growth of one step in a fresh process per case (Linux
   VmHWM, reset before it).
2. The cost of the features when unused: the same call through the code before they existed (the
   backend module of commit `--base`, loaded from git) and through today's, with sinks=0 and no
   documents; then sinks=4, one document passed as document_ids, and sinks=4 with 8 documents. Runs are
   interleaved in one process so that load on a shared machine hits every case alike.

Every case reports wall time and the process's CPU time (`time.process_time`). On a machine shared with
other jobs, wall time mostly measures the waits for a core; with one thread, CPU time does not, which is
why the default also runs every case with one thread (with two, CPU time includes OpenMP's spin-waits).

    PYTHONPATH=src python benchmarks/features_bench.py --out benchmarks/results/features
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from piattn.benchmarking import command_line, machine_info, reset_peak_rss, rss_kib, save_results

THREADS = (2, 1)
BASE = "4084b3d"  # the last commit before the torch backend implemented sinks, GQA and documents
GQA_SHAPE = dict(B=1, H=9, H_kv=3, T=8192, D=64)
PATTERNS = ((256, 512), (4, 16))  # (window, period)
COST_SHAPE = dict(B=1, H=8, T=4096, D=64)
COST_PATTERNS = ((4, 16), (64, 256))


def _inputs(B, H, H_kv, T, D):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, T, D, generator=g)
    k, v = (torch.randn(B, H_kv, T, D, generator=g) for _ in range(2))
    gate = 0.05 + 0.9 * torch.rand(B, H, T, generator=g)
    dy = torch.randn(B, H, T, D, generator=g)
    return [t.requires_grad_() for t in (q, k, v, gate)], dy


def _timed(step, repeats: int) -> tuple[list[float], list[float]]:
    """Wall and CPU milliseconds of `repeats` calls of step()."""
    wall, cpu = [], []
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        step()
        wall.append((time.perf_counter() - w0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
    return wall, cpu


def _stats(wall: list[float], cpu: list[float]) -> dict:
    return dict(ms=statistics.median(wall), ms_min=min(wall), cpu_ms=statistics.median(cpu), cpu_ms_min=min(cpu))


def _gqa_step(mode: str, window: int, period: int, inputs):
    """One forward + backward on GQA_SHAPE: "native" (k, v with H_kv heads) or "repeat" (k, v repeated to H
    heads first, inside the step, so that the repeat and its backward are timed and counted)."""
    import piattn

    (q, k, v, gate), dy = inputs
    group = GQA_SHAPE["H"] // GQA_SHAPE["H_kv"]

    def step():
        kk, vv = (k, v) if mode == "native" else (k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))
        piattn.pi_attention(q, kk, vv, gate, window=window, period=period, backend="torch").backward(dy)
        for t in (q, k, v, gate):
            t.grad = None

    return step


def gqa_peak(mode: str, window: int, period: int) -> float:
    """Peak resident-memory growth (MiB) of one step in this (fresh) process, after a warm-up step (thread
    pools and allocator caches are not the case's memory)."""
    torch.set_num_threads(1)
    step = _gqa_step(mode, window, period, _inputs(**GQA_SHAPE))
    step()
    reset_peak_rss()
    before = rss_kib("VmRSS")
    step()
    return (rss_kib("VmHWM") - before) / 1024


def gqa_peak_isolated(mode: str, window: int, period: int) -> float | str:
    request = json.dumps(dict(mode=mode, window=window, period=period))
    # A fixed mmap threshold: glibc then maps every large tensor afresh and unmaps it when freed, so that
    # the resident set follows the live tensors instead of what the heap kept from earlier frees.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    proc = subprocess.run([sys.executable, __file__, "--gqa-peak", request], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return proc.stderr.strip().splitlines()[-1]
    return float(proc.stdout.strip().splitlines()[-1])


def gqa_table(repeats: int, threads: int) -> list[dict]:
    """Native vs repeat, runs interleaved in this process; peak memory from a fresh process per case."""
    torch.set_num_threads(threads)
    inputs = _inputs(**GQA_SHAPE)
    rows = []
    for window, period in PATTERNS:
        steps = {mode: _gqa_step(mode, window, period, inputs) for mode in ("native", "repeat")}
        times = {mode: ([], []) for mode in steps}
        for step in steps.values():
            step()
        for _ in range(repeats):  # interleaved: a burst of load on the shared machine hits both modes
            for mode, step in steps.items():
                wall, cpu = _timed(step, 1)
                times[mode][0].extend(wall)
                times[mode][1].extend(cpu)
        for mode, (wall, cpu) in times.items():
            peak = gqa_peak_isolated(mode, window, period)
            rows.append(dict(mode=mode, window=window, period=period, threads=threads, **GQA_SHAPE,
                             **_stats(wall, cpu), repeats=repeats,
                             **({"peak_mib": peak} if isinstance(peak, float) else {"error": peak})))
    return rows


def _base_backend(base: str):
    """The torch backend module as of commit `base`, imported inside piattn.ops.pi (its relative imports)."""
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(["git", "show", f"{base}:src/piattn/ops/pi/torch.py"], cwd=root, capture_output=True,
                            text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "torch_base.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("piattn.ops.pi._torch_base", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def feature_cost(base: str, repeats: int, threads: int) -> list[dict]:
    """fwd+bwd of the same causal adaptive call through the base code and today's, with and without features."""
    from piattn.ops.pi import torch as today

    old = _base_backend(base)
    torch.set_num_threads(threads)
    (q, k, v, gate), dy = _inputs(H_kv=COST_SHAPE["H"], **COST_SHAPE)
    B, T = COST_SHAPE["B"], COST_SHAPE["T"]
    one_doc = torch.zeros(B, T, dtype=torch.long)
    eight_docs = torch.arange(T).div(T // 8, rounding_mode="floor").expand(B, T).contiguous()
    cases = {
        f"base ({base}), sinks=0": (old.pi_attention_torch, {}),
        "today, sinks=0": (today.pi_attention_torch, {}),
        "today, sinks=4": (today.pi_attention_torch, dict(sinks=4)),
        "today, one document": (today.pi_attention_torch, dict(document_ids=one_doc)),
        "today, sinks=4, 8 documents": (today.pi_attention_torch, dict(sinks=4, document_ids=eight_docs)),
    }
    rows = []
    for window, period in COST_PATTERNS:
        kw = dict(window=window, period=period, causal=True, variant="adaptive", prior=0.5, logit_clamp=20.0,
                  eps=1e-4, scale=COST_SHAPE["D"] ** -0.5, dropout_keep=None, dropout_p=0.0)

        def step(fn, extra, kw=kw):
            fn(q, k, v, gate, **kw, **extra).backward(dy)
            for t in (q, k, v, gate):
                t.grad = None

        times = {name: ([], []) for name in cases}
        for fn, extra in cases.values():
            step(fn, extra)
        for _ in range(repeats):  # interleaved: a burst of load on the shared machine hits every case
            for name, (fn, extra) in cases.items():
                wall, cpu = _timed(lambda fn=fn, extra=extra: step(fn, extra), 1)
                times[name][0].extend(wall)
                times[name][1].extend(cpu)
        for name, (wall, cpu) in times.items():
            rows.append(dict(case=name, window=window, period=period, threads=threads, **COST_SHAPE,
                             **_stats(wall, cpu), repeats=repeats))
    return rows


def _ratio(x: float, ref: float) -> str:
    return f"{x / ref:.2f}"


def markdown(result: dict) -> str:
    m = result["machine"]
    g, c = GQA_SHAPE, COST_SHAPE
    out = [f"# torch backend: GQA, sinks and documents on CPU ({m['processor']}, torch {m['torch']})", "",
           f"Command: `{result['command']}`", "",
           f"The machine ({os.cpu_count()} cores) was shared with other jobs while this ran (load average "
           f"{result['load_before']} before, {result['load_after']} after): wall times mostly measure waits for "
           "a core. The one-thread CPU time (`time.process_time`) is the figure to compare; with two threads "
           "it includes OpenMP's spin-waits, and every parallel op waits until both threads get a core, so "
           "two-thread times follow the number of ops more than their work. Medians (and minima) over the "
           "repeats.", "",
           "## Grouped-query attention: native vs repeat-then-attend", "",
           f"B={g['B']}, H={g['H']}, H_kv={g['H_kv']}, T={g['T']}, D={g['D']}, fp32, adaptive, causal, "
           "forward + backward, `pi_attention(backend=\"torch\")`; the runs of both modes interleaved in one "
           "process. Peak = resident-memory growth of one step (outputs, gradients and the repeated K, V "
           "included), one thread, in a fresh process per case.", "",
           "| window | period | threads | mode | wall ms (median / min) | CPU ms (median / min) | peak MiB | "
           "CPU vs repeat |", "|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in result["gqa"]:
        if "error" in r:
            out.append(f"| {r['window']} | {r['period']} | {r['threads']} | {r['mode']} | {r['error']} | | | |")
            continue
        ref = next((x for x in result["gqa"] if x["mode"] == "repeat" and x["window"] == r["window"]
                    and x["threads"] == r["threads"] and "error" not in x), None)
        out.append(f"| {r['window']} | {r['period']} | {r['threads']} | {r['mode']} | {r['ms']:.0f} / "
                   f"{r['ms_min']:.0f} | {r['cpu_ms']:.0f} / {r['cpu_ms_min']:.0f} | {r['peak_mib']:.0f} | "
                   f"{_ratio(r['cpu_ms'], ref['cpu_ms']) if ref else '–'} |")
    out += ["", "## What the features cost when unused, and when used", "",
            f"B={c['B']}, H={c['H']}, T={c['T']}, D={c['D']}, fp32, adaptive, causal, forward + backward, "
            "the backend function called directly; the runs of all cases interleaved in one process. "
            f"\"base\" is the backend as of commit {result['base']}, before sinks, GQA and documents.", "",
            "| window | period | threads | case | wall ms (median / min) | CPU ms (median / min) | "
            "CPU vs today, sinks=0 |", "|---:|---:|---:|---|---:|---:|---:|"]
    for r in result["cost"]:
        ref = next(x for x in result["cost"] if x["window"] == r["window"] and x["threads"] == r["threads"]
                   and x["case"] == "today, sinks=0")
        out.append(f"| {r['window']} | {r['period']} | {r['threads']} | {r['case']} | {r['ms']:.0f} / "
                   f"{r['ms_min']:.0f} | {r['cpu_ms']:.0f} / {r['cpu_ms_min']:.0f} | "
                   f"{_ratio(r['cpu_ms'], ref['cpu_ms'])} |")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/features"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, nargs="+", default=list(THREADS))
    parser.add_argument("--base", default=BASE, help="commit whose torch backend is the 'before' of table 2")
    parser.add_argument("--gqa-peak", help=argparse.SUPPRESS)  # the child process measuring one GQA case
    args = parser.parse_args()
    if args.gqa_peak:
        print(gqa_peak(**json.loads(args.gqa_peak)))
        return
    load_before = [round(x, 1) for x in os.getloadavg()]
    gqa = [row for threads in args.threads for row in gqa_table(args.repeats, threads)]
    cost = [row for threads in args.threads for row in feature_cost(args.base, args.repeats, threads)]
    command = command_line("benchmarks/features_bench.py", None, from_source=True)
    result = dict(machine=machine_info(), threads=args.threads, command=command,
                  load_before=load_before, load_after=[round(x, 1) for x in os.getloadavg()], gqa=gqa, cost=cost,
                  gqa_shape=GQA_SHAPE, cost_shape=COST_SHAPE, base=args.base)
    save_results(args.out, "features_cpu", result, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
