"""Backend "fused" (CPU): the forward and the backward each as one compiled pass over the rows (`fused_cpu.c`).

The "torch" backend runs a dozen tensor ops per chunk, each moving its [T, |U|] or [T, D] intermediate
through memory; the C kernels carry a query row from its scores to its outputs (and, backward, to every
gradient it feeds) while the row and its few key rows are in cache. The forward saves one statistic per row
(the log-sum-exp of its logits; two for "separate", one per branch) and the backward recomputes the scores
from q and k: no [T, |U|] tensor is saved, and the passes are bound by reading inputs and writing outputs.

What it runs: fp32 and fp64 CPU tensors (computed in their own precision), bf16 and fp16 (read and written
in their own dtype, computed and summed in fp32: the statistics, and dk, dv until a key row is complete, in
fp32 or wider; each output rounded once, as torch rounds), the four variants, causal and
bidirectional, grouped-query attention, the logit clamp, any head dim, sinks, packed documents
(`document_ids`, passed to the kernels as each position's document bounds), and per-head periods in one
call (`period` a tuple of one π_h per query head; `backends.py` declares `per_head_periods`, so
`pi_attention` sends such a call here whole instead of once per period group); OpenMP threads over (batch,
key/value head), as many as `torch.get_num_threads()`; dropout, reading the keep mask `pi_attention` draws
(the contract's slot layout, per head: local keys, skips, sinks), so that a seed gives the same result as
on every other backend (with per-head periods `pi_attention` draws it per period group, as for the others,
and hands the heads' masks over in one tensor). A NaN or ±inf input stays in the rows that read it.

The library is compiled on first use with the system's C compiler (`$CC`, else `cc`), with the
machine's vector instructions and OpenMP where the compiler takes them, and loaded through the checks of
`cbuild.py` (the builder shared with the decoding step: a private folder, a SHA-256 recorded at build
time). Where it cannot be built or loaded (no compiler, `PIATTN_NATIVE=0`) the backend refuses every call
with the reason and what to do (`unavailable`, the probe `backends.py` declares for it): a call naming
"fused" raises a ValueError, and "auto" runs the next backend of its order ("torch"). It never runs another
backend in its place.

Every output is a fresh tensor that nothing else holds (no pool hands out memory something might still read:
`benchmarks/results/cpu_bench/output_pool_decision.md` measured that one bought a user's training loop nothing); one of
4 MiB or more is marked for transparent huge pages before the kernels first write it
(`piattn.allocator.advise_huge_pages`: a first write then faults in 2 MiB instead of 4 KiB;
`allocator.huge_pages(False)` turns it off, and where the system has no THP one warning says so). The kernels
write every element of their outputs.

"auto" picks it first on a CPU (`backends.AUTO_ORDER`: "fused", "torch", "reference"), for every dtype it runs.
Under torch.compile (and for fake tensors) it runs as the custom operators `piattn::pi_fused_fwd` /
`piattn::pi_fused_bwd` at the end of this file, which call the same `fused_forward` / `fused_backward` as the
eager autograd Function, so that a compiled CPU model runs these kernels too.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

import torch

from ... import allocator
from ...checks import env_switch
from . import cbuild
from .backends import by_keywords, refuse_double_backward
from .operators import register_pair
from .pattern import document_bounds
from .settings import OpSettings

SOURCE = Path(__file__).with_name("fused_cpu.c")
# No -ffast-math: NaN and inf must behave as IEEE says (they stay in the rows that read them).
_BASE_FLAGS = ("-O3", "-std=c99", "-fPIC", "-shared", "-fno-math-errno", "-ffp-contract=fast")
# Tried in order until the compiler takes one: this machine's vector instructions (AVX where it has them) and
# OpenMP threads, then without what it refuses (SSE vectors; one thread: the pragmas are ignored).
FLAG_SETS = (("-march=native", "-fopenmp"), ("-fopenmp",), ())


def flag_sets() -> tuple[tuple[str, ...], ...]:
    """The flag sets to try: FLAG_SETS, or with PIATTN_MARCH set (`cbuild.march`) that instruction set alone,
    with and without OpenMP: a pinned build never falls back to another instruction set."""
    pinned = cbuild.march()
    if pinned is None:
        return FLAG_SETS
    return ((f"-march={pinned}", "-fopenmp"), (f"-march={pinned}",))


VARIANT_CODES = {"union": 0, "fixed": 1, "adaptive": 2, "separate": 3}
_SUFFIXES = {torch.float32: "f32", torch.float64: "f64", torch.bfloat16: "bf16", torch.float16: "f16"}
_FUNCTIONS = {(dtype, direction): f"pi_fused_{direction}_{suffix}"
              for dtype, suffix in _SUFFIXES.items() for direction in ("forward", "backward")}
# fused_cpu.c's PI_ERR_* codes. The checks here come first, so these are reached only through a bug.
_ERRORS = {1: "sizes (B >= 0, 1 <= H_kv <= H dividing H, T >= 1, D >= 1, B·H·T·D within int64)",
           2: "settings (window >= 0, sinks >= 0, periods >= 1, variant, clamp > 0, scale > 0, 0 <= eps < 0.5, "
              "prior in [0, 1], document bounds start <= i < end <= T, dropout scale in [1, inf))",
           3: "a buffer's length disagrees with the sizes, or a buffer the call needs is missing (or a head's "
              "slots do not fit in the dropout mask)",
           4: "out of memory for the scratch rows"}


class _Call(ctypes.Structure):
    """fused_cpu.c's pi_call, field by field."""

    _fields_ = [(name, ctypes.c_int64) for name in ("B", "H", "H_kv", "T", "D", "window", "sinks", "causal",
                                                    "variant", "has_clamp", "threads", "keep_slots")] + \
               [(name, ctypes.c_double) for name in ("clamp", "prior", "eps", "scale", "keep_scale")]


class _Buffer(ctypes.Structure):
    """fused_cpu.c's pi_buffer: a tensor's data pointer and its number of elements."""

    _fields_ = [("data", ctypes.c_void_p), ("numel", ctypes.c_int64)]


_lock = threading.Lock()
_state: dict[str, object] = {}


def _open(path: Path) -> dict[tuple[torch.dtype, str], ctypes._CFuncPtr]:
    library = ctypes.CDLL(str(path))
    functions = {}
    for key, name in _FUNCTIONS.items():
        function = getattr(library, name)
        function.argtypes = [ctypes.POINTER(_Call), ctypes.POINTER(_Buffer), ctypes.c_int64]
        function.restype = ctypes.c_int
        functions[key] = function
    return functions


def _load() -> dict | None:
    """The C kernels by (dtype, direction), built on first use; None (with the reason in `unavailable()`)
    when disabled or when they cannot be built or loaded safely."""
    with _lock:
        if "functions" in _state:
            return _state["functions"]
        functions = None
        other = "or pick backend='torch'"
        if not env_switch("PIATTN_NATIVE"):
            _state["reason"] = (f"its C kernels are switched off by PIATTN_NATIVE={os.environ['PIATTN_NATIVE']}: "
                                f"unset it to build them, {other}")
        else:
            try:
                functions, _state["flags"] = cbuild.load(SOURCE, _open, compiler=os.environ.get("CC") or "cc",
                                                         base_flags=_BASE_FLAGS, flag_sets=flag_sets())
            except ValueError as err:  # PIATTN_MARCH names no instruction set this CPU runs
                _state["reason"] = f"its C kernels are not built: {err}, {other}"
            except cbuild.BuildError as err:
                _state["reason"] = f"its C kernels do not build: {err}. Install a C compiler or set CC to one, {other}"
            except cbuild.LoadError as err:  # built, verified, and still not loadable
                _state["reason"] = f"its C kernels do not load: {err}. Check PIATTN_CACHE, {other}"
            except cbuild.Unsafe as err:
                _state["reason"] = (f"will not load its C kernels from a folder others control: {err}. Set "
                                    f"PIATTN_CACHE to a private folder, {other}")
            except OSError as err:  # the folder could not be made
                _state["reason"] = f"its C kernels' folder cannot be made: {err}. Check PIATTN_CACHE, {other}"
        _state["functions"] = functions
        return functions


def unavailable() -> str | None:
    """Why the compiled kernels cannot run here and what to do, in one line (None when they can); builds them
    if not tried yet. The backend's probe (`Backend.probe`): its refusal of every call where it is not None."""
    _load()
    return _state.get("reason")


def build_flags() -> tuple[str, ...] | None:
    """The extra compiler flags the loaded library was built with (None when it is unavailable)."""
    _load()
    return _state.get("flags")


def reset() -> None:
    """Forget the loaded library, so the next call builds or loads it again (after a change of CC or
    PIATTN_NATIVE)."""
    with _lock:
        _state.clear()


def _buffer(t: torch.Tensor | None) -> _Buffer:
    return _Buffer(None, 0) if t is None else _Buffer(t.data_ptr() or None, t.numel())


def period_tensor(period: int | tuple[int, ...], H: int) -> torch.Tensor:
    """The period of each of the H query heads, int64 [H]: an int is H copies."""
    periods = torch.tensor([period] * H if isinstance(period, int) else list(period), dtype=torch.int64)
    if periods.shape != (H,):
        raise ValueError(f"period must be an int or {H} ints (one per query head), got {period!r}")
    return periods


def _run(direction: str, q: torch.Tensor, k: torch.Tensor, settings: OpSettings, tensors: list,
         bounds: tuple = (None, None), keep: torch.Tensor | None = None) -> None:
    """Call the C kernel of `direction` on `tensors` (its buffers, in fused_cpu.c's order, before the periods,
    the document bounds and the dropout keep mask, which this adds)."""
    B, H, T, D = q.shape
    clamp = settings.logit_clamp
    tensors = [*tensors, period_tensor(settings.period, H), *bounds, keep]
    call = _Call(B=B, H=H, H_kv=k.shape[1], T=T, D=D, window=settings.window, sinks=settings.sinks,
                 causal=int(settings.causal), variant=VARIANT_CODES[settings.variant], has_clamp=int(clamp is not None),
                 threads=torch.get_num_threads(), clamp=0.0 if clamp is None else clamp, prior=settings.prior,
                 eps=settings.eps, scale=settings.scale, keep_slots=0 if keep is None else keep.shape[-1],
                 keep_scale=1 / (1 - settings.dropout_p))
    buffers = (_Buffer * len(tensors))(*map(_buffer, tensors))
    functions = _load()
    if functions is None:
        raise ValueError(f"backend 'fused' cannot run this call: {unavailable()}")
    code = functions[q.dtype, direction](ctypes.byref(call), buffers, len(tensors))
    if code:
        raise RuntimeError(f"fused_cpu.c refused the {direction} call: {_ERRORS.get(code, f'error {code}')}")


def stats_per_row(variant: str) -> int:
    """The statistics the forward keeps per query row: the log-sum-exp of its logits, one per branch for
    "separate"."""
    return 2 if variant == "separate" else 1


def _fresh(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor of its own (the kernels write every element), on huge pages when large."""
    tensor = torch.empty(shape, dtype=dtype)
    allocator.advise_huge_pages(tensor)
    return tensor


def _outputs(out, layout: list[tuple[torch.Size, torch.dtype] | None], name: str) -> list[torch.Tensor | None]:
    """`out` checked against `layout` (shape and dtype of each output, None where there is none), or fresh
    fresh tensors of that layout when out is None (large ones advised onto huge pages)."""
    if out is None:
        return [None if lay is None else _fresh(*lay) for lay in layout]
    out = list(out)
    got = [None if t is None else (t.shape, t.dtype, t.device.type, t.is_contiguous()) for t in out]
    want = [None if lay is None else (lay[0], lay[1], "cpu", True) for lay in layout]
    if got != want:
        raise ValueError(f"{name} out= must be contiguous CPU tensors {want}, got {got}")
    return out


def keep_bytes(dropout_keep: torch.Tensor | None) -> torch.Tensor | None:
    """The dropout keep mask [B, H, T, slots] as the kernels read it: contiguous uint8 (a bool mask's bytes)."""
    if dropout_keep is None:
        return None
    return dropout_keep.contiguous().view(torch.uint8) if dropout_keep.dtype == torch.bool else \
        dropout_keep.to(torch.uint8).contiguous()


def fused_forward(q, k, v, gate, settings: OpSettings, *, bounds=(None, None), keep=None,
                  out=None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, T, D], k, v [B, H_kv, T, D], gate [B, H, T] or None, all contiguous CPU tensors of one dtype
    (fp32, fp64, bf16 or fp16) -> (y [B, H, T, D] in that dtype, stat [B, H, T, stats_per_row] fp64: the
    log-sum-exp in double, so that the backward's exp(z − lse) does not lose |lse|·2^-24 in fp32).
    settings.period: an int or one per query head; bounds: `document_bounds(document_ids, device="cpu")`; keep:
    `keep_bytes(dropout_keep)` or None (the weights are multiplied by keep / (1 − settings.dropout_p)). out:
    (y, stat) to write into instead of fresh tensors (a benchmark's way to time the kernel without first
    touches of new memory)."""
    B, H, T, D = q.shape
    y, stat = _outputs(out, [(q.shape, q.dtype), (torch.Size((B, H, T, stats_per_row(settings.variant))),
                                                  torch.float64)], "fused_forward")
    _run("forward", q, k, settings, [q, k, v, gate, y, stat], bounds, keep)
    return y, stat


def fused_backward(dy, q, k, v, gate, stat, settings: OpSettings, *, want_dgate: bool, bounds=(None, None),
                   keep=None, out=None):
    """The gradients (dq, dk, dv, dgate or None) for the cotangent dy [B, H, T, D] of `fused_forward`'s
    output, from its inputs and its statistics (all contiguous, one dtype). out: (dq, dk, dv, dgate or None)
    to write into instead of fresh tensors."""
    layout = [(q.shape, q.dtype), (k.shape, k.dtype), (v.shape, v.dtype),
              (gate.shape, gate.dtype) if want_dgate else None]
    dq, dk, dv, dgate = _outputs(out, layout, "fused_backward")
    _run("backward", q, k, settings, [q, k, v, gate, dy.contiguous(), stat, dq, dk, dv, dgate], bounds, keep)
    return dq, dk, dv, dgate


class _FusedFunction(torch.autograd.Function):
    """Autograd around `fused_forward` and `fused_backward`; inputs contiguous, of one dtype."""

    @staticmethod
    def forward(ctx, q, k, v, gate, settings: OpSettings, start, end, keep):
        y, stat = fused_forward(q, k, v, gate, settings, bounds=(start, end), keep=keep)
        ctx.save_for_backward(q, k, v, gate, stat, start, end, keep)
        ctx.settings = settings
        return y

    @staticmethod
    def backward(ctx, dy):
        refuse_double_backward("fused")
        q, k, v, gate, stat, start, end, keep = ctx.saved_tensors
        dq, dk, dv, dgate = fused_backward(dy, q, k, v, gate, stat, ctx.settings, want_dgate=ctx.needs_input_grad[3],
                                           bounds=(start, end), keep=keep)
        return dq, dk, dv, dgate, None, None, None, None


def _refusal(q: torch.Tensor) -> str | None:
    """Why this backend cannot run a call (what `backends.py` declares for it), or None."""
    if q.device.type != "cpu":
        return f"runs on the CPU, not {q.device.type}"
    if q.dtype not in _SUFFIXES:
        return f"no {str(q.dtype).removeprefix('torch.')} (runs float32, float64, bfloat16, float16)"
    return None


def run_fused(q, k, v, gate, settings: OpSettings, dropout_keep=None, document_ids=None):
    """The contract, `backends.BackendRun`: q [B, H, T, D], k, v [B, H_kv, T, D], gate [B, H, T] or None ->
    [B, H, T, D] in q's dtype; settings.period an int or one per query head. Refuses (ValueError) what it
    does not implement, and every call where the compiled kernels are unavailable (`unavailable`)."""
    reason = _refusal(q) or unavailable()
    if reason is not None:
        raise ValueError(f"backend 'fused' cannot run this call: {reason}")
    # Cast and copied outside the Function, so that autograd takes the gradients back to the callers' layout
    # and dtype.
    q, k, v, gate = _kernel_inputs(q, k, v, gate)
    return _FusedFunction.apply(q, k, v, gate, settings, *document_bounds(document_ids, device="cpu"),
                                keep_bytes(dropout_keep))


pi_attention_fused = by_keywords(run_fused)


def _kernel_inputs(q, k, v, gate):
    """q, k, v contiguous and the gate in q's dtype, contiguous, as the kernels read them."""
    q, k, v = (x.contiguous() for x in (q, k, v))
    return q, k, v, None if gate is None else gate.to(q.dtype).contiguous()


# ---------------------------------------------------------------------------------------------------------
# torch.compile: the same kernels as the custom operators piattn::pi_fused_fwd / piattn::pi_fused_bwd
# (`operators.register_pair`), one opaque node each way; the forward's per-row statistics leave it as an
# output, so that AOTAutograd keeps them for the backward graph. A ctypes call cannot be traced: without the
# operators dynamo would break the graph there.
#
#   piattn::pi_fused_fwd (q, k, v, gate, dropout_keep, document_ids, periods, settings…) -> (y, stat)
#   piattn::pi_fused_bwd (dy, q, k, v, gate, dropout_keep, document_ids, stat, want_gate, periods, settings…)
#                        -> [dq, dk, dv] or [dq, dk, dv, dgate]
#
# periods: one per query head, or empty for `settings.period` in every head (an OpSettings field is one int).


def _contiguous(*tensors):
    return [None if t is None else t.contiguous() for t in tensors]


def _op_forward(q, k, v, gate, dropout_keep, document_ids, settings: OpSettings):
    """(y [B, H, T, D] in q's dtype, stat [B, H, T, stats_per_row] fp64): `fused_forward`."""
    q, k, v, gate = _contiguous(q, k, v, gate)
    return fused_forward(q, k, v, gate, settings, bounds=document_bounds(document_ids, device="cpu"),
                         keep=keep_bytes(dropout_keep))


def _op_forward_fake(q, k, v, gate, dropout_keep, document_ids, settings: OpSettings):
    B, H, T, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, H, T, stats_per_row(settings.variant)), dtype=torch.float64)


def _op_backward(dy, q, k, v, gate, dropout_keep, document_ids, stat, want_gate, settings: OpSettings):
    """[dq, dk, dv], and dgate when `want_gate`, of `pi_fused_fwd` for the cotangent dy of its y."""
    dy, q, k, v, gate, stat = _contiguous(dy, q, k, v, gate, stat)
    grads = fused_backward(dy, q, k, v, gate, stat, settings, want_dgate=want_gate,
                           bounds=document_bounds(document_ids, device="cpu"), keep=keep_bytes(dropout_keep))
    return list(grads) if want_gate else list(grads[:3])


pi_fused_fwd, pi_fused_bwd = register_pair("pi_fused", "fused", forward=_op_forward, forward_fake=_op_forward_fake,
                                           backward=_op_backward, saved="Tensor stat")


def run_fused_op(q, k, v, gate, settings: OpSettings, dropout_keep=None, document_ids=None):
    """The contract, `backends.BackendRun`, through the operator `piattn::pi_fused_fwd`: what torch.compile
    captures (and what runs on fake tensors). The call was checked by `backends.select`, the kernels'
    availability included."""
    periods, settings = settings.to_op()
    y, _ = pi_fused_fwd(*_kernel_inputs(q, k, v, gate), dropout_keep, document_ids, periods, *settings)
    return y
