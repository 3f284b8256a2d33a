"""Measuring the operator on this machine: time and peak memory growth, each case in a fresh process.

A fresh process per case keeps one backend's allocator state and caches from colouring the next, and makes
the peak resident-set growth (Linux VmHWM after resetting it) a clean figure for that case alone.

    measure_isolated("torch", B=1, H=8, T=8192, D=64, mode="fwd+bwd")   # runs `measure` in a child process

Also the helpers the scripts of benchmarks/ (and experiments/) share, so that none imports another's: the
machine's description (`machine_info`, `cpu_model`, `compiler_version`), timing (`sync`, `median_ms`,
`block_sizes`), what they time (`PI_SETTINGS`, `DECODE_KINDS` / `decode_model`, `fill_cache`), and their
output (`command_line`, `save_results`, `markdown_table`, `spread`, `fmt`, `log`, `describe_error`).
"""

from __future__ import annotations

import functools
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.nn.functional as F

import piattn
from piattn.config import PI_DEFAULTS

# "sdpa" (a `measure` case) is dense scaled-dot-product attention (causal), the quadratic baseline.
MODES = ("fwd", "fwd+bwd")
# A backend is timed only if it matches the reference this closely (fp64, forward and every gradient).
CHECK_TOLERANCE = 1e-9
# The operator's settings the CPU benchmarks time (cpu_bench, kernel_ab): the library's defaults, causal.
PI_SETTINGS = dict(window=PI_DEFAULTS.window, period=PI_DEFAULTS.period, causal=True, variant="adaptive",
                   prior=PI_DEFAULTS.prior, logit_clamp=PI_DEFAULTS.logit_clamp, eps=PI_DEFAULTS.eps)
# The GPT kinds the decoding benchmarks time (decode_bench, decode_profile, kernel_ab): kind -> GPTConfig
# overrides. "pi-union" is π without the gate MLP (what the gate costs a step); "ms-pi" is multi-scale π (the
# designer's per-head periods: every head over its own slots in one call a layer).
DECODE_KINDS = {"pi": dict(attention="pi"), "pi-union": dict(attention="pi", variant="union"),
                "ms-pi": dict(attention="pi", period="cover"),
                "local": dict(attention="local"), "dense": dict(attention="dense")}


def error_vs_reference(backend: str) -> float:
    """Largest abs difference to "reference" of output and all gradients: adaptive, fp64, both directions."""
    worst = 0.0
    for causal in (True, False):
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, 2, 300, 32, dtype=torch.float64, requires_grad=True) for _ in range(3))
        gate = (0.05 + 0.9 * torch.rand(1, 2, 300, dtype=torch.float64)).requires_grad_()
        outs = []
        for b in ("reference", backend):
            y = piattn.pi_attention(q, k, v, gate, causal=causal, backend=b)
            outs.append((y, *torch.autograd.grad(y.square().sum(), (q, k, v, gate))))
        worst = max(worst, *((a - b).abs().max().item() for a, b in zip(*outs, strict=True)))
    return worst


def rss_kib(field: str = "VmRSS") -> int:
    """A memory figure of this process from /proc/self/status, in KiB: VmRSS (now) or VmHWM (peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not found in /proc/self/status")


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0). False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _call(case: str, q, k, v, gate, window: int, period: int):
    if case == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return piattn.pi_attention(q, k, v, gate, window=window, period=period, backend=case)


def measure(case: str, *, B: int, H: int, T: int, D: int, dtype: torch.dtype = torch.float32,
            mode: str = "fwd+bwd", window: int = PI_DEFAULTS.window, period: int = PI_DEFAULTS.period, repeats: int = 5,
            device: str = "cpu") -> dict:
    """Time (median ms over `repeats` after one warm-up) and peak memory growth (MiB, first call) of one case."""
    torch.manual_seed(0)
    grad = mode == "fwd+bwd"
    q, k, v = (torch.randn(B, H, T, D, dtype=dtype, device=device, requires_grad=grad) for _ in range(3))
    gate = (0.05 + 0.9 * torch.rand(B, H, T, device=device)).to(dtype).requires_grad_(grad)
    dy = torch.randn(B, H, T, D, dtype=dtype, device=device)

    def step(q, k, v, gate, dy):
        y = _call(case, q, k, v, gate, window, period)
        if grad:
            y.backward(dy)
        if device != "cpu":
            torch.cuda.synchronize()

    # A tiny call first: library start-up (thread pools, kernels' workspaces) is not the case's memory.
    step(*(t[:, :, :64].detach().requires_grad_(grad) for t in (q, k, v, gate)), dy[:, :, :64])
    step = functools.partial(step, q, k, v, gate, dy)
    peak_mib = None
    if device == "cpu" and reset_peak_rss():
        before = rss_kib("VmRSS")
        step()
        peak_mib = (rss_kib("VmHWM") - before) / 1024
    else:
        step()
    times = []
    for _ in range(repeats):
        for t in (q, k, v, gate):
            t.grad = None
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return dict(case=case, mode=mode, B=B, H=H, T=T, D=D, dtype=str(dtype).removeprefix("torch."),
                window=window, period=period, ms=times[len(times) // 2], ms_min=times[0],
                peak_mib=peak_mib, threads=torch.get_num_threads())


def measure_isolated(case: str, **kwargs) -> dict:
    """`measure` in a fresh Python process; returns its result, or {"error": ...} if the process failed."""
    request = json.dumps({"case": case, **{k: str(v).removeprefix("torch.") if k == "dtype" else v
                                           for k, v in kwargs.items()}})
    proc = subprocess.run([sys.executable, "-m", "piattn.benchmarking", request], capture_output=True, text=True)
    if proc.returncode != 0:
        return dict(case=case, **{k: str(v) for k, v in kwargs.items()},
                    error=proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def fill_cache(cache, position: int, generator: torch.Generator) -> None:
    """Bring every layer of a model's decoding cache to `position` tokens seen, with random keys and values:
    decoding speed at a position without decoding the text before it (ring caches are full-size already,
    growing ones get `position` rows)."""
    for layer in cache.layers:
        if hasattr(layer, "capacity"):
            layer.k.normal_(generator=generator)
            layer.v.normal_(generator=generator)
        else:
            B, H, _, D = layer.k.shape
            layer.k = torch.randn(B, H, position, D, generator=generator).to(layer.k)
            layer.v = torch.randn(B, H, position, D, generator=generator).to(layer.v)
        layer.seen = position


def decode_model(kind: str, config: str = "tiny"):
    """The GPT of `kind` (a DECODE_KINDS name) in the named config, vocabulary 256, no dropout, in eval mode,
    its weights from seed 0: the model the decoding benchmarks time."""
    from piattn.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig.from_name(config, **DECODE_KINDS[kind], vocab_size=256, dropout=0.0)).eval()


def timed_step(model, forward, optimizer, idx: torch.Tensor) -> float:
    """Seconds of one training step on idx [B, T + 1] through `forward` (the model, or it compiled): loss,
    backward, gradient clipping and AdamW on `model`'s parameters."""
    start = time.perf_counter()
    logits = forward(idx[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def block_sizes(steps: int) -> list[int]:
    """The timed steps cut into blocks of 16 (the last one shorter): a step's time is the median of the
    blocks' means, so that a spell of a shared machine's other work touches one block, not the figure."""
    return [16] * (steps // 16) + ([steps % 16] if steps % 16 else [])


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on a CPU), so that a wall-clock reading includes it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], object], repeats: int, *, cuda: bool = False,
              before: Callable[[], object] | None = None) -> float:
    """Median ms of fn() over `repeats` runs: CUDA events on a GPU, with before() (e.g. an L2 flush, so that
    the inputs come from HBM) run ahead of each outside the timed span; wall clock on a CPU."""
    times = []
    for _ in range(repeats):
        if cuda:
            if before is not None:
                before()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def command_line(script: str, argv: list[str] | None, *, from_source: bool = False) -> str:
    """How to reproduce this run: `python SCRIPT` and its arguments (argv, or the process's when None),
    prefixed with `PYTHONPATH=src` when the script runs from a source tree without piattn installed (the
    GPU machines)."""
    words = ["python", script, *(argv if argv is not None else sys.argv[1:])]
    return " ".join(["PYTHONPATH=src", *words] if from_source else words)


def save_results(out: Path, name: str, result: dict, table: str) -> None:
    """Write a benchmark's result as out/NAME.json and its markdown table as out/NAME.md."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{name}.md").write_text(table)


def markdown_table(header: Iterable[str], rows: Iterable[Iterable[object]]) -> list[str]:
    """The lines of a markdown table: the header, its rule, one line per row (cells through str)."""
    header = list(header)
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(map(str, row)) + " |" for row in rows)]


def spread(values: Iterable[float], spec: str = ".3f", brackets: str = "()") -> str:
    """The median of `values` and their range in brackets, each formatted by `spec`: "1.50 (1.20–1.90)"."""
    values = sorted(values)
    low, high = (format(v, spec) for v in (values[0], values[-1]))
    return f"{format(statistics.median(values), spec)} {brackets[0]}{low}–{high}{brackets[1]}"


def fmt(value, spec: str = ".3f", missing: str = "–") -> str:
    """`value` formatted by `spec`, or `missing` for None (a table cell of a figure not measured)."""
    return missing if value is None else format(value, spec)


def log(msg: str) -> None:
    """A progress line, flushed at once (a run's log is read while it runs, or after it is killed)."""
    print(msg, flush=True)


def describe_error(exc: BaseException) -> str:
    """Exception type and the first line of its message, cut at 300 characters (compiler errors run to pages)."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}"


def machine_info() -> dict:
    return dict(machine=platform.machine(), processor=platform.processor() or platform.machine(),
                cpu_count=torch.get_num_threads(), python=platform.python_version(),
                torch=torch.__version__, piattn=piattn.__version__, platform=platform.platform())


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("unknown" where it has none); `platform.processor()` (often
    just the architecture) where there is no /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        return platform.processor() or platform.machine()


def compiler_version(compiler: str = "cc") -> str:
    """The first line of `compiler --version`: "unknown" if it says nothing, "none" if there is no compiler."""
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=10)
        return done.stdout.splitlines()[0] if done.returncode == 0 and done.stdout else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "none"


if __name__ == "__main__":  # the child process of `measure_isolated`: one JSON request in, one JSON line out
    request = json.loads(sys.argv[1])
    if "dtype" in request:
        request["dtype"] = getattr(torch, request["dtype"])
    print(json.dumps(measure(request.pop("case"), **request)))
