"""Sequence-parallel π-Attention: halo bytes per rank per layer, and time per step, on CPU processes (Gloo).

Three tables:

1. planned: the bytes the busiest rank receives in one layer's forward (keys and values of the rows its
   queries read; backward sends the same number back as gradients), from `HaloPlan`, for a model-sized
   head layout at sequence lengths up to millions of tokens; flat in T once a shard is longer than π;
2. measured: a real Gloo run of P processes at small T, counting the bytes every rank hands to
   torch.distributed (forward and backward), next to what the plan predicts;
3. time: fwd+bwd step of the sharded operator on P CPU processes (one thread each), the slowest rank's
   time (best and median over steps) and the part spent in the exchange, next to the unsharded operator
   run the same way in one process.

    PYTHONPATH=src python benchmarks/halo_bench.py --out benchmarks/results/halo
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from piattn.benchmarking import command_line, machine_info, save_results
from piattn.parallel import HaloPlan, sequence_parallel_pi_attention

# The planned table's head layout: a 1B-class model's attention, one sequence, bf16.
PLAN_SHAPE = dict(batch=1, heads=16, head_dim=128, dtype_bytes=2)
PLAN_TS = (65_536, 262_144, 1_048_576, 4_194_304)
PLAN_PS = (8, 64)
PLAN_PATTERNS = ((4, 16, True), (4, 16, False), (4, 4096, True), (64, 256, True))


def planned() -> list[dict]:
    rows = []
    for window, period, causal in PLAN_PATTERNS:
        for P in PLAN_PS:
            for T in PLAN_TS:
                plan = HaloPlan(P, T // P, window, period, causal)
                b = plan.bytes_per_rank(**PLAN_SHAPE)
                rows.append(dict(window=window, period=period, causal=causal, P=P, T=T, shard=T // P,
                                 mode="gapped" if plan.gapped else "contiguous", rows=plan.max_rows_received(),
                                 fwd_recv_bytes=b["forward_recv"], bwd_send_bytes=b["backward_sent"],
                                 allgather_bytes=(P - 1) * (T // P) * 2 * PLAN_SHAPE["heads"]
                                 * PLAN_SHAPE["head_dim"] * PLAN_SHAPE["dtype_bytes"]))
    return rows


# ---------------------------------------------------------------- multi-process part

def _worker(rank: int, world: int, store: str, out: str, job: str, cases: list[dict]) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        result = [(_measure_bytes if job == "bytes" else _measure_time)(rank, world, c) for c in cases]
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _inputs(case: dict, world: int, rank: int, grad: bool = True):
    S = case["T"] // world
    g = torch.Generator().manual_seed(0)
    B, H, D = case["B"], case["H"], case["D"]
    q, k, v, dy = (torch.randn(B, H, S, D, generator=g) for _ in range(4))
    gate = (0.05 + 0.9 * torch.rand(B, H, S, generator=g))
    return [t.requires_grad_(grad) for t in (q, k, v, gate)], dy


def _kwargs(case: dict) -> dict:
    return dict(window=case["window"], period=case["period"], causal=case["causal"], backend=case["backend"])


def _measure_bytes(rank: int, world: int, case: dict) -> dict:
    """Run fwd+bwd once with batch_isend_irecv wrapped: the bytes of every tensor sent, per phase."""
    counts, phase = Counter(), ["fwd"]
    original = dist.batch_isend_irecv

    def counting(ops):
        for op in ops:
            kind = "recv" if op.op is dist.irecv else "send"
            counts[f"{phase[0]}_{kind}"] += op.tensor.numel() * op.tensor.element_size()
        return original(ops)

    (q, k, v, gate), dy = _inputs(case, world, rank)
    dist.batch_isend_irecv = counting
    try:
        y = sequence_parallel_pi_attention(q, k, v, gate, **_kwargs(case))
        phase[0] = "bwd"
        y.backward(dy)
    finally:
        dist.batch_isend_irecv = original
    return dict(counts)


def _measure_time(rank: int, world: int, case: dict) -> dict:
    """Median over repeats of the slowest rank's fwd+bwd step, and of its time inside the exchange."""
    import piattn.parallel.sequence as sp

    (q, k, v, gate), dy = _inputs(case, world, rank)
    spent = [0.0]
    exchange = sp._exchange

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return exchange(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t0

    sp._exchange = timed
    steps, comms = [], []
    try:
        for i in range(case["repeats"] + 1):
            for t in (q, k, v, gate):
                t.grad = None
            dist.barrier()
            spent[0] = 0.0
            t0 = time.perf_counter()
            y = sequence_parallel_pi_attention(q, k, v, gate, **_kwargs(case))
            y.backward(dy)
            took = torch.tensor([time.perf_counter() - t0, spent[0]], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the step ends when its slowest rank does
            if i:  # the first step is a warm-up
                steps.append(took[0].item())
                comms.append(took[1].item())
    finally:
        sp._exchange = exchange
    best = min(range(len(steps)), key=steps.__getitem__)
    return dict(step_s=statistics.median(steps), exchange_s=statistics.median(comms), step_s_min=steps[best],
                exchange_s_at_min=comms[best])


def run_world(world: int, job: str, cases: list[dict]) -> list[list[dict]]:
    """[rank][case] results of `job` on `world` Gloo processes."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(r, world, os.path.join(tmp, "store"), tmp, job, cases))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
            if p.exitcode != 0:
                raise RuntimeError(f"a worker of job {job} on {world} ranks failed (exit code {p.exitcode})")
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]


def measured_bytes(worlds, Ts, patterns) -> list[dict]:
    rows = []
    for world in worlds:
        cases = [dict(T=T, B=1, H=2, D=16, window=k, period=p, causal=c, backend="torch")
                 for k, p, c in patterns for T in Ts]
        per_rank = run_world(world, "bytes", cases)
        for i, case in enumerate(cases):
            plan = HaloPlan(world, case["T"] // world, case["window"], case["period"], case["causal"])
            row_bytes = 2 * case["B"] * case["H"] * case["D"] * 4  # a key and a value row, fp32
            got = [per_rank[r][i] for r in range(world)]
            rows.append(dict(P=world, T=case["T"], window=case["window"], period=case["period"],
                             causal=case["causal"], mode="gapped" if plan.gapped else "contiguous",
                             fwd_recv_bytes_max=max(g.get("fwd_recv", 0) for g in got),
                             fwd_send_bytes_max=max(g.get("fwd_send", 0) for g in got),
                             bwd_send_bytes_max=max(g.get("bwd_send", 0) for g in got),
                             planned_fwd_recv_bytes_max=plan.max_rows_received() * row_bytes,
                             per_rank=got))
            print(f"bytes P={world} T={case['T']:6d} k={case['window']} π={case['period']} "
                  f"recv {rows[-1]['fwd_recv_bytes_max']} (plan {rows[-1]['planned_fwd_recv_bytes_max']})",
                  flush=True)
    return rows


def timing(worlds, Ts, repeats) -> list[dict]:
    """P = 1 runs the same way (one Gloo process; the call falls back to the plain operator)."""
    base = dict(B=1, H=4, D=32, window=4, period=16, causal=True, backend="torch", repeats=repeats)
    rows = []
    for world in (1, *worlds):
        cases = [{**base, "T": T} for T in Ts]
        per_rank = run_world(world, "time", cases)
        for i, T in enumerate(Ts):
            rows.append(dict(P=world, T=T, **per_rank[0][i]))  # already the max over ranks
            print(f"time P={world} T={T} best {rows[-1]['step_s_min'] * 1e3:.1f} ms "
                  f"median {rows[-1]['step_s'] * 1e3:.1f} ms", flush=True)
    for r in rows:
        r.update(B=base["B"], H=base["H"], D=base["D"], window=base["window"], period=base["period"],
                 causal=base["causal"], backend=base["backend"], dtype="float32")
    return rows


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f}"


def markdown(result: dict) -> str:
    m = result["machine"]
    s = PLAN_SHAPE
    out = [f"# Sequence-parallel halo benchmark ({m['processor']}, {m['cpu_count']} threads, torch {m['torch']})",
           "", f"`{result['command']}`", "",
           f"## Planned bytes per rank per layer (B={s['batch']}, H={s['heads']}, D={s['head_dim']}, bf16)", "",
           "From `HaloPlan`: key and value rows the busiest rank receives in one layer's forward (backward "
           "sends as many bytes of gradients back). `all-gather` is what gathering every other shard's keys "
           "and values would move instead.", "",
           "| k | π | causal | P | T | shard | mode | rows | fwd recv MiB | all-gather MiB |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["planned"]:
        out.append(f"| {r['window']} | {r['period']} | {r['causal']} | {r['P']} | {r['T']:,} | {r['shard']:,} | "
                   f"{r['mode']} | {r['rows']:,} | {_mib(r['fwd_recv_bytes'])} | {_mib(r['allgather_bytes'])} |")
    out += ["", "## Measured bytes (real Gloo run, B=1, H=2, D=16, fp32)", "",
            "Counted at `torch.distributed.batch_isend_irecv` on every rank during one fwd+bwd; the busiest "
            "rank's figures, and the plan's prediction for its forward receive.", "",
            "| P | T | k | π | causal | mode | fwd recv B | plan B | fwd send B | bwd send B |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["measured"]:
        out.append(f"| {r['P']} | {r['T']:,} | {r['window']} | {r['period']} | {r['causal']} | {r['mode']} | "
                   f"{r['fwd_recv_bytes_max']:,} | {r['planned_fwd_recv_bytes_max']:,} | "
                   f"{r['fwd_send_bytes_max']:,} | {r['bwd_send_bytes_max']:,} |")
    t0 = result["time"][0]
    out += ["", f"## Time per fwd+bwd step (CPU processes, Gloo, one thread each; B={t0['B']}, H={t0['H']}, "
            f"D={t0['D']}, fp32, k={t0['window']}, π={t0['period']}, causal, backend {t0['backend']})", "",
            "Per step the slowest rank's time; best and median over the timed steps (the best is the least "
            "disturbed by other load). P = 1 is the plain operator in one process. 'In exchange' is the time "
            "inside the point-to-point exchange (forward and backward) in the best step, waiting for slower "
            "peers included. This machine has 2 cores, so P = 4 runs 4 processes on 2 cores (oversubscribed), and "
            f"it is shared: 1-minute load average {result['load_average_1min']['before']:.1f} before the run, "
            f"{result['load_average_1min']['after']:.1f} after. These times show the exchange works at small "
            "scale on CPU; they are not a scaling measurement.",
            "", "| T | P | shard | best step ms | in exchange ms | median step ms | best × P=1 best |",
            "|---|---|---|---|---|---|---|"]
    for r in sorted(result["time"], key=lambda r: (r["T"], r["P"])):
        one = next(x for x in result["time"] if x["T"] == r["T"] and x["P"] == 1)
        out.append(f"| {r['T']:,} | {r['P']} | {r['T'] // r['P']:,} | {r['step_s_min'] * 1e3:.1f} | "
                   f"{r['exchange_s_at_min'] * 1e3:.2f} | {r['step_s'] * 1e3:.1f} | "
                   f"{r['step_s_min'] / one['step_s_min']:.2f} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="directory for halo_bench.{json,md}")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--bytes-T", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--time-T", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    patterns = [(4, 16, True), (4, 16, False), (4, 300, True)]
    load_before = os.getloadavg()
    command = command_line("benchmarks/halo_bench.py", argv)
    result = dict(machine=machine_info(), command=command, plan_shape=PLAN_SHAPE, planned=planned(),
                  measured=measured_bytes(args.worlds, args.bytes_T, patterns),
                  time=timing(args.worlds, args.time_T, args.repeats))
    result["load_average_1min"] = dict(before=load_before[0], after=os.getloadavg()[0])
    table = markdown(result)
    if args.out:
        save_results(args.out, "halo_bench", result, table)
    print(table)


if __name__ == "__main__":
    main()
