"""The "compiled" decoding step: a plan's rows in one call of decode_step.c (through `native.py`'s binding).

One call per layer and step computes what the torch-ops step (`decode_torch.py`) does in a dozen ops, on fp32
and fp64 CPU tensors without autograd, for the variants of `native.PRIOR_MODES` ("union", "fixed",
"adaptive"; not "separate", two softmaxes): every query head over its own slot table (per-head periods in one
call; one period is H equal tables), grouped-query attention, sinks, one to a few queries per sequence (each its
own one-query step, so a step of t tokens is exactly t one-token steps), the gate's last layers or its whole MLP
in the step (`PRIOR_HIDDEN`, `PRIOR_INPUT`), and a decoding layer's whole one-token step (RoPE on q and the new
key, the key and value stored in the ring, then the attention). `refusal` is the one place that decides whether
it runs a call; where it does not, `run` returns None and the plan runs its next step.
"""

from __future__ import annotations

import torch

from . import native


def unavailable() -> str | None:
    """Why the compiled step cannot run on this install (None when it can); builds it if not tried yet."""
    return native.unavailable()


def refusal(q: torch.Tensor, tensors: list[torch.Tensor], n_slots: int) -> str | None:
    """Why the C step does not run a call on q and `tensors` (keys and values, the gate and its layers) with
    `n_slots` slots per query, or None: it runs where the library loaded (a compiler, not `PIATTN_NATIVE=0`),
    on a CPU, one dtype of `native.DTYPES` for all, no gradient asked for, at most `native.MAX_SLOTS` slots.
    The one home of that decision (`run` asks it before it stacks or packs anything)."""
    functions = native.functions()
    if functions is None:
        return f"the compiled step is unavailable: {native.unavailable()}"
    dtype, grad = q.dtype, torch.is_grad_enabled()
    if dtype not in functions or q.device.type != "cpu":
        return f"the compiled step runs fp32 and fp64 CPU tensors, not {dtype} on {q.device}"
    if n_slots > native.MAX_SLOTS:
        return f"the compiled step takes at most {native.MAX_SLOTS} slots a query, not {n_slots}"
    if grad and q.requires_grad:
        return "the compiled step computes no gradient"
    for t in tensors:  # a loop, not any(): a generator costs a step more than these few comparisons
        if t.dtype != dtype or not t.is_cpu or (grad and t.requires_grad):
            return f"the compiled step takes one dtype ({dtype}) of CPU tensors without autograd"
    return None


def _shape(x) -> str:
    return str(tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__


def check_step(q: torch.Tensor, kv_store: torch.Tensor, slot: torch.Tensor, valid: torch.Tensor | None,
               kind: torch.Tensor, prior_mode: int, gate: torch.Tensor | None,
               gate_layers: tuple[torch.Tensor, ...] | None) -> None:
    """The shape checks of a one-query call of the C step on arguments built by hand (the plans build theirs):
    q [B, H, 1, D], kv_store [2, B, H_kv, N, D] (H_kv dividing H), slot [S] int64 (one table for every head),
    valid [1, S] bool or None, kind [S] int64; the gate α [B, H, 1] for PRIOR_ALPHA, or for PRIOR_HIDDEN the hidden
    pre-activation [B, 1, n_hidden] with gate_layers (weight [H, n_hidden], bias [H]). A one-line ValueError naming
    the argument at the first inconsistency, in plain comparisons of sizes; the C step checks the contents of
    slot and kind itself, before it reads anything."""
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
    weight, bias = gate_layers if gate_layers is not None else (None, None)
    if prior_mode in (native.PRIOR_NONE, native.PRIOR_CONST):
        if gate is not None or gate_layers is not None:
            raise ValueError("gate, gate_weight and gate_bias are read by PRIOR_ALPHA and PRIOR_HIDDEN only; "
                             f"prior_mode {prior_mode} takes None")
    elif prior_mode == native.PRIOR_ALPHA:
        if not isinstance(gate, torch.Tensor) or gate.shape != (B, H, 1):
            raise ValueError(f"gate must be α [B, H, 1] = {(B, H, 1)} for PRIOR_ALPHA, got {_shape(gate)}")
        if gate_layers is not None:
            raise ValueError("gate_weight and gate_bias are read by PRIOR_HIDDEN only; PRIOR_ALPHA takes None")
    elif prior_mode == native.PRIOR_HIDDEN:
        gs = gate.shape if isinstance(gate, torch.Tensor) else ()
        if len(gs) != 3 or gs[0] != B or gs[1] != 1 or gs[2] < 1:
            raise ValueError(f"gate must be the hidden layer [B, 1, n_hidden] with B = {B}, n_hidden >= 1 for "
                             f"PRIOR_HIDDEN, got {_shape(gate)}")
        if not isinstance(weight, torch.Tensor) or weight.shape != (H, gs[2]):
            raise ValueError(f"gate_weight must be [H, n_hidden] = {(H, gs[2])}, got {_shape(weight)}")
        if not isinstance(bias, torch.Tensor) or bias.shape != (H,):
            raise ValueError(f"gate_bias must be [H] = {(H,)}, got {_shape(bias)}")
    else:
        raise ValueError(f"prior_mode must be one of PRIOR_NONE, PRIOR_CONST, PRIOR_ALPHA, PRIOR_HIDDEN "
                         f"(0 … 3), got {prior_mode!r}")


def run(plan, x: torch.Tensor, kv, slot: torch.Tensor, valid: torch.Tensor | None, gate: torch.Tensor | None,
        gate_layers: tuple[torch.Tensor, ...] | None, *, fresh_slot: int | None = None,
        rotation: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> torch.Tensor | None:
    """The rows [B, H, t, D] of `plan` in one call of the C step, or None where it does not take the call
    (`refusal`, or a layout it does not read), having written nothing.

    x: the queries [B, H, t, D] (any strides but the last); or, with `fresh_slot`, a decoding layer's projection of
    its one new token [B, 1, P >= (H + 2·H_kv)·D] (its q, k and v columns, the last dimension contiguous), whose
    key (rotated by `rotation`) and value the step first stores in ring row `fresh_slot`, then attends with its
    query (rotated) over the ring: the layer's whole one-token step. rotation: (cos, sin, position) with `Rotary`'s
    tables [n > position, 1, D] (fp32, or fp64 in a model made fp64), or None (no RoPE).
    kv: the storage [2, B, H_kv, N, D] of a ring cache (keys, then values), or a block (k, v) of [B, H_kv, N, D]
    each (stacked into one block, only once the step takes the call). slot [H, t·S], valid [H, t, S] or None: the
    plan's tables (`decode_slots`); a single table [t·S] is read by every head.
    The gate: α̃ [B, H, t] (variants "adaptive"), or with gate_layers = the gate MLP's last layer (weight
    [H, n_hidden], bias [H]) its hidden pre-activation [B, t, n_hidden] (`PRIOR_HIDDEN`), or with gate_layers =
    its first and last layers (four tensors) its input [B, 1, n_in] (`PRIOR_INPUT`, the one-token step).
    Unchecked in Python beyond the layouts (the plan builds every table and its callers the shapes); the C step
    checks every size, slot and kind before it reads or writes anything."""
    kind = plan.kind
    pair = type(kv) is tuple
    tensors = [*kv] if pair else [kv]
    if gate is not None:
        tensors.append(gate)
        if gate_layers is not None:
            tensors.extend(gate_layers)
    if refusal(x, tensors, kind.shape[0]) is not None:
        return None
    if pair:  # the step reads keys and values from one contiguous [2, B, H_kv, N, D] block, as from a ring
        kv = torch.stack(kv)
    _, _, H_kv, N, D = kv.shape
    settings = plan.settings
    mode, (c_local, c_skip) = plan.prior_mode, plan.log_priors
    if gate_layers is not None:
        mode = native.PRIOR_HIDDEN if len(gate_layers) == 2 else native.PRIOR_INPUT
    base = x.data_ptr()
    if fresh_slot is None:
        B, H, T, _ = x.shape
        q_sb, q_sh, q_st, q_sd = x.stride()
        fresh = fresh_sb = 0
    else:
        B, H, T = x.shape[0], plan.n_heads, 1
        q_sb, _, q_sd = x.stride()
        q_sh, q_st = D, 0
        if (H + 2 * H_kv) * D > x.shape[2]:
            return None
        fresh, fresh_sb = base + H * D * x.element_size(), q_sb
    if q_sd != 1 or not kv.is_contiguous():
        return None
    slot_sh = _slot_stride(slot, valid, H)
    gate_ptr, gate_sb, gate_sh, gate_st, n_hidden, w_ptr, b_ptr, w_in_ptr, b_in_ptr, n_in = (0,) * 10
    if mode == native.PRIOR_ALPHA:  # α of (b, h, t) at b·stride(0) + h·stride(1) + t·stride(2)
        gate_ptr, (gate_sb, gate_sh, gate_st) = gate.data_ptr(), gate.stride()
    elif mode >= native.PRIOR_HIDDEN:
        for layer in gate_layers:
            if not layer.is_contiguous():
                return None
        gate_sb, gate_st, gate_sd = gate.stride()
        if gate_sd != 1:
            return None
        gate_ptr = gate.data_ptr()
        if mode == native.PRIOR_INPUT:
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
    y = torch.empty(B, H, T, D, dtype=x.dtype)
    clamp = float("inf") if settings.logit_clamp is None else settings.logit_clamp
    native.check(native.functions()[x.dtype](native.ARGS.pack(
        base, q_sb, q_sh, q_st, kv.data_ptr(), B, H, H_kv, N, D, T, slot.data_ptr(),
        0 if valid is None else valid.data_ptr(), slot_sh, kind.data_ptr(), kind.shape[0], mode, c_local, c_skip,
        gate_ptr, gate_sb, gate_sh, gate_st, n_hidden, w_ptr, b_ptr, settings.scale, clamp, settings.eps,
        y.data_ptr(), fresh, fresh_sb, fresh_slot or 0, cos_ptr, sin_ptr, rope_f64, w_in_ptr, b_in_ptr, n_in)))
    return y


def _slot_stride(slot: torch.Tensor, valid: torch.Tensor | None, H: int) -> int:
    """decode_step.c's slot_sh: t·S for one table per query head (slot [H, t·S], valid [H, t, S] or None), which
    the C step reads H of, so they must be there; 0 for one table [t·S] read by every head."""
    if slot.dim() != 2:
        return 0
    if (slot.shape[0] != H or not slot.is_contiguous()
            or (valid is not None and (valid.numel() != slot.numel() or not valid.is_contiguous()))):
        raise ValueError(f"per-head slot tables must be [H, t·S] with H = {H} (and valid [H, t, S]), got slot "
                         f"{tuple(slot.shape)}, valid {None if valid is None else tuple(valid.shape)}")
    return slot.shape[1]
