"""Where a Triton π call's time goes on a GPU: kernels, host work, and what compiling or a CUDA graph saves.

The first GPU run (benchmarks/results/gpu/gpu_first_bench.md) timed a bf16 forward at B=1, H=16, T=4K at
0.47 ms against a floor of 0.008 ms, and about the same at T=32K: a fixed cost per call, not the kernel.
Two host syncs were part of it (benchmarks/results/gpu/gpu_overhead.md): the gate's value check and the
backward's finiteness check. The backward now keeps a bad value local in its kernels (no check); the gate's
check runs unless the caller vouches for its gate (`pi_attention(check_gate=False)`, what `PiAttention` does
for its own). This script separates, per shape and pass (fwd, fwd+bwd), each a median over repeats:

- `kernels`: the device time of the Triton kernels alone, from torch.profiler;
- `eager`: CUDA-event time of `pi_attention(..., backend="triton")` with a user's gate (checked: one sync);
- `no_gate_check`: the same with check_gate=False (a layer's call: no sync);
- `compiled`: the call under `torch.compile` (default mode);
- `graph`: one replay of a CUDA graph captured around the call (forward, or forward and backward: what
  `mode="reduce-overhead"` does), `graph_capture` saying whether the capture succeeded (it fails on a host
  sync);
- `*_host_us`: host time per call with no sync, N calls then one synchronize (the launch cost a CPU pays).

    PYTHONPATH=src python3 benchmarks/gpu_overhead.py --out DIR          # on a GPU, about 40 s
    PYTHONPATH=src python3 benchmarks/gpu_overhead.py --smoke --out DIR  # CPU, Triton interpreter, seconds
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import piattn  # noqa: E402
from piattn.benchmarking import command_line, median_ms, save_results  # noqa: E402

OP = dict(window=4, period=16, causal=True, variant="adaptive", backend="triton")
SHAPES = ((1, 16, 4096, 64), (8, 16, 32768, 64))
SMOKE_SHAPES = ((1, 2, 64, 16),)


def inputs(B, H, T, D, device, dtype):
    """q, k, v [B, H, T, D], gate [B, H, T] in (0.05, 0.95), all requiring grad, and a cotangent dy."""
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, dy = (torch.randn(B, H, T, D, generator=g, device=device, dtype=dtype) for _ in range(4))
    gate = (0.05 + 0.9 * torch.rand(B, H, T, generator=g, device=device)).to(dtype)
    return [t.requires_grad_() for t in (q, k, v, gate)], dy


def step(xs, dy, backward: bool, check_gate: bool = True):
    y = piattn.pi_attention(*xs, **OP, check_gate=check_gate)
    if backward:
        return torch.autograd.grad(y, xs, dy)
    return y


def graph_of(fn, cuda: bool):
    """(replay, status): a CUDA graph captured around fn (after warm-up on a side stream), or None and why not."""
    if not cuda:
        return None, "needs CUDA"
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay, "ok"
    except Exception as exc:  # a host sync inside fn refuses the capture: the finding to record
        return None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"


def host_us(fn, calls: int, cuda: bool) -> float:
    """Host microseconds per call: `calls` calls back to back, then one synchronize."""
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def kernel_ms(fn, repeats: int) -> tuple[float, dict]:
    """Device ms per call of the Triton kernels (names starting 'pi_'), and each kernel's share."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    per_kernel = {}
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if event.key.startswith("pi_") and device_us:
            per_kernel[event.key] = device_us / repeats / 1e3
    return sum(per_kernel.values()), per_kernel


def measure(shape, device, dtype, repeats: int, calls: int) -> list[dict]:
    cuda = device.type == "cuda"
    xs, dy = inputs(*shape, device, dtype)
    rows = []
    for mode in ("fwd", "fwd+bwd"):
        backward = mode == "fwd+bwd"

        def fn(xs=xs, dy=dy, backward=backward):
            step(xs, dy, backward)

        def trusted(xs=xs, dy=dy, backward=backward):
            step(xs, dy, backward, check_gate=False)

        for _ in range(3):  # warm-up: the first call compiles the kernels
            fn()
        row = dict(B=shape[0], H=shape[1], T=shape[2], D=shape[3], mode=mode)
        for label, call in (("eager", fn), ("no_gate_check", trusted)):
            row[f"{label}_ms"] = median_ms(call, repeats, cuda=cuda)
            row[f"{label}_host_us"] = host_us(call, calls, cuda)
        if cuda:
            row["kernels_ms"], row["per_kernel_ms"] = kernel_ms(fn, repeats)
            try:
                compiled = functools.partial(torch.compile(functools.partial(step, backward=backward,
                                                                             check_gate=False)), xs, dy)
                for _ in range(3):
                    compiled()
                row["compiled_ms"] = median_ms(compiled, repeats, cuda=cuda)
                row["compiled_host_us"] = host_us(compiled, calls, cuda)
            except Exception as exc:  # recorded, not fatal
                row["compiled_error"] = f"{type(exc).__name__}: {str(exc).strip()[:200]}"
        replay, row["graph_capture"] = graph_of(trusted, cuda)
        if replay is not None:
            row["graph_ms"] = median_ms(replay, repeats, cuda=cuda)
            row["graph_host_us"] = host_us(replay, calls, cuda)
        rows.append(row)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                       if not isinstance(v, dict)), flush=True)
    return rows


def markdown(result: dict) -> str:
    env = result["environment"]
    cols = ("kernels_ms", "eager_ms", "no_gate_check_ms", "compiled_ms", "graph_ms", "eager_host_us",
            "no_gate_check_host_us", "graph_capture")
    out = [f"# Where a Triton π call's time goes ({env['device']})", "",
           f"torch {env['torch']}, triton {env['triton']}, {result['dtype']}, {OP}. Command: "
           f"`{result['command']}`. Medians over {result['repeats']} repeats; host µs per call over "
           f"{result['calls']} calls without a sync.", "",
           "| B | H | T | D | mode | " + " | ".join(cols) + " |", "|" + "---|" * (5 + len(cols))]
    for r in result["rows"]:
        cells = [str(r[k]) for k in ("B", "H", "T", "D", "mode")]
        cells += [f"{r[c]:.4g}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in cols]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for gpu_overhead.json and .md")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run under the Triton interpreter (for tests)")
    a = p.parse_args(argv)
    if not a.smoke and not torch.cuda.is_available():
        p.error("no CUDA device; use --smoke for the CPU run")
    device = torch.device("cpu" if a.smoke else "cuda")
    dtype = torch.float32 if a.smoke else torch.bfloat16
    repeats, calls = (2, 2) if a.smoke else (20, 50)
    import triton

    result = dict(
        command=command_line("benchmarks/gpu_overhead.py", argv, from_source=True), smoke=a.smoke,
        environment=dict(device=torch.cuda.get_device_name() if not a.smoke else "CPU (Triton interpreter)",
                         torch=torch.__version__, triton=triton.__version__, python=sys.version.split()[0]),
        dtype=str(dtype).removeprefix("torch."), repeats=repeats, calls=calls, rows=[],
    )
    for shape in SMOKE_SHAPES if a.smoke else SHAPES:
        result["rows"] += measure(shape, device, dtype, repeats, calls)
    text = markdown(result)
    save_results(a.out, "gpu_overhead", result, text)
    print(text, flush=True)
    return result


if __name__ == "__main__":
    main()
