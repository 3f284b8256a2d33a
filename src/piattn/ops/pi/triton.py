"""Backend "triton": the launchers of the fused kernels in `triton_kernels.py` (ops/pi/TRITON.md).

`triton_forward` runs the forward kernel, `triton_backward` the two backward kernels; `_PiAttentionTriton`
only connects them to autograd. Which calls this backend can run (dtypes, head dims, devices) is declared
in `backends.py`, and `pi_attention` checks it before calling here.

Saved for backward: the inputs, the document bounds (int32 [B, T], with document_ids) and `stats`
[2, N, T] fp32, per query the offsets c_local, c_skip such that the weight of a local (or sink) slot is
exp(z - c_local) and that of a skip slot exp(z - c_skip) (z the clamped, scaled score). They hold the
log-sum-exp, the priors and, for "separate", the mixing coefficients.

Per-head periods (`period` a tuple of one π_h per query head; `backends.py` declares `per_head_periods`, so
`pi_attention` hands them over in one call) run in one launch of each kernel: `plan` puts them in an int32
[H] tensor on q's device that the kernels read per head (PER_HEAD), or launches the one-period kernels where
the heads' patterns do not differ.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton

from ...caching import untainted
from .backends import by_keywords, refuse_double_backward
from .operators import register_pair
from .pattern import Pattern, document_bounds, log_priors
from .settings import OpSettings
from .triton_kernels import (
    MODE_ADAPTIVE,
    MODE_CONSTANT,
    MODE_SEPARATE,
    pi_bwd_dkdv_kernel,
    pi_bwd_dq_kernel,
    pi_fwd_kernel,
)


def _tiles(D: int, halo: int, elem_size: int) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_K, num_warps, num_stages) for head dim D (a power of two), band halo and input element
    size.

    BLOCK_T = 64 rows is one Hopper warpgroup MMA tall. BLOCK_K = 32 wastes few columns on the usual small
    windows; wide bands take 64 where the chunks are short rows (D·elem_size <= 128 bytes), since longer
    ones spill registers in the backward kernels (ptxas for sm_90a, TRITON.md). Rows of 1 KiB (fp32, D =
    256) take 32-row tiles and no pipelining: the dQ kernel asked for 384 KiB of shared memory with 64 rows
    and two stages on an H200, which has 227 KiB (first GPU run, benchmarks/results/gpu/gpu_first_tests.md).
    """
    block_k = 64 if halo >= 64 and D * elem_size <= 128 else 32
    if D * elem_size >= 1024:
        return 32, block_k, 8, 1
    return 64, block_k, 4 if D <= 64 else 8, 2


@dataclass(frozen=True)
class Launch:
    """Everything the kernels take besides tensors, fixed by the forward and reused by the backward."""

    window: int
    period: int  # the one period of every head; 0 with per-head periods (`periods`)
    periods: torch.Tensor | None  # int32 [H] on q's device: each query head's period (PER_HEAD), else None
    mode: int
    eps: float
    scale: float
    clamp: float  # 0.0 when there is no clamp (HAS_CLAMP is then False)
    log_local: float
    log_skip: float
    keep_scale: float  # 1 / (1 - dropout_p)
    sinks: int
    heads: int  # H, query heads per batch row
    group: int  # H // H_kv, query heads per key/value head
    n_tiles: int  # tiles of BLOCK_T rows per head
    grid: tuple[int]  # one program per (query head, tile): forward and dQ kernels
    grid_kv: tuple[int]  # one program per (key/value head, tile): dK/dV kernel
    meta: dict  # the constexprs shared by all three kernels, num_warps and num_stages


@functools.lru_cache(maxsize=64)
@untainted
def _periods_on(periods: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The per-head periods as the kernels read them, int32 [H] on `device`: made once per (periods, device),
    so that a call pays no host-to-device copy."""
    return torch.tensor(periods, dtype=torch.int32, device=device)


def plan(q: torch.Tensor, settings: OpSettings, *, dropout: bool, kv_heads: int | None = None,
         documents: bool = False) -> Launch:
    """The launch configuration for q [B, H, T, D] (D a power of two >= 16); settings.period: an int, or one
    per query head (H ints); dropout: a keep mask is passed (with per-head periods [B, H, T, N_SLOTS], head h's slots
    first, N_SLOTS the most any head has); kv_heads: H_kv (None: H); documents: document bounds are passed.

    Per-head periods launch PER_HEAD kernels with N_SKIP the most skip slots any head has, unless every head
    has the same pattern (equal periods, or none beyond the window): then the one-period kernels run."""
    B, H, T, D = q.shape
    window, period, causal, sinks = settings.window, settings.period, settings.causal, settings.sinks
    variant, prior, eps, logit_clamp = settings.variant, settings.prior, settings.eps, settings.logit_clamp
    kv_heads = H if kv_heads is None else kv_heads
    periods = (period,) if isinstance(period, int) else tuple(int(p) for p in period)
    # The pattern with the most slots (N_SKIP, N_SLOTS): any head's with a skip beyond the window.
    pat = max((Pattern(window, p, causal, sinks) for p in periods), key=lambda pattern: pattern.n_slots)
    per_head = len(set(periods)) > 1 and pat.n_skip > 0
    block_t, block_k, num_warps, num_stages = _tiles(D, pat.n_local - 1, q.element_size())
    # Constant priors only; the kernels take "adaptive"'s from the gate and "separate" has none.
    log_local, log_skip = log_priors("fixed", None, prior, eps) if variant == "fixed" else (0.0, 0.0)
    mode = {"separate": MODE_SEPARATE, "adaptive": MODE_ADAPTIVE}.get(variant, MODE_CONSTANT).value
    upcast = q.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"
    # fp32 operands: three TF32 products per dot, about fp32-accurate on tensor cores ("ieee" would
    # fall back to FMA loops that spill kilobytes of registers on sm_90; TRITON.md).
    prec = "tf32x3" if q.dtype == torch.float32 or upcast else "tf32"
    meta = dict(
        CAUSAL=causal, N_SKIP=pat.n_skip, SINKS=sinks, N_SLOTS=pat.n_slots,
        HAS_CLAMP=logit_clamp is not None, HAS_DROPOUT=dropout, HAS_DOCS=documents, PER_HEAD=per_head, D=D,
        BLOCK_T=block_t, BLOCK_K=block_k, DOT_PREC=prec, UPCAST=upcast,
        num_warps=num_warps, num_stages=num_stages,
    )
    n_tiles = triton.cdiv(T, block_t)
    return Launch(
        window=window, period=0 if per_head else pat.period,
        periods=_periods_on(periods, q.device) if per_head else None, mode=mode, eps=eps, scale=settings.scale,
        clamp=0.0 if logit_clamp is None else float(logit_clamp), log_local=log_local, log_skip=log_skip,
        keep_scale=1.0 / (1.0 - settings.dropout_p), sinks=sinks, heads=H, group=H // kv_heads, n_tiles=n_tiles,
        grid=(B * H * n_tiles,), grid_kv=(B * kv_heads * n_tiles,), meta=meta,
    )


def _or(t: torch.Tensor | None, stand_in: torch.Tensor) -> torch.Tensor:
    """t, or a tensor standing in for a pointer argument the kernel never reads (no gate, no dropout)."""
    return stand_in if t is None else t


def triton_forward(q, k, v, gate, keep, launch: Launch, bounds=(None, None)) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, T, D], k, v [B, H_kv, T, D], gate [B, H, T] or None, keep uint8 [B, H, T, |U|] or None,
    bounds (start, end) int32 [B, T] or (None, None) (`pattern.document_bounds`), all contiguous ->
    (y [B, H, T, D], stats fp32 [2, N, T]: c_local, c_skip)."""
    B, H, T, D = q.shape
    out = torch.empty_like(q)
    stats = torch.empty(2, B * H, T, dtype=torch.float32, device=q.device)
    L = launch
    start, end = (_or(b, q) for b in bounds)
    pi_fwd_kernel[L.grid](
        q, k, v, _or(gate, q), _or(keep, q), start, end, _or(L.periods, q), out, stats[0], stats[1],
        T, L.n_tiles, L.heads, L.group, L.window, L.period, L.scale, L.clamp, L.log_local, L.log_skip, L.eps,
        L.keep_scale, MODE=L.mode, **L.meta,
    )
    return out, stats


def triton_backward(dy, q, k, v, gate, keep, stats, launch: Launch, *, want_dgate: bool, bounds=(None, None)):
    """The gradients (dq, dk, dv, dgate or None) for the cotangent dy of `triton_forward`'s output."""
    B, H, T, D = q.shape
    N = B * H
    L = launch
    dy = dy.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    delta = torch.empty(2, N, T, dtype=torch.float32, device=q.device)  # Δ_local, Δ_skip
    dgate = torch.empty(N, T, dtype=torch.float32, device=q.device) if want_dgate else None
    # Per sink slot: its dlogit and dropped weight, for the dK/dV of the sink keys, O(T·sinks) per head.
    sink_terms = torch.empty(2, N, T, L.sinks, dtype=torch.float32, device=q.device) if L.sinks else delta
    start, end = (_or(b, q) for b in bounds)
    # Δ and the sink terms are written by the dQ kernel and read by the dK/dV kernel: stream order makes
    # them ready.
    pi_bwd_dq_kernel[L.grid](
        q, k, v, _or(gate, q), _or(keep, q), start, end, _or(L.periods, q), dy, stats[0], stats[1], dq,
        delta[0], delta[1], _or(dgate, q), sink_terms[0], sink_terms[1], T, L.n_tiles, L.heads, L.group,
        L.window, L.period, L.scale, L.clamp, L.eps, L.keep_scale, MODE=L.mode, HAS_DGATE=want_dgate, **L.meta,
    )
    pi_bwd_dkdv_kernel[L.grid_kv](
        q, k, v, _or(keep, q), start, end, _or(L.periods, q), dy, stats[0], stats[1], delta[0], delta[1],
        sink_terms[0], sink_terms[1], dk, dv, T, L.n_tiles, L.heads // L.group, L.window, L.period, L.scale,
        L.clamp, L.keep_scale, GROUP=L.group, **L.meta,
    )
    dgate = None if dgate is None else dgate.view(B, H, T).to(gate.dtype)
    return dq, dk, dv, dgate


def triton_gradients(dy, q, k, v, gate, keep, document_ids, stats, launch: Launch, settings: OpSettings, *,
                     want_dgate: bool, bounds=(None, None)):
    """What both wrappers (`_PiAttentionTriton`, the operator `piattn::pi_triton_bwd`) run backward:
    `triton_backward`. A NaN or ±inf in an input or the cotangent stays in the gradient rows that read it,
    as in the forward (`triton_kernels._contained_dot`): no check of the values, no host sync.
    (document_ids and settings: the operator's signature; the kernels take the bounds and the launch.)"""
    del document_ids, settings
    return triton_backward(dy, q, k, v, gate, keep, stats, launch, want_dgate=want_dgate, bounds=bounds)


class _PiAttentionTriton(torch.autograd.Function):
    """Autograd around the launchers: q, k, v, gate differentiable; keep, the document bounds, document_ids,
    launch and settings are not."""

    @staticmethod
    def forward(ctx, q, k, v, gate, keep, start, end, document_ids, launch, settings):
        out, stats = triton_forward(q, k, v, gate, keep, launch, (start, end))
        ctx.save_for_backward(q, k, v, gate, keep, start, end, document_ids, stats)
        ctx.launch, ctx.settings = launch, settings
        return out

    @staticmethod
    def backward(ctx, dy):
        refuse_double_backward("triton")
        q, k, v, gate, keep, start, end, document_ids, stats = ctx.saved_tensors
        want_dgate = gate is not None and ctx.needs_input_grad[3]
        dq, dk, dv, dgate = triton_gradients(dy, q, k, v, gate, keep, document_ids, stats, ctx.launch, ctx.settings,
                                             want_dgate=want_dgate, bounds=(start, end))
        return dq, dk, dv, dgate, None, None, None, None, None, None


def _kernel_inputs(q, k, v, gate):
    """q, k, v zero-padded to a head dim the kernels take (a power of two >= 16) and made contiguous, the
    gate contiguous; and the head dim to slice the output back to."""
    D = q.shape[-1]
    d_pad = max(16, triton.next_power_of_2(D))
    if d_pad != D:
        q, k, v = (F.pad(x, (0, d_pad - D)) for x in (q, k, v))
    q, k, v = (x.contiguous() for x in (q, k, v))
    return q, k, v, None if gate is None else gate.contiguous(), D


def _unpadded(y: torch.Tensor, D: int) -> torch.Tensor:
    return y if y.shape[-1] == D else y[..., :D]


def _plan_for(q, k, keep, document_ids, settings: OpSettings) -> Launch:
    """`plan` for kernel inputs q, k (`_kernel_inputs`), the uint8 keep mask or None and document_ids or None;
    settings.period an int or one per query head."""
    return plan(q, settings, dropout=keep is not None, kv_heads=k.shape[1], documents=document_ids is not None)


def run_triton(q, k, v, gate, settings: OpSettings, dropout_keep=None, document_ids=None):
    """The contract, `backends.BackendRun`: q [B, H, T, D], k, v [B, H_kv, T, D] -> [B, H, T, D] in q's
    dtype, with sinks, documents and grouped-query attention (no repeated k, v: each program of a query head
    reads its key/value head). settings.period: an int, or one per query head (one launch of each kernel,
    `plan`).

    fp32, bf16 and fp16 inputs, head dims up to 256 (`backends.py` declares this); scores, softmax and
    outputs accumulate in fp32 (fp32 inputs: 3xTF32 dots, about fp32-accurate). `tl.dot` needs a
    power-of-two head dim of at least 16: other D (8, 48, 96, …) are zero-padded to the next one here,
    which leaves every dot product unchanged, and the padding is sliced off the output (and, through
    autograd, off the gradients).
    """
    q, k, v, gate, D = _kernel_inputs(q, k, v, gate)
    keep = None if dropout_keep is None else dropout_keep.contiguous().view(torch.uint8)
    start, end = document_bounds(document_ids, torch.int32)
    launch = _plan_for(q, k, keep, document_ids, settings)
    return _unpadded(_PiAttentionTriton.apply(q, k, v, gate, keep, start, end, document_ids, launch, settings), D)


pi_attention_triton = by_keywords(run_triton)


# The backend as PyTorch custom operators (`operators.register_pair`), what runs inside torch.compile (and on
# meta and fake tensors): one opaque node each way, the kernels launched as in eager. The settings are
# `OpSettings`' fields, in its order (`settings.py`); the launch plan is rebuilt from them. periods: one per
# query head, or empty for `settings.period` in every head (an OpSettings field is one int), as for "fused"'s
# operators.
#
#     piattn::pi_triton_fwd (q, k, v, gate, keep, document_ids, periods, settings…) -> (y, stats)
#     piattn::pi_triton_bwd (dy, q, k, v, gate, keep, document_ids, stats, want_gate, periods, settings…) -> grads

def _op_forward(q, k, v, gate, keep, document_ids, settings: OpSettings):
    """(y [B, H, T, D], stats fp32 [2, B·H, T]) for q, k, v as `_kernel_inputs` leaves them and keep the
    bool dropout mask [B, H, T, |U|] or None."""
    keep = None if keep is None else keep.view(torch.uint8)
    launch = _plan_for(q, k, keep, document_ids, settings)
    return triton_forward(q, k, v, gate, keep, launch, document_bounds(document_ids, torch.int32))


def _op_forward_fake(q, k, v, gate, keep, document_ids, settings: OpSettings):
    B, H, T, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((2, B * H, T), dtype=torch.float32)


def _op_backward(dy, q, k, v, gate, keep, document_ids, stats, want_gate, settings: OpSettings):
    """[dq, dk, dv], and dgate when `want_gate`, of `pi_triton_fwd` for the cotangent dy of its y."""
    keep = None if keep is None else keep.view(torch.uint8)
    dq, dk, dv, dgate = triton_gradients(dy, q, k, v, gate, keep, document_ids, stats,
                                         _plan_for(q, k, keep, document_ids, settings), settings,
                                         want_dgate=want_gate, bounds=document_bounds(document_ids, torch.int32))
    return [dq, dk, dv, dgate] if want_gate else [dq, dk, dv]


pi_triton_fwd, pi_triton_bwd = register_pair("pi_triton", "triton", forward=_op_forward,
                                             forward_fake=_op_forward_fake, backward=_op_backward,
                                             saved="Tensor stats", keep="keep")


def run_triton_op(q, k, v, gate, settings: OpSettings, dropout_keep=None, document_ids=None):
    """The contract, `backends.BackendRun`, through the operator `piattn::pi_triton_fwd`: what torch.compile
    captures (per-head periods as its `periods`, the one period of every head as `period`)."""
    q, k, v, gate, D = _kernel_inputs(q, k, v, gate)
    keep = None if dropout_keep is None else dropout_keep.contiguous()
    periods, settings = settings.to_op()
    y, _ = pi_triton_fwd(q, k, v, gate, keep, document_ids, periods, *settings)
    return _unpadded(y, D)
