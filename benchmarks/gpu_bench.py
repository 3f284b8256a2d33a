"""GPU benchmark: the fused Triton kernel, FlexAttention and dense flash SDPA against the bandwidth floor.

One run, one process, about 9 minutes at most on an H100/H200 (a time budget skips what does not fit, and
says so):

    PYTHONPATH=src python benchmarks/gpu_bench.py --out benchmarks/results/gpu/
    PYTHONPATH=src python benchmarks/gpu_bench.py --smoke --out /tmp/smoke    # CPU, tiny, seconds

What it measures (bf16, causal, window=4, period=16, variant "adaptive", logit_clamp=20):
- device-to-device copy bandwidth (one 1 GiB `dst.copy_(src)`; bytes = read + write), in this run;
- correctness of every timed π backend against backend "reference" (output and all gradients) at a
  small shape; a backend that fails is reported as "failed check" and never timed;
- the smallest sparse block FlexAttention accepts (tried 16, 32, 64: compiles and passes the check);
- operator time, fwd and fwd+bwd, for B·H ∈ {16, 128}, T ∈ {4K … 32K}, D ∈ {64, 128}: backend "triton",
  "flex" at block 128 and at its smallest block, dense causal SDPA (flash), and the floor = bytes that
  must move ÷ the copy bandwidth;
- finiteness of output and gradients at T = 32K with scores around the clamp (q scaled by 19);
- whole-layer time (d_model 1024, 16 heads: projections, gate MLP, attention): `piattn.PiAttention`
  against the same projections around dense flash SDPA.

"fwd" is the forward of a training step (inputs require grad, so kernels also write their softmax
statistics); "fwd+bwd" adds the backward. Each timing is the median of CUDA-event times over repeats,
with L2 flushed before each repeat, after warm-up calls (the first of which compiles).

Floor bytes per (batch, head), bf16 = 2 bytes, statistics fp32 = 4 bytes (one log-sum-exp per query,
which a fused backward needs):
    fwd      2·(3TD + T) read Q, K, V, gate  +  2·TD + 4T write O, lse
    backward 2·(5TD + T) + 4T read Q, K, V, gate, O, dO, lse  +  2·(3TD + T) write dQ, dK, dV, dgate
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import piattn
from piattn.benchmarking import command_line, describe_error, log, median_ms, save_results, sync

OP = dict(window=4, period=16, causal=True, variant="adaptive", prior=0.5, logit_clamp=20.0, eps=1e-4)
DTYPE = torch.bfloat16
TOL = dict(atol=2e-2, rtol=2e-2)  # bf16, as tests/utils.py
FLEX_PROBE = (16, 32, 64)  # smallest first; 16 is the least Triton's tl.dot takes
# (B, H, D) combinations, each over every T; in this order, so that a run cut short by the time budget
# still has whole T-curves for the first ones.
GRID = dict(BHD=((1, 16, 64), (8, 16, 128), (8, 16, 64), (1, 16, 128)), T=(4096, 8192, 16384, 32768))
LAYER = dict(d_model=1024, n_heads=16, shapes=((4, 4096), (1, 32768)))
NAMES = ("y", "dq", "dk", "dv", "dgate")


class Setup:
    """Device, sizes and timing settings of one run: the GPU run or the CPU smoke run."""

    def __init__(self, smoke: bool, budget_s: float):
        self.smoke = smoke
        self.device = torch.device("cpu" if smoke else "cuda")
        self.start = time.monotonic()
        self.budget_s = budget_s
        if smoke:
            # Tiny and forward-only: torch's flex has no CPU backward. One shape, so flex compiles once.
            self.grid = dict(BHD=((1, 2, 32),), T=(256,))
            self.check_shape = (1, 2, 256, 32)
            self.layer = dict(d_model=64, n_heads=2, shapes=((1, 256),))
            self.nan_shape = (1, 2, 256, 32)
            self.modes = ("fwd",)
            self.sdpa = SDPBackend.MATH
            self.warmup, self.repeats, self.copy_bytes = 1, 1, 64 << 20  # checks the plumbing, times nothing
            self.flex_probe = (16,)
        else:
            self.grid = GRID
            self.check_shape = (2, 4, 1000, 64)  # T not a multiple of any block: partial tiles at the end
            self.layer = LAYER
            self.nan_shape = (1, 16, 32768, 64)
            self.modes = ("fwd", "fwd+bwd")
            self.sdpa = SDPBackend.FLASH_ATTENTION
            self.warmup, self.repeats, self.copy_bytes = 3, 10, 1 << 30
            self.flex_probe = FLEX_PROBE
        self._flush = None if smoke else torch.empty(256 << 20, dtype=torch.int8, device=self.device)

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def out_of_time(self) -> bool:
        return self.elapsed() > self.budget_s

    def sync(self) -> None:
        sync(self.device)

    def time_ms(self, fn) -> float:
        """Median time of fn() in ms after warm-up; on CUDA by events, with L2 flushed before each run."""
        for _ in range(self.warmup):
            fn()
        self.sync()
        return median_ms(fn, self.repeats, cuda=self.device.type == "cuda",
                         before=None if self._flush is None else self._flush.zero_)


def environment(setup: Setup) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = setup.device.type == "cuda"
    return dict(
        device=torch.cuda.get_device_name() if cuda else f"CPU {platform.processor() or platform.machine()}",
        torch=torch.__version__, triton=triton_version, cuda=torch.version.cuda if cuda else None,
        python=platform.python_version(), piattn=piattn.__version__, backends=list(piattn.BACKENDS),
        threads=torch.get_num_threads(),
    )


def copy_bandwidth(setup: Setup) -> float:
    """Bytes per second of `dst.copy_(src)` on the device, counting read + write."""
    n = setup.copy_bytes
    src = torch.empty(n, dtype=torch.uint8, device=setup.device).random_()
    dst = torch.empty_like(src)
    ms = setup.time_ms(lambda: dst.copy_(src))
    return 2 * n / (ms / 1e3)


def floor_bytes(B: int, H: int, T: int, D: int, mode: str, elem: int = 2) -> int:
    """Bytes that any π kernel must move (module docstring): tensors of `elem` bytes (2: bf16), fp32 statistics."""
    fwd = elem * (3 * T * D + T) + elem * T * D + 4 * T
    bwd = elem * (5 * T * D + T) + 4 * T + elem * (3 * T * D + T)
    return B * H * (fwd + (bwd if mode == "fwd+bwd" else 0))


def design_floor_bytes(B: int, H: int, T: int, D: int, mode: str, elem: int = 2) -> int:
    """Bytes the design that runs must move (`floor_bytes` is a one-pass design's): the forward also writes the
    second fp32 statistic per query (c_local and c_skip); the backward is two kernels, dQ then dK/dV
    (ops/pi/TRITON.md), each reading q, k, v and dY and both the statistics, the first writing dQ, Δ (two fp32
    per query, read by the second) and dα in fp32, which is then cast to the gate's dtype. Its ratio to
    `floor_bytes` is the design's own cost; a kernel's time over `design_floor_bytes` ÷ bandwidth, its own
    inefficiency."""
    fwd = elem * (3 * T * D + T) + elem * T * D + 8 * T
    dq = elem * (4 * T * D + T) + 8 * T + elem * T * D + 8 * T + 4 * T
    dkdv = elem * 4 * T * D + 8 * T + 8 * T + elem * 2 * T * D
    cast = 4 * T + elem * T
    return B * H * (fwd + (dq + dkdv + cast if mode == "fwd+bwd" else 0))


# ----------------------------------------------------------------------------------------------- operators

def pi_op(backend: str):
    def op(q, k, v, gate):
        return piattn.pi_attention(q, k, v, gate, **{**OP, "backend": backend})

    return op


def flex_op(block_size: int):
    from piattn.ops.pi.flex import pi_attention_flex

    def op(q, k, v, gate):
        return pi_attention_flex(q, k, v, gate, **OP, scale=q.shape[-1] ** -0.5, block_size=block_size)

    return op


def sdpa_op(backend: SDPBackend):
    def op(q, k, v, gate):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return op


def make_inputs(B, H, T, D, device, *, grad: bool, q_scale: float = 1.0, seed: int = 0, dtype=DTYPE):
    """q, k, v [B, H, T, D] of dtype ~ N(0, 1) (q times q_scale), gate [B, H, T] in (0.05, 0.95), dy."""
    g = torch.Generator(device=device).manual_seed(seed)
    q, k, v, dy = (torch.randn(B, H, T, D, generator=g, device=device).to(dtype) for _ in range(4))
    q = q * q_scale
    gate = (0.05 + 0.9 * torch.rand(B, H, T, generator=g, device=device)).to(dtype)
    for t in (q, k, v, gate):
        t.requires_grad_(grad)
    return q, k, v, gate, dy


def run_op(op, inputs, *, backward: bool, uses_gate: bool = True):
    """(y, *grads of q, k, v[, gate]) or (y,) without backward."""
    q, k, v, gate, dy = inputs
    y = op(q, k, v, gate)
    if not backward:
        return (y,)
    wrt = (q, k, v, gate) if uses_gate else (q, k, v)
    return (y, *torch.autograd.grad(y, wrt, dy))


def compare(expected, actual, tol: dict = TOL) -> tuple[bool, dict]:
    """allclose with tolerance `tol` (default bf16's), per tensor; max abs errors for the record."""
    errors, ok = {}, True
    for name, e, a in zip(NAMES, expected, actual, strict=False):
        e, a = e.float(), a.float()
        finite = bool(torch.isfinite(a).all())
        errors[name] = (a - e).abs().max().item() if finite else None
        ok = ok and finite and torch.allclose(a, e, **tol)
    return ok, errors


# ------------------------------------------------------------------------------------------------- checks

def check_backends(setup: Setup, candidates: dict) -> dict:
    """Run each candidate at the check shape against "reference"; returns label -> check record."""
    backward = "fwd+bwd" in setup.modes
    # Smoke inputs do not require grad: no_grad would compile flex a second time (grad mode is a guard).
    inputs = make_inputs(*setup.check_shape, setup.device, grad=backward)
    expected = run_op(pi_op("reference"), inputs, backward=backward)  # accumulates in fp32 itself
    # SDPA's own oracle: the math backend on fp32 copies, so that only the candidate's rounding shows.
    inputs32 = tuple(t.detach().float().requires_grad_(t.requires_grad) for t in inputs)
    dense_expected = run_op(sdpa_op(SDPBackend.MATH), inputs32, backward=backward, uses_gate=False)
    results = {}
    for label, (op, uses_gate) in candidates.items():
        t0 = time.monotonic()
        try:
            got = run_op(op, inputs, backward=backward, uses_gate=uses_gate)
            ok, errors = compare(expected if uses_gate else dense_expected, got)
            results[label] = dict(status="ok" if ok else "failed check", max_abs_err=errors)
        except Exception as exc:  # a backend that cannot run here is reported, not fatal
            results[label] = dict(status="error", error=describe_error(exc))
        r = results[label]
        r["seconds"] = round(time.monotonic() - t0, 1)
        log(f"  check {label:<20} {r['status']:<13} {check_errors(r)} ({r['seconds']} s)")
    return results


def probe_flex(setup: Setup) -> tuple[int | None, dict]:
    """The smallest block size in setup.flex_probe for which flex compiles and passes the check; the
    check records of the sizes tried, keyed by label."""
    records = {}
    for block in setup.flex_probe:
        label = f"flex-{block}"
        records.update(check_backends(setup, {label: (flex_op(block), True)}))
        if records[label]["status"] == "ok":
            return block, records
    return None, records


# --------------------------------------------------------------------------------------------- operator grid

def time_grid(setup: Setup, ops: dict, sdpa_label: str, bandwidth: float) -> list[dict]:
    """Every shape × mode × op; rows carry ms, the floor and ratios measured side by side.

    ops: label -> (op, uses_gate), or (status, None) for an op that is not timed (unavailable, failed check).
    """
    rows = []
    shapes = [(B, H, T, D) for (B, H, D) in setup.grid["BHD"] for T in setup.grid["T"]]
    for B, H, T, D in shapes:
        try:
            inputs = make_inputs(B, H, T, D, setup.device, grad="fwd+bwd" in setup.modes)
        except torch.OutOfMemoryError:
            inputs = None
        for mode in setup.modes:
            floor_ms = floor_bytes(B, H, T, D, mode) / bandwidth * 1e3
            group = []
            for label, (op, uses_gate) in ops.items():
                row = dict(B=B, H=H, T=T, D=D, mode=mode, backend=label, floor_ms=floor_ms)
                if isinstance(op, str):
                    row["status"] = op
                elif inputs is None:
                    row["status"] = "skipped: out of memory"
                elif setup.out_of_time():
                    row["status"] = "skipped: time budget"
                else:
                    row.update(time_case(setup, op, inputs, mode == "fwd+bwd", uses_gate))
                if row.get("ms"):
                    row["ratio_to_floor"] = row["ms"] / floor_ms
                group.append(row)
                shown = row["status"]
                if row.get("ms"):
                    shown = f"{row['ms']:9.3f} ms  x{row['ratio_to_floor']:.1f} floor"
                log(f"  B={B} H={H} T={T} D={D} {mode:<7} {label:<20} {shown}  [{setup.elapsed():.0f} s]")
            _add_ratios(group, sdpa_label)
            rows += group
        del inputs
        if setup.device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def time_case(setup: Setup, op, inputs, backward: bool, uses_gate: bool) -> dict:
    """{status, ms}; an op with a `prepare(inputs)` method gets its inputs laid out its way first (untimed)."""
    try:
        if hasattr(op, "prepare"):
            inputs = op.prepare(inputs)
        ms = setup.time_ms(lambda: run_op(op, inputs, backward=backward, uses_gate=uses_gate))
        return dict(status="ok", ms=ms)
    except torch.OutOfMemoryError:
        return dict(status="skipped: out of memory")
    except Exception as exc:
        return dict(status=f"error: {describe_error(exc)}")


def _add_ratios(group: list[dict], sdpa_label: str) -> None:
    """speedup_vs_X = X's ms / this row's ms (> 1: faster than X), for X = flex at block 128 and SDPA."""
    ms = {r["backend"]: r.get("ms") for r in group}
    for r in group:
        for key, ref in (("speedup_vs_flex128", "flex-128"), ("speedup_vs_sdpa", sdpa_label)):
            r[key] = ms[ref] / r["ms"] if r.get("ms") and ms.get(ref) else None


# ---------------------------------------------------------------------------------------- NaN and the layer

def nan_check(setup: Setup, ops: dict) -> dict:
    """Outputs and gradients finite at the longest shape, with scores spread around the clamp."""
    results = {}
    backward = "fwd+bwd" in setup.modes
    # |z| = |q·k|/sqrt(D) ~ 19·|N(0, 1)|: a third of the scores beyond the clamp at 20, most near it.
    inputs = make_inputs(*setup.nan_shape, setup.device, grad=backward, q_scale=19.0)
    for label, (op, uses_gate) in ops.items():
        if isinstance(op, str) or not uses_gate:
            continue
        try:
            outs = run_op(op, inputs, backward=backward)
            finite = {name: bool(torch.isfinite(t).all()) for name, t in zip(NAMES, outs, strict=False)}
            results[label] = dict(status="ok" if all(finite.values()) else "non-finite", finite=finite)
        except torch.OutOfMemoryError:
            results[label] = dict(status="skipped: out of memory")
        except Exception as exc:
            results[label] = dict(status=f"error: {describe_error(exc)}")
        log(f"  nan check {label:<20} {results[label]['status']}")
    return dict(shape=list(setup.nan_shape), q_scale=19.0, logit_clamp=OP["logit_clamp"], results=results)


class DenseLayer(nn.Module):
    """The projections of `PiAttention` around dense causal SDPA: x [B, T, d] -> [B, T, d]."""

    def __init__(self, d_model: int, n_heads: int, sdpa_backend: SDPBackend):
        super().__init__()
        self.n_heads, self.sdpa_backend = n_heads, sdpa_backend
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        q, k, v = (t.view(B, T, self.n_heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        with sdpa_kernel(self.sdpa_backend):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, T, d))


def time_layers(setup: Setup, checks: dict) -> list[dict]:
    """PiAttention (each π backend whose operator check passed) against DenseLayer, fwd and fwd+bwd; "fwd"
    is a training forward here too (the parameters require grad)."""
    d, H = setup.layer["d_model"], setup.layer["n_heads"]
    layers = {}
    # The smoke run leaves flex out: its non-contiguous q, k, v would compile flex once more.
    for backend in ("torch",) if setup.smoke else ("triton", "flex"):
        label = "flex-128" if backend == "flex" else backend
        if checks.get(label, {}).get("status") != "ok" or not hasattr(piattn, "PiAttention"):
            continue
        layers[f"PiAttention[{backend}]"] = lambda b=backend: piattn.PiAttention(
            d, H, **{k: OP[k] for k in ("window", "period", "causal", "variant")}, backend=b)
    layers[f"dense[{setup.sdpa.name.lower()}]"] = lambda: DenseLayer(d, H, setup.sdpa)
    rows = []
    for B, T in setup.layer["shapes"]:
        for mode in setup.modes:
            group = []
            for label, build in layers.items():
                row = dict(d_model=d, n_heads=H, B=B, T=T, mode=mode, layer=label)
                if setup.out_of_time():
                    row["status"] = "skipped: time budget"
                else:
                    row.update(_time_layer(setup, build, B, T, d, mode == "fwd+bwd"))
                group.append(row)
                log(f"  layer B={B} T={T} {mode:<7} {label:<22} "
                    + (f"{row['ms']:9.3f} ms" if row.get("ms") else row["status"]))
            dense = next((r.get("ms") for r in group if r["layer"].startswith("dense")), None)
            for r in group:
                r["speedup_vs_dense"] = dense / r["ms"] if r.get("ms") and dense else None
            rows += group
    return rows


def _time_layer(setup: Setup, build, B: int, T: int, d: int, backward: bool) -> dict:
    try:
        torch.manual_seed(0)
        layer = build().to(setup.device, DTYPE)
        x = torch.randn(B, T, d, device=setup.device, dtype=DTYPE, requires_grad=backward)
        dy = torch.randn_like(x)

        def step():
            y = layer(x)
            if backward:
                torch.autograd.grad(y, (x, *layer.parameters()), dy)

        return dict(status="ok", ms=setup.time_ms(step))
    except torch.OutOfMemoryError:
        return dict(status="skipped: out of memory")
    except Exception as exc:
        return dict(status=f"error: {describe_error(exc)}")


# ------------------------------------------------------------------------------------------------- report

def check_errors(check: dict) -> str:
    """A check's largest errors for a table cell (or its error message)."""
    if "max_abs_err" not in check:
        return check.get("error", "")
    errors = check["max_abs_err"].items()
    return ", ".join(f"{k} {v:.2g}" if v is not None else f"{k} non-finite" for k, v in errors)


def _cell(row: dict | None) -> str:
    if row is None:
        return ""
    if row.get("ms"):
        return f"{row['ms']:.3f} (×{row['ratio_to_floor']:.1f})"
    return row["status"]


def markdown(result: dict) -> str:
    env = result["environment"]
    rows = result["rows"]
    labels = list(dict.fromkeys(r["backend"] for r in rows))
    out = [
        f"# GPU benchmark: π-Attention operator ({env['device']})", "",
        f"torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}; bf16, causal, window=4, "
        f"period=16, adaptive. Copy bandwidth {result['copy_bandwidth_GBps']:.0f} GB/s (read + write, "
        f"measured in this run). Command: `{result['command']}`.", "",
        "Cells: median ms (× the floor = bytes that must move ÷ copy bandwidth). Speed-ups are the other "
        "backend's time ÷ triton's, from the same run. Backends whose correctness check failed are not "
        "timed.",
        "", f"Smallest flex block accepted: {result['flex_smallest_block']}.", "",
        "| B | H | T | D | mode | floor ms | " + " | ".join(labels)
        + " | triton vs flex-128 | triton vs SDPA |",
        "|" + "---|" * (8 + len(labels)),
    ]
    keys = list(dict.fromkeys((r["B"], r["H"], r["T"], r["D"], r["mode"]) for r in rows))
    for key in keys:
        group = {r["backend"]: r for r in rows if (r["B"], r["H"], r["T"], r["D"], r["mode"]) == key}
        tri = group.get("triton", {})
        speedups = [f"{tri[k]:.2f}×" if tri.get(k) else "" for k in ("speedup_vs_flex128", "speedup_vs_sdpa")]
        floor = next(iter(group.values()))["floor_ms"]
        cells = [*map(str, key), f"{floor:.3f}", *(_cell(group.get(label)) for label in labels), *speedups]
        out.append("| " + " | ".join(cells) + " |")
    out += ["", "## Correctness checks (against backend \"reference\", bf16 tolerance 2e-2)", "",
            "| backend | status | max abs error |", "|---|---|---|"]
    for label, c in result["checks"].items():
        out.append(f"| {label} | {c['status']} | {check_errors(c)} |")
    nan = result["nan_check"]
    out += ["", f"## Finiteness at shape {nan['shape']}, q × {nan['q_scale']}, clamp {nan['logit_clamp']}",
            ""]
    out += [f"- {label}: {r['status']}" for label, r in nan["results"].items()]
    layer = result["layer"]
    out += ["", f"## Whole layer (d_model {layer['d_model']}, {layer['n_heads']} heads: projections, gate "
            "MLP, attention; dense = the same projections around causal SDPA)", "",
            "| B | T | mode | layer | ms | speed-up vs dense |", "|---|---|---|---|---|---|"]
    for r in result["layer_rows"]:
        ms = f"{r['ms']:.3f}" if r.get("ms") else r["status"]
        sp = f"{r['speedup_vs_dense']:.2f}×" if r.get("speedup_vs_dense") else ""
        out.append(f"| {r['B']} | {r['T']} | {r['mode']} | {r['layer']} | {ms} | {sp} |")
    out += ["", f"Total run time {result['elapsed_s']:.0f} s."]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for gpu_bench.json and gpu_bench.md")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run of the whole script (for tests)")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="start no new case after this many seconds (default 480: the run ends within 9 min)")
    a = p.parse_args(argv)
    if not a.smoke and not torch.cuda.is_available():
        p.error("no CUDA device; use --smoke for the CPU run")
    setup = Setup(a.smoke, a.budget_s)
    result = dict(
        command=command_line("benchmarks/gpu_bench.py", argv, from_source=True),
        smoke=a.smoke, environment=environment(setup),
        config=dict(
            dtype=str(DTYPE).removeprefix("torch."), **OP, tolerance=TOL, check_shape=setup.check_shape,
            warmup=setup.warmup, repeats=setup.repeats, statistic="median", l2_flushed=not setup.smoke,
            fwd="forward of a training step (inputs require grad)" if not setup.smoke else "forward only",
            floor_bytes_per_head=dict(fwd="2(3TD+T) + 2TD + 4T", bwd="2(5TD+T) + 4T + 2(3TD+T)"),
            floor_assumption="bf16 q, k, v, gate, o and grads; one fp32 log-sum-exp per query saved by the "
                             "forward and read by the backward; nothing else touches HBM",
        ),
    )
    log(f"device: {result['environment']['device']}, torch {torch.__version__}, backends {piattn.BACKENDS}")

    bandwidth = copy_bandwidth(setup)
    result.update(copy_bandwidth_GBps=bandwidth / 1e9, copy_bytes=setup.copy_bytes)
    log(f"copy bandwidth: {bandwidth / 1e9:.0f} GB/s")

    log("correctness checks (small shape, against reference):")
    smallest, checks = probe_flex(setup)
    result["flex_smallest_block"] = smallest
    sdpa_label = f"sdpa-{setup.sdpa.name.lower()}"
    # label -> (op, uses_gate), in column order
    if setup.smoke:
        candidates = {"reference": (pi_op("reference"), True), "torch": (pi_op("torch"), True)}
    else:
        candidates = {"triton": (pi_op("triton"), True)} if "triton" in piattn.BACKENDS else {}
    candidates["flex-128"] = (flex_op(128), True)
    checks.update(check_backends(setup, {**candidates, sdpa_label: (sdpa_op(setup.sdpa), False)}))
    if smallest is not None:
        candidates[f"flex-{smallest}"] = (flex_op(smallest), True)
    candidates[sdpa_label] = (sdpa_op(setup.sdpa), False)
    not_timed = {"failed check": "failed check", "error": "check error"}
    ops = {label: op if checks[label]["status"] == "ok" else (not_timed[checks[label]["status"]], None)
           for label, op in candidates.items()}
    if not setup.smoke and "triton" not in piattn.BACKENDS:
        checks["triton"] = dict(status="unavailable")
        ops = {"triton": ("unavailable", None), **ops}
    result["checks"] = checks

    log("finiteness near the clamp:")
    result["nan_check"] = nan_check(setup, ops)
    log("whole layer:")
    result["layer"] = {k: setup.layer[k] for k in ("d_model", "n_heads")}
    result["layer_rows"] = time_layers(setup, checks)
    log("operator grid:")
    result["rows"] = time_grid(setup, ops, sdpa_label, bandwidth)
    result["elapsed_s"] = setup.elapsed()

    text = markdown(result)
    save_results(a.out, "gpu_bench", result, text)
    print(text, flush=True)
    return result


if __name__ == "__main__":
    main()
