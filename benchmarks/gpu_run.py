"""One prepared GPU session: environment, the CUDA tests, the kernels, the tile sweep, the overheads and the
models, each in its budget; the budgets (BUDGETS, their one home) add up to at most RUN_S (docs/gpu.md).

    PYTHONPATH=src python3 benchmarks/gpu_run.py --out DIR                  # GPU, within RUN_S
    PYTHONPATH=src python3 benchmarks/gpu_run.py --out DIR --steps kernels  # one step again, alone
    PYTHONPATH=src python3 benchmarks/gpu_run.py --smoke --out /tmp/smoke   # CPU, tiny, about a minute

Steps, in order (`--steps` runs a selection, in this order; `--ops` a selection of the kernel ops); each
starts nothing new once its budget (or the total, --budget-s) is spent, keeps what it measured, and a step
that crashes is recorded and the next one runs:
  env       device, versions, SM count, memory, device-to-device copy bandwidth (gpu_bench.copy_bandwidth);
  tests     pytest over the CUDA test files, the changed Triton code's first (CUDA_TESTS), then every other
            test file that uses DEVICE or torch.cuda, killed at its budget; junit counts, the failures' ids
            and first message lines, the log's tail;
  kernels   bf16, B 8, H 16, D 64, T 4K-32K, fwd and fwd+bwd: π (triton), π with per-head periods (one
            launch), π's union variant, local, dense SDPA, flash-sparse-attn (the union function, and a
            sliding window as the real local peer, when .whl/ carries it) and FlexAttention through a
            kernel-options probe (FLEX_CONFIGS: the first that passes its check is timed; each failure's
            reason is kept); every op first checked against backend "reference"; finiteness at 32K near the
            clamp. Each row: ms, × the one-pass floor and, for π's kernels, × the floor of the design that
            runs (gpu_bench.design_floor_bytes: two-kernel backward), beside its target;
  d128      the D 128 cells (bf16, T 8K-32K): π, union, local, SDPA, flash-sparse-attn;
  tune      the tile sweep, a handful of settings per shape (gpu_tune.py, its own gpu_tune.{json,md});
  overhead  where a small and a large call's time goes: kernels, eager (a user's gate: its check, one sync),
            a layer's call (no sync), torch.compile, one CUDA-graph replay (gpu_overhead.py), and whether a
            CUDA graph captures a whole training step of a π GPT (forward, backward, AdamW);
  model     `small` GPT training tokens/s at 8K-32K, batch > 1 (dense, local, π, multi-scale π), and the
            decode tokens/s and cache memory of a SmolLM2-shaped random-weight model (dense cache, local +
            sinks, π + sinks) at 2K-32K (gpu_model.py).
Baselines already measured (dense SDPA and flash-sparse-attn's union, benchmarks/results/gpu/gpu_run_b8.json) are
taken from that file, not timed again, unless --remeasure-baselines. After every step it writes
DIR/gpu_run.json and DIR/gpu_run.md (a kill keeps the finished steps), plus gpu_tests_tail.log,
gpu_tests.xml, gpu_run.png and gpu_tune.{json,md}: seven files.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is first imported (by piattn)

from torch.nn.attention import SDPBackend  # noqa: E402

import gpu_bench as gb  # noqa: E402  (after TRITON_INTERPRET)
import gpu_model  # noqa: E402
import gpu_overhead  # noqa: E402
import gpu_tune  # noqa: E402
import peers  # noqa: E402
import piattn  # noqa: E402
from piattn.benchmarking import command_line, describe_error, fmt, log, markdown_table, median_ms  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# Seconds per step, in the order they run: the one home of the run's budget (docs/gpu.md states the total).
BUDGETS = dict(env=10.0, tests=130.0, kernels=100.0, d128=30.0, tune=40.0, overhead=30.0, model=80.0)
RUN_S = 420.0  # 7 minutes of a session's 15, the machine's start and the copies back besides
assert sum(BUDGETS.values()) <= RUN_S
TAIL_LINES = 300
# The changed Triton code's tests first (xdist hands tests out in collection order, so a run killed at its
# budget has them), then the other CUDA files of the earlier runs; `test_files` adds any other that touches CUDA.
CUDA_TESTS = ("tests/ops/test_no_host_sync.py", "tests/ops/test_triton.py", "tests/ops/test_triton_head_periods.py",
              "tests/ops/test_conformance.py", "tests/ops/test_head_periods.py", "tests/ops/test_features.py",
              "tests/ops/test_compile.py", "tests/ops/test_flex.py")
# Measured already (second session, B 8, H 16): taken from the file unless --remeasure-baselines.
BASELINE_FILE = ROOT / "benchmarks" / "results" / "gpu" / "gpu_run_b8.json"
BASELINES = ("sdpa", "sdpa-fp32", "fsa-union")
# FlexAttention under torch 2.11 compiled at no block size in the second session (16-64: no kernel
# configuration; 128: 240 KiB of shared memory asked, 227 KiB there): (label, block size, kernel options),
# tried in order until one passes its check. fwd_/bwd_ options reach only the forward or the backward kernels.
FLEX_CONFIGS = (
    ("flex-128-s1", 128, dict(fwd_num_stages=1, bwd_num_stages=1)),
    ("flex-128-t64", 128, dict(fwd_BLOCK_M=64, fwd_BLOCK_N=64, fwd_num_stages=1, bwd_BLOCK_M1=32, bwd_BLOCK_N1=64,
                               bwd_BLOCK_M2=64, bwd_BLOCK_N2=32, bwd_num_stages=1, num_warps=4)),
    ("flex-64-s1", 64, dict(fwd_num_stages=1, bwd_num_stages=1, num_warps=4)),
    ("flex-128", 128, {}),
)
SMOKE_FLEX_CONFIGS = (("flex-16", 16, {}),)
# What the GPU work list asks of the kernels (docs/gpu.md): π's times as a multiple of its one-pass floor.
TARGET_X_FLOOR = {"fwd": 1.5, "fwd+bwd": 2.5}
PI_KERNELS = ("pi", "pi-heads", "pi-union", "local")  # rows of the library's own kernels: design floors too
# The smoke run checks the step's plumbing (pytest under xdist, the junit file, the counts), not the suite:
# three quick tests.
SMOKE_TESTS = ("tests/ops/test_backends.py::test_auto_on_cpu_is_fused_then_torch_and_correct",
               "tests/ops/test_backends.py::test_auto_on_a_simulated_gpu",
               "tests/ops/test_backends.py::test_unknown_backend")
FP32_TOL = dict(atol=2e-3, rtol=2e-3)  # triton and flex run fp32 dots as TF32 on a GPU


class Clock:
    """A step's budget: `out_of_time()` once `budget_s` seconds have passed since it was made."""

    def __init__(self, budget_s: float):
        self.start, self.budget_s = time.monotonic(), budget_s

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def out_of_time(self) -> bool:
        return self.left() <= 0


# ---------------------------------------------------------------------------------------------------- env

def env_step(smoke: bool, clock: Clock) -> dict:
    """Device, versions, SMs, memory and copy bandwidth (bytes read + written per second)."""
    setup = gb.Setup(smoke, clock.budget_s)
    env = gb.environment(setup)
    if setup.device.type == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(sm_count=props.multi_processor_count, gpu_memory_gib=props.total_memory / 2**30,
                   capability=".".join(map(str, torch.cuda.get_device_capability())))
    env.update(cpu_count=os.cpu_count(), copy_bandwidth_GBps=gb.copy_bandwidth(setup) / 1e9,
               copy_bytes=setup.copy_bytes)
    log(f"  {env['device']}, torch {env['torch']}, triton {env['triton']}, "
        f"copy {env['copy_bandwidth_GBps']:.0f} GB/s")
    return dict(environment=env)


# -------------------------------------------------------------------------------------------------- tests

def test_files(root: Path = ROOT) -> list[str]:
    """CUDA_TESTS plus every other tests/**/test_*.py that names DEVICE or torch.cuda."""
    uses_cuda = re.compile(r"\bDEVICE\b|torch\.cuda")
    found = [str(p.relative_to(root)) for p in sorted((root / "tests").rglob("test_*.py"))
             if uses_cuda.search(p.read_text())]
    return list(dict.fromkeys([*CUDA_TESTS, *found]))


def pytest_command(files: list[str], xml: Path, *, workers: bool = True) -> list[str]:
    """pytest over files, not slow, with -n (if `workers`) and --timeout where their plugins are importable.
    Verbose, so that each test's outcome is in the log as it happens: a run killed at its budget (the junit
    file is written only at the end) still tells which tests failed (`outcomes_from_log`, whose test reads
    both xdist's and plain pytest's lines)."""
    cmd = [sys.executable, "-m", "pytest", "-v", "-m", "not slow", "-p", "no:cacheprovider",
           f"--junitxml={xml}", *files]
    if importlib.util.find_spec("pytest_benchmark"):
        cmd += ["-p", "no:benchmark"]  # the GPU image has it: one warning per xdist worker, nothing else
    if workers and importlib.util.find_spec("xdist"):
        cmd += ["-n", str(min(16, os.cpu_count() or 1))]
    if importlib.util.find_spec("pytest_timeout"):
        cmd += ["--timeout", "90"]
    return cmd


_OUTCOME = re.compile(r"(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) (tests/\S+)|(tests/\S+) (PASSED|FAILED|SKIPPED|ERROR|"
                      r"XFAIL|XPASS)")


def outcomes_from_log(lines: list[str]) -> dict:
    """{passed, failed, errors, skipped, failures: [{id}]} from a verbose pytest log (xdist's "[gwN] [ x%]
    OUTCOME id" lines or plain "id OUTCOME"), for a run whose junit file was never written."""
    counts = dict(passed=0, failed=0, errors=0, skipped=0)
    failures = []
    for line in lines:
        m = _OUTCOME.search(line)
        if not m:
            continue
        outcome, test_id = (m.group(1), m.group(2)) if m.group(1) else (m.group(4), m.group(3))
        kind = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failed", "ERROR": "errors"}.get(outcome, "skipped")
        counts[kind] += 1
        if kind in ("failed", "errors"):
            failures.append(dict(id=test_id, kind=kind, message="(run killed: message not in the log)"))
    return dict(**counts, failures=failures)


def run_killable(cmd: list[str], log_path: Path, timeout_s: float) -> tuple[int | None, float]:
    """Run cmd in its own process group, output to log_path; kill the group at timeout_s.
    Returns (exit code or None when killed, seconds)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    t0 = time.monotonic()
    with open(log_path, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            return proc.wait(timeout=max(timeout_s, 1.0)), time.monotonic() - t0
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its xdist workers too: they share its session
            proc.wait()
            return None, time.monotonic() - t0


def parse_junit(xml: Path) -> dict:
    """{passed, failed, errors, skipped, failures: [{id, message}]} from a junit XML file."""
    counts = dict(passed=0, failed=0, errors=0, skipped=0)
    failures = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        kind = {"failure": "failed", "error": "errors", "skipped": "skipped"}.get(getattr(outcome, "tag", None),
                                                                                 "passed")
        counts[kind] += 1
        if kind in ("failed", "errors"):
            message = (outcome.get("message") or outcome.text or "").strip()
            test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
            failures.append(dict(id=test_id, kind=kind, message=message.splitlines()[0][:300] if message else ""))
    return dict(**counts, failures=failures)


def summary_line(lines: list[str]) -> str | None:
    """pytest's last "N passed, M failed … in S s" line, if the log has one."""
    return next((line.strip("= \n") for line in reversed(lines)
                 if re.search(r"\d+ (passed|failed|error)", line)), None)


def tests_step(smoke: bool, clock: Clock, out: Path) -> dict:
    files = list(SMOKE_TESTS) if smoke else test_files()
    xml, tail = out / "gpu_tests.xml", out / "gpu_tests_tail.log"
    xml.unlink(missing_ok=True)
    cmd = pytest_command(files, xml, workers=not smoke)  # three smoke tests: starting workers would be most of it
    log(f"  {' '.join(cmd[2:])}")
    full_log = out / ".gpu_tests_full.log"
    code, seconds = run_killable(cmd, full_log, clock.left())
    lines = full_log.read_text(errors="replace").splitlines()
    full_log.unlink()
    tail.write_text("\n".join(lines[-TAIL_LINES:]) + "\n")
    result = dict(files=files, command=" ".join(cmd[1:]), exit_code=code, killed=code is None,
                  seconds=seconds, summary=summary_line(lines), log_tail=tail.name)
    if xml.exists():
        result.update(parse_junit(xml), junit=xml.name)
    else:
        result.update(outcomes_from_log(lines), counted_from="log")
    log(f"  tests: {result['summary'] or 'no summary'} (exit {code}, {seconds:.0f} s)")
    return result


# ------------------------------------------------------------------------------------------------ kernels

class KernelPlan:
    """Shapes, dtypes and settings of a kernel step (D 64, or the D 128 cells): the GPU run's or the CPU smoke's."""

    def __init__(self, smoke: bool, D: int = 64, fp32: bool = False):
        cuda = not smoke
        self.backend = "triton" if cuda else "torch"  # the interpreter would take minutes per call on a CPU
        # bf16 is the run's dtype; fp32 (measured at D 64 in the second session) only when asked for. The
        # smoke run takes both, so that both dense SDPA paths are exercised.
        self.dtypes = (torch.bfloat16, torch.float32) if fp32 or smoke else (torch.bfloat16,)
        # B 8: enough heads of work to keep an H100/H200 busy, so that the ratio to the floor measures the
        # kernels rather than the launch (B 1 was host-bound in the first runs: benchmarks/results/gpu/gpu_run.md).
        self.BHD = ((8, 16, D),) if cuda else ((1, 4, 16 if D == 64 else 32),)
        self.T = ((4096, 8192, 16384, 32768) if D == 64 else (8192, 16384, 32768)) if cuda else (64,)
        self.check_shape = (2, 4, 1000, D) if cuda else (1, 4, 80, self.BHD[0][2])
        self.modes = ("fwd", "fwd+bwd")
        self.flex_configs = SMOKE_FLEX_CONFIGS if smoke else FLEX_CONFIGS
        self.flex_modes = self.modes if cuda else ("fwd",)  # torch's flex has no CPU backward
        self.flex_T = self.T[-1:]  # flex compiles per shape (10-40 s each on a GPU): the longest T only


def _pi(backend: str, **kwargs):
    """op(q, k, v, gate) -> pi_attention(q, k, v, gate, **OP overridden by kwargs); gate None unless gated."""
    settings = {**gb.OP, **kwargs, "backend": backend}
    gated = settings["variant"] in ("adaptive", "separate")

    def op(q, k, v, gate):
        return piattn.pi_attention(q, k, v, gate if gated else None, **settings)

    return op


def _sdpa(backend: SDPBackend, upcast: bool = False):
    def op(q, k, v, gate):
        if upcast:
            q, k, v = q.float(), k.float(), v.float()
        with gb.sdpa_kernel(backend):
            return gb.F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return op


def _emulated_fsa(skip: bool = True):
    """op computing what flash-sparse-attn computes for `peers.window_sizes` (with or without the skip key),
    from its documented mask."""
    def op(q, k, v, gate):
        sizes = peers.window_sizes(gb.OP["window"], gb.OP["period"], 1, "cpu", skip=skip)[0]
        mask = peers.emulated_mask(q.shape[-2], sizes).to(q.device)
        return gb.F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return op


def head_periods(H: int) -> list[int]:
    """One period per head: 8, 16, … 1024, repeated (multi-scale π)."""
    return [8 << (h % 8) for h in range(H)]


def kernel_ops(plan: KernelPlan, H: int, fsa) -> dict:
    """label -> (op, reference op, uses_gate, dtypes it runs or None for all). H: heads of the timed shapes."""
    b, ref = plan.backend, "reference"
    union = dict(variant="union", logit_clamp=None)  # the function flash-sparse-attn computes
    local = dict(variant="union", period=gb.OP["window"])  # LocalAttention's operator: period = window
    periods = dict(period=head_periods(H))
    cuda = plan.backend == "triton"
    ops = {
        "pi": (_pi(b), _pi(ref), True, None),
        "pi-heads": (_pi(b, **periods), _pi(ref, **periods), True, None),
        "pi-union": (_pi(b, **union), _pi(ref, **union), False, None),
        "local": (_pi(b, **local), _pi(ref, **local), False, None),
        "sdpa": (_sdpa(SDPBackend.FLASH_ATTENTION if cuda else SDPBackend.MATH),
                 _sdpa(SDPBackend.MATH, upcast=True), False, (torch.bfloat16,)),
        "sdpa-fp32": (_sdpa(SDPBackend.EFFICIENT_ATTENTION if cuda else SDPBackend.MATH),
                      _sdpa(SDPBackend.MATH, upcast=True), False, (torch.float32,)),
    }
    sliding = dict(variant="union", period=gb.OP["window"], logit_clamp=None)  # the window alone, no clamp
    if not cuda:  # its kernels need CUDA: check its window_sizes, by the library's mask rule, on SDPA instead
        ops["fsa-mask"] = (_emulated_fsa(), _pi(ref, **union), False, (torch.float32,))
        ops["fsa-window-mask"] = (_emulated_fsa(skip=False), _pi(ref, **sliding), False, (torch.float32,))
    if fsa is not None:
        ops["fsa-union"] = (peers.FlashSparseOp(fsa, gb.OP["window"], gb.OP["period"]), _pi(ref, **union), False,
                            (torch.bfloat16,))
        # The real sliding-window peer of "local": its near band alone.
        ops["fsa-window"] = (peers.FlashSparseOp(fsa, gb.OP["window"], gb.OP["period"], skip=False),
                             _pi(ref, **sliding), False, (torch.bfloat16,))
    return ops


def selected(ops: dict, names: set[str] | None) -> dict:
    """ops whose label is in names, or whose prefix before "-" is a name that is no label itself ("fsa" takes
    both peers, "pi" only π); all without a selection."""
    if not names:
        return ops
    prefixes = names - set(ops)
    return {label: op for label, op in ops.items() if label in names or label.split("-")[0] in prefixes}


def check_op(plan: KernelPlan, op, ref, uses_gate: bool, dtype, H: int, backward: bool = True) -> dict:
    """op against ref at plan.check_shape with H heads (per-head periods need the timed head count)."""
    B, _, T, D = plan.check_shape
    inputs = gb.make_inputs(B, H, T, D, "cuda" if plan.backend == "triton" else "cpu", grad=backward, dtype=dtype)
    try:
        expected = gb.run_op(ref, inputs, backward=backward, uses_gate=uses_gate)
        got = gb.run_op(op, inputs, backward=backward, uses_gate=uses_gate)
        ok, errors = gb.compare(expected, got, gb.TOL if dtype == torch.bfloat16 else FP32_TOL)
        return dict(status="ok" if ok else "failed check", max_abs_err=errors)
    except Exception as exc:  # a peer that cannot run here is reported, not fatal
        return dict(status="error", error=describe_error(exc))


def _flex(block: int, options: dict):
    from piattn.ops.pi.flex import pi_attention_flex

    def op(q, k, v, gate):
        return pi_attention_flex(q, k, v, gate, **gb.OP, scale=q.shape[-1] ** -0.5, block_size=block,
                                 kernel_options=options or None)

    return op


def probe_flex(plan: KernelPlan, H: int, clock: Clock) -> tuple[str | None, dict]:
    """The first of plan.flex_configs whose flex op passes the bf16 check (label or None), and the record of
    every one tried: FlexAttention gets a number, or the reasons it got none."""
    records = {}
    for label, block, options in plan.flex_configs:
        if clock.out_of_time():
            records[label] = dict(status="skipped: time budget")
            continue
        record = check_op(plan, _flex(block, options), _pi("reference"), True, torch.bfloat16, H,
                          backward="fwd+bwd" in plan.flex_modes)
        records[label] = dict(record, block=block, kernel_options=options)
        log(f"  check {label:<14} {record['status']} {record.get('error', '')}")
        if record["status"] == "ok":
            return label, records
    return None, records


def flex_ops(plan: KernelPlan, label: str):
    block, options = next((b, o) for name, b, o in plan.flex_configs if name == label)
    return {label: (_flex(block, options), None, True, (torch.bfloat16,))}


def measured_baselines(path: Path = BASELINE_FILE) -> dict:
    """{(backend, B, H, T, D, dtype, mode): ms} of the BASELINES rows in a committed run's JSON ({} without it)."""
    try:
        rows = json.loads(path.read_text())["steps"]["kernels"]["rows"]
    except (OSError, KeyError, ValueError):
        return {}
    return {(r["backend"], r["B"], r["H"], r["T"], r["D"], r["dtype"], r["mode"]): r["ms"] for r in rows
            if r["backend"] in BASELINES and r.get("ms")}


def time_rows(setup: gb.Setup, plan: KernelPlan, ops: dict, checks: dict, bandwidth: float,
              modes: tuple[str, ...], known: dict | None = None, lengths: tuple[int, ...] | None = None) -> list[dict]:
    """Every (B, H, D) × dtype × T × mode (of modes) × op, rows with ms, the one-pass floor and ratio_to_floor
    (and for π's own kernels the design's floor, ratio_to_design_floor, and the target × floor); ops not
    passing their check (checks[(label, dtype)]) are rows with that status; a baseline in `known`
    (`measured_baselines`) takes its ms from there (source) instead of being timed. lengths: the T to run
    (plan.T without)."""
    known = known or {}
    rows = []
    for (B, H, D), dtype in ((bhd, dt) for bhd in plan.BHD for dt in plan.dtypes):
        elem = torch.finfo(dtype).bits // 8
        for T in lengths or plan.T:
            inputs = None
            for mode in modes:
                floor_ms = gb.floor_bytes(B, H, T, D, mode, elem) / bandwidth * 1e3
                design_ms = gb.design_floor_bytes(B, H, T, D, mode, elem) / bandwidth * 1e3
                for label, (op, _, uses_gate, dtypes) in ops.items():
                    if dtypes is not None and dtype not in dtypes:
                        continue
                    name = str(dtype).removeprefix("torch.")
                    row = dict(B=B, H=H, T=T, D=D, dtype=name, mode=mode, backend=label, floor_ms=floor_ms)
                    if label in PI_KERNELS:
                        row.update(design_floor_ms=design_ms, target_x_floor=TARGET_X_FLOOR[mode])
                    check = checks.get((label, dtype), {}).get("status", "ok")
                    if (label, B, H, T, D, name, mode) in known:
                        row.update(ms=known[(label, B, H, T, D, name, mode)], source=BASELINE_FILE.name)
                    elif check != "ok":
                        row["status"] = f"not timed: {check}"
                    elif setup.out_of_time():
                        row["status"] = "skipped: time budget"
                    else:
                        if inputs is None:
                            inputs = gb.make_inputs(B, H, T, D, setup.device, grad="fwd+bwd" in modes, dtype=dtype)
                        row.update(gb.time_case(setup, op, inputs, mode == "fwd+bwd", uses_gate))
                    if row.get("ms"):
                        row["ratio_to_floor"] = row["ms"] / floor_ms
                        if "design_floor_ms" in row:
                            row["ratio_to_design_floor"] = row["ms"] / design_ms
                    rows.append(row)
                    shown = f"{row['ms']:9.3f} ms x{row['ratio_to_floor']:.1f}" if row.get("ms") else row["status"]
                    log(f"  {row['dtype']:<8} D={D} T={T:<6} {mode:<7} {label:<10} {shown}")
            del inputs
            if setup.device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def add_ratios(rows: list[dict]) -> None:
    """speedup_vs_sdpa = dense SDPA's ms / this row's; vs_pi = this row's ms / π's (one period, triton)."""
    def key(r):
        return r["B"], r["H"], r["T"], r["D"], r["dtype"], r["mode"]

    ms = {(key(r), r["backend"]): r.get("ms") for r in rows}
    for r in rows:
        sdpa = ms.get((key(r), "sdpa")) or ms.get((key(r), "sdpa-fp32"))
        pi = ms.get((key(r), "pi"))
        r["speedup_vs_sdpa"] = sdpa / r["ms"] if r.get("ms") and sdpa else None
        r["vs_pi"] = r["ms"] / pi if r.get("ms") and pi else None


def targets(rows: list[dict]) -> list[dict]:
    """The GPU work list's targets, each with what the rows measured (bf16, T >= 8K unless said) and whether
    it is met: "unmeasured" where the rows lack a side."""
    def pick(backend, mode, D=None, T=None):
        return {(r["D"], r["T"]): r for r in rows if r["backend"] == backend and r["mode"] == mode and r.get("ms")
                and r["dtype"] == "bfloat16" and r["T"] >= 8192 and (D is None or r["D"] == D)
                and (T is None or r["T"] == T)}

    def ratio_of(a: dict, b: dict) -> dict:  # b's ms / a's ms for each cell both have
        return {cell: b[cell]["ms"] / a[cell]["ms"] for cell in a.keys() & b.keys()}

    def line(name, values: dict, ok) -> dict:
        if not values:
            return dict(target=name, measured="unmeasured", met="unmeasured")
        shown = ", ".join(f"D {d} {t // 1024}K {v:.2f}" for (d, t), v in sorted(values.items()))
        return dict(target=name, measured=shown, met="yes" if all(map(ok, values.values())) else "no")

    out = []
    for mode, limit in TARGET_X_FLOOR.items():
        out.append(line(f"π {mode} ≤ {limit}× its one-pass floor (× shown)",
                        {c: r["ratio_to_floor"] for c, r in pick("pi", mode).items()}, lambda x, lim=limit: x <= lim))
        out.append(line(f"π {mode}: × the floor of the design that runs (two-kernel backward; report)",
                        {c: r["ratio_to_design_floor"] for c, r in pick("pi", mode).items()}, lambda x: True))
    for peer, mine in (("fsa-union", "pi-union"), ("fsa-union", "pi")):
        out.append(line(f"{mine} fwd+bwd ≥ 2× faster than flash-sparse-attn's union (speedup shown)",
                        ratio_of(pick(mine, "fwd+bwd"), pick(peer, "fwd+bwd")), lambda x: x >= 2))
    out.append(line("local fwd+bwd against flash-sparse-attn's sliding window (speedup shown; report)",
                    ratio_of(pick("local", "fwd+bwd"), pick("fsa-window", "fwd+bwd")), lambda x: True))
    flex = next((r["backend"] for r in rows if r["backend"].startswith("flex") and r.get("ms")), None)
    out.append(line("π fwd+bwd ≥ 3× faster than FlexAttention (speedup shown)",
                    ratio_of(pick("pi", "fwd+bwd"), pick(flex, "fwd+bwd")) if flex else {}, lambda x: x >= 3))
    out.append(line("π fwd+bwd ≥ 10× faster than dense flash SDPA at 32K (speedup shown)",
                    ratio_of(pick("pi", "fwd+bwd", T=32768), pick("sdpa", "fwd+bwd", T=32768)), lambda x: x >= 10))
    out.append(line("per-head periods (one launch) ≤ 1.1× one period, fwd+bwd (× shown)",
                    ratio_of(pick("pi", "fwd+bwd"), pick("pi-heads", "fwd+bwd")) and
                    {c: 1 / x for c, x in ratio_of(pick("pi", "fwd+bwd"), pick("pi-heads", "fwd+bwd")).items()},
                    lambda x: x <= 1.1))
    return out


def tune_step(smoke: bool, clock: Clock, out: Path) -> dict:
    """gpu_tune.py in the step's budget: its own files in `out`, the best tile setting per shape here."""
    if clock.left() <= 0:
        return dict(skipped="no budget")
    result = gpu_tune.main(["--out", str(out), "--budget-s", f"{clock.left():.0f}", *(["--smoke"] if smoke else [])])
    best = {}
    for shape in result["shapes"]:
        timed = [r for r in shape["rows"] if r["status"] == "ok"]
        if timed:
            top = min(timed, key=lambda r: r["fwd_ms"] + r["bwd_ms"])
            best[f"{shape['dtype']} D{shape['D']} T{shape['T']}"] = {
                key: top[key] for key in ("tiles", "fwd_x_floor", "bwd_x_floor")}
    return dict(best=best, head_periods=result["head_periods"])


def kernels_step(plan: KernelPlan, clock: Clock, bandwidth: float | None, peer: dict, result: dict, save, *,
                 names: set[str] | None = None, within: set[str] | None = None, flex: bool = True,
                 nan_check: bool = True, remeasure: bool = False) -> dict:
    """Fills `result` (the step's record, saved part-way) with checks, finiteness and rows; returns it. names:
    the ops to run (`selected`), of those in `within` (all without); flex: probe and time FlexAttention last
    (it compiles per shape, 10-40 s on a GPU, so it gets what time is left)."""
    setup = gb.Setup(plan.backend != "triton", clock.budget_s)
    setup.start = clock.start
    bandwidth = bandwidth or gb.copy_bandwidth(setup)
    H = plan.BHD[0][1]
    fsa, peer_record = (peers.load_flash_sparse() if peer["status"] == "installed" else (None, peer))
    result.update(title=f"π-Attention ops, causal, window {gb.OP['window']}, period {gb.OP['period']}, B "
                        f"{plan.BHD[0][0]}, H {H}, D {plan.BHD[0][2]}",
                  plan=dict(BHD=plan.BHD, T=plan.T, dtypes=[str(d) for d in plan.dtypes], backend=plan.backend,
                            check_shape=plan.check_shape, head_periods=head_periods(H), op=gb.OP),
                  peer=peer_record, bandwidth_GBps=bandwidth / 1e9, checks={}, rows=[])
    ops = {label: op for label, op in selected(kernel_ops(plan, H, fsa), names).items()
           if within is None or label in within}
    known = {} if remeasure else measured_baselines()
    log("  checks against backend reference:")
    for label, (op, ref, uses_gate, dtypes) in ops.items():
        for dtype in dtypes or plan.dtypes:
            record = check_op(plan, op, ref, uses_gate, dtype, H)
            result["checks"][f"{label}/{str(dtype).removeprefix('torch.')}"] = record
            log(f"  check {label:<14} {str(dtype):<15} {record['status']} {record.get('error', '')}")
    checks = {(k.split("/")[0], getattr(torch, k.split("/")[1])): v for k, v in result["checks"].items()}
    save()
    if nan_check and "pi" in ops:
        log("  finiteness near the clamp:")
        setup.nan_shape = (1, H, plan.T[-1], plan.BHD[0][2])
        result["nan_check"] = gb.nan_check(setup, {"pi": (ops["pi"][0], True)})
    log("  operator grid:")
    result["rows"] = time_rows(setup, plan, ops, checks, bandwidth, plan.modes, known)
    add_ratios(result["rows"])
    save()
    if flex and (not names or "flex" in names):
        label, flex_checks = probe_flex(plan, H, clock)
        result.update(flex_config=label)
        result["checks"].update({f"{k}/bfloat16": v for k, v in flex_checks.items()})
        if label is not None:
            result["rows"] += time_rows(setup, plan, flex_ops(plan, label), {}, bandwidth, plan.flex_modes,
                                        lengths=plan.flex_T)
            add_ratios(result["rows"])
    result["targets"] = targets(result["rows"])
    return result


# ------------------------------------------------------------------------------------------------ overhead

def overhead_step(smoke: bool, clock: Clock) -> dict:
    """gpu_overhead's rows (small and large shape, within the budget) and a CUDA graph of a training step."""
    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16
    repeats, calls = (2, 2) if smoke else (20, 50)
    rows = []
    for shape in gpu_overhead.SMOKE_SHAPES if smoke else gpu_overhead.SHAPES:
        if clock.out_of_time():
            rows.append(dict(B=shape[0], H=shape[1], T=shape[2], D=shape[3], status="skipped: time budget"))
            continue
        rows += gpu_overhead.measure(shape, device, dtype, repeats, calls)
    return dict(rows=rows, train_graph=train_step_graph(smoke))


def train_step_graph(smoke: bool) -> dict:
    """Whether a CUDA graph captures a whole training step of a tiny π GPT (forward, loss, backward, AdamW
    with capturable state) and, replayed, gives the eager step's loss; its replay ms against eager's."""
    if smoke:
        return dict(status="needs CUDA")
    from piattn.models import GPT, GPTConfig

    try:
        torch.manual_seed(0)
        T = 4096
        model = GPT(GPTConfig.from_name("tiny", attention="pi", vocab_size=512, block_size=T, dropout=0.0)).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, capturable=True)
        idx = torch.randint(512, (4, T + 1), device="cuda")
        loss_out = torch.zeros((), device="cuda")

        def step():
            loss = gb.F.cross_entropy(model(idx[:, :-1]).flatten(0, 1).float(), idx[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            loss_out.copy_(loss.detach())

        eager_ms = median_ms(step, 5, cuda=True)
        replay, status = gpu_overhead.graph_of(step, True)
        if replay is None:
            return dict(status=status, eager_ms=eager_ms)
        replay_ms = median_ms(replay, 5, cuda=True)
        replay()
        torch.cuda.synchronize()
        return dict(status="ok", eager_ms=eager_ms, replay_ms=replay_ms, loss_after_replay=float(loss_out))
    except Exception as exc:
        return dict(status="error", error=describe_error(exc))


# -------------------------------------------------------------------------------------------------- model

def model_step(smoke: bool, clock: Clock, record: dict) -> dict:
    """Training rows in the first three fifths of the budget, decoding rows in the rest (record filled as it
    goes)."""
    plan = gpu_model.ModelPlan(smoke)
    record.update(size=plan.size, dtype=str(plan.dtype).removeprefix("torch."), decode_tokens=plan.decode_tokens,
                  decode_settings=gpu_model.DECODE_KINDS, llama=plan.llama)
    train_until = clock.budget_s * 0.6
    record["rows"] = gpu_model.run(plan, lambda: clock.elapsed() > train_until, log)
    record["decode_rows"] = gpu_model.run_decode(plan, clock.out_of_time, log)
    return record


# ------------------------------------------------------------------------------------------------- report

def _cell(r: dict | None) -> str:
    if r is None:
        return ""
    if not r.get("ms"):
        return r["status"]
    text = f"{r['ms']:.3f} (×{r['ratio_to_floor']:.1f}"
    if r.get("ratio_to_design_floor"):
        text += f"; ×{r['ratio_to_design_floor']:.1f} design"
    return text + (", from " + r["source"] if r.get("source") else "") + ")"


def _kernel_table(kernels: dict) -> list[str]:
    rows = kernels.get("rows", [])
    labels = list(dict.fromkeys(r["backend"] for r in rows))
    out = ["| dtype | D | T | mode | floor ms (one-pass / design) | target ms | " + " | ".join(labels) + " |",
           "|" + "---|" * (6 + len(labels))]
    keys = list(dict.fromkeys((r["dtype"], r["D"], r["T"], r["mode"]) for r in rows))
    for key in keys:
        group = {r["backend"]: r for r in rows if (r["dtype"], r["D"], r["T"], r["mode"]) == key}
        cells = [_cell(group.get(label)) for label in labels]
        first = next(iter(group.values()))
        design = next((r["design_floor_ms"] for r in group.values() if "design_floor_ms" in r), None)
        floors = f"{first['floor_ms']:.3f}" + (f" / {design:.3f}" if design else "")
        target = f"{first['floor_ms'] * TARGET_X_FLOOR[key[3]]:.3f}"
        out.append("| " + " | ".join([*map(str, key), floors, target, *cells]) + " |")
    return out


def _kernel_section(name: str, kernels: dict) -> list[str]:
    peer = kernels.get("peer", {})
    out = ["", f"## {name}", "", f"{kernels.get('title')}. Cells: median ms (× the one-pass floor = bytes a "
           "one-pass design must move ÷ copy bandwidth; for π's own kernels also × the floor of the design "
           "that runs, a two-kernel backward: gpu_bench.design_floor_bytes); target ms = "
           f"{TARGET_X_FLOOR['fwd']}× (fwd) or {TARGET_X_FLOOR['fwd+bwd']}× (fwd+bwd) the one-pass floor. pi = "
           f"adaptive (gate), pi-heads = one period per head {kernels['plan']['head_periods']} (one launch), "
           "pi-union and fsa-union = window + skip key under one softmax without clamp, local = union with "
           "period = window (LocalAttention's operator), fsa-window = flash-sparse-attn's near band alone (a "
           "sliding window), sdpa = dense causal (flash for bf16, efficient for fp32); \"from\" marks a baseline "
           "taken from an earlier run's file.",
           "", f"Peer flash-sparse-attn: {peer.get('status')} {peer.get('version', '')} "
           f"{peer.get('error', peer.get('note', ''))}. FlexAttention configuration timed: "
           f"{kernels.get('flex_config')}.", "", *_kernel_table(kernels)]
    if kernels.get("targets"):
        out += ["", "| target | measured | met |", "|---|---|---|"]
        out += [f"| {t['target']} | {t['measured']} | {t['met']} |" for t in kernels["targets"]]
    out += ["", "Checks against backend \"reference\":", "", "| op/dtype | status | max abs error |", "|---|---|---|"]
    out += [f"| {k} | {c['status']} {c.get('error', '')} | {gb.check_errors(c)} |"
            for k, c in kernels.get("checks", {}).items()]
    nan = kernels.get("nan_check")
    if nan:
        out += ["", f"Finiteness at {nan['shape']}, q × {nan['q_scale']}, clamp {nan['logit_clamp']}: "
                + ", ".join(f"{k} {r['status']}" for k, r in nan["results"].items())]
    return out


def markdown(report: dict) -> str:
    env = report.get("environment", {})
    steps = report["steps"]
    out = [f"# GPU run ({env.get('device', '?')})", "",
           f"torch {env.get('torch')}, triton {env.get('triton')}, CUDA {env.get('cuda')}, Python "
           f"{env.get('python')}, SMs {env.get('sm_count')}, memory {fmt(env.get('gpu_memory_gib'), '.0f', '')} GiB, "
           f"copy bandwidth {fmt(env.get('copy_bandwidth_GBps'), '.0f', '')} GB/s (read + write, this run). "
           f"Command: `{report['command']}`.", "",
           "| step | status | seconds | budget s |", "|---|---|---|---|"]
    out += [f"| {name} | {s['status']} | {s.get('seconds', 0):.0f} | {s['budget_s']:.0f} |"
            for name, s in steps.items()]
    out += [f"\n- {name}: {s['error']}" for name, s in steps.items() if s.get("error")]
    tests = steps.get("tests", {})
    if "passed" in tests or "summary" in tests:
        out += ["", "## Tests", "", f"`{tests.get('command')}`", "",
                f"Summary: {tests.get('summary')}; {tests.get('passed')} passed, {tests.get('failed')} "
                f"failed, {tests.get('errors')} errors, {tests.get('skipped')} skipped"
                + (" (killed at its budget: counted from the verbose log, no failure messages)"
                   if tests.get("killed") else "") + "."]
        failures = tests.get("failures", [])
        if failures:
            out += ["", "| test | first message |", "|---|---|"]
            out += [f"| {f['id']} | {f['message'].replace('|', '/')} |" for f in failures[:100]]
    for step, name in (("kernels", "Kernels (D 64)"), ("d128", "Kernels (D 128)")):
        kernels = steps.get(step, {})
        if kernels.get("rows") or kernels.get("checks"):
            out += _kernel_section(name, kernels)
    overhead = steps.get("overhead", {})
    if overhead.get("rows"):
        cols = ("kernels_ms", "eager_ms", "no_gate_check_ms", "compiled_ms", "graph_ms", "eager_host_us",
                "no_gate_check_host_us", "graph_capture")
        out += ["", "## Overhead", "", "eager = a user's gate (checked: one host sync); no_gate_check = a layer's "
                "call (check_gate=False: no sync); compiled = torch.compile; graph = one CUDA-graph replay.", "",
                "| B | H | T | D | mode | " + " | ".join(cols) + " |", "|" + "---|" * (5 + len(cols))]
        for r in overhead["rows"]:
            cells = [str(r.get(k, "")) for k in ("B", "H", "T", "D", "mode")]
            cells += [f"{r[c]:.4g}" if isinstance(r.get(c), float) else str(r.get(c, r.get("status", "")))
                      for c in cols]
            out.append("| " + " | ".join(cells) + " |")
        graph = overhead.get("train_graph", {})
        out += ["", "CUDA graph of a training step (tiny π GPT, B 4, T 4K, AdamW): "
                + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in graph.items())]
    model = steps.get("model", {})
    if model.get("rows"):
        out += ["", f"## Model: training ({model['size']} GPT, {model['dtype']})", "",
                *markdown_table(["kind", "T", "batch", "train ms", "tokens/s", "peak MiB", "status"],
                                ([r["kind"], r["T"], r.get("batch", ""), fmt(r.get("train_ms"), ".1f", ""),
                                  fmt(r.get("train_tokens_per_s"), ".0f", ""), fmt(r.get("train_peak_mib"), ".0f", ""),
                                  r["status"]] for r in model["rows"]))]
    if model.get("decode_rows"):
        out += ["", f"## Model: decoding (SmolLM2-shaped Llama, random weights, {model['dtype']}, batch 1, "
                f"{model['decode_tokens']} tokens after a prompt of T; settings {model['decode_settings']})", "",
                *markdown_table(["kind", "T", "ms/token", "tokens/s", "cache MiB", "peak MiB", "status"],
                                ([r["kind"], r["T"], fmt(r.get("decode_ms_per_token"), ".2f", ""),
                                  fmt(r.get("decode_tokens_per_s"), ".1f", ""), fmt(r.get("cache_mib"), ".2f", ""),
                                  fmt(r.get("decode_peak_mib"), ".0f", ""), r["status"]]
                                 for r in model["decode_rows"]))]
    out += ["", f"Total {report.get('elapsed_s', 0):.0f} s."]
    return "\n".join(out) + "\n"


class Report:
    """The run's record; `save()` rewrites gpu_run.json and gpu_run.md (and the figure when it can)."""

    def __init__(self, out: Path, argv: list[str] | None, smoke: bool):
        self.out, self.start = out, time.monotonic()
        self.data = dict(command=command_line("benchmarks/gpu_run.py", argv, from_source=True), smoke=smoke,
                         steps={})

    def save(self) -> None:
        self.data["elapsed_s"] = time.monotonic() - self.start
        (self.out / "gpu_run.json").write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        (self.out / "gpu_run.md").write_text(markdown(self.data))

    def plot(self) -> None:
        steps = self.data["steps"]
        rows = [r for name in ("kernels", "d128") for r in steps.get(name, {}).get("rows", [])]
        if any(r.get("ms") for r in rows):
            import plot_gpu

            title = steps.get("kernels", steps.get("d128", {})).get("title", "")
            plot_gpu.plot(dict(rows=rows, environment=self.data["environment"], title=title),
                          self.out / "gpu_run.png")

    def step(self, name: str, budget_s: float, fn) -> dict:
        """Run fn(clock, record) -> dict under its budget; record status, seconds and any error; save. fn may
        fill the record itself, so that a save part-way keeps what it has."""
        clock = Clock(budget_s)
        record = self.data["steps"][name] = dict(status="running", budget_s=budget_s)
        log(f"[{name}] budget {budget_s:.0f} s")
        try:
            record.update(fn(clock, record))
            record["status"] = "ok"
        except Exception as exc:  # keep the other steps
            record.update(status="error", error=describe_error(exc), traceback=traceback.format_exc()[-3000:])
            log(f"  {name} failed: {record['error']}")
        record["seconds"] = clock.elapsed()
        if name == "env" and "environment" in record:
            self.data["environment"] = record["environment"]
        self.save()
        return record


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for the run's files (seven; none by default)")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run of every step (for tests)")
    p.add_argument("--steps", default=",".join(BUDGETS),
                   help=f"comma-separated steps to run, in the run's order (default all: {','.join(BUDGETS)})")
    p.add_argument("--ops", default="", help="comma-separated kernel ops (or prefixes: pi, fsa, flex, sdpa) to run "
                                             "in the kernel steps (default all)")
    p.add_argument("--budget-s", type=float, default=RUN_S, help=f"cap on the whole run (default {RUN_S:.0f})")
    for name, seconds in BUDGETS.items():
        p.add_argument(f"--{name}-s", type=float, default=seconds,
                       help=f"budget of step {name} (default {seconds:.0f})")
    p.add_argument("--fp32", action="store_true", help="fp32 rows too in the D 64 kernel step")
    p.add_argument("--remeasure-baselines", action="store_true",
                   help=f"time {', '.join(BASELINES)} again instead of taking them from {BASELINE_FILE.name}")
    p.add_argument("--wheels", type=Path, default=ROOT / ".whl", help="folder of peer wheels (gpu_wheels.sh)")
    a = p.parse_args(argv)
    steps = [name.strip() for name in a.steps.split(",") if name.strip()]
    unknown = sorted(set(steps) - set(BUDGETS))
    if unknown:
        p.error(f"--steps: unknown {unknown}; steps are {', '.join(BUDGETS)}")
    if not a.smoke and not torch.cuda.is_available():
        p.error("no CUDA device; use --smoke for the CPU run")
    names = {n.strip() for n in a.ops.split(",") if n.strip()} or None
    a.out.mkdir(parents=True, exist_ok=True)
    report = Report(a.out, argv, a.smoke)
    report.data["budgets_s"] = {name: getattr(a, f"{name}_s") for name in BUDGETS}
    total = Clock(a.budget_s)

    def budget(name: str) -> float:
        return max(0.0, min(getattr(a, f"{name}_s"), total.left()))

    env = {}
    if "env" in steps:
        env = report.step("env", budget("env"), lambda clock, _: env_step(a.smoke, clock))
    report.data.setdefault("environment", gb.environment(gb.Setup(a.smoke, 0)))
    if "tests" in steps:
        report.step("tests", budget("tests"), lambda clock, _: tests_step(a.smoke, clock, a.out))
    bandwidth = env.get("environment", {}).get("copy_bandwidth_GBps")
    bandwidth = bandwidth and bandwidth * 1e9
    peer = peers.install_wheels(a.wheels) if {"kernels", "d128"} & set(steps) else {}
    if "kernels" in steps:
        plan = KernelPlan(a.smoke, 64, fp32=a.fp32)
        report.step("kernels", budget("kernels"), lambda clock, record: kernels_step(
            plan, clock, bandwidth, peer, record, report.save, names=names, remeasure=a.remeasure_baselines))
    if "d128" in steps:
        plan128 = KernelPlan(a.smoke, 128)
        d128_ops = {"pi", "pi-union", "local", "sdpa", "fsa-union", "fsa-window", "fsa-mask", "fsa-window-mask"}
        report.step("d128", budget("d128"), lambda clock, record: kernels_step(
            plan128, clock, bandwidth, peer, record, report.save, names=names, within=d128_ops,
            flex=False, nan_check=False, remeasure=a.remeasure_baselines))
    if "tune" in steps:
        report.step("tune", budget("tune"), lambda clock, _: tune_step(a.smoke, clock, a.out))
    if "overhead" in steps:
        report.step("overhead", budget("overhead"), lambda clock, _: overhead_step(a.smoke, clock))
    if "model" in steps:
        report.step("model", budget("model"), lambda clock, record: model_step(a.smoke, clock, record))
    try:
        report.plot()
    except Exception as exc:  # the JSON and markdown are the record; the figure is a view of them
        report.data["plot_error"] = describe_error(exc)
    report.save()
    log((a.out / "gpu_run.md").read_text())
    return report.data


if __name__ == "__main__":
    main()
