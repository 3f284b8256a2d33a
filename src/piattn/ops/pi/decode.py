"""`pi_decode`: the last few rows of the causal π-Attention operator, computed from the keys they read.

A decoding step adds t (usually 1) query rows at the end of a causal sequence whose keys are cached.
Query i reads at most window + 2 keys (i − window … i and i − period, `Pattern` slot order), so this
gathers exactly those, scores them, clamps, adds the variant's log priors (`log_priors`), takes one small
softmax (two for "separate") and the weighted sum of the gathered values: O(t·(window + 2)·D) work in a
handful of plain torch ops, no blocking, no dropout (decoding runs in eval). Its rows equal the last t
rows of `pi_attention` (causal) on the N given rows; positions before the first given key count as
outside the text, as they do for the full operator.
"""

from __future__ import annotations

import functools

import torch

from ...config.pi import PI_DEFAULTS, check_pi_settings
from .pattern import Pattern, log_priors
from .validate import _check_gate, check_qkv_tensors


@functools.lru_cache(maxsize=256)
def _slots(window: int, period: int, n_queries: int, n_keys: int, device: torch.device):
    """For t new queries over N keys: the flat index [t·S] of each query's slots into the N keys (clamped
    to 0), which slots are inside the text ([t, S] bool, or None when all are), and each slot's kind
    ([S]: 0 local, 1 skip), in `Pattern` slot order."""
    pat = Pattern(window, period, causal=True)
    rows = torch.arange(n_keys - n_queries, n_keys, device=device)[:, None]
    idx = rows + torch.tensor(pat.offsets, device=device)
    valid = idx >= 0
    kind = (torch.arange(pat.n_slots, device=device) >= pat.n_local).long()
    return idx.clamp_min(0).flatten(), None if bool(valid.all()) else valid, kind, pat.n_local


def _check(q, k, v) -> None:
    check_qkv_tensors(q, k, v, layout="[B, H, *, D]")
    if k.shape != v.shape:
        raise ValueError(f"k and v must share one shape [B, H, N, D]; got k {tuple(k.shape)}, v {tuple(v.shape)}")
    B, H, t, D = q.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (B, H, D):
        raise ValueError(f"k must have shape [B, H, N, D] with B, H, D of q {tuple(q.shape)}, got {tuple(k.shape)}")
    if t < 1 or D < 1:
        raise ValueError(f"q must have at least one row and D >= 1, got shape {tuple(q.shape)}")
    if k.shape[2] < t:
        raise ValueError(f"k must hold at least the t = {t} new rows of q, got N = {k.shape[2]}")


def pi_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate: torch.Tensor | None = None,
    *,
    window: int = PI_DEFAULTS.window,
    period: int = PI_DEFAULTS.period,
    variant: str = PI_DEFAULTS.variant,
    prior: float = PI_DEFAULTS.prior,
    logit_clamp: float | None = PI_DEFAULTS.logit_clamp,
    eps: float = PI_DEFAULTS.eps,
    scale: float | None = None,
) -> torch.Tensor:
    """The last t rows of causal `pi_attention` on N rows, from those rows' queries and all N keys.

    Args:
        q: [B, H, t, D] queries of positions N − t … N − 1 (the new tokens).
        k, v: [B, H, N, D] keys and values of positions 0 … N − 1 (N >= t), the new ones last. Only the
            last max(window, period) + t matter; when N is smaller, the text starts at the first row.
        gate: [B, H, t] the α of the new queries, for variants "adaptive" and "separate"; else None.
        window, period, variant, prior, logit_clamp, eps, scale: as in `piattn.pi_attention`.

    Returns:
        [B, H, t, D] in the dtype of q, equal to `pi_attention(q_full, k, v, gate_full, causal=True, …)
        [:, :, -t:]` for any q_full, gate_full whose last t rows are q, gate.
    """
    _check(q, k, v)
    check_pi_settings(window=window, period=period, variant=variant, prior=prior, logit_clamp=logit_clamp,
                      eps=eps)
    if scale is not None and not scale > 0:
        raise ValueError(f"scale must be > 0 or None (None means 1/sqrt(D)), got {scale!r}")
    _check_gate(q, gate, variant)
    return decode_rows(q, k, v, gate, window=window, period=period, variant=variant, prior=prior,
                       logit_clamp=logit_clamp, eps=eps, scale=q.shape[3]**-0.5 if scale is None else scale)


def decode_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None, *, window: int,
                period: int, variant: str, prior: float, logit_clamp: float | None, eps: float,
                scale: float, sinks: int = 0) -> torch.Tensor:
    """`pi_decode` without its argument checks, for callers whose inputs are right by construction (the
    decoding layers: a step is a few dozen small ops, and the checks would be a third of them)."""
    if sinks:
        raise NotImplementedError("cached decoding with sinks > 0 is not implemented yet")
    B, H, t, D = q.shape
    out_dtype = q.dtype
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v = q.to(acc), k.to(acc), v.to(acc)
    idx, valid, kind, n_local = _slots(window, period, t, k.shape[2], q.device)
    S = kind.shape[0]
    kg = k.index_select(2, idx).view(B, H, t, S, D)
    vg = v.index_select(2, idx).view(B, H, t, S, D)
    z = (kg @ q.unsqueeze(-1)).squeeze(-1) * scale  # [B, H, t, S]: Eq. (z)
    if logit_clamp is not None:
        z = z.clamp(-logit_clamp, logit_clamp)
    if variant == "adaptive":  # log max(α, ε) on local slots, log max(1 − α, ε) on the skip slot
        a = gate.to(acc)
        z = z + torch.stack((a, 1 - a), -1).clamp_min(eps).log().index_select(-1, kind)
    elif variant == "fixed":
        log_local, log_skip = log_priors(variant, None, prior, eps)
        z = z + torch.tensor((log_local, log_skip), dtype=acc, device=z.device).index_select(0, kind)
    if valid is not None:
        z = z.masked_fill(~valid, float("-inf"))
    if variant == "separate" and n_local < S:  # Variant 1: α·softmax(local) and (1 − α)·softmax(skip)
        a = gate.to(acc).unsqueeze(-1)
        local, skip = z[..., :n_local], z[..., n_local:]
        has_skip = torch.isfinite(skip).any(-1, keepdim=True)
        skip_w = torch.softmax(torch.where(has_skip, skip, torch.zeros_like(skip)), -1) * has_skip
        a = torch.where(has_skip, a, torch.ones_like(a))
        w = torch.cat([a * torch.softmax(local, -1), (1 - a) * skip_w], -1)
    else:  # one softmax ("separate" with no skip slot, period <= window, is the local softmax alone)
        w = torch.softmax(z, -1)
    return (w.unsqueeze(-2) @ vg).squeeze(-2).to(out_dtype)
