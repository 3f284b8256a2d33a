"""π-Attention's weights over the slots of U(i) (Eqs. z, delta_adapt, alphahat_adapt, gamma): one formulation.

`slot_weights` is the formulation, written plainly: one gather of K per slot, per-slot logits, a softmax
over the stacked slots (or, for "separate", two mixed by α). The reference backend weighs its gathered
values with it, and `pi_attention_weights` hands it out, checked, to whoever wants to look at the weights
(`piattn.inspection`), so what is inspected is what the operator computes.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from ...config.pi import PI_DEFAULTS, PiSettings, period_tuple
from .dtypes import accumulation_dtype
from .heads import period_groups
from .pattern import Pattern, log_priors, slot_keys
from .validate import check_settings_call, gate_or_prior, head_periods


class SlotWeights(NamedTuple):
    """The weights of every query on its slots (order of `Pattern`: local, skip, sinks) and the keys they read.

    weights [B, H, T, |U|] in the accumulation dtype (fp64 for fp64 inputs, else fp32), each row summing to
    1 and 0 on invalid slots; key [B, T, |U|] int64, the key position slot m of query i reads (0 where
    invalid); valid [B, T, |U|] bool, whether it reads one. With per-head periods the keys differ by head:
    key and valid are [B, H, T, |U|] (slot m is still one key class for every head, see
    `pi_attention_weights`).
    """

    weights: torch.Tensor
    key: torch.Tensor
    valid: torch.Tensor


def pi_attention_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    gate: torch.Tensor | None = None,
    *,
    settings: PiSettings = PI_DEFAULTS,
    causal: bool = True,
    scale: float | None = None,
    document_ids: torch.Tensor | None = None,
) -> SlotWeights:
    """The attention weights `pi_attention_with_settings(q, k, v, gate, settings, causal=causal, scale=scale,
    document_ids=document_ids)` applies to v (without dropout).

    q [B, H, T, D], k [B, H_kv, T, D] (H_kv dividing H), gate [B, H, T] or None, document_ids [B, T] or
    None: the arguments of `pi_attention`, checked the same way. The slots are those of the pattern asked
    for (`settings_pattern`), not clamped to T: a slot no query of this T can use is simply invalid
    everywhere, so slot m means the same key class at every T.

    With per-head periods (`settings.period` a tuple of H ints, multi-scale π) each group of heads sharing a
    period gets the weights of its own pattern (`heads.period_groups`, as `pi_attention` runs it), laid out
    in the slots of the largest period: local, skip (i − π_h, then i + π_h), sinks; a head whose period lies
    inside the window has no skip key, so its skip slots are invalid. key and valid are then [B, H, T, |U|].
    """
    if not isinstance(settings, PiSettings):
        raise ValueError(f"settings must be a piattn.config.PiSettings, got {type(settings).__name__}")
    variant, gate = gate_or_prior(q, gate, settings.variant, settings.prior)
    settings = dataclasses.replace(settings, variant=variant)
    # v plays no part in the weights; k stands in for it, so that the operator's one check covers the call.
    check_settings_call(q, k, k, gate, settings, causal=causal, scale=scale, dropout_p=0.0, document_ids=document_ids)
    periods = head_periods(settings.period, q.shape[1])
    formulation = dict(variant=settings.variant, prior=settings.prior, logit_clamp=settings.logit_clamp,
                       eps=settings.eps, scale=q.shape[-1] ** -0.5 if scale is None else scale,
                       document_ids=document_ids)
    layout = settings_pattern(settings, causal)
    if len(set(periods)) == 1:
        return slot_weights(q, k, gate, layout, **formulation)
    B, H, T, _ = q.shape
    acc = accumulation_dtype(q.dtype)
    weights = q.new_zeros(B, H, T, layout.n_slots, dtype=acc)
    key = torch.zeros(B, H, T, layout.n_slots, dtype=torch.long, device=q.device)
    valid = torch.zeros(B, H, T, layout.n_slots, dtype=torch.bool, device=q.device)
    for p, heads, kv_heads in period_groups(periods, k.shape[1]):
        pattern = Pattern(settings.window, p, causal, settings.sinks)
        part = slot_weights(q[:, heads], k[:, kv_heads], None if gate is None else gate[:, heads], pattern,
                            **formulation)
        heads_index = torch.tensor(heads, device=q.device)
        gap = layout.n_skip - pattern.n_skip  # a period inside the window has no skip slot: left empty
        weights[:, heads_index] = _widen(part.weights, pattern.n_local, gap)
        key[:, heads_index] = _widen(part.key, pattern.n_local, gap)[:, None]
        valid[:, heads_index] = _widen(part.valid, pattern.n_local, gap)[:, None]
    return SlotWeights(weights, key, valid)


def _widen(x: torch.Tensor, at: int, n: int) -> torch.Tensor:
    """x [..., |U_p|] with n empty (zero, False) slots inserted before slot `at`."""
    if not n:
        return x
    return torch.cat([x[..., :at], x.new_zeros(*x.shape[:-1], n), x[..., at:]], -1)


def settings_pattern(settings: PiSettings, causal: bool) -> Pattern:
    """The slots of U(i) under `settings`, in the order of `pi_attention_weights`' last dimension (with
    per-head periods, the pattern of the largest: every head's slots have the same key classes)."""
    return Pattern(settings.window, max(period_tuple(settings.period)), causal, settings.sinks)


def slot_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    gate: torch.Tensor | None,
    pattern: Pattern,
    *,
    variant: str,
    prior: float,
    logit_clamp: float | None,
    eps: float,
    scale: float,
    document_ids: torch.Tensor | None = None,
) -> SlotWeights:
    """The formulation, unchecked: q [B, H, T, D], k [B, H_kv, T, D], gate [B, H, T] or None, document_ids
    [B, T] or None -> `SlotWeights` (weights [B, H, T, |U|], key and valid [B, T, |U|])."""
    acc = accumulation_dtype(q.dtype)
    B, H, T, D = q.shape
    # Grouped-query attention: query head h reads key/value head h // (H // H_kv). Materialised here only.
    q, k = q.to(acc), k.repeat_interleave(H // k.shape[1], 1).to(acc)
    key, valid = slot_keys(pattern, T, document_ids, q.device)  # [B or 1, T, |U|]
    key, valid = key.expand(B, T, -1), valid.expand(B, T, -1)
    log_local, log_skip = log_priors(variant, None if gate is None else gate.to(acc), prior, eps)

    logits = []
    for m, is_local in enumerate(pattern.slot_is_local()):  # Eq. (U): N_r(i) ∪ N_π(i), then the sinks
        inside = valid[:, None, :, m, None]  # [B, 1, T, 1]
        # An unread key is zeros, not some other row: 0·NaN would carry a NaN in a row the query never reads
        # to it (through the weight 0, and to dq through z's mask).
        kg = torch.where(inside, torch.gather(k, 2, key[:, None, :, m, None].expand(B, H, T, D)), 0.0)
        z = (q * kg).sum(-1) * scale  # Eq. (z)
        if logit_clamp is not None:
            z = z.clamp(-logit_clamp, logit_clamp)
        z = z + (log_local if is_local else log_skip)  # Eq. (delta_adapt)
        logits.append(z.masked_fill(~inside[..., 0], float("-inf")))
    logits = torch.stack(logits, -1)  # [B, H, T, |U|]
    if variant == "separate":
        weights = _separate_weights(logits, gate.to(acc), pattern, valid[:, None])
    else:
        weights = torch.softmax(logits, -1)  # Eq. (alphahat_adapt)
    return SlotWeights(weights, key, valid)


def _separate_weights(logits: torch.Tensor, gate: torch.Tensor, pat: Pattern, valid: torch.Tensor) -> torch.Tensor:
    """Variant 1 (Eq. gamma): α·softmax over N_r (with the sinks) and (1 − α)·softmax over N_π, local alone
    where N_π is empty.

    valid [B, 1, T, |U|]: whether a slot reads a key (from the pattern, not from finite logits, so that a
    NaN skip logit is not mistaken for an empty N_π)."""
    n_local, n_skip = pat.n_local, pat.n_skip
    skip = logits[..., n_local : n_local + n_skip]
    local = torch.cat([logits[..., :n_local], logits[..., n_local + n_skip :]], -1)
    has_skip = valid[..., n_local : n_local + n_skip].any(-1, keepdim=True)
    # Rows without a valid skip would softmax over all -inf; give them finite logits, then drop them.
    skip_w = torch.softmax(torch.where(has_skip, skip, torch.zeros_like(skip)), -1) * has_skip
    a = torch.where(has_skip, gate.unsqueeze(-1), torch.ones_like(gate).unsqueeze(-1))
    local_w = a * torch.softmax(local, -1)
    return torch.cat([local_w[..., :n_local], (1 - a) * skip_w, local_w[..., n_local:]], -1)
