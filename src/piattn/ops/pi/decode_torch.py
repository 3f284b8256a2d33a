"""The "torch" decoding step: a plan's rows in a dozen plain torch ops, on any device and dtype, with autograd.

One gather of the key and value rows the slots read, the scores (Eq. z), the clamp, the variant's log priors
(Eqs. delta, omega), one softmax (two for "separate", Variant 1) and the weighted sum of the gathered values.
Per-head periods: once per distinct period over every head, each head's rows kept from the pass of its own
period (`DecodePlan.groups`): every row is computed on its own, so a head's row of its period's pass is the row
of that head alone, and the key/value heads are read where they lie (grouping heads by period would copy them).
One period is one pass.
"""

from __future__ import annotations

import functools

import torch
from torch.nn import functional as F

from .dtypes import accumulation_dtype
from .pattern import log_priors

# The variants this step computes ("separate" included: two softmaxes, mixed by α).
TORCH_OPS_VARIANTS = frozenset({"union", "separate", "fixed", "adaptive"})


def unavailable() -> str | None:
    """Torch ops run wherever torch does."""
    return None


def gate_tail(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The gate MLP after its first linear layer (Eq. app_gate): hidden [B, T, n_hidden] pre-activation ->
    σ(weight·GELU(hidden) + bias) [B, T, H], in at least fp32 (`piattn.layers.gate.gate_mlp`)."""
    s = F.linear(F.gelu(hidden), weight, bias).sigmoid_()
    return s.to(accumulation_dtype(s.dtype))


@functools.lru_cache(maxsize=16)
def _ignored(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 0-dim tensor for baddbmm's ignored input (beta = 0)."""
    return torch.zeros((), dtype=dtype, device=device)


@functools.lru_cache(maxsize=256)
def _prior_rows(kind: torch.Tensor, floor: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(offset, slope) [S] with which addcmul(offset, slope, s) is each slot's prior in one op (`kind` is a plan's
    cached tensor): for floor 0 and s = α, α on local and sink slots and 1 − α on the skip slot, exactly; for
    floor ε and s = σ, the same for the clipped α = ε + (1 − 2ε)·σ."""
    skip = kind.to(dtype)
    sign = 1 - 2 * skip
    return skip + floor * sign, (1 - 2 * floor) * sign


def run(plan, q: torch.Tensor, kv, slot: torch.Tensor, valid: torch.Tensor | None, gate: torch.Tensor | None,
        gate_layers: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """The rows [B, H, t, D] (q's dtype) of `plan` for the queries q [B, H, t, D].

    kv: a ring cache's storage [2, B, H_kv, N, D], or a block (k, v) of [B, H_kv, N, D] each; slot [H, t·S] and
    valid [H, t, S] or None: the plan's tables, slot s of query j at j·S + s (`Pattern` slot order; any row where
    the slot reads nothing). gate: α [B, H, t], or with gate_layers = the gate MLP's last layer (weight
    [H, n_hidden], bias [H]; variant "adaptive" only) its hidden pre-activation [B, t, n_hidden], finished here
    (`gate_tail`, the clip folded into the priors). The variant, prior, clamp, ε and scale are the plan's.

    Laid out as R = B·H_kv·t batched products of the g = H / H_kv query heads of a group against the S keys their
    query reads, in as few tensor ops as the maths allows: a decoding step is dominated by the fixed cost of each
    op, not by its arithmetic.
    """
    _, _, _, variant, prior, logit_clamp, eps, scale, _, _ = plan.settings
    n_local, n_skip, kind = plan.n_local, plan.n_skip, plan.kind
    gate_is_sigmoid = gate_layers is not None
    if gate_is_sigmoid:
        gate = gate_tail(gate, *gate_layers).transpose(1, 2)
    B, H, t, D = q.shape
    S = kind.shape[0]
    g = H // (kv[0].shape[1] if type(kv) is tuple else kv.shape[2])
    H_kv = H // g
    R = B * H_kv * t
    out_dtype = q.dtype
    acc = accumulation_dtype(q.dtype)
    # With one query (t = 1) the heads of a group are already adjacent: plain views, no transposes.
    q3 = q.reshape(R, g, D) if t == 1 else q.view(B, H_kv, g, t, D).transpose(2, 3).reshape(R, g, D)
    q3 = q3 if q3.dtype == acc else q3.to(acc)
    a = None
    if gate is not None:
        a = gate.reshape(R, g, 1) if t == 1 else gate.view(B, H_kv, g, t).transpose(2, 3).reshape(R, g, 1)
        a = a if a.dtype == acc else a.to(acc)
    y = None
    for row, heads in plan.groups:  # one pass per distinct period (one period: one pass, every head)
        index, ok = slot[row], None if valid is None else valid[row]
        if type(kv) is tuple:
            kg, vg = kv[0].index_select(2, index), kv[1].index_select(2, index)
        else:
            # Rows of a [2·B·H_kv, N, D] view: index_select along a middle dim of the 5-d store is about twice as
            # slow for these few rows (reshape: a view of a cache's contiguous store, a copy of any other). The
            # slot count is spelled out, not -1: with B = 0 there is no element to infer it from.
            two, _, _, N, _ = kv.shape
            kg, vg = kv.reshape(two * B * H_kv, N, D).index_select(1, index).view(two, B, H_kv, t * S, D).unbind(0)
        k3, v3 = kg.view(R, S, D), vg.view(R, S, D)
        if ok is not None:
            # A slot that reads nothing still gathered some key and value (row 0, a sink slot not yet written): its
            # weight is 0, but 0·inf and 0·NaN are NaN, so a non-finite value there would reach rows that never read
            # it. Replaced, not multiplied (as the operator does); its key's score is replaced by -inf below.
            v3 = torch.where(ok[None, :, :, None], v3.view(B * H_kv, t, S, D), 0.0).view(R, S, D)
        # Each converted on its own: the cache may hold another dtype than q (an fp32 step reading a bf16 or fp64
        # cache), and baddbmm takes one dtype.
        k3, v3 = (x if x.dtype == acc else x.to(acc) for x in (k3, v3))
        z = torch.baddbmm(_ignored(acc, q.device), q3, k3.transpose(1, 2), beta=0, alpha=scale)  # [R, g, S]: Eq. z
        if logit_clamp is not None:
            z.clamp_(-logit_clamp, logit_clamp)
        if variant == "adaptive":  # log max(α, ε) on local and sink slots, log max(1 − α, ε) on the skip slot
            if gate_is_sigmoid:  # α = ε + (1 − 2ε)·σ lies in [ε, 1 − ε]: the clip folds into the rows, no max
                z.add_(torch.addcmul(*_prior_rows(kind, eps, acc), a).log_())
            else:
                z.add_(torch.addcmul(*_prior_rows(kind, 0.0, acc), a).clamp_min_(eps).log_())
        elif variant == "fixed":
            log_local, log_skip = log_priors(variant, None, prior, eps)
            z.add_(torch.tensor((log_local, log_skip), dtype=acc, device=z.device).index_select(0, kind))
        if ok is not None:
            z.view(B * H_kv, t, g, S).masked_fill_(~ok[:, None, :], float("-inf"))
        if variant == "separate" and n_skip:  # Variant 1: α·softmax(local and sinks) and (1 − α)·softmax(skip)
            skip = z[..., n_local:n_local + n_skip]
            local = torch.cat([z[..., :n_local], z[..., n_local + n_skip:]], -1)
            if ok is None:
                has_skip = torch.ones(1, 1, 1, dtype=torch.bool, device=z.device)
            else:  # [t, 1, 1] -> one per row of z
                has_skip = ok[:, None, n_local:n_local + n_skip].any(-1, keepdim=True)
                has_skip = has_skip.expand(t, g, 1).repeat(B * H_kv, 1, 1)
            skip_w = torch.softmax(torch.where(has_skip, skip, torch.zeros_like(skip)), -1) * has_skip
            a_p = torch.where(has_skip, a, torch.ones_like(a))
            local_w = a_p * torch.softmax(local, -1)
            w = torch.cat([local_w[..., :n_local], (1 - a_p) * skip_w, local_w[..., n_local:]], -1)
        else:  # one softmax ("separate" with no skip slot, period <= window, is the local softmax alone)
            w = torch.softmax(z, -1)
        y_p = torch.bmm(w, v3)
        y_p = y_p.view(B, H, 1, D) if t == 1 else y_p.view(B, H_kv, t, g, D).transpose(2, 3).reshape(B, H, t, D)
        y = y_p if y is None else torch.where(heads, y_p, y)
    return y if y.dtype == out_dtype else y.to(out_dtype)
