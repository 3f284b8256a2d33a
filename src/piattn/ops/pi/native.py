"""The decoding step in compiled C (`decode_step.c`): one call per layer instead of a dozen tensor ops.

A token of generation on a CPU costs each small tensor op a few microseconds of fixed overhead, whatever
its size; π-Attention's step (gather, scores, clamp, priors, softmax, weighted sum, and the gate's GELU,
linear and sigmoid) is about a dozen of them, where dense attention is one fused SDPA call. `ring_step`
does all of it in one C function, compiled once per machine with the system's C compiler (`$CC`, else
`cc`) into `$PIATTN_CACHE/native` (default `~/.cache/piattn/native`) and loaded with ctypes.

Loading a library runs its code, so what is loaded is checked first (`cbuild.py`, the builder shared with
the fused CPU backend): the folder must be this user's alone (made with mode 0o700; one owned by another
user or writable by group or others is refused, with a warning), and the library must match the SHA-256
recorded beside it when it was built. One that fails (cut short, from an older piattn, written by
something else) or does not load is rebuilt.

It serves the variants of `PRIOR_MODES` ("union", "fixed", "adaptive"; `decode.decode_ring` and
`decode._decode_rows` hand it no other), fp32 and fp64 CPU tensors in inference (no gradient asked for), any
batch, heads, grouped-query attention and sinks, and one or a few new queries per sequence: `ring_step` one
query read from a ring cache, `_rows_step_unchecked` t queries (a step of 2–4 tokens) in one call, each
query its own one-query step over its own slots, and `_token_step_unchecked` a decoding layer's whole
one-token step (RoPE on q and the new key, the key and value stored in the ring, then `ring_step`) from the
layer's projection of the token. Each call packs its arguments into one block (`_ARGS`) for a one-argument
ctypes call. Anything else it is given (another device or dtype,
autograd, no compiler, `PIATTN_NATIVE=0`) returns None and the caller runs the same step in torch ops
(`decode.decode_gathered`), which gives the same result up to rounding; `applies` says beforehand whether
it would run (the one place that decides).
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
# `ring_step` come first, so these are reached only through the contents of slot and kind, or a bug.
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
# fresh_slot, cos, sin, rope_f64 (the new token that `_token_step_unchecked` stores and rotates; 0 otherwise),
# then w_in, bias_in, n_in (the gate's first layer of PRIOR_INPUT; 0 otherwise). Native alignment ("@") lays the
# fields out as the C compiler does; `_open` refuses a library whose struct has another size. One `pack` and a
# one-argument call cost a sixth of what ctypes took to convert the arguments one by one (a step of generation is
# tens of microseconds).
_ARGS = struct.Struct("@PqqqPqqqqqqPPqPqqddPqqqqPPdddPPqqPPqPPq")
_FUNCTIONS = {torch.float32: "pi_decode_step_packed_f32", torch.float64: "pi_decode_step_packed_f64"}
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
    if size() != _ARGS.size:
        raise OSError(f"its argument block has {size()} bytes where {_ARGS.size} are packed")
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


def _shape(x) -> str:
    return str(tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__


def check_step(q: torch.Tensor, kv_store: torch.Tensor, slot: torch.Tensor, valid: torch.Tensor | None,
               kind: torch.Tensor, prior_mode: int, gate: torch.Tensor | None, gate_weight: torch.Tensor | None,
               gate_bias: torch.Tensor | None) -> None:
    """The shape checks of `ring_step` (see there): a one-line ValueError naming the argument at the first
    inconsistency, in plain comparisons of sizes (no tensor op)."""
    qs = q.shape if isinstance(q, torch.Tensor) else ()
    if len(qs) != 4 or qs[2] != 1 or qs[1] < 1 or qs[3] < 1:
        raise ValueError(f"q must be a tensor [B, H, 1, D] with H, D >= 1, got {_shape(q)}")
    B, H, _, D = qs
    ks = kv_store.shape if isinstance(kv_store, torch.Tensor) else ()
    if len(ks) != 5 or ks[0] != 2 or ks[1] != B or ks[3] < 1 or ks[4] != D:
        raise ValueError(f"kv_store must be a tensor [2, B, H_kv, N, D] with B = {B}, D = {D} of q and N >= 1, "
                         f"got {_shape(kv_store)}")
    H_kv = ks[2]
    if H_kv < 1 or H % H_kv:
        raise ValueError(f"kv_store's H_kv = {H_kv} key/value heads must divide the H = {H} heads of q")
    if not isinstance(slot, torch.Tensor) or slot.dim() != 1 or slot.dtype != torch.int64:
        raise ValueError(f"slot must be an int64 tensor [S], got {_shape(slot)}")
    S = slot.shape[0]
    if not isinstance(kind, torch.Tensor) or kind.shape != slot.shape or kind.dtype != torch.int64:
        raise ValueError(f"kind must be an int64 tensor [S] with S = {S} like slot, got {_shape(kind)}")
    if valid is not None and (not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool
                              or valid.numel() != S or valid.dim() not in (1, 2)):
        raise ValueError(f"valid must be None or a bool tensor [1, S] with S = {S}, got {_shape(valid)}")
    for name, x in (("slot", slot), ("kind", kind), ("valid", valid)):
        if x is not None and (x.device != q.device or not x.is_contiguous()):
            raise ValueError(f"{name} must be contiguous and on the device of q ({q.device}), got {x.device}")
    if prior_mode in (PRIOR_NONE, PRIOR_CONST):
        if gate is not None or gate_weight is not None or gate_bias is not None:
            raise ValueError("gate, gate_weight and gate_bias are read by PRIOR_ALPHA and PRIOR_HIDDEN only; "
                             f"prior_mode {prior_mode} takes None")
    elif prior_mode == PRIOR_ALPHA:
        if not isinstance(gate, torch.Tensor) or gate.shape != (B, H, 1):
            raise ValueError(f"gate must be α [B, H, 1] = {(B, H, 1)} for PRIOR_ALPHA, got {_shape(gate)}")
        if gate_weight is not None or gate_bias is not None:
            raise ValueError("gate_weight and gate_bias are read by PRIOR_HIDDEN only; PRIOR_ALPHA takes None")
    elif prior_mode == PRIOR_HIDDEN:
        gs = gate.shape if isinstance(gate, torch.Tensor) else ()
        if len(gs) != 3 or gs[0] != B or gs[1] != 1 or gs[2] < 1:
            raise ValueError(f"gate must be the hidden layer [B, 1, n_hidden] with B = {B}, n_hidden >= 1 for "
                             f"PRIOR_HIDDEN, got {_shape(gate)}")
        if not isinstance(gate_weight, torch.Tensor) or gate_weight.shape != (H, gs[2]):
            raise ValueError(f"gate_weight must be [H, n_hidden] = {(H, gs[2])}, got {_shape(gate_weight)}")
        if not isinstance(gate_bias, torch.Tensor) or gate_bias.shape != (H,):
            raise ValueError(f"gate_bias must be [H] = {(H,)}, got {_shape(gate_bias)}")
    else:
        raise ValueError(f"prior_mode must be one of PRIOR_NONE, PRIOR_CONST, PRIOR_ALPHA, PRIOR_HIDDEN "
                         f"(0 … 3), got {prior_mode!r}")


def ring_step(q: torch.Tensor, kv_store: torch.Tensor, slot: torch.Tensor, valid: torch.Tensor | None,
              kind: torch.Tensor, *, prior_mode: int, log_priors: tuple[float, float] = (0.0, 0.0),
              gate: torch.Tensor | None = None, gate_weight: torch.Tensor | None = None,
              gate_bias: torch.Tensor | None = None, logit_clamp: float | None, eps: float,
              scale: float) -> torch.Tensor | None:
    """One query per sequence read from a ring cache's storage, or None where the C step does not apply.

    q [B, H, 1, D]; kv_store [2, B, H_kv, N, D] with H_kv dividing H; slot [S] int64 (rows of kv_store,
    0 … N − 1), valid [1, S] bool or None, kind [S] int64 (0 or 1) (`decode.ring_slots`); prior_mode one of
    PRIOR_*: log_priors (local, skip) for PRIOR_CONST; gate α [B, H, 1] for PRIOR_ALPHA, or for
    PRIOR_HIDDEN the gate MLP's hidden pre-activation [B, 1, n_hidden] with its last layer's gate_weight
    [H, n_hidden] and gate_bias [H].
    Returns y [B, H, 1, D] in the dtype of q. Inconsistent shapes raise ValueError (`check_step`), and a
    slot or kind out of range raises ValueError from the C step's own checks, before it reads anything.
    """
    check_step(q, kv_store, slot, valid, kind, prior_mode, gate, gate_weight, gate_bias)
    return _ring_step_unchecked(q, kv_store, slot, valid, kind, prior_mode=prior_mode, log_priors=log_priors,
                                gate=gate, gate_weight=gate_weight, gate_bias=gate_bias, logit_clamp=logit_clamp,
                                eps=eps, scale=scale)


def _ring_step_unchecked(q: torch.Tensor, kv_store: torch.Tensor, slot: torch.Tensor, valid: torch.Tensor | None,
                         kind: torch.Tensor, *, prior_mode: int, log_priors: tuple[float, float] = (0.0, 0.0),
                         gate: torch.Tensor | None = None, gate_weight: torch.Tensor | None = None,
                         gate_bias: torch.Tensor | None = None, logit_clamp: float | None, eps: float,
                         scale: float) -> torch.Tensor | None:
    """`ring_step` without `check_step`, for `decode.decode_ring`, whose own checks cover the same shapes (a
    step of generation is tens of microseconds; checking twice was a noticeable part of it). The C step
    still checks every size, slot and kind it is given before reading anything."""
    return _step(q, kv_store, slot, valid, kind, prior_mode, log_priors, gate, gate_weight, gate_bias, logit_clamp,
                 eps, scale)


def _rows_step_unchecked(q: torch.Tensor, kv_store: torch.Tensor, slot: torch.Tensor, valid: torch.Tensor | None,
                         kind: torch.Tensor, *, prior_mode: int, log_priors: tuple[float, float] = (0.0, 0.0),
                         gate: torch.Tensor | None = None, gate_weight: torch.Tensor | None = None,
                         gate_bias: torch.Tensor | None = None, logit_clamp: float | None, eps: float,
                         scale: float) -> torch.Tensor | None:
    """t new queries per sequence (a step of a few tokens, `decode._decode_rows`) in one call: each query
    its own one-query step over its own slots, so the rows are exactly those of t `ring_step`s. None where
    the C step does not apply (`applies`).

    q [B, H, t, D] (any strides but the last); kv_store [2, B, H_kv, N, D] contiguous, the keys then the
    values of the rows the queries read; slot [t·S] int64 (query j's slots at j·S …), valid [t, S] bool or
    None, kind [S] (`decode._slots`); or, for per-head periods in one call, slot [H, t·S] and valid [H, t, S] or
    None, one table per query head (`decode.per_head_ring_slots`; kind shared); gate α [B, H, t] for
    PRIOR_ALPHA, or for PRIOR_HIDDEN the hidden pre-activation [B, t, n_hidden] with gate_weight [H, n_hidden],
    gate_bias [H]. Unchecked in Python (the caller builds every shape); the C step checks every size, slot and
    kind before reading anything.
    """
    return _step(q, kv_store, slot, valid, kind, prior_mode, log_priors, gate, gate_weight, gate_bias, logit_clamp,
                 eps, scale)


def _token_step_unchecked(proj: torch.Tensor, n_heads: int, kv_store: torch.Tensor, slot: torch.Tensor,
                          valid: torch.Tensor | None, kind: torch.Tensor, fresh_slot: int,
                          rotation: tuple[torch.Tensor, torch.Tensor, int] | None, log_priors: tuple[float, float],
                          gate: torch.Tensor | None, gate_layers: tuple[torch.Tensor, ...] | None,
                          logit_clamp: float | None, eps: float, scale: float, *,
                          prior_mode: int) -> torch.Tensor | None:
    """The whole one-token step of a decoding layer in one call (`decode._decode_token`): the new token's key
    (rotated) and value stored in row `fresh_slot` of the ring, then `ring_step` of its query (rotated) over
    `slot`. None where the C step does not apply (`applies`, and the layouts below), and then nothing is written.

    proj [B, 1, P >= (n_heads + 2·H_kv)·D]: the new token's q (n_heads·D columns), k and v (H_kv·D each)
    projection, its last dimension contiguous. kv_store [2, B, H_kv, N, D] contiguous, of proj's dtype; slot,
    valid, kind of `decode.ring_slots` for the new position; rotation (cos, sin, position) with `Rotary`'s
    tables [n > position, 1, D] (fp32, or fp64 in a model made fp64), or None (no RoPE). The gate: α [B, H, 1]
    for PRIOR_ALPHA; for PRIOR_HIDDEN the gate MLP's hidden pre-activation [B, 1, n_hidden] and gate_layers its
    last layer (weight [H, n_hidden], bias [H]); for PRIOR_INPUT the MLP's input [B, 1, n_in] and gate_layers
    its first and last layers (weight [n_hidden, n_in], bias [n_hidden], weight [H, n_hidden], bias [H]), every
    one contiguous; positional: a step of generation calls this once per layer.
    Unchecked in Python beyond the layouts (the caller is a layer whose cache `RingCache.check` accepted); the
    C step checks every size, slot and kind before it reads or writes anything."""
    functions = _state["functions"] if "functions" in _state else _load()
    function = _function(functions, proj, [kv_store] if gate is None else [kv_store, gate, *(gate_layers or ())],
                         kind.shape[0])
    if function is None:
        return None
    B, _, cols = proj.shape
    _, _, H_kv, N, D = kv_store.shape
    H = n_heads
    p_sb, _, p_sd = proj.stride()
    if p_sd != 1 or (H + 2 * H_kv) * D > cols or not kv_store.is_contiguous():
        return None
    base = proj.data_ptr()
    slot_sh = _slot_stride(slot, valid, H)
    gate_ptr, gate_sb, gate_sh, gate_st, n_hidden, w_ptr, b_ptr, w_in_ptr, b_in_ptr, n_in = (0,) * 10
    if prior_mode == PRIOR_ALPHA:
        gate_ptr, (gate_sb, gate_sh, gate_st) = gate.data_ptr(), gate.stride()
    elif prior_mode >= PRIOR_HIDDEN:
        for layer in gate_layers:
            if not layer.is_contiguous():
                return None
        gate_sb, gate_st, gate_sd = gate.stride()
        if gate_sd != 1:
            return None
        gate_ptr = gate.data_ptr()
        if prior_mode == PRIOR_INPUT:
            w_in, b_in, w, b = gate_layers
            w_in_ptr, b_in_ptr, (n_hidden, n_in) = w_in.data_ptr(), b_in.data_ptr(), w_in.shape
        else:
            (w, b), n_hidden = gate_layers, gate.shape[2]
        w_ptr, b_ptr = w.data_ptr(), b.data_ptr()
    cos_ptr = sin_ptr = rope_f64 = 0
    if rotation is not None:
        cos, sin, position = rotation
        table = cos.dtype
        if (table not in (torch.float32, torch.float64) or sin.dtype != table or not cos.is_contiguous()
                or not sin.is_contiguous() or cos.shape[-1] != D or sin.shape != cos.shape
                or not 0 <= position < cos.shape[0] or not cos.is_cpu or not sin.is_cpu):
            return None
        rope_f64 = int(table == torch.float64)
        row = position * D * cos.element_size()
        cos_ptr, sin_ptr = cos.data_ptr() + row, sin.data_ptr() + row
    y = torch.empty(B, H, 1, D, dtype=proj.dtype)
    code = function(_ARGS.pack(base, p_sb, D, 0, kv_store.data_ptr(), B, H, H_kv, N, D, 1, slot.data_ptr(),
                               0 if valid is None else valid.data_ptr(), slot_sh, kind.data_ptr(), kind.shape[0],
                               prior_mode, log_priors[0], log_priors[1], gate_ptr, gate_sb, gate_sh, gate_st,
                               n_hidden, w_ptr, b_ptr, scale, float("inf") if logit_clamp is None else logit_clamp,
                               eps, y.data_ptr(),
                               base + H * D * proj.element_size(), p_sb, fresh_slot, cos_ptr, sin_ptr, rope_f64,
                               w_in_ptr, b_in_ptr, n_in))
    _refuse(code)
    return y


def _slot_stride(slot: torch.Tensor, valid: torch.Tensor | None, H: int) -> int:
    """decode_step.c's slot_sh: 0 for one slot table [t·S] shared by every head, t·S for one per query head
    (slot [H, t·S], valid [H, t, S] or None: per-head periods), which the C step reads H of, so they must be
    there."""
    if slot.dim() != 2:
        return 0
    if (slot.shape[0] != H or not slot.is_contiguous()
            or (valid is not None and (valid.numel() != slot.numel() or not valid.is_contiguous()))):
        raise ValueError(f"per-head slot tables must be [H, t·S] with H = {H} (and valid [H, t, S]), got slot "
                         f"{tuple(slot.shape)}, valid {None if valid is None else tuple(valid.shape)}")
    return slot.shape[1]


def _refuse(code: int) -> None:
    """Raise what the C step's return code says it refused (nothing for 0: it ran)."""
    if code == 5:
        raise MemoryError("the compiled decoding step could not allocate its scratch rows")
    if code:
        raise ValueError(_ERRORS.get(code, f"the compiled decoding step failed with code {code}"))


def applies(q: torch.Tensor, *tensors: torch.Tensor | None, n_slots: int) -> bool:
    """Whether the C step runs a call on q and `tensors` (keys, values, gate, …) with `n_slots` slots per query:
    the library loaded (a compiler, not `PIATTN_NATIVE=0`), a CPU, one dtype of fp32/fp64 for all, no gradient
    asked for, at most `MAX_SLOTS` slots. The one home of that decision: `_step` asks it too, so a caller that
    prepares a call only when it applies (`decode._decode_rows` stacks keys and values) and the step agree."""
    functions = _state["functions"] if "functions" in _state else _load()
    return _function(functions, q, [t for t in tensors if t is not None], n_slots) is not None


def _function(functions, q: torch.Tensor, tensors: list[torch.Tensor], n_slots: int):
    if functions is None:
        return None
    function = functions.get(q.dtype)
    if function is None or q.device.type != "cpu" or n_slots > MAX_SLOTS:
        return None
    dtype, grad = q.dtype, torch.is_grad_enabled()
    if grad and q.requires_grad:
        return None
    for t in tensors:  # a loop, not any(): a generator costs a step more than these few comparisons
        if t.dtype != dtype or not t.is_cpu or (grad and t.requires_grad):
            return None
    return function


def _step(q, kv_store, slot, valid, kind, prior_mode, log_priors, gate, gate_weight, gate_bias, logit_clamp, eps,
          scale) -> torch.Tensor | None:
    functions = _state["functions"] if "functions" in _state else _load()
    function = _function(functions, q, [t for t in (kv_store, gate, gate_weight, gate_bias) if t is not None],
                         kind.shape[0])
    if function is None:
        return None
    B, H, T, D = q.shape
    _, _, H_kv, N, _ = kv_store.shape
    q_sb, q_sh, q_st, q_sd = q.stride()
    if q_sd != 1 or not kv_store.is_contiguous():
        return None
    slot_sh = _slot_stride(slot, valid, H)
    gate_ptr, gate_sb, gate_sh, gate_st, n_hidden, w_ptr, b_ptr = 0, 0, 0, 0, 0, 0, 0
    if prior_mode == PRIOR_ALPHA:  # α of (b, h, t) at b·stride(0) + h·stride(1) + t·stride(2)
        gate_ptr, (gate_sb, gate_sh, gate_st) = gate.data_ptr(), gate.stride()
    elif prior_mode == PRIOR_HIDDEN:
        gate_sb, gate_st, gate_sd = gate.stride()
        if gate_sd != 1 or not gate_weight.is_contiguous() or not gate_bias.is_contiguous():
            return None
        gate_ptr, n_hidden = gate.data_ptr(), gate.shape[2]
        w_ptr, b_ptr = gate_weight.data_ptr(), gate_bias.data_ptr()
    y = torch.empty(B, H, T, D, dtype=q.dtype)
    code = function(_ARGS.pack(q.data_ptr(), q_sb, q_sh, q_st, kv_store.data_ptr(), B, H, H_kv, N, D, T,
                               slot.data_ptr(), 0 if valid is None else valid.data_ptr(), slot_sh, kind.data_ptr(),
                               kind.shape[0], prior_mode, log_priors[0], log_priors[1], gate_ptr, gate_sb, gate_sh,
                               gate_st, n_hidden, w_ptr, b_ptr, scale,
                               float("inf") if logit_clamp is None else logit_clamp, eps, y.data_ptr(), 0, 0, 0, 0, 0,
                               0, 0, 0, 0))
    _refuse(code)
    return y
