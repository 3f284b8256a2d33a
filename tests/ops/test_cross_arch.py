"""The C kernels built for aarch64 and run under qemu-aarch64, against the same kernels built for x86-64 and
against the reference backend, on the same inputs (issue 36: the suite green on every x86-64 CPU, and on
aarch64 where it builds; no aarch64 machine is at hand, so its code runs in user-mode emulation).

Both sources are built as cbuild builds them, with fused.py's and native.py's own flags (less -fPIC
-shared: linked statically into a program here) and OpenMP, with `-march=<level>` where cbuild's first
flag set says `-march=native`: x86-64-v2 (16-byte vectors, SSE4.1's widening, no AVX, no F16C, no FMA) on
this machine, armv8-a for aarch64 (16-byte vectors, every path generic C: fused_cpu.c has no aarch64
intrinsics, and armv8.2-a+fp16+bf16 compiles to the same instructions; PIATTN_CROSS_AARCH64 names other
levels, comma separated, e.g. armv8-a,armv8.2-a+sve,armv9-a for the SVE code GCC's vectorizer writes where
-march=native finds SVE). Each is linked with tests/native/cross_harness.c, a driver that reads the calls
and their inputs from a file, fills the output buffers with NaN, makes the calls and writes the outputs.

Checked, for every build:
- the fused forward then backward (the backward reading the forward's statistics) in fp32, fp64, bf16 and
  fp16, the four variants, causal and bidirectional, grouped heads, the logit clamp, sinks, packed
  documents, per-head periods, dropout (the mask `pi_attention` draws for the seed), a head dim that is no
  multiple of the vector width, two OpenMP threads: against `pi_attention(..., backend="reference")` (fp64 at
  1e-10; fp32 against the fp64 reference of the same values at test_fused_cpu's 2e-5, 1e-4 for dgate;
  bf16, fp16 by the reference-error rule of tests/utils.py) and against the x86-64 build (CROSS_ULPS below);
- the decoding step (`pi_decode_step_packed_*`, its 35 arguments packed by native.ARGS) in fp32 and fp64,
  prior modes none, const, alpha and hidden, all T queries of a sequence in one call (each over its own
  `decode_slots.block_slots`): its rows against the reference backend's rows of the whole sequence; and the one-token
  step of a layer (the new key and value stored in the ring, RoPE on q and the key, fp32 and fp64 angle
  tables): the stored key bit for bit `Rotary.rotate`'s, the row against the reference.

Skipped where aarch64-linux-gnu-gcc or qemu-aarch64 is missing (Debian: apt-get install gcc-aarch64-linux-gnu
qemu-user), or where this machine is not x86-64. The builds take about a minute on two busy cores
(fused_cpu.c at -O3, twice), kept in pytest's cache folder until a source, a flag or a compiler changes; the
tests themselves about ten seconds.
"""

from __future__ import annotations

import hashlib
import math
import os
import platform
import re
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

import piattn
from piattn.layers.rotary import Rotary
from piattn.ops.pi import cbuild, fused, native
from piattn.ops.pi.decode_slots import block_slots, head_table
from piattn.ops.pi.pattern import Pattern
from utils import FLOOR_ULPS, TOLERANCES, compare_to_exact, divmod_index, exact_run, forward_backward, param_id

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ROOT / "tests" / "native" / "cross_harness.c"
CROSS_CC = os.environ.get("PIATTN_CROSS_CC") or "aarch64-linux-gnu-gcc"
QEMU = os.environ.get("PIATTN_QEMU") or "qemu-aarch64"
HOST_CC = os.environ.get("CC") or "cc"
AARCH64_LEVELS = tuple((os.environ.get("PIATTN_CROSS_AARCH64") or "armv8-a").split(","))
HOST_LEVEL = "x86-64-v2"

_missing = [name for name in (CROSS_CC, QEMU, HOST_CC) if shutil.which(name) is None]
pytestmark = [
    # Minutes of cross-compiling on a cold cache, and only where the cross toolchain is installed: `make
    # test-slow` (docs/results.md §9 gives its last run).
    pytest.mark.slow,
    pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                       reason=f"builds its x86-64 side natively; this machine is {platform.machine()}"),
    pytest.mark.skipif(bool(_missing), reason=f"no {', '.join(_missing)} (Debian: apt-get install "
                                              f"gcc-aarch64-linux-gnu qemu-user) to build and run aarch64 code"),
]

FP32 = dict(atol=2e-5, rtol=2e-5)  # test_fused_cpu's: fp32 against the fp64 reference of the same values
FP32_DGATE = dict(atol=1e-4, rtol=1e-4)
# The aarch64 build against the x86-64 one: the same algorithm in the same precision and vector width (16
# bytes), but aarch64 contracts a·b + c into one fused multiply-add (-ffp-contract=fast; x86-64-v2 has no
# FMA) and links another libm. Allowed: CROSS_ULPS units in the last place (of the dtype) of the tensor's
# largest element or of 1, tests/utils.py's FLOOR_ULPS (seen: up to 4.4 for fp32's dgate, a sum that cancels
# to near 0, 3.1 in fp64; bf16 and fp16 outputs differ in a few elements by one unit of their own).
CROSS_ULPS = FLOOR_ULPS
SUFFIX = {torch.float32: "f32", torch.float64: "f64", torch.bfloat16: "bf16", torch.float16: "f16"}
MAGIC_IN, MAGIC_OUT = 0x4E49485849500001, 0x54554F4849500001
INPUT, OUTPUT, ABSENT, UPDATED = 0, 1, 2, 3


# ---------------------------------------------------------------------------------------------------------
# The builds.

def _flags(base: tuple[str, ...]) -> list[str]:
    """cbuild's flags for a library, less what makes a shared one: these are linked into a program."""
    return [f for f in base if f not in ("-fPIC", "-shared")]


@dataclass
class Build:
    """One target's harness: its name, the program, and how to run it (qemu for aarch64)."""

    name: str
    program: Path
    runner: tuple[str, ...]
    warnings: str = ""

    def run(self, program: bytes, tmp: Path) -> bytes:
        (tmp / f"{self.name}.in").write_bytes(program)
        done = subprocess.run([*self.runner, str(self.program), str(tmp / f"{self.name}.in"),
                               str(tmp / f"{self.name}.out")], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{self.name}: the harness failed ({done.returncode}): {done.stderr.strip()}"
        return (tmp / f"{self.name}.out").read_bytes()


def _jobs(level: str) -> list[tuple[Path, list[str]]]:
    """(source, compiler flags) of each object of a target's harness."""
    marched = [f"-march={level}" if f == "-march=native" else f for f in fused.FLAG_SETS[0]]
    assert any(f.startswith("-march=") for f in marched), "fused.FLAG_SETS[0] no longer pins -march=native"
    return [(fused.SOURCE, [*_flags(fused._BASE_FLAGS), *marched]),
            (native.SOURCE, _flags(native._FLAGS)),  # cbuild builds it with these alone: no -march
            (HARNESS, ["-O2", "-std=c11", "-Wall", "-Wextra"])]


LINK = ["-static", "-fopenmp", "-lm"]


def _key(cc: str, level: str) -> str:
    """What a target's harness is built from: the sources, the commands, the compiler's version."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    parts = [cc, version, *LINK]
    for source, flags in _jobs(level):
        parts += [*(path.read_text() for path in cbuild.sources(source)), *flags]  # with the files it includes
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _start_build(cc: str, level: str, folder: Path) -> list[tuple[subprocess.Popen, str]]:
    """The compilers of one target, started (they run side by side), with the objects they write."""
    started = []
    for source, flags in _jobs(level):
        obj = str(folder / f"{source.stem}.o")
        started.append((subprocess.Popen([cc, *flags, "-c", str(source), "-o", obj], stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True), obj))
    return started


def _finish_build(name: str, cc: str, started: list[tuple[subprocess.Popen, str]], folder: Path, done: Path) -> None:
    """Wait for the compilers, link, and put the folder at `done` (the compilers' words in compiler.txt); a
    build that fails fails the test with the compiler's words."""
    said = []
    for process, _ in started:
        out, _ = process.communicate(timeout=600)
        said.append(out)
        if process.returncode:
            pytest.fail(f"{name}: {' '.join(process.args)} failed:\n{out}")
    linked = subprocess.run([cc, *[obj for _, obj in started], "-o", str(folder / "cross_harness"), *LINK],
                            capture_output=True, text=True, timeout=300)
    if linked.returncode:
        pytest.fail(f"{name}: linking failed:\n{linked.stderr}")
    (folder / "compiler.txt").write_text("".join(said))
    try:
        folder.rename(done)
    except OSError:  # another pytest worker got there first, with the same build
        shutil.rmtree(folder)
    for old in done.parent.iterdir():  # this target's builds of older sources
        if old != done and re.fullmatch(re.escape(name) + r"-[0-9a-f]{16}", old.name):
            shutil.rmtree(old, ignore_errors=True)


@pytest.fixture(scope="session")
def builds(request, tmp_path_factory) -> list[Build]:
    """[the x86-64 build, then each aarch64 one], built once per change of their sources, flags or compilers:
    kept in pytest's cache folder (.pytest_cache/d/cross-arch, shared by xdist's workers), else for the session."""
    if cbuild.missing_features(HOST_LEVEL, cbuild.cpu_features()):
        pytest.skip(f"this CPU cannot run {HOST_LEVEL} code")
    cache = getattr(request.config, "cache", None)  # absent under `-p no:cacheprovider`
    root = cache.mkdir("cross-arch") if cache is not None else tmp_path_factory.mktemp("cross-arch")
    targets = [(HOST_LEVEL, HOST_CC, HOST_LEVEL, ()), *((f"aarch64-{level}", CROSS_CC, level, (QEMU,))
                                                      for level in AARCH64_LEVELS)]
    done = {name: root / f"{name}-{_key(cc, level)}" for name, cc, level, _ in targets}
    pending = []
    for name, cc, level, _ in targets:
        if not (done[name] / "compiler.txt").exists():
            folder = Path(tempfile.mkdtemp(prefix=f"{name}-", suffix=".tmp", dir=root))
            pending.append((name, cc, _start_build(cc, level, folder), folder))
    for name, cc, started, folder in pending:
        _finish_build(name, cc, started, folder, done[name])
    return [Build(name, done[name] / "cross_harness", runner, (done[name] / "compiler.txt").read_text())
            for name, _, _, runner in targets]


# ---------------------------------------------------------------------------------------------------------
# The harness's input: buffers, then calls (tests/native/cross_harness.c says the format).

def _words(*values: int) -> bytes:
    return struct.pack(f"<{len(values)}q", *values)


def _bytes_of(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@dataclass
class Program:
    buffers: list[tuple[int, int, int, bytes]] = field(default_factory=list)  # (bytes, element size, role, data)
    layouts: dict[int, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)
    calls: list[bytes] = field(default_factory=list)

    def _add(self, nbytes: int, size: int, role: int, data: bytes, layout) -> int:
        self.buffers.append((nbytes, size, role, data))
        self.layouts[len(self.buffers)] = layout
        return len(self.buffers)  # a buffer's number + 1: 0 is NULL

    def input(self, t: torch.Tensor | None, role: int = INPUT) -> int:
        if t is None:
            return 0
        data = _bytes_of(t)
        return self._add(len(data), t.element_size(), role, data, (tuple(t.shape), t.dtype))

    def output(self, shape, dtype: torch.dtype) -> int:
        size = torch.empty((), dtype=dtype).element_size()
        return self._add(math.prod(shape) * size, size, OUTPUT, b"", (tuple(shape), dtype))

    def call(self, name: str, fields: bytes, pointers: list[int], buffers: list[int]) -> None:
        words = len(fields) // 8
        padded = name.encode().ljust(-(-len(name) // 8) * 8, b"\0")
        self.calls.append(_words(len(name)) + padded + _words(words) + fields + _words(len(pointers), *pointers)
                          + _words(len(buffers), *buffers))

    def encode(self) -> bytes:
        parts = [_words(MAGIC_IN, len(self.buffers))]
        for nbytes, size, role, data in self.buffers:
            parts.append(_words(nbytes, size, role) + data.ljust(-(-len(data) // 8) * 8, b"\0"))
        parts.append(_words(len(self.calls)))
        return b"".join(parts + self.calls)

    def decode(self, out: bytes) -> tuple[list[int], dict[int, torch.Tensor]]:
        """(each call's return code, {buffer number + 1: what the harness left in it})."""
        magic, n_calls = struct.unpack_from("<2q", out)
        assert magic == MAGIC_OUT
        codes = list(struct.unpack_from(f"<{n_calls}q", out, 16))
        at = 16 + 8 * n_calls
        (n_out,) = struct.unpack_from("<q", out, at)
        at += 8
        tensors = {}
        for _ in range(n_out):
            index, nbytes = struct.unpack_from("<2q", out, at)
            at += 16
            shape, dtype = self.layouts[index + 1]
            tensors[index + 1] = torch.frombuffer(bytearray(out[at:at + nbytes]), dtype=dtype).reshape(shape)
            at += -(-nbytes // 8) * 8
        assert at == len(out), "the harness wrote more than it was asked for"
        return codes, tensors


def run_everywhere(builds: list[Build], program: Program, tmp: Path) -> list[tuple[list[int], dict]]:
    encoded = program.encode()
    return [program.decode(build.run(encoded, tmp)) for build in builds]


# ---------------------------------------------------------------------------------------------------------
# The fused kernels: forward, then backward.

B, T = 1, 37
FUSED_CASES = {  # name: (H, H_kv, D, settings of pi_attention)
    "union-causal-clamp": (2, 2, 16, dict(window=3, period=7, causal=True, variant="union", logit_clamp=1.5)),
    "fixed-bidirectional-gqa-sinks": (2, 1, 16, dict(window=2, period=5, causal=False, variant="fixed", prior=0.3,
                                                     sinks=2)),
    "adaptive-documents-head-periods": (2, 2, 13, dict(window=4, period=(6, 13), causal=True, variant="adaptive",
                                                       logit_clamp=None, documents=(15, 22))),
    "separate-bidirectional-dropout": (2, 2, 16, dict(window=3, period=9, causal=False, variant="separate",
                                                      dropout_p=0.25)),
}
FUSED_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
NAMES = ("y", "dq", "dk", "dv", "dgate")
SEED = 5


def _fused_inputs(H, H_kv, D, variant, dtype):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64).to(dtype)
    k, v = (torch.randn(B, H_kv, T, D, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    gate = None
    if variant in ("adaptive", "separate"):
        gate = (0.02 + 0.96 * torch.rand(B, H, T, generator=g, dtype=torch.float64)).to(dtype)
    # utils.forward_backward's cotangent, which exact_run uses too
    dy = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return q, k, v, gate, dy


def _operator_settings(kw: dict) -> dict:
    """`pi_attention`'s keywords for a case (its documents as ids)."""
    kw = dict(kw)
    sizes = kw.pop("documents", None)
    if sizes is not None:
        kw["document_ids"] = torch.cat([torch.full((n,), i) for i, n in enumerate(sizes)]).expand(B, T)
    return kw


def _fused_program(q, k, v, gate, dy, kw: dict) -> tuple[Program, dict[str, int]]:
    """The harness's forward then backward, with what `fused._run` would pass (2 threads); the buffer of each
    output by name (and "stat")."""
    H, D, H_kv = q.shape[1], q.shape[-1], k.shape[1]
    window, period, causal, variant = kw["window"], kw["period"], kw["causal"], kw["variant"]
    sinks, dropout_p = kw.get("sinks", 0), kw.get("dropout_p", 0.0)
    clamp = kw.get("logit_clamp", 20.0)
    keep = None
    if dropout_p:  # the mask `pi_attention` draws for this seed (one period: `_pi_attention`)
        assert isinstance(period, int)
        torch.manual_seed(SEED)
        keep = fused.keep_bytes(torch.rand(B, H, T, Pattern(window, period, causal, sinks).n_slots) >= dropout_p)
    start, end = fused.document_bounds(_operator_settings(kw).get("document_ids"))
    call = fused._Call(B=B, H=H, H_kv=H_kv, T=T, D=D, window=window, sinks=sinks, causal=int(causal),
                       variant=fused.VARIANT_CODES[variant], has_clamp=int(clamp is not None), threads=2,
                       clamp=0.0 if clamp is None else clamp, prior=kw.get("prior", 0.5), eps=1e-4,
                       scale=D ** -0.5, keep_slots=0 if keep is None else keep.shape[-1],
                       keep_scale=1 / (1 - dropout_p))
    p = Program()
    qb, kb, vb, gb = p.input(q), p.input(k), p.input(v), p.input(gate)
    y = p.output(q.shape, q.dtype)
    stat = p.output((B, H, T, fused.stats_per_row(variant)), torch.float64)
    periods, sb, eb, keepb = (p.input(fused.period_tensor(period, H)), p.input(start), p.input(end), p.input(keep))
    dyb = p.input(dy.to(q.dtype))
    grads = [p.output(q.shape, q.dtype), p.output(k.shape, k.dtype), p.output(v.shape, v.dtype),
             0 if gate is None else p.output(gate.shape, gate.dtype)]
    suffix = SUFFIX[q.dtype]
    p.call(f"pi_fused_forward_{suffix}", bytes(call), [], [qb, kb, vb, gb, y, stat, periods, sb, eb, keepb])
    p.call(f"pi_fused_backward_{suffix}", bytes(call), [], [qb, kb, vb, gb, dyb, stat, *grads, periods, sb, eb, keepb])
    return p, dict(zip(NAMES, [y, *grads], strict=True), stat=stat)


def _outputs(tensors: dict, index: dict[str, int]) -> tuple:
    return tuple(tensors[index[name]] if index[name] else None for name in NAMES)


def _against_reference(name: str, got: tuple, reference: tuple, exact: tuple | None, dtype: torch.dtype) -> None:
    if exact is not None:  # bf16, fp16: the reference-error rule (tests/utils.py)
        compare_to_exact(reference, got, exact)
        return
    for what, e, a in zip(NAMES, reference, got, strict=True):
        assert (e is None) == (a is None), f"{name} {what}"
        if e is None:
            continue
        tol = TOLERANCES[dtype] if dtype == torch.float64 else FP32_DGATE if what == "dgate" else FP32
        torch.testing.assert_close(a.double(), e.detach().double(), **tol, msg=lambda m, w=what: f"{name} {w}: {m}")


def _across(builds: list[Build], results: list[tuple], names: tuple[str, ...], dtype: torch.dtype) -> None:
    """Every aarch64 build's outputs against the x86-64 build's: finite, within CROSS_ULPS of the kernels' dtype
    (the fp64 statistics of an fp32 kernel are computed in fp32)."""
    first = results[0]
    for build, other in zip(builds[1:], results[1:], strict=True):
        for what, e, a in zip(names, first, other, strict=True):
            assert (e is None) == (a is None), what
            if e is None:
                continue
            label = f"{build.name} against {builds[0].name}, {what}"
            assert a.shape == e.shape and a.dtype == e.dtype, label
            assert torch.isfinite(a).all() and torch.isfinite(e).all(), f"{label}: non-finite values"
            error = (a.double() - e.double()).abs()
            scale = max(e.double().abs().max().item(), 1.0)
            bound = CROSS_ULPS * torch.finfo(dtype).eps * scale
            worst = error.max().item()
            assert worst <= bound, (f"{label}: differ by {worst:.3g} at "
                                    f"{tuple(divmod_index(error.argmax().item(), error.shape))} > {bound:.3g} = "
                                    f"{CROSS_ULPS} ulps of {scale:.3g} ({dtype})")


@pytest.mark.parametrize("dtype", FUSED_DTYPES, ids=param_id)
@pytest.mark.parametrize("case", FUSED_CASES)
def test_fused_forward_backward(builds, case, dtype, tmp_path):
    H, H_kv, D, kw = FUSED_CASES[case]
    q, k, v, gate, dy = _fused_inputs(H, H_kv, D, kw["variant"], dtype)
    program, index = _fused_program(q, k, v, gate, dy, kw)
    runs = run_everywhere(builds, program, tmp_path)

    settings = _operator_settings(kw)
    inputs = [None if t is None else t.clone().requires_grad_() for t in (q, k, v, gate)]
    exact = None
    if dtype in (torch.float64, torch.float32):  # the fp64 reference of the same values
        inputs = [None if t is None else t.detach().double().requires_grad_() for t in inputs]
    else:
        exact = exact_run(inputs, seed=SEED, grad=True, **settings)
    torch.manual_seed(SEED)  # dropout's mask: the one _fused_program drew
    reference = forward_backward(*inputs, backend="reference", **settings)
    results = []
    for build, (codes, tensors) in zip(builds, runs, strict=True):
        assert codes == [0, 0], f"{build.name}: the kernels returned {codes}"
        got = _outputs(tensors, index)
        assert all(t is None or t.dtype == dtype for t in got)
        assert not tensors[index["stat"]].isnan().any(), f"{build.name}: stat left unwritten"
        _against_reference(f"{build.name} {case}", got, reference, exact, dtype)
        results.append((*got, tensors[index["stat"]]))
    _across(builds, results, (*NAMES, "stat"), dtype)


def test_a_wrong_or_unwritten_element_fails(builds, tmp_path):
    """The checks above can fail: the aarch64 run's outputs with one element's sign flipped, or one element left
    as the harness's NaN poison, fail both the comparison with the reference and the one with x86-64."""
    if len(builds) < 2:
        pytest.skip("no aarch64 build")
    H, H_kv, D, kw = FUSED_CASES["union-causal-clamp"]
    q, k, v, gate, dy = _fused_inputs(H, H_kv, D, kw["variant"], torch.float32)
    program, index = _fused_program(q, k, v, gate, dy, kw)
    runs = run_everywhere(builds[:2], program, tmp_path)
    wide = [None if t is None else t.detach().double().requires_grad_() for t in (q, k, v, gate)]
    reference = forward_backward(*wide, backend="reference", **_operator_settings(kw))
    results = [_outputs(tensors, index) for _, tensors in runs]
    _against_reference("aarch64", results[1], reference, None, torch.float32)
    _across(builds[:2], results, NAMES, torch.float32)
    for what, spoil in (("dk", lambda t: t.neg_()), ("y", lambda t: t.fill_(math.nan))):
        spoilt = [t.clone() if t is not None else None for t in results[1]]
        spoil(spoilt[NAMES.index(what)][0, 0, 17, 3:4])
        with pytest.raises(AssertionError, match=what):
            _against_reference("aarch64", tuple(spoilt), reference, None, torch.float32)
        with pytest.raises(AssertionError, match=what):
            _across(builds[:2], [results[0], tuple(spoilt)], NAMES, torch.float32)


# ---------------------------------------------------------------------------------------------------------
# The decoding step: every query of a sequence at once, each over its own slots, and the one-token step.

STEP_DTYPES = (torch.float64, torch.float32)
STEP_CASES = {  # name: (H, H_kv, D, prior mode, settings)
    "none-clamp": (2, 2, 16, native.PRIOR_NONE, dict(window=3, period=7, variant="union", logit_clamp=1.5)),
    "const-gqa-sinks": (2, 1, 16, native.PRIOR_CONST, dict(window=2, period=5, variant="fixed", prior=0.3, sinks=2)),
    "alpha-odd-d": (2, 2, 13, native.PRIOR_ALPHA, dict(window=4, period=11, variant="adaptive", logit_clamp=None)),
    "hidden-sink": (2, 1, 16, native.PRIOR_HIDDEN, dict(window=3, period=6, variant="adaptive", sinks=1)),
    # the whole gate MLP in the step, its first layer's 11 inputs and 7 rows both past a multiple of the lanes
    "input-gate": (2, 2, 16, native.PRIOR_INPUT, dict(window=3, period=6, variant="adaptive")),
    "period-in-window": (2, 2, 16, native.PRIOR_NONE, dict(window=5, period=3, variant="union")),
}
EPS = 1e-4
N_HIDDEN = 7
N_IN = 11
_POINTERS = [i for i, c in enumerate(native.ARGS.format.lstrip("@=<>!")) if c == "P"]


def _step_field_names() -> list[str]:
    """The fields of decode_step.c's pi_step_args, in order, read from its typedef."""
    text = native.SOURCE.read_text()
    body = text[text.index("typedef struct {", text.index("pi_step_args")):text.index("} pi_step_args;")]
    names = []
    for line in body.splitlines()[1:]:
        declarators = re.sub(r"^\s*(const\s+)?\w+\s*", "", line.split(";")[0])
        names += [d.strip(" *") for d in declarators.split(",") if d.strip()]
    return names


def _step_fields(**values) -> bytes:
    """native.ARGS packed as native.py packs it (fields by name, 0 where not given), pointers as buffer numbers
    + 1."""
    names = _step_field_names()
    assert len(names) == len(native.ARGS.format.lstrip("@=<>!")), names
    assert not set(values) - set(names), set(values) - set(names)
    return native.ARGS.pack(*(values.get(name, 0) for name in names))


def _step_inputs(H, H_kv, D, mode, dtype):
    g = torch.Generator().manual_seed(7)
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, H_kv, T, D, generator=g, dtype=torch.float64) for _ in range(2))
    alpha, hidden, w, bias, w_in, b_in = None, None, None, None, None, None
    if mode == native.PRIOR_ALPHA:
        alpha = 0.02 + 0.96 * torch.rand(B, H, T, generator=g, dtype=torch.float64)
    if mode in (native.PRIOR_HIDDEN, native.PRIOR_INPUT):  # for PRIOR_INPUT, hidden is the MLP's input
        hidden = torch.randn(B, T, N_IN if mode == native.PRIOR_INPUT else N_HIDDEN, generator=g, dtype=torch.float64)
        w = torch.randn(H, N_HIDDEN, generator=g, dtype=torch.float64) / 2
        bias = torch.randn(H, generator=g, dtype=torch.float64)
    if mode == native.PRIOR_INPUT:
        w_in = torch.randn(N_HIDDEN, N_IN, generator=g, dtype=torch.float64) / 2
        b_in = torch.randn(N_HIDDEN, generator=g, dtype=torch.float64)
    return [None if t is None else t.to(dtype) for t in (q, k, v, alpha, hidden, w, bias, w_in, b_in)]


def _slots(window, period, sinks, t, n):
    """One slot table for every head (slot [t·S], valid [t, S] or None, kind [S]) of t queries over n keys: a
    plan's table of one head (`decode_slots.block_slots`)."""
    cpu = torch.device("cpu")
    idx, valid = block_slots(window, (period,), sinks, t, n, cpu)
    return idx[0], None if valid is None else valid[0], head_table(window, (period,), sinks, cpu).kind


def _hidden_alpha(hidden, w, bias, H):
    """α of PRIOR_HIDDEN, in fp64: ε + (1 − 2ε)·σ(w·GELU(hidden) + bias), [B, H, T]."""
    act = torch.nn.functional.gelu(hidden.double())
    u = torch.einsum("btj,hj->bht", act, w.double()) + bias.double()[None, :, None]
    return EPS + (1 - 2 * EPS) * torch.sigmoid(u)


@pytest.mark.parametrize("dtype", STEP_DTYPES, ids=param_id)
@pytest.mark.parametrize("case", STEP_CASES)
def test_decode_step_every_query(builds, case, dtype, tmp_path):
    H, H_kv, D, mode, kw = STEP_CASES[case]
    q, k, v, alpha, hidden, w, bias, w_in, b_in = _step_inputs(H, H_kv, D, mode, dtype)
    window, period, sinks = kw["window"], kw["period"], kw.get("sinks", 0)
    slot, valid, kind = _slots(window, period, sinks, T, T)
    clamp = kw.get("logit_clamp", 20.0)
    prior = kw.get("prior", 0.5)
    p = Program()
    y = p.output((B, H, T, D), dtype)
    fields = dict(q=p.input(q), q_sb=H * T * D, q_sh=T * D, q_st=D, kv=p.input(torch.stack([k, v])), B=B, H=H,
                  H_kv=H_kv, N=T, D=D, Q=T, slot=p.input(slot), valid=p.input(valid), kind=p.input(kind),
                  S=kind.shape[0], prior_mode=mode, c_local=math.log(max(prior, EPS)),
                  c_skip=math.log(max(1 - prior, EPS)), scale=D ** -0.5,
                  clamp=math.inf if clamp is None else clamp, eps=EPS, y=y)
    if mode == native.PRIOR_ALPHA:
        fields.update(gate=p.input(alpha), gate_sb=H * T, gate_sh=T, gate_st=1)
    if mode in (native.PRIOR_HIDDEN, native.PRIOR_INPUT):
        width = hidden.shape[-1]
        fields.update(gate=p.input(hidden), gate_sb=T * width, gate_st=width, n_hidden=N_HIDDEN,
                      w=p.input(w), bias=p.input(bias))
    if mode == native.PRIOR_INPUT:
        fields.update(w_in=p.input(w_in), bias_in=p.input(b_in), n_in=N_IN)
    p.call(f"pi_decode_step_packed_{SUFFIX[dtype]}", _step_fields(**fields), _POINTERS, [])
    runs = run_everywhere(builds, p, tmp_path)

    if mode == native.PRIOR_INPUT:  # the MLP's first layer, in fp64
        hidden = hidden.double() @ w_in.double().T + b_in.double()
    gate = alpha if mode == native.PRIOR_ALPHA else _hidden_alpha(hidden, w, bias, H) if hidden is not None else None
    with torch.no_grad():
        expected = piattn.pi_attention(q.double(), k.double(), v.double(), None if gate is None else gate.double(),
                                       **{**kw, "sinks": sinks}, eps=EPS, causal=True, backend="reference")
    tol = TOLERANCES[dtype]
    results = []
    for build, (codes, tensors) in zip(builds, runs, strict=True):
        assert codes == [0], f"{build.name}: the step returned {codes}"
        got = tensors[y]
        torch.testing.assert_close(got.double(), expected, **tol, msg=lambda m, n=build.name: f"{n} {case}: {m}")
        results.append((got,))
    _across(builds, results, ("y",), dtype)


@pytest.mark.parametrize("table", (torch.float32, torch.float64), ids=param_id)
@pytest.mark.parametrize("dtype", STEP_DTYPES, ids=param_id)
def test_decode_one_token_step_with_rope(builds, dtype, table, tmp_path):
    """The layer's step (`decode_native.run`'s call with a token to store): the new token's key rotated and
    stored in its ring row and its value beside it, q rotated, then the step over the query's slots. The stored key is
    `Rotary.rotate`'s bit for bit (no FMA: -ffp-contract=off); the row is the reference's last row of the
    sequence whose last key and query are the rotated ones."""
    H, H_kv, D, window, period = 2, 1, 16, 3, 7
    position = T - 1
    g = torch.Generator().manual_seed(9)
    q_new = torch.randn(B, H, 1, D, generator=g, dtype=torch.float64).to(dtype)
    kv = torch.randn(2, B, H_kv, T, D, generator=g, dtype=torch.float64).to(dtype)
    fresh = torch.randn(B, 2, H_kv, D, generator=g, dtype=torch.float64).to(dtype)
    alpha = (0.02 + 0.96 * torch.rand(B, H, 1, generator=g, dtype=torch.float64)).to(dtype)
    cos, sin = (t[position, 0].to(table).contiguous() for t in Rotary(D).cos_sin(T))
    slot, valid, kind = _slots(window, period, 0, 1, T)
    p = Program()
    y = p.output((B, H, 1, D), dtype)
    store = p.input(kv, role=UPDATED)
    fields = dict(q=p.input(q_new), q_sb=H * D, q_sh=D, q_st=D, kv=store, B=B, H=H, H_kv=H_kv, N=T, D=D, Q=1,
                  slot=p.input(slot), valid=p.input(valid), kind=p.input(kind), S=kind.shape[0],
                  prior_mode=native.PRIOR_ALPHA, gate=p.input(alpha), gate_sb=H, gate_sh=1, gate_st=1,
                  scale=D ** -0.5, clamp=5.0, eps=EPS, y=y, fresh=p.input(fresh), fresh_sb=2 * H_kv * D,
                  fresh_slot=position, cos=p.input(cos), sin=p.input(sin), rope_f64=int(table == torch.float64))
    p.call(f"pi_decode_step_packed_{SUFFIX[dtype]}", _step_fields(**fields), _POINTERS, [])
    runs = run_everywhere(builds, p, tmp_path)

    def rotate(x):  # [B, heads, D] by the angles of `position`, as a layer rotates [B, T, heads, D]
        return Rotary.rotate(x[:, None], cos, sin)[:, 0]

    k_new, v_new = rotate(fresh[:, 0]), fresh[:, 1]
    stored = kv.clone()
    stored[0, :, :, position], stored[1, :, :, position] = k_new, v_new
    q_full = torch.zeros(B, H, T, D, dtype=torch.float64)
    q_full[:, :, position] = rotate(q_new[:, :, 0]).double()
    with torch.no_grad():
        expected = piattn.pi_attention(q_full, stored[0].double(), stored[1].double(),
                                       alpha.double().expand(B, H, T).contiguous(), window=window, period=period,
                                       variant="adaptive", logit_clamp=5.0, eps=EPS, backend="reference")
    results = []
    for build, (codes, tensors) in zip(builds, runs, strict=True):
        assert codes == [0], f"{build.name}: the step returned {codes}"
        assert torch.equal(tensors[store].view(torch.uint8), stored.view(torch.uint8)), \
            f"{build.name}: the ring after the step is not the rotated key and the value in row {position}"
        torch.testing.assert_close(tensors[y][:, :, 0].double(), expected[:, :, position], **TOLERANCES[dtype],
                                   msg=lambda m, n=build.name: f"{n}: {m}")
        results.append((tensors[y],))
    _across(builds, results, ("y",), dtype)


def test_builds_say_nothing(builds):
    """No target's compiler says a word (a warning of the harness's -Wall -Wextra, or of the kernels at cbuild's
    own flags, which enable no extra warnings): what would only show on another architecture shows here."""
    for build in builds:
        lines = [line for line in build.warnings.splitlines() if "warning:" in line or "error:" in line]
        assert not lines, f"{build.name}:\n" + "\n".join(lines)
