"""Ground truth: the seed's offset loop (appendix, Fig. code), written plainly and extended to all variants.

One gather of K and V per offset, per-offset logits, a softmax over the stacked offsets and a weighted
sum of the gathered values. Autograd does the backward. Memory is O(T·|U|·D): this backend exists to be
right, not fast.
"""

from __future__ import annotations

import torch

from .pattern import Pattern, log_priors


def pi_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate: torch.Tensor | None,
    *,
    window: int,
    period: int,
    causal: bool,
    variant: str,
    prior: float,
    logit_clamp: float | None,
    eps: float,
    scale: float,
    dropout_keep: torch.Tensor | None,
    dropout_p: float,
) -> torch.Tensor:
    """q, k, v [B, H, T, D], gate [B, H, T] or None, dropout_keep bool [B, H, T, |U|] or None -> [B, H, T, D]."""
    out_dtype = q.dtype
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v = q.to(acc), k.to(acc), v.to(acc)
    B, H, T, D = q.shape
    pat = Pattern(window, period, causal)
    idx = torch.arange(T, device=q.device)
    log_local, log_skip = log_priors(variant, None if gate is None else gate.to(acc), prior, eps)

    logits, values = [], []
    for o in pat.offsets:  # Eq. (U): N_r(i) ∪ N_π(i)
        raw = idx + o
        valid = (raw >= 0) & (raw < T)
        g = raw.clamp(0, T - 1).view(1, 1, T, 1).expand(B, H, T, D)
        # Keys outside [0, T) are zeros, not the clamped edge rows: 0·NaN would carry a NaN in k[0], v[0],
        # k[T-1] or v[T-1] to queries that never read it (through the weight 0, and dq through z's mask).
        inside = valid.view(1, 1, T, 1)
        kg = torch.where(inside, torch.gather(k, 2, g), 0.0)
        vg = torch.where(inside, torch.gather(v, 2, g), 0.0)
        z = (q * kg).sum(-1) * scale  # Eq. (z)
        if logit_clamp is not None:
            z = z.clamp(-logit_clamp, logit_clamp)
        z = z + (log_local if abs(o) <= window else log_skip)  # Eq. (delta_adapt)
        logits.append(z.masked_fill(~valid, float("-inf")))
        values.append(vg)
    logits = torch.stack(logits, -1)  # [B, H, T, |U|]
    if variant == "separate":
        w = _separate_weights(logits, gate.to(acc), pat.n_local, pat.valid(T, q.device))
    else:
        w = torch.softmax(logits, -1)  # Eq. (alphahat_adapt)
    if dropout_keep is not None:
        w = w * dropout_keep / (1 - dropout_p)
    return (w.unsqueeze(-1) * torch.stack(values, -2)).sum(-2).to(out_dtype)  # Eq. (attn_adapt)


def _separate_weights(logits: torch.Tensor, gate: torch.Tensor, n_local: int, valid: torch.Tensor) -> torch.Tensor:
    """Variant 1 (Eq. gamma): α·softmax over N_r and (1 − α)·softmax over N_π, local alone where N_π is empty.

    valid [T, |U|]: whether a slot's key lies in [0, T) (from the pattern, not from finite logits, so
    that a NaN skip logit is not mistaken for an empty N_π)."""
    local, skip = logits[..., :n_local], logits[..., n_local:]
    has_skip = valid[:, n_local:].any(-1, keepdim=True)
    # Rows without a valid skip would softmax over all -inf; give them finite logits, then drop them.
    skip_w = torch.softmax(torch.where(has_skip, skip, torch.zeros_like(skip)), -1) * has_skip
    a = torch.where(has_skip, gate.unsqueeze(-1), torch.ones_like(gate).unsqueeze(-1))
    return torch.cat([a * torch.softmax(local, -1), (1 - a) * skip_w], -1)
