"""The binding of the compiled decoding step (`decode_step.c`): built, verified, loaded, called.

A token of generation on a CPU costs each small tensor op a few microseconds of fixed overhead, whatever
its size; π-Attention's step (gather, scores, clamp, priors, softmax, weighted sum, and the gate's GELU,
linear and sigmoid) is about a dozen of them, where dense attention is one fused SDPA call. decode_step.c
does all of it in one C function, compiled once per machine with the system's C compiler (`$CC`, else
`cc`) into `$PIATTN_CACHE/native` (default `~/.cache/piattn/native`) and loaded with ctypes.

Loading a library runs its code, so what is loaded is checked first (`cbuild.py`, the builder shared with
the fused CPU backend): the folder must be this user's alone (made with mode 0o700; one owned by another
user or writable by group or others is refused, with a warning), and the library must match the SHA-256
recorded beside it when it was built. One that fails (cut short, from an older piattn, written by
something else) or does not load is rebuilt.

This module is the binding only: `functions()` the C functions by dtype (None, with the reason in
`unavailable()`, where they cannot run: no compiler, `PIATTN_NATIVE=0`), the argument block `ARGS` in
decode_step.c's `pi_step_args` order (one `pack`, one one-argument ctypes call), the prior modes, and `check`,
which turns the C step's return code into its error. The step that uses it, deciding which calls it takes and
packing their tensors, is `decode_native.py` (the "compiled" step of `decode_steps.REGISTRY`).
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
import warnings
from pathlib import Path

import torch

from ...checks import env_switch
from . import cbuild

SOURCE = Path(__file__).with_name("decode_step.c")
# Prior modes of decode_step.c.
PRIOR_NONE, PRIOR_CONST, PRIOR_ALPHA, PRIOR_HIDDEN, PRIOR_INPUT = range(5)
# The variants the C step computes, each by its prior mode ("adaptive" also by PRIOR_HIDDEN, from the gate
# MLP's hidden layer, and by PRIOR_INPUT, from its input). Not "separate": it normalises the local and the skip
# slots apart, and the step takes one softmax over all of them.
PRIOR_MODES = {"union": PRIOR_NONE, "fixed": PRIOR_CONST, "adaptive": PRIOR_ALPHA}
# Slots per query the C step takes; wider windows run in torch ops, where the per-op overhead that the C
# step saves no longer dominates anyway.
MAX_SLOTS = 4096
# decode_step.c's PI_ERR_* codes: what the C step refused (having read nothing). The shape checks of
# `decode_native.check_step` come first, so these are reached only through the contents of slot and kind, or a bug.
_ERRORS = {1: "the sizes given to the compiled step are inconsistent (B >= 0, H >= 1, 1 <= H_kv <= H dividing "
              "H, N >= 1, D >= 1, t >= 1 queries; one query with a new token to store, an even D with RoPE)",
           2: "slot must index rows 0 … N − 1 of kv_store (and so must the row of a new token to store)",
           3: "kind must hold 0 (local prior) or 1 (skip prior) only",
           4: "prior_mode must be one of PRIOR_NONE, PRIOR_CONST, PRIOR_ALPHA, PRIOR_HIDDEN, PRIOR_INPUT, with its "
              "gate"}

# No -ffast-math: NaN and inf must behave as IEEE says (they stay in the rows that read them).
# No fused multiply-add either: RoPE in the step rounds each product and sum as `Rotary.rotate` does.
_FLAGS = ("-O3", "-std=c99", "-fPIC", "-shared", "-fno-math-errno", "-ffp-contract=off")

# The step's 39 arguments, packed into one block in decode_step.c's `pi_step_args` order: q, q_sb, q_sh, q_st, kv,
# B, H, H_kv, N, D, Q, slot, valid, slot_sh (0: one slot table for every head), kind, S, prior_mode, c_local,
# c_skip, gate, gate_sb, gate_sh, gate_st, n_hidden, w, bias, scale, clamp, eps, y, then fresh, fresh_sb,
# fresh_slot, cos, sin, rope_f64 (the new token that a layer's one-token step stores and rotates; 0 otherwise),
# then w_in, bias_in, n_in (the gate's first layer of PRIOR_INPUT; 0 otherwise). Native alignment ("@") lays the
# fields out as the C compiler does; `_open` refuses a library whose struct has another size. One `pack` and a
# one-argument call cost a sixth of what ctypes took to convert the arguments one by one (a step of generation is
# tens of microseconds).
ARGS = struct.Struct("@PqqqPqqqqqqPPqPqqddPqqqqPPdddPPqqPPqPPq")
_FUNCTIONS = {torch.float32: "pi_decode_step_packed_f32", torch.float64: "pi_decode_step_packed_f64"}
DTYPES = tuple(_FUNCTIONS)  # the dtypes the C step computes in
_lock = threading.Lock()
_state: dict[str, object] = {}


def flag_sets() -> tuple[tuple[str, ...], ...]:
    """The flag sets to try in order: this CPU's vector instructions (AVX where it has them: the gate's GELU runs
    eight lanes wide), then without (SSE on x86); with PIATTN_MARCH set (`cbuild.march`), that instruction set
    alone. The step's bits do not depend on which: no FMA, and every vector lane computes alone."""
    pinned = cbuild.march()
    return ((f"-march={pinned}",),) if pinned else (("-march=native",), ())


def _open(path: Path) -> dict[torch.dtype, ctypes._CFuncPtr]:
    """The C functions of the library at `path` (OSError or AttributeError if it does not load)."""
    library = ctypes.CDLL(str(path))
    size = library.pi_step_args_size
    size.argtypes, size.restype = [], ctypes.c_int64
    if size() != ARGS.size:
        raise OSError(f"its argument block has {size()} bytes where {ARGS.size} are packed")
    functions = {}
    for dtype, name in _FUNCTIONS.items():
        function = getattr(library, name)
        function.argtypes, function.restype = [ctypes.c_char_p], ctypes.c_int
        functions[dtype] = function
    return functions


def _load() -> dict[torch.dtype, ctypes._CFuncPtr] | None:
    """The C functions by dtype, compiling them on first use; None (with the reason in `unavailable()`)
    when disabled, or when they cannot be built or loaded safely."""
    with _lock:
        if "functions" in _state:
            return _state["functions"]
        functions = None
        if not env_switch("PIATTN_NATIVE"):
            _state["reason"] = f"disabled by PIATTN_NATIVE={os.environ['PIATTN_NATIVE']}"
        else:
            compiler = os.environ.get("CC") or "cc"
            try:
                functions, _ = cbuild.load(SOURCE, _open, compiler=compiler, base_flags=_FLAGS, flag_sets=flag_sets(),
                                           timeout=120)
            except cbuild.BuildError as err:
                _warn(str(err), "set CC to a C compiler for the faster step")
            except cbuild.Unsafe as err:
                _warn(f"will not load compiled code from a folder others control: {err}",
                      "set PIATTN_CACHE to a folder of your own for the faster step")
            except (cbuild.LoadError, OSError) as err:  # OSError: the folder could not be made
                _warn(str(err), "check PIATTN_CACHE")
        _state["functions"] = functions
        return functions


def _warn(reason: str, advice: str) -> None:
    _state["reason"] = reason
    warnings.warn(f"piattn: decoding runs in torch ops ({reason}); {advice}, or PIATTN_NATIVE=0 to silence this",
                  RuntimeWarning, stacklevel=4)


def unavailable() -> str | None:
    """Why the compiled step cannot run here (None when it can); builds it if that was not tried yet."""
    _load()
    return _state.get("reason")


def reset() -> None:
    """Forget the loaded library and the reason it was unavailable, so the next call tries again (after a
    change of `PIATTN_NATIVE` or `CC`)."""
    with _lock:
        _state.clear()


def functions() -> dict[torch.dtype, ctypes._CFuncPtr] | None:
    """The C functions by dtype (`DTYPES`), or None where the library cannot run (`unavailable` says why)."""
    return _state["functions"] if "functions" in _state else _load()


def check(code: int) -> None:
    """Raise what the C step's return code says it refused (nothing for 0: it ran)."""
    if code == 5:
        raise MemoryError("the compiled decoding step could not allocate its scratch rows")
    if code:
        raise ValueError(_ERRORS.get(code, f"the compiled decoding step failed with code {code}"))
