"""CPU benchmark of the π-Attention backends against the memory floor: the bytes a call must move, at the
speed this machine copies memory.

The floor of a call is the bytes it must read and write once, divided by the copy bandwidth (a 256 MiB
`copy_`, counted as 2 × 256 MiB moved): fp32, forward-only reads q, k, v, gate and writes y and one
statistic per row, 4·B·H·(4·T·D + 2·T) bytes; forward and backward add reading q, k, v, gate, y, dy and the
statistic and writing dq, dk, dv, dgate, 4·B·H·(12·T·D + 5·T) in all. Each backend's time is reported in
ms and as a multiple of that floor.

Everything runs in one process, interleaved: each repeat times the copy and then every case once, so that
a busy machine slows them alike; the tables give medians. Threads: every case at one thread, and the
`--threaded-cases` at each other count of `--threads` too, against the copy bandwidth at that count. The
backend functions are called directly (`pi_attention`'s argument checks are the same for all of them and
not timed). A backend whose forward or gradients differ from the reference is reported as failed and not
timed; "fused" without its compiled kernels is reported as unavailable (it refuses every call).

Huge pages: the fused backend places its large outputs on transparent huge pages by default
(`piattn.allocator.huge_pages`); `--huge-pages on off` times the cases it touches ("fused" and "outputs")
both ways, interleaved call by call in one process. Beside each time: the page faults of the call (the
process's minor faults, `getrusage`, median over the repeats): the first touches of fresh memory.

    OMP_WAIT_POLICY=passive python benchmarks/cpu_bench.py --out benchmarks/results/cpu_bench   # T = 1K … 16K, ~2 min
    python benchmarks/cpu_bench.py --lengths 1024 2048 --repeats 3 --out /tmp/b    # quick
    OMP_WAIT_POLICY=passive python benchmarks/cpu_bench.py --lengths 8192 16384 32768 --cases fused \
        --huge-pages on off --name cpu_bench_hugepages --repeats 7

Results go to NAME.{json,md} in --out: --name, else cpu_bench, or cpu_bench_kept_pages with
--keep-freed-pages.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

import piattn
from piattn import allocator
from piattn.allocator import keep_freed_pages
from piattn.benchmarking import CHECK_TOLERANCE, PI_SETTINGS, compiler_version, cpu_model, machine_info, save_results
from piattn.ops.pi import fused
from piattn.ops.pi.fused import pi_attention_fused
from piattn.ops.pi.reference import pi_attention_reference
from piattn.ops.pi.settings import OpSettings
from piattn.ops.pi.torch import pi_attention_torch

SHAPE = dict(B=1, H=8, D=64)
SETTINGS = PI_SETTINGS  # the operator's settings every CPU benchmark times (kernel_ab's too)
FUNCTIONS = {"reference": pi_attention_reference, "torch": pi_attention_torch, "fused": pi_attention_fused}
# Not a backend: allocating the outputs of a call and writing them once, the part of any backend's time that
# fresh memory costs (the kernel zeroes each new page on its first write: a second write the floor does not
# count).
OUTPUTS = "outputs"
# The fused kernels alone: forward (and backward) written into outputs allocated once, before timing, without
# autograd: what the fused backend costs without the first touches of fresh memory.
KERNEL = "fused-kernel"
# What a user's training step runs: `piattn.pi_attention` on its defaults (backend "auto", its argument checks
# included) with autograd, gradients cleared before each call and the cotangent allocated in the loop (a new
# tensor written once, as an upstream layer's gradient is), where the backend rows reuse one cotangent.
USER = "user"
MODES = ("fwd", "fwd+bwd")
FP32_BYTES = 4
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The cases whose memory the huge-page setting changes (the others run once, under the library's default).
HUGE_PAGE_CASES = ("fused", USER, OUTPUTS)
# Variables that change the timings, recorded with the command: OMP_WAIT_POLICY=passive keeps idle OpenMP
# threads (torch's and the fused kernels') from spinning on a machine whose cores other processes share.
ENVIRONMENT = ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "PIATTN_NATIVE", "PIATTN_HUGE_PAGES", "CC")


def floor_bytes(mode: str, *, B: int, H: int, T: int, D: int, element: int = FP32_BYTES) -> int:
    """The bytes a call must move at least: its inputs read and its outputs written once, `element` bytes
    each (4: fp32, 2: bf16 / fp16)."""
    per_head = 4 * T * D + 2 * T if mode == "fwd" else 12 * T * D + 5 * T
    return element * B * H * per_head


def slope(rows: list[dict], case: str, mode: str, key: str, threads: int = 1,
          huge_pages: bool | None = None) -> float | None:
    """Least-squares slope of log(key) against log(T): 1.0 means linear in T."""
    pts = [(math.log(r["T"]), math.log(r[key])) for r in rows
           if r["case"] == case and r["mode"] == mode and r.get("threads", 1) == threads and r.get(key)
           and r.get("huge_pages") == huge_pages]
    if len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


def _call(case: str, q, k, v, gate, scale: float):
    return FUNCTIONS[case](q, k, v, gate, scale=scale, dropout_keep=None, dropout_p=0.0, **SETTINGS)


def check(case: str) -> float:
    """Largest abs difference to the reference of y and every gradient: adaptive, fp64, both directions."""
    worst = 0.0
    for causal in (True, False):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 2, 300, 32, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
        gate = (0.05 + 0.9 * torch.rand(1, 2, 300, generator=g, dtype=torch.float64)).requires_grad_()
        outs = []
        for function in (pi_attention_reference, FUNCTIONS[case]):
            y = function(q, k, v, gate, scale=32**-0.5, dropout_keep=None, dropout_p=0.0,
                         **{**SETTINGS, "causal": causal})
            outs.append((y, *torch.autograd.grad(y.square().sum(), (q, k, v, gate))))
        worst = max(worst, *((a - b).abs().max().item() for a, b in zip(*outs, strict=True)))
    return worst


class Inputs:
    """q, k, v [B, H, T, D], a gate [B, H, T] in (0.05, 0.95) and a cotangent dy, seeded (fp32 unless
    `dtype`)."""

    def __init__(self, *, B: int, H: int, T: int, D: int, dtype: torch.dtype = torch.float32):
        g = torch.Generator().manual_seed(0)
        self.q, self.k, self.v = (torch.randn(B, H, T, D, generator=g).to(dtype).requires_grad_() for _ in range(3))
        self.gate = (0.05 + 0.9 * torch.rand(B, H, T, generator=g)).to(dtype).requires_grad_()
        self.dy = torch.randn(B, H, T, D, generator=g).to(dtype)
        self.scale = D**-0.5
        self.reused = None  # outputs of KERNEL's calls

    def run(self, case: str, mode: str) -> tuple[float, int]:
        """One call of `case` in `mode`: (its wall time in ms, the page faults during it). Gradients are
        cleared before, not timed."""
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        ms = self._run(case, mode)
        return ms, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults

    def _run(self, case: str, mode: str) -> float:
        if case == OUTPUTS:
            return self.fresh_outputs(mode)
        if case == KERNEL:
            return self.kernel(mode)
        if case == USER:
            return self.user_step(mode)
        return self.timed(case, mode)

    def timed(self, case: str, mode: str) -> float:
        """ms of one call of backend `case` in `mode` through autograd, with the one cotangent `dy`."""
        return self._through_autograd(mode, lambda *t: _call(case, *t, self.scale), lambda y: self.dy)

    def user_step(self, mode: str) -> float:
        """ms of one `piattn.pi_attention` call on its defaults as a training loop makes it (see USER)."""
        return self._through_autograd(mode, lambda *t: piattn.pi_attention(*t, **SETTINGS, scale=self.scale),
                                      lambda y: torch.empty_like(y).copy_(self.dy))

    def _through_autograd(self, mode: str, call, cotangent) -> float:
        """ms of `call(q, k, v, gate)` (fwd: under no_grad; else backward from `cotangent(y)`, made inside the
        timing); gradients cleared before, untimed."""
        tensors = (self.q, self.k, self.v, self.gate)
        for t in tensors:
            t.grad = None
        start = time.perf_counter()
        if mode == "fwd":
            with torch.no_grad():
                call(*tensors)
        else:
            y = call(*tensors)
            y.backward(cotangent(y))
        return (time.perf_counter() - start) * 1e3

    def kernel(self, mode: str) -> float:
        """ms of the fused kernels of `mode` writing into outputs of an earlier call."""
        settings = OpSettings(**SETTINGS, scale=self.scale, dropout_p=0.0, sinks=0)
        q, k, v, gate = (t.detach() for t in (self.q, self.k, self.v, self.gate))
        if self.reused is None:  # allocated and written once, untimed
            forward = fused.fused_forward(q, k, v, gate, settings)
            self.reused = forward, fused.fused_backward(self.dy, q, k, v, gate, forward[1], settings, want_dgate=True)
        start = time.perf_counter()
        _, stat = fused.fused_forward(q, k, v, gate, settings, out=self.reused[0])
        if mode != "fwd":
            fused.fused_backward(self.dy, q, k, v, gate, stat, settings, want_dgate=True, out=self.reused[1])
        return (time.perf_counter() - start) * 1e3

    def fresh_outputs(self, mode: str) -> float:
        """ms to allocate the outputs of `mode` (y and one statistic per row; with the backward also dq, dk,
        dv, dgate) as the fused backend does (huge pages where the setting says) and write each once."""
        shapes = [self.q.shape, self.gate.shape]
        if mode != "fwd":
            shapes += [self.q.shape, self.k.shape, self.v.shape, self.gate.shape]
        start = time.perf_counter()
        for shape in shapes:
            t = torch.empty(shape, dtype=self.q.dtype)
            allocator.advise_huge_pages(t)
            t.fill_(1.0)
        return (time.perf_counter() - start) * 1e3


class Copy:
    """A `copy_` of `mib` MiB between two buffers allocated (and touched) once."""

    def __init__(self, mib: int):
        self.src = torch.randn(mib * 2**20 // FP32_BYTES)
        self.dst = torch.empty_like(self.src)
        self.dst.copy_(self.src)
        self.moved = 2 * self.src.numel() * FP32_BYTES  # read once, written once

    def run(self) -> float:
        start = time.perf_counter()
        self.dst.copy_(self.src)
        return (time.perf_counter() - start) * 1e3


def measure(lengths: list[int], cases: list[str], thread_counts: list[int], threaded: list[str], repeats: int,
            copy: Copy, log=print, huge_pages: tuple[bool, ...] = (True,),
            dtype: torch.dtype = torch.float32) -> tuple[list[dict], dict[int, list[float]]]:
    """Interleaved timings: (rows of medians by T, mode, case, threads and huge-page setting; copy times in ms
    by threads). The cases of HUGE_PAGE_CASES run once per `huge_pages` setting, call after call; the others
    once, with huge pages as the library's default (their row's huge_pages: None)."""
    copy_ms: dict[int, list[float]] = {n: [] for n in thread_counts}
    rows = []
    plan = [(n, case, hp) for n in thread_counts for case in cases if n == 1 or case in threaded
            for hp in (huge_pages if case in HUGE_PAGE_CASES else (None,))]
    before, default = torch.get_num_threads(), allocator.huge_pages()
    element = torch.empty((), dtype=dtype).element_size()

    def run(inputs, case, mode, hp):
        allocator.huge_pages(default if hp is None else hp)
        return inputs.run(case, mode)

    try:
        for T in lengths:
            inputs = Inputs(**SHAPE, T=T, dtype=dtype)
            times = {(n, case, hp, mode): [] for n, case, hp in plan for mode in MODES}
            faults = {key: [] for key in times}
            for n, case, hp in plan:  # warm-up: thread pools, the compiled library, first allocations
                torch.set_num_threads(n)
                for mode in MODES:
                    run(inputs, case, mode, hp)
            for r in range(repeats):
                for n in thread_counts:
                    torch.set_num_threads(n)
                    copy_ms[n].append(copy.run())
                    for case, hp in ((c, h) for m, c, h in plan if m == n):
                        for mode in MODES:
                            ms, count = run(inputs, case, mode, hp)
                            times[n, case, hp, mode].append(ms)
                            faults[n, case, hp, mode].append(count)
                log(f"T={T} repeat {r + 1}/{repeats}: " + ", ".join(
                    f"{case}{_pages(hp)}/{n}t {mode} {times[n, case, hp, mode][-1]:.1f}"
                    for n, case, hp in plan for mode in MODES))
            for (n, case, hp, mode), ms in times.items():
                rows.append(dict(case=case, mode=mode, T=T, threads=n, huge_pages=hp, ms=statistics.median(ms),
                                 ms_min=min(ms), ms_all=ms, faults=statistics.median(faults[n, case, hp, mode]),
                                 faults_all=faults[n, case, hp, mode],
                                 bytes=floor_bytes(mode, **SHAPE, T=T, element=element)))
            del inputs
    finally:
        torch.set_num_threads(before)
        allocator.huge_pages(default)
    return rows, copy_ms


def _pages(hp: bool | None) -> str:
    return "" if hp is None else " [huge pages on]" if hp else " [huge pages off]"


def add_floors(rows: list[dict], copy_ms: dict[int, list[float]], moved: int) -> dict[int, float]:
    """Each row's floor (ms at the median copy bandwidth of its thread count) and its multiple of it; returns
    the bandwidths in GB/s by thread count."""
    bandwidth = {n: moved / (statistics.median(ms) / 1e3) / 1e9 for n, ms in copy_ms.items()}
    for r in rows:
        r["floor_ms"] = r["bytes"] / (bandwidth[r["threads"]] * 1e9) * 1e3
        r["x_floor"] = r["ms"] / r["floor_ms"]
        r["x_floor_min"] = r["ms_min"] / r["floor_ms"]
    return bandwidth


def markdown(result: dict) -> str:
    rows, threads = result["rows"], result["threads"]
    machine = result["machine"]
    bw = ", ".join(f"{n} thread{'s' if n > 1 else ''}: {b:.1f} GB/s" for n, b in result["copy_gb_s"].items())
    dtype = result.get("dtype", "float32")
    element = torch.empty((), dtype=DTYPES[dtype]).element_size()
    load = result.get("load")
    out = [f"# CPU benchmark: π-Attention backends against the memory floor ({result['cpu']}, "
           f"{machine['cpu_count']} threads, torch {machine['torch']}, piattn {machine['piattn']})", "",
           f"B={SHAPE['B']} H={SHAPE['H']} D={SHAPE['D']} {dtype}, window={SETTINGS['window']}, "
           f"period={SETTINGS['period']}, {SETTINGS['variant']}, causal, logit clamp {SETTINGS['logit_clamp']}. "
           f"Medians of {result['repeats']} interleaved repeats in one process. Floor = bytes that must move "
           f"(fwd: {element}·B·H·(4·T·D + 2·T), fwd+bwd: {element}·B·H·(12·T·D + 5·T)) / copy bandwidth "
           f"({result['copy_mib']} MiB copy_, 2 × size moved; {bw}); × floor = ms / floor ms. Multi-thread "
           f"columns are against the copy bandwidth at that thread count. '{OUTPUTS}' is no backend: the time to "
           "allocate a call's outputs and write them once (the kernel zeroes each fresh page on its first write), "
           f"part of every backend's time and of none's floor; '{KERNEL}' is the fused kernels writing into outputs "
           f"allocated once (no autograd, no fresh memory); '{USER}' is what a training step runs: `pi_attention` on "
           "its defaults with autograd and the cotangent allocated in the loop, where the backend rows reuse one. "
           "'huge pages': the library's setting "
           "(`piattn.allocator.huge_pages`) for the cases it changes, timed both ways call after call where both "
           "are listed ('–': a case it does not change, run with the default). 'faults': the process's minor page "
           "faults during the call (median). 'best' is the fastest repeat: the least disturbed by the other "
           "processes on this machine.", "",
           f"Machine: {machine['platform']}, Python {machine['python']}; C compiler: {result['compiler']}; "
           f"fused built with: {result['fused_flags']}; transparent huge pages: {result.get('thp', '?')}.", "",
           f"Command: `{result['command']}`", ""]
    if load:
        out += [f"Load average (1 min) before and after: {load[0]:.2f}, {load[1]:.2f}.", ""]
    more = [n for n in threads if n != 1]
    for mode in MODES:
        head = "| T | MB | floor ms | case | huge pages | ms | × floor | faults | best ms | best × floor |"
        rule = "|---:|---:|---:|---|---|---:|---:|---:|---:|---:|"
        for n in more:
            head += f" ms ({n} threads) | × floor ({n}) | speed-up ×{n} |"
            rule += "---:|---:|---:|"
        out += [f"## {mode}", "", head, rule]
        for T in result["lengths"]:
            for case in result["cases"]:
                for hp in (True, False, None):
                    one = _row(rows, case, mode, T, 1, hp)
                    if one is None:
                        continue
                    shown = "–" if hp is None else "on" if hp else "off"
                    line = (f"| {T} | {one['bytes'] / 1e6:.0f} | {one['floor_ms']:.1f} | {case} | {shown} | "
                            f"{one['ms']:.1f} | {one['x_floor']:.2f} | {one.get('faults', 0):.0f} | "
                            f"{one['ms_min']:.1f} | {one['x_floor_min']:.2f} |")
                    for n in more:
                        r = _row(rows, case, mode, T, n, hp)
                        line += (" | | |" if r is None else
                                 f" {r['ms']:.1f} | {r['x_floor']:.2f} | {one['ms'] / r['ms']:.2f} |")
                    out.append(line)
        out.append("")
    out += ["## Growth with T (log-log slope of ms over the measured lengths, one thread; 1.0 = linear)", "",
            "| case | huge pages | mode | slope |", "|---|---|---|---:|"]
    for s in result["slopes"]:
        shown = "–" if s["time"] is None else f"{s['time']:.2f}"
        hp = s.get("huge_pages")
        out.append(f"| {s['case']} | {'–' if hp is None else 'on' if hp else 'off'} | {s['mode']} | {shown} |")
    checks = ", ".join(f"{b}: {e:.1e}" for b, e in result["checks"].items())
    out += ["", f"Correctness before timing (max abs diff to reference, fp64, fwd + all grads): {checks}."]
    out += [f"Not timed: {case}: {why}." for case, why in result["not_timed"].items()]
    return "\n".join(out) + "\n"


def _row(rows, case, mode, T, threads, huge_pages=None):
    return next((r for r in rows if (r["case"], r["mode"], r["T"], r["threads"], r.get("huge_pages")) ==
                 (case, mode, T, threads, huge_pages)), None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu_bench"))
    p.add_argument("--name", help="results go to NAME.{json,md} (default: cpu_bench, or cpu_bench_kept_pages)")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192, 16384])
    p.add_argument("--cases", nargs="+", default=list(FUNCTIONS), choices=list(FUNCTIONS))
    p.add_argument("--dtype", default="float32", choices=list(DTYPES),
                   help="of the timed inputs (the floor counts its bytes); the correctness check stays fp64")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread counts (1 is always run)")
    p.add_argument("--threaded-cases", nargs="+", default=["torch", "fused", USER, KERNEL],
                   choices=[*FUNCTIONS, USER, KERNEL],
                   help="the cases also timed at the other thread counts")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--copy-mib", type=int, default=256, help="size of the copy that measures the bandwidth")
    p.add_argument("--no-outputs", action="store_true", help=f"skip the {OUTPUTS!r} row (fresh output memory)")
    p.add_argument("--no-kernel", action="store_true", help=f"skip the {KERNEL!r} row (outputs reused)")
    p.add_argument("--no-user", action="store_true", help=f"skip the {USER!r} row (a training loop's call)")
    p.add_argument("--keep-freed-pages", action="store_true",
                   help="glibc serves large tensors from its heap and keeps freed memory mapped "
                        "(piattn.allocator.keep_freed_pages), instead of mapping each call's outputs afresh")
    p.add_argument("--huge-pages", nargs="+", default=["on"], choices=["on", "off"],
                   help="the library's huge pages for large outputs (piattn.allocator.huge_pages) in the cases "
                        f"they change ({', '.join(HUGE_PAGE_CASES)}); both: each call timed both ways")
    args = p.parse_args(argv)
    if args.keep_freed_pages:
        keep_freed_pages()
    huge_pages = tuple(dict.fromkeys(a == "on" for a in args.huge_pages))
    load_before = os.getloadavg()[0]

    not_timed = {}
    if "fused" in args.cases and fused.unavailable() is not None:
        not_timed["fused"] = f"unavailable ({fused.unavailable()})"
    checks = {c: check(c) for c in args.cases if c != "reference" and c not in not_timed}
    not_timed.update({c: f"failed the correctness check ({e:.1e})" for c, e in checks.items() if e > CHECK_TOLERANCE})
    cases = [c for c in args.cases if c not in not_timed]
    cases += [] if args.no_user else [USER]
    cases += [KERNEL] if "fused" in cases and not args.no_kernel else []
    cases += [] if args.no_outputs else [OUTPUTS]
    threads = sorted({1, *args.threads})
    copy = Copy(args.copy_mib)
    rows, copy_ms = measure(args.lengths, cases, threads, args.threaded_cases, args.repeats, copy,
                            huge_pages=huge_pages, dtype=DTYPES[args.dtype])
    bandwidth = add_floors(rows, copy_ms, copy.moved)
    flags = " ".join(fused.build_flags() or ()) or "–"
    result = dict(machine=machine_info(), cpu=cpu_model(), compiler=compiler_version(), fused_flags=flags,
                  shape=SHAPE, settings=SETTINGS, lengths=args.lengths, cases=cases, threads=threads,
                  dtype=args.dtype, repeats=args.repeats, copy_mib=args.copy_mib, copy_gb_s=bandwidth,
                  keep_freed_pages=args.keep_freed_pages, huge_pages=list(huge_pages), thp=_thp(),
                  load=[load_before, os.getloadavg()[0]],
                  copy_ms={n: ms for n, ms in copy_ms.items()}, checks=checks, not_timed=not_timed, rows=rows,
                  command=" ".join([*(f"{name}={os.environ[name]}" for name in ENVIRONMENT if name in os.environ),
                                    "python", sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
                  slopes=[dict(case=c, mode=m, huge_pages=hp, time=slope(rows, c, m, "ms", huge_pages=hp))
                          for c in cases for hp in (huge_pages if c in HUGE_PAGE_CASES else (None,))
                          for m in MODES])
    table = markdown(result)
    name = args.name or ("cpu_bench_kept_pages" if args.keep_freed_pages else "cpu_bench")
    save_results(args.out, name, result, table)
    print(table)
    return 0


def _thp() -> str:
    """The kernel's THP mode and defrag setting, as the library sees them."""
    mode = allocator.thp_mode()
    if mode is None:
        return "none (no /sys/kernel/mm/transparent_hugepage)"
    try:
        with open("/sys/kernel/mm/transparent_hugepage/defrag") as f:
            defrag = f.read().strip()
    except OSError:
        defrag = "?"
    return f"enabled [{mode}], defrag {defrag}"


if __name__ == "__main__":
    raise SystemExit(main())
