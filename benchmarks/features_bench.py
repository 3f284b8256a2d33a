"""CPU benchmark of the "torch" backend's grouped-query attention and of what sinks and documents cost.

Two tables:

1. GQA: H = 9 query heads on H_kv = 3 key/value heads, native (the operator reads each key head for its
   3 query heads) against repeat-then-attend (k and v repeated to 9 heads with repeat_interleave, then the
   operator with H_kv = H; the repeat's backward sums the gradients back). Forward + backward time and the
   peak resident-memory growth of one step, each case in a fresh process (Linux VmHWM, reset before it).
2. The cost of the features when unused: the same call through the code before they existed (the
   backend module of commit `--base`, loaded from git) and through today's, with sinks=0 and no
   documents; then sinks=4, one document passed as document_ids, and sinks=4 with 8 documents. Runs are
   interleaved in one process so that load on a shared machine hits every case alike.

    PYTHONPATH=src python benchmarks/features_bench.py --out benchmarks/results
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

from piattn.benchmarking import machine_info, reset_peak_rss, rss_kib, save_results

THREADS = 2
BASE = "4084b3d"  # the last commit before the torch backend implemented sinks, GQA and documents
GQA_SHAPE = dict(B=1, H=9, H_kv=3, T=8192, D=64)
PATTERNS = ((256, 512), (4, 16))  # (window, period)
COST_SHAPE = dict(B=1, H=8, T=8192, D=64)
COST_PATTERNS = ((4, 16), (64, 256))


def _inputs(B, H, H_kv, T, D):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, T, D, generator=g)
    k, v = (torch.randn(B, H_kv, T, D, generator=g) for _ in range(2))
    gate = 0.05 + 0.9 * torch.rand(B, H, T, generator=g)
    dy = torch.randn(B, H, T, D, generator=g)
    return [t.requires_grad_() for t in (q, k, v, gate)], dy


def gqa_case(mode: str, window: int, period: int, repeats: int) -> dict:
    """One GQA case in this process: median fwd+bwd ms over `repeats` and peak RSS growth of one step."""
    import piattn

    torch.set_num_threads(THREADS)
    shape = GQA_SHAPE
    (q, k, v, gate), dy = _inputs(**shape)
    group = shape["H"] // shape["H_kv"]

    def step():
        kk, vv = (k, v) if mode == "native" else (k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))
        y = piattn.pi_attention(q, kk, vv, gate, window=window, period=period, backend="torch")
        y.backward(dy)
        for t in (q, k, v, gate):
            t.grad = None

    step()  # warm-up: thread pools and allocator caches are not the case's memory
    reset_peak_rss()
    before = rss_kib("VmRSS")
    step()
    peak_mib = (rss_kib("VmHWM") - before) / 1024
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    return dict(mode=mode, window=window, period=period, **shape, ms=statistics.median(times), ms_min=min(times),
                peak_mib=peak_mib, repeats=repeats)


def gqa_isolated(mode: str, window: int, period: int, repeats: int) -> dict:
    request = json.dumps(dict(mode=mode, window=window, period=period, repeats=repeats))
    proc = subprocess.run([sys.executable, __file__, "--gqa-case", request], capture_output=True, text=True)
    if proc.returncode != 0:
        return dict(mode=mode, window=window, period=period, error=proc.stderr.strip().splitlines()[-1])
    return json.loads(proc.stdout.strip().splitlines()[-1])


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


def feature_cost(base: str, repeats: int) -> list[dict]:
    """fwd+bwd of the same causal adaptive call through the base code and today's, with and without features."""
    from piattn.ops.pi import torch as today

    old = _base_backend(base)
    torch.set_num_threads(THREADS)
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

        times = {name: [] for name in cases}
        for fn, extra in cases.values():
            step(fn, extra)
        for _ in range(repeats):  # interleaved: a burst of load on the shared machine hits every case
            for name, (fn, extra) in cases.items():
                t0 = time.perf_counter()
                step(fn, extra)
                times[name].append((time.perf_counter() - t0) * 1e3)
        for name, ts in times.items():
            rows.append(dict(case=name, window=window, period=period, **COST_SHAPE, ms=statistics.median(ts),
                             ms_min=min(ts), repeats=repeats))
    return rows


def markdown(result: dict) -> str:
    m = result["machine"]
    g = GQA_SHAPE
    out = [f"# torch backend: GQA, sinks and documents on CPU ({m['processor']}, {THREADS} threads, "
           f"torch {m['torch']})", "",
           f"Command: `{result['command']}`", "",
           f"The machine was shared with other jobs while this ran (load average {result['load_before']} "
           f"before, {result['load_after']} after, on {os.cpu_count()} cores): times are medians (and minima) "
           "of interleaved or repeated runs, and differences of a few percent are within the noise.", "",
           f"## Grouped-query attention: native vs repeat-then-attend", "",
           f"B={g['B']}, H={g['H']}, H_kv={g['H_kv']}, T={g['T']}, D={g['D']}, fp32, adaptive, causal, "
           "forward + backward. Each case in a fresh process; peak = resident-memory growth of one step "
           "(outputs, gradients and the repeated K, V included).", "",
           "| window | period | mode | ms (median) | ms (min) | peak MiB |", "|---:|---:|---|---:|---:|---:|"]
    for r in result["gqa"]:
        if "error" in r:
            out.append(f"| {r['window']} | {r['period']} | {r['mode']} | {r['error']} | | |")
            continue
        out.append(f"| {r['window']} | {r['period']} | {r['mode']} | {r['ms']:.0f} | {r['ms_min']:.0f} | "
                   f"{r['peak_mib']:.0f} |")
    c = COST_SHAPE
    out += ["", "## What the features cost when unused, and when used", "",
            f"B={c['B']}, H={c['H']}, T={c['T']}, D={c['D']}, fp32, adaptive, causal, forward + backward, "
            "the backend function called directly; runs of all cases interleaved in one process.", "",
            "| window | period | case | ms (median) | ms (min) | median vs today, sinks=0 |",
            "|---:|---:|---|---:|---:|---:|"]
    for r in result["cost"]:
        ref = next(x for x in result["cost"] if x["window"] == r["window"] and x["case"] == "today, sinks=0")
        out.append(f"| {r['window']} | {r['period']} | {r['case']} | {r['ms']:.0f} | {r['ms_min']:.0f} | "
                   f"{r['ms'] / ref['ms']:.2f} |")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--base", default=BASE, help="commit whose torch backend is the 'before' of table 2")
    parser.add_argument("--gqa-case", help=argparse.SUPPRESS)  # the child process of one GQA case
    args = parser.parse_args()
    if args.gqa_case:
        print(json.dumps(gqa_case(**json.loads(args.gqa_case))))
        return
    torch.set_num_threads(THREADS)
    load_before = [round(x, 1) for x in os.getloadavg()]
    gqa = [gqa_isolated(mode, window, period, args.repeats)
           for window, period in PATTERNS for mode in ("native", "repeat")]
    cost = feature_cost(args.base, args.repeats)
    result = dict(machine=machine_info(), threads=THREADS, command="PYTHONPATH=src python " + " ".join(sys.argv),
                  load_before=load_before, load_after=[round(x, 1) for x in os.getloadavg()], gqa=gqa, cost=cost,
                  gqa_shape=GQA_SHAPE, cost_shape=COST_SHAPE, base=args.base)
    save_results(args.out, "features_cpu", result, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
