"""The decoding step in compiled C (`decode_step.c`): one call per layer instead of a dozen tensor ops.

A token of generation on a CPU costs each small tensor op a few microseconds of fixed overhead, whatever
its size; π-Attention's step (gather, scores, clamp, priors, softmax, weighted sum, and the gate's GELU,
linear and sigmoid) is about a dozen of them, where dense attention is one fused SDPA call. `ring_step`
does all of it in one C function, compiled once per machine with the system's C compiler (`$CC`, else
`cc`) into `$PIATTN_CACHE/native` (default `~/.cache/piattn/native`) and loaded with ctypes.

It serves fp32 and fp64 CPU tensors in inference (no gradient asked for), variants "union", "fixed"
and "adaptive", any batch, heads, grouped-query attention and sinks. Anything else (another device or
dtype, autograd, "separate", no compiler, `PIATTN_NATIVE=0`) returns None and the caller runs the same
step in torch ops (`decode.decode_gathered`), which gives the same result up to rounding.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("decode_step.c")
# Prior modes of decode_step.c.
PRIOR_NONE, PRIOR_CONST, PRIOR_ALPHA, PRIOR_HIDDEN = range(4)
_FUNCTIONS = {torch.float32: "pi_decode_step_f32", torch.float64: "pi_decode_step_f64"}
# Slots per query the C step takes (its scores live on the stack); wider windows run in torch ops, where
# the per-op overhead no longer dominates anyway.
MAX_SLOTS = 4096

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
_ARGTYPES = [_P, _I, _I, _P, _I, _I, _I, _I, _I, _P, _P, _P, _I, ctypes.c_int, _F, _F, _P, _I, _I, _P, _P,
             _F, _F, _F, _P]

_lock = threading.Lock()
_state: dict[str, object] = {}


def _compiler_flags() -> list[str]:
    # No -ffast-math: NaN and inf must behave as IEEE says (they stay in the rows that read them).
    return ["-O3", "-std=c99", "-fPIC", "-shared", "-fno-math-errno"]


def _library_path(compiler: str) -> Path:
    """Where the compiled step lives: keyed by the source, the compiler, its flags and the machine."""
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), compiler.encode(), " ".join(_compiler_flags()).encode(),
                                     platform.machine().encode()])).hexdigest()[:16]
    root = Path(os.environ.get("PIATTN_CACHE") or Path.home() / ".cache" / "piattn")
    return root / "native" / f"decode_step-{key}.so"


def _build(path: Path, compiler: str) -> None:
    """Compile SOURCE into `path`, atomically: concurrent processes each write a temporary file and the
    last rename wins, so no process ever loads a half-written library."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *_compiler_flags(), str(SOURCE), "-o", tmp, "-lm"], capture_output=True,
                              text=True, timeout=120)
        if done.returncode:
            raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "compiler failed")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load() -> dict[torch.dtype, ctypes._CFuncPtr] | None:
    """The C functions by dtype, compiling them on first use; None (with the reason in `unavailable()`)
    when disabled or when no compiler can build them."""
    with _lock:
        if "functions" in _state:
            return _state["functions"]
        functions = None
        if os.environ.get("PIATTN_NATIVE", "1") == "0":
            _state["reason"] = "disabled by PIATTN_NATIVE=0"
        else:
            compiler = os.environ.get("CC") or "cc"
            try:
                path = _library_path(compiler)
                if not path.exists():
                    _build(path, compiler)
                library = ctypes.CDLL(str(path))
                functions = {}
                for dtype, name in _FUNCTIONS.items():
                    function = getattr(library, name)
                    function.argtypes, function.restype = _ARGTYPES, ctypes.c_int
                    functions[dtype] = function
            except (OSError, RuntimeError, subprocess.SubprocessError) as err:
                _state["reason"] = f"could not build {SOURCE.name} with {compiler!r}: {err}"
                warnings.warn(f"piattn: decoding runs in torch ops ({_state['reason']}); set CC to a C compiler "
                              "for the faster step, or PIATTN_NATIVE=0 to silence this", RuntimeWarning, stacklevel=3)
        _state["functions"] = functions
        return functions


def unavailable() -> str | None:
    """Why the compiled step cannot run here (None when it can); builds it if that was not tried yet."""
    _load()
    return _state.get("reason")


def reset() -> None:
    """Forget the loaded library and the reason it was unavailable, so the next call tries again (after a
    change of `PIATTN_NATIVE` or `CC`)."""
    with _lock:
        _state.clear()


def ring_step(q: torch.Tensor, kv_store: torch.Tensor, slot: torch.Tensor, valid: torch.Tensor | None,
              kind: torch.Tensor, *, prior_mode: int, log_priors: tuple[float, float] = (0.0, 0.0),
              gate: torch.Tensor | None = None, gate_weight: torch.Tensor | None = None,
              gate_bias: torch.Tensor | None = None, logit_clamp: float | None, eps: float,
              scale: float) -> torch.Tensor | None:
    """One query per sequence read from a ring cache's storage, or None where the C step does not apply.

    q [B, H, 1, D]; kv_store [2, B, H_kv, N, D] contiguous; slot [S] int64, valid [1, S] bool or None, kind
    [S] int64 (`decode.ring_slots`); prior_mode one of PRIOR_*: log_priors (local, skip) for PRIOR_CONST;
    gate α [B, H, 1] for PRIOR_ALPHA, or for PRIOR_HIDDEN the gate MLP's hidden pre-activation [B, 1,
    n_hidden] with its last layer's gate_weight [H, n_hidden] and gate_bias [H].
    Returns y [B, H, 1, D] in the dtype of q.
    """
    functions = _state["functions"] if "functions" in _state else _load()
    if functions is None:
        return None
    function = functions.get(q.dtype)
    tensors = [t for t in (q, kv_store, gate, gate_weight, gate_bias) if t is not None]
    if (function is None or q.device.type != "cpu" or kind.shape[0] > MAX_SLOTS
            or any(t.dtype != q.dtype or t.device != q.device for t in tensors)
            or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))):
        return None
    B, H, _, D = q.shape
    _, _, H_kv, N, _ = kv_store.shape
    if not kv_store.is_contiguous() or q.stride(3) != 1:
        return None
    gate_ptr, gate_sb, n_hidden, w_ptr, b_ptr = None, 0, 0, None, None
    if prior_mode == PRIOR_ALPHA:
        if gate.stride(1) != 1:  # the C step reads α of (b, h) at b·stride(0) + h
            return None
        gate_ptr, gate_sb = gate.data_ptr(), gate.stride(0)
    elif prior_mode == PRIOR_HIDDEN:
        if gate.stride(-1) != 1 or not gate_weight.is_contiguous() or not gate_bias.is_contiguous():
            return None
        gate_ptr, gate_sb, n_hidden = gate.data_ptr(), gate.stride(0), gate.shape[-1]
        w_ptr, b_ptr = gate_weight.data_ptr(), gate_bias.data_ptr()
    y = torch.empty(B, H, 1, D, dtype=q.dtype)
    function(q.data_ptr(), q.stride(0), q.stride(1), kv_store.data_ptr(), B, H, H_kv, N, D, slot.data_ptr(),
             None if valid is None else valid.data_ptr(), kind.data_ptr(), kind.shape[0], prior_mode,
             log_priors[0], log_priors[1], gate_ptr, gate_sb, n_hidden, w_ptr, b_ptr, scale,
             float("inf") if logit_clamp is None else logit_clamp, eps, y.data_ptr())
    return y
