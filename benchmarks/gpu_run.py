"""One prepared GPU session: environment, the CUDA tests, the operator grid and the model, each in its budget.

    PYTHONPATH=src python3 benchmarks/gpu_run.py --out DIR                  # GPU, about 6 minutes
    PYTHONPATH=src python3 benchmarks/gpu_run.py --smoke --out /tmp/smoke   # CPU, tiny, seconds

Steps, in order; each starts nothing new once its budget (or the total, --budget-s) is spent, keeps what it
measured, and a step that crashes is recorded and the next one runs:
  env      device, versions, SM count, memory, device-to-device copy bandwidth (gpu_bench.copy_bandwidth);
  tests    pytest over every test file that uses DEVICE or torch.cuda, killed at its budget; junit counts,
           the failures' ids and first message lines, the log's tail;
  tune     the Triton tile sweep and one period against per-head periods (gpu_tune.py), written to
           DIR/gpu_tune.{json,md};
  kernels  π (triton) fwd and fwd+bwd for T 4K-32K, D 64 and 128, bf16 and fp32, as a multiple of the
           bandwidth floor, beside dense SDPA, local attention, per-head periods, π's union variant, the peer
           flash-sparse-attn (when .whl/ carries it) and FlexAttention at its smallest block; every op is
           first checked against backend "reference" (a failing one is reported, not timed); finiteness at
           32K near the clamp;
  model    the small GPT, dense / local / pi, bf16, T 4K-16K: train step, prefill, decode per token, peaks.
After every step it writes DIR/gpu_run.json and DIR/gpu_run.md (a kill keeps the finished steps), plus
gpu_tests_tail.log, gpu_tests.xml, gpu_run.png and gpu_tune.{json,md}: seven files.
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
import gpu_tune  # noqa: E402
import peers  # noqa: E402
import piattn  # noqa: E402
from piattn.benchmarking import command_line  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# The model step was measured in the first session (benchmarks/results/gpu_run.md): 0 unless asked for.
BUDGETS = dict(env=20.0, tests=200.0, tune=150.0, kernels=120.0, model=0.0)
TAIL_LINES = 300
# The six files of the first GPU run; `test_files` adds any other that touches CUDA.
CUDA_TESTS = ("tests/ops/test_triton.py", "tests/ops/test_conformance.py", "tests/ops/test_features.py",
              "tests/ops/test_head_periods.py", "tests/ops/test_compile.py", "tests/ops/test_flex.py")
# The smoke run checks the step's plumbing (pytest under xdist, the junit file, the counts), not the suite:
# three quick tests.
SMOKE_TESTS = ("tests/ops/test_backends.py::test_auto_on_cpu_is_fused_then_torch_and_correct",
               "tests/ops/test_backends.py::test_auto_on_a_simulated_gpu",
               "tests/ops/test_backends.py::test_unknown_backend")
FP32_TOL = dict(atol=2e-3, rtol=2e-3)  # triton and flex run fp32 dots as TF32 on a GPU


def log(msg: str) -> None:
    print(msg, flush=True)


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}"


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
    """Shapes, dtypes and settings of the kernel step: the GPU run's or the CPU smoke's."""

    def __init__(self, smoke: bool):
        cuda = not smoke
        self.backend = "triton" if cuda else "torch"  # the interpreter would take minutes per call on a CPU
        self.dtypes = (torch.bfloat16, torch.float32)
        # B 8: enough heads of work to keep an H100/H200 busy, so that the ratio to the floor measures the
        # kernels rather than the launch (B 1 was host-bound in the first runs: benchmarks/results/gpu_run.md).
        # One B per run: the report's rows are keyed by dtype, D, T and mode.
        self.BHD = ((8, 16, 64), (8, 16, 128)) if cuda else ((1, 4, 16),)
        self.T = (4096, 8192, 16384, 32768) if cuda else (64,)
        self.check_shape = (2, 4, 1000, 64) if cuda else (1, 4, 80, 16)
        self.modes = ("fwd", "fwd+bwd")
        self.flex_probe = gb.FLEX_PROBE if cuda else (16,)
        self.flex_modes = self.modes if cuda else ("fwd",)  # torch's flex has no CPU backward


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


def _emulated_fsa():
    """op computing what flash-sparse-attn computes for `peers.window_sizes`, from its documented mask."""
    def op(q, k, v, gate):
        sizes = peers.window_sizes(gb.OP["window"], gb.OP["period"], 1, "cpu")[0]
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
    if not cuda:  # its kernels need CUDA: check its window_sizes, by the library's mask rule, on SDPA instead
        ops["fsa-mask"] = (_emulated_fsa(), _pi(ref, **union), False, (torch.float32,))
    if fsa is not None:
        ops["fsa-union"] = (peers.FlashSparseOp(fsa, gb.OP["window"], gb.OP["period"]), _pi(ref, **union), False,
                            (torch.bfloat16,))
    return ops


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
        return dict(status="error", error=_describe(exc))


def probe_flex(plan: KernelPlan, H: int, clock: Clock) -> tuple[int | None, dict]:
    """Smallest block of plan.flex_probe whose flex op passes the bf16 check; the records tried."""
    from piattn.ops.pi.flex import pi_attention_flex

    records = {}
    for block in plan.flex_probe:
        if clock.out_of_time():
            break

        def op(q, k, v, gate, block=block):
            return pi_attention_flex(q, k, v, gate, **gb.OP, scale=q.shape[-1] ** -0.5, block_size=block)

        records[f"flex-{block}"] = check_op(plan, op, _pi("reference"), True, torch.bfloat16, H,
                                            backward="fwd+bwd" in plan.flex_modes)
        log(f"  check flex-{block:<4} {records[f'flex-{block}']['status']}")
        if records[f"flex-{block}"]["status"] == "ok":
            return block, records
    return None, records


def flex_ops(block: int):
    from piattn.ops.pi.flex import pi_attention_flex

    def op(q, k, v, gate):
        return pi_attention_flex(q, k, v, gate, **gb.OP, scale=q.shape[-1] ** -0.5, block_size=block)

    return {f"flex-{block}": (op, None, True, (torch.bfloat16,))}


def time_rows(setup: gb.Setup, plan: KernelPlan, ops: dict, checks: dict, bandwidth: float,
              modes: tuple[str, ...]) -> list[dict]:
    """Every (B, H, D) × dtype × T × mode (of modes) × op, rows with ms, floor, ratio_to_floor; ops not passing their
    check (checks[(label, dtype)]) are rows with that status."""
    rows = []
    for (B, H, D), dtype in ((bhd, dt) for bhd in plan.BHD for dt in plan.dtypes):
        elem = torch.finfo(dtype).bits // 8
        for T in plan.T:
            inputs = None
            for mode in modes:
                floor_ms = gb.floor_bytes(B, H, T, D, mode, elem) / bandwidth * 1e3
                for label, (op, _, uses_gate, dtypes) in ops.items():
                    if dtypes is not None and dtype not in dtypes:
                        continue
                    row = dict(B=B, H=H, T=T, D=D, dtype=str(dtype).removeprefix("torch."), mode=mode,
                               backend=label, floor_ms=floor_ms)
                    check = checks.get((label, dtype), {}).get("status", "ok")
                    if check != "ok":
                        row["status"] = f"not timed: {check}"
                    elif setup.out_of_time():
                        row["status"] = "skipped: time budget"
                    else:
                        if inputs is None:
                            inputs = gb.make_inputs(B, H, T, D, setup.device, grad="fwd+bwd" in modes, dtype=dtype)
                        row.update(gb._time_case(setup, op, inputs, mode == "fwd+bwd", uses_gate))
                    if row.get("ms"):
                        row["ratio_to_floor"] = row["ms"] / floor_ms
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


def kernels_step(smoke: bool, clock: Clock, bandwidth: float | None, peer: dict, result: dict, save) -> dict:
    """Fills `result` (the step's record, saved part-way) with checks, finiteness and rows; returns it."""
    plan = KernelPlan(smoke)
    setup = gb.Setup(smoke, clock.budget_s)
    setup.start = clock.start
    bandwidth = bandwidth or gb.copy_bandwidth(setup)
    H = plan.BHD[0][1]
    fsa, peer_record = (peers.load_flash_sparse() if peer["status"] == "installed" else (None, peer))
    result.update(title=f"π-Attention ops, causal, window {gb.OP['window']}, period {gb.OP['period']}, B "
                        f"{plan.BHD[0][0]}, H {H}",
                  plan=dict(BHD=plan.BHD, T=plan.T, dtypes=[str(d) for d in plan.dtypes], backend=plan.backend,
                            check_shape=plan.check_shape, head_periods=head_periods(H), op=gb.OP),
                  peer=peer_record, bandwidth_GBps=bandwidth / 1e9, checks={}, rows=[])
    ops = kernel_ops(plan, H, fsa)
    log("  checks against backend reference:")
    for label, (op, ref, uses_gate, dtypes) in ops.items():
        for dtype in dtypes or plan.dtypes:
            record = check_op(plan, op, ref, uses_gate, dtype, H)
            result["checks"][f"{label}/{str(dtype).removeprefix('torch.')}"] = record
            log(f"  check {label:<10} {str(dtype):<15} {record['status']} {record.get('error', '')}")
    checks = {(k.split("/")[0], getattr(torch, k.split("/")[1])): v for k, v in result["checks"].items()}
    save()
    log("  finiteness near the clamp:")
    setup.nan_shape = (1, H, plan.T[-1], plan.BHD[0][2])
    result["nan_check"] = gb.nan_check(setup, {"pi": (ops["pi"][0], True)})
    log("  operator grid:")
    result["rows"] = time_rows(setup, plan, ops, checks, bandwidth, plan.modes)
    add_ratios(result["rows"])
    save()
    # flex last: it compiles per shape (10-40 s each on a GPU), so it gets what time is left
    block, flex_checks = probe_flex(plan, H, clock)
    result.update(flex_smallest_block=block)
    result["checks"].update({f"{k}/bfloat16": v for k, v in flex_checks.items()})
    if block is not None:
        result["rows"] += time_rows(setup, plan, flex_ops(block), {}, bandwidth, plan.flex_modes)
        add_ratios(result["rows"])
    return result


# -------------------------------------------------------------------------------------------------- model

def model_step(smoke: bool, clock: Clock) -> dict:
    plan = gpu_model.ModelPlan(smoke)
    return dict(size=plan.size, dtype=str(plan.dtype).removeprefix("torch."), decode_tokens=plan.decode_tokens,
                rows=gpu_model.run(plan, clock.out_of_time, log))


# ------------------------------------------------------------------------------------------------- report

def _fmt(x, spec: str = ".3f") -> str:
    return "" if x is None else format(x, spec)


def _kernel_table(kernels: dict) -> list[str]:
    rows = kernels.get("rows", [])
    labels = list(dict.fromkeys(r["backend"] for r in rows))
    out = ["| dtype | D | T | mode | floor ms | " + " | ".join(labels) + " |", "|" + "---|" * (5 + len(labels))]
    keys = list(dict.fromkeys((r["dtype"], r["D"], r["T"], r["mode"]) for r in rows))
    for key in keys:
        group = {r["backend"]: r for r in rows if (r["dtype"], r["D"], r["T"], r["mode"]) == key}
        cells = []
        for label in labels:
            r = group.get(label)
            cells.append("" if r is None else f"{r['ms']:.3f} (×{r['ratio_to_floor']:.1f})" if r.get("ms")
                         else r["status"])
        floor = next(iter(group.values()))["floor_ms"]
        out.append("| " + " | ".join([*map(str, key), f"{floor:.3f}", *cells]) + " |")
    return out


def markdown(report: dict) -> str:
    env = report.get("environment", {})
    steps = report["steps"]
    out = [f"# GPU run ({env.get('device', '?')})", "",
           f"torch {env.get('torch')}, triton {env.get('triton')}, CUDA {env.get('cuda')}, Python "
           f"{env.get('python')}, SMs {env.get('sm_count')}, memory {_fmt(env.get('gpu_memory_gib'), '.0f')} GiB, "
           f"copy bandwidth {_fmt(env.get('copy_bandwidth_GBps'), '.0f')} GB/s (read + write, this run). "
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
    kernels = steps.get("kernels", {})
    if kernels.get("rows") or kernels.get("checks"):
        peer = kernels.get("peer", {})
        out += ["", "## Kernels", "", f"{kernels.get('title')}. Cells: median ms (× the floor = bytes that must "
                "move ÷ copy bandwidth). pi = adaptive (gate), pi-heads = one period per head "
                f"{kernels['plan']['head_periods']}, pi-union and fsa-union = window + skip key under one "
                "softmax without clamp, local = union with period = window (LocalAttention's operator), "
                "sdpa = dense causal (flash for bf16, efficient for fp32).",
                "", f"Peer flash-sparse-attn: {peer.get('status')} {peer.get('version', '')} "
                f"{peer.get('error', peer.get('note', ''))}. "
                f"Smallest flex block: {kernels.get('flex_smallest_block')}.",
                "", *_kernel_table(kernels), "", "### Checks against backend \"reference\"", "",
                "| op/dtype | status | max abs error |", "|---|---|---|"]
        out += [f"| {k} | {c['status']} | {gb._errors(c)} |" for k, c in kernels.get("checks", {}).items()]
        nan = kernels.get("nan_check")
        if nan:
            out += ["", f"Finiteness at {nan['shape']}, q × {nan['q_scale']}, clamp {nan['logit_clamp']}: "
                    + ", ".join(f"{k} {r['status']}" for k, r in nan["results"].items())]
    model = steps.get("model", {})
    if model.get("rows"):
        out += ["", f"## Model ({model['size']} GPT, {model['dtype']}, batch 1)", "",
                "| kind | T | train ms | train peak MiB | prefill ms | prefill peak MiB | decode ms/token | "
                "decode peak MiB | cache MiB | status |", "|" + "---|" * 10]
        for r in model["rows"]:
            out.append("| " + " | ".join([r["kind"], str(r["T"]), *(_fmt(r.get(k), ".1f") for k in (
                "train_ms", "train_peak_mib", "prefill_ms", "prefill_peak_mib")), _fmt(r.get("decode_ms_per_token"),
                ".2f"), *(_fmt(r.get(k), ".1f") for k in ("decode_peak_mib", "cache_mib")), r["status"]]) + " |")
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
        kernels = self.data["steps"].get("kernels", {})
        if any(r.get("ms") for r in kernels.get("rows", [])):
            import plot_gpu

            plot_gpu.plot(dict(rows=kernels["rows"], environment=self.data["environment"], title=kernels["title"]),
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
            record.update(status="error", error=_describe(exc), traceback=traceback.format_exc()[-3000:])
            log(f"  {name} failed: {record['error']}")
        record["seconds"] = clock.elapsed()
        if name == "env" and "environment" in record:
            self.data["environment"] = record["environment"]
        self.save()
        return record


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for gpu_run.{json,md,png} and the test log")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run of every step (for tests)")
    p.add_argument("--budget-s", type=float, default=sum(BUDGETS.values()), help="cap on the whole run")
    for name, seconds in BUDGETS.items():
        p.add_argument(f"--{name}-s", type=float, default=seconds,
                       help=f"budget of step {name} (default {seconds:.0f})")
    p.add_argument("--wheels", type=Path, default=ROOT / ".whl", help="folder of peer wheels (gpu_wheels.sh)")
    a = p.parse_args(argv)
    if not a.smoke and not torch.cuda.is_available():
        p.error("no CUDA device; use --smoke for the CPU run")
    a.out.mkdir(parents=True, exist_ok=True)
    report = Report(a.out, argv, a.smoke)
    total = Clock(a.budget_s)

    def budget(name: str) -> float:
        return max(0.0, min(getattr(a, f"{name}_s"), total.left()))

    env = report.step("env", budget("env"), lambda clock, _: env_step(a.smoke, clock))
    report.data.setdefault("environment", gb.environment(gb.Setup(a.smoke, 0)))
    report.step("tests", budget("tests"), lambda clock, _: tests_step(a.smoke, clock, a.out))
    report.step("tune", budget("tune"), lambda clock, _: tune_step(a.smoke, clock, a.out))
    peer = peers.install_wheels(a.wheels)
    bandwidth = env.get("environment", {}).get("copy_bandwidth_GBps")
    report.step("kernels", budget("kernels"), lambda clock, record: kernels_step(
        a.smoke, clock, bandwidth and bandwidth * 1e9, peer, record, report.save))
    report.step("model", budget("model"), lambda clock, _: model_step(a.smoke, clock))
    try:
        report.plot()
    except Exception as exc:  # the JSON and markdown are the record; the figure is a view of them
        report.data["plot_error"] = _describe(exc)
    report.save()
    log((a.out / "gpu_run.md").read_text())
    return report.data


if __name__ == "__main__":
    main()
