"""Tile sweep of the Triton π kernels on a GPU: which (BLOCK_T, BLOCK_K, num_warps, num_stages) brings the
forward and the backward closest to their bandwidth floors, per head dim and dtype.

The second GPU run (benchmarks/results/gpu/gpu_run_b8.md, B 8, H 16, bf16, D 64) had the forward at 4.0× its
floor and forward+backward at 4.8× at T = 32K, with the tiles `triton._tiles` picks by rule (64-row tiles,
32-key chunks, 4 warps for D ≤ 64 else 8, two stages). This sweep times the kernels alone (the launchers
`triton_forward` and `triton_backward` on a fixed launch plan: no checks, no autograd, no host syncs
inside), CUDA events with L2 flushed before each run, for each tile setting in `CONFIGS` (the rule's own
first), and reports ms and × the floor (gpu_bench.floor_bytes, the copy bandwidth measured in the run).

A last section times a user's whole call with one period against per-head periods (8 distinct periods
over 16 heads), the GPU work list's target being per-head ≤ 1.1× one period.

    PYTHONPATH=src python3 benchmarks/gpu_tune.py --out DIR [--budget-s 240]   # on a GPU
    PYTHONPATH=src python3 benchmarks/gpu_tune.py --smoke --out DIR           # CPU, Triton interpreter

Also a step of `gpu_run.py` (`--tune-s`). Each shape starts nothing new once the budget is spent; the JSON
and markdown are rewritten after every shape, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import piattn  # noqa: E402
from gpu_bench import Setup, copy_bandwidth, floor_bytes, make_inputs  # noqa: E402
from piattn.benchmarking import command_line, median_ms, save_results  # noqa: E402
from piattn.ops.pi import triton as triton_backend  # noqa: E402
from piattn.ops.pi.settings import OpSettings  # noqa: E402

OP = dict(window=4, period=16, causal=True, variant="adaptive", prior=0.5, logit_clamp=20.0, eps=1e-4)
HEAD_PERIODS = [8, 16, 32, 64, 128, 256, 512, 1024] * 2
# (BLOCK_T, BLOCK_K, num_warps, num_stages): the rule's pick is timed first (added per shape), then these.
# A handful per shape, so that compiling stays within the run's step (three kernels, 1-3 s each, per setting):
# taller tiles, wider chunks, more warps, deeper or no pipelining, each one step from the rule's pick.
CONFIGS = [(128, 32, 8, 2), (64, 64, 4, 2), (64, 32, 4, 3), (64, 32, 8, 2), (64, 32, 4, 1)]
SHAPES = ((8, 16, 32768, 64, torch.bfloat16), (8, 16, 32768, 128, torch.bfloat16))
HEAD_SHAPES = ((8, 16, 32768, 64),)
SMOKE = dict(shapes=((1, 2, 48, 16, torch.float32),), configs=[(32, 16, 4, 1)], head_shapes=((1, 4, 48, 16),))
TOL = dict(bfloat16=2e-2, float32=1e-4)  # a tile setting's results against the rule's: atol = rtol


def rule_tiles(D: int, dtype) -> tuple[int, int, int, int]:
    halo = OP["window"]  # causal: the band's halo is the window
    return triton_backend._tiles(D, halo, torch.empty((), dtype=dtype).element_size())


def time_config(xs, cfg, timer, expected=None) -> tuple[dict, list | None]:
    """(fwd and bwd ms of the kernels with tiles cfg, or the error that stopped them; their results y, dq,
    dk, dv, dgate). With `expected` (the rule's results) a setting whose results differ is reported, not
    timed."""
    q, k, v, gate, dy = xs
    saved = triton_backend._tiles
    triton_backend._tiles = lambda D, halo, elem: cfg
    try:
        settings = OpSettings(**OP, scale=q.shape[-1] ** -0.5, dropout_p=0.0, sinks=0)
        launch = triton_backend.plan(q, settings, dropout=False)
        y, stats = triton_backend.triton_forward(q, k, v, gate, None, launch)
        got = [y, *triton_backend.triton_backward(dy, q, k, v, gate, None, stats, launch, want_dgate=True)]
        if expected is not None:
            tol = TOL[str(q.dtype).removeprefix("torch.")]
            bad = [name for name, e, a in zip(("y", "dq", "dk", "dv", "dgate"), expected, got, strict=True)
                   if not torch.allclose(a.float(), e.float(), atol=tol, rtol=tol)]
            if bad:
                return dict(status=f"wrong: {', '.join(bad)} differ from the rule's tiles"), None
        fwd = timer(lambda: triton_backend.triton_forward(q, k, v, gate, None, launch))
        bwd = timer(lambda: triton_backend.triton_backward(dy, q, k, v, gate, None, stats, launch,
                                                           want_dgate=True))
        return dict(status="ok", fwd_ms=fwd, bwd_ms=bwd), got
    except Exception as exc:  # a tile setting the compiler or the device refuses: recorded, not fatal
        return dict(status=f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"), None
    finally:
        triton_backend._tiles = saved


def sweep_shape(shape, configs, device, bandwidth, timer, deadline) -> dict:
    B, H, T, D, dtype = shape
    xs = make_inputs(B, H, T, D, device, grad=False, dtype=dtype)
    elem = torch.empty((), dtype=dtype).element_size()
    fwd_floor = floor_bytes(B, H, T, D, "fwd", elem) / bandwidth * 1e3
    bwd_floor = floor_bytes(B, H, T, D, "fwd+bwd", elem) / bandwidth * 1e3 - fwd_floor
    rule = rule_tiles(D, dtype)
    rows, expected = [], None
    for cfg in [rule] + [c for c in configs if c != rule]:
        if time.monotonic() > deadline:
            rows.append(dict(tiles=list(cfg), status="skipped: time budget"))
            continue
        timing, got = time_config(xs, cfg, timer, expected)
        expected = got if cfg == rule else expected
        row = dict(tiles=list(cfg), rule=cfg == rule, **timing)
        if row["status"] == "ok":
            row["fwd_x_floor"], row["bwd_x_floor"] = row["fwd_ms"] / fwd_floor, row["bwd_ms"] / bwd_floor
        rows.append(row)
        print(shape[:4], str(dtype).removeprefix("torch."), row, flush=True)
    return dict(B=B, H=H, T=T, D=D, dtype=str(dtype).removeprefix("torch."), fwd_floor_ms=fwd_floor,
                bwd_floor_ms=bwd_floor, rows=rows)


def head_periods_rows(shapes, device, timer, deadline) -> list[dict]:
    """A user's call (pi_attention, backend triton, bf16 on a GPU) with one period and with HEAD_PERIODS."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for B, H, T, D in shapes:
        xs = make_inputs(B, H, T, D, device, grad=True, dtype=dtype)
        for mode in ("fwd", "fwd+bwd"):
            row = dict(B=B, H=H, T=T, D=D, mode=mode)
            for label, period in (("one", OP["period"]), ("heads", HEAD_PERIODS[:H])):
                if time.monotonic() > deadline:
                    row[label] = "skipped: time budget"
                    continue

                def call(period=period, mode=mode, xs=xs):
                    y = piattn.pi_attention(*xs[:4], **{**OP, "period": period, "backend": "triton"})
                    if mode == "fwd+bwd":
                        torch.autograd.grad(y, xs[:4], xs[4])

                row[label] = timer(call)  # the timer warms up
            if isinstance(row.get("one"), float) and isinstance(row.get("heads"), float):
                row["ratio"] = row["heads"] / row["one"]
            rows.append(row)
            print(row, flush=True)
    return rows


def markdown(result: dict) -> str:
    out = [f"# Triton tile sweep ({result['device']})", "",
           f"torch {result['torch']}, triton {result['triton']}, copy bandwidth {result['bandwidth_gbs']:.0f} GB/s "
           f"(read + write, this run). {OP}. Command: `{result['command']}`. Kernels alone (launchers on a fixed "
           "plan), median ms over repeats with L2 flushed; × = ms ÷ the bandwidth floor. Tiles: (BLOCK_T, "
           "BLOCK_K, num_warps, num_stages); * = the rule's pick (`triton._tiles`).", ""]
    for s in result["shapes"]:
        out += [f"## B {s['B']}, H {s['H']}, T {s['T']}, D {s['D']}, {s['dtype']} (floors: fwd "
                f"{s['fwd_floor_ms']:.3f} ms, bwd {s['bwd_floor_ms']:.3f} ms)", "",
                "| tiles | fwd ms | fwd × | bwd ms | bwd × | status |", "|---|---|---|---|---|---|"]
        for r in sorted(s["rows"], key=lambda r: r.get("fwd_ms", float("inf")) + r.get("bwd_ms", float("inf"))):
            name = ",".join(map(str, r["tiles"])) + (" *" if r.get("rule") else "")
            if r["status"] == "ok":
                out.append(f"| {name} | {r['fwd_ms']:.3f} | {r['fwd_x_floor']:.2f} | {r['bwd_ms']:.3f} | "
                           f"{r['bwd_x_floor']:.2f} | ok |")
            else:
                out.append(f"| {name} |  |  |  |  | {r['status']} |")
        out.append("")
    if result["head_periods"]:
        out += [f"## One period against per-head periods {HEAD_PERIODS} (a user's call, triton, eager)", "",
                "| B | H | T | D | mode | one ms | per-head ms | ratio |", "|---|---|---|---|---|---|---|---|"]
        for r in result["head_periods"]:
            cells = [r.get(c) for c in ("one", "heads", "ratio")]
            cells = [f"{c:.3f}" if isinstance(c, float) else str(c or "") for c in cells]
            out.append(f"| {r['B']} | {r['H']} | {r['T']} | {r['D']} | {r['mode']} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> dict:
    """Run the sweep (argv as on the command line); the result as written to DIR/gpu_tune.json."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop starting new measurements after this")
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, one tiny shape, two tile settings")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    # Three quarters of the budget for the sweep, the rest for the per-head comparison.
    start = time.monotonic()
    deadline, heads_deadline = start + 0.75 * args.budget_s, start + args.budget_s
    shapes, configs, head_shapes = ((SMOKE["shapes"], SMOKE["configs"], SMOKE["head_shapes"]) if args.smoke
                                    else (SHAPES, CONFIGS, HEAD_SHAPES))
    flush = torch.empty(256 << 20, dtype=torch.int8, device=device) if cuda else None
    repeats = 10 if cuda else 1

    def timer(fn) -> float:
        if cuda:  # a warm-up call: Triton compiles on the first; the interpreter has nothing to warm
            fn()
        return median_ms(fn, repeats, cuda=cuda, before=None if flush is None else flush.zero_)

    import triton

    bandwidth = copy_bandwidth_of(cuda)
    result = dict(device=torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)",
                  torch=torch.__version__, triton=triton.__version__, bandwidth_gbs=bandwidth / 1e9,
                  command=command_line("benchmarks/gpu_tune.py", argv, from_source=True), shapes=[],
                  head_periods=[])
    for shape in shapes:
        result["shapes"].append(sweep_shape(shape, configs, device, bandwidth, timer, deadline))
        save_results(args.out, "gpu_tune", result, markdown(result))
    result["head_periods"] = head_periods_rows(head_shapes, device, timer, heads_deadline)
    save_results(args.out, "gpu_tune", result, markdown(result))
    return result


def copy_bandwidth_of(cuda: bool) -> float:
    """Read + write bytes per second of a 1 GiB device copy, as gpu_run measures it (a nominal 1e10 on the CPU
    smoke run, which times nothing meaningful)."""
    return copy_bandwidth(Setup(smoke=False, budget_s=float("inf"))) if cuda else 1e10


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
