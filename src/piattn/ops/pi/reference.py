"""Ground truth: the seed's offset loop (appendix, Fig. code), written plainly and extended to all variants.

One gather of K and V per offset, per-offset logits, a softmax over the stacked offsets and a weighted
sum of the gathered values. Autograd does the backward. Memory is O(T·|U|·D): this backend exists to be
right, not fast.
"""

from __future__ import annotations

import torch

from .pattern import Pattern, log_priors, slot_keys


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
    sinks: int = 0,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, H, T, D], k, v [B, H_kv, T, D] (H_kv divides H), gate [B, H, T] or None, dropout_keep bool
    [B, H, T, |U|] or None, document_ids [B, T] or None -> [B, H, T, D]."""
    out_dtype = q.dtype
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, H, T, D = q.shape
    # Grouped-query attention: query head h reads key/value head h // (H // H_kv). Materialised here only.
    group = H // k.shape[1]
    q, k, v = q.to(acc), k.repeat_interleave(group, 1).to(acc), v.repeat_interleave(group, 1).to(acc)
    pat = Pattern(window, period, causal, sinks)
    key, valid = slot_keys(pat, T, document_ids, q.device)  # [B or 1, T, |U|]
    key, valid = key.expand(B, T, -1), valid.expand(B, T, -1)
    log_local, log_skip = log_priors(variant, None if gate is None else gate.to(acc), prior, eps)

    logits, values = [], []
    for m, is_local in enumerate(pat.slot_is_local()):  # Eq. (U): N_r(i) ∪ N_π(i), then the sinks
        inside = valid[:, None, :, m, None]  # [B, 1, T, 1]
        g = key[:, None, :, m, None].expand(B, H, T, D)
        # Unread keys are zeros, not some other row: 0·NaN would carry a NaN in a row the query never reads
        # to it (through the weight 0, and to dq through z's mask).
        kg = torch.where(inside, torch.gather(k, 2, g), 0.0)
        vg = torch.where(inside, torch.gather(v, 2, g), 0.0)
        z = (q * kg).sum(-1) * scale  # Eq. (z)
        if logit_clamp is not None:
            z = z.clamp(-logit_clamp, logit_clamp)
        z = z + (log_local if is_local else log_skip)  # Eq. (delta_adapt)
        logits.append(z.masked_fill(~inside[..., 0], float("-inf")))
        values.append(vg)
    logits = torch.stack(logits, -1)  # [B, H, T, |U|]
    if variant == "separate":
        w = _separate_weights(logits, gate.to(acc), pat, valid[:, None])
    else:
        w = torch.softmax(logits, -1)  # Eq. (alphahat_adapt)
    if dropout_keep is not None:
        w = w * dropout_keep / (1 - dropout_p)
    return (w.unsqueeze(-1) * torch.stack(values, -2)).sum(-2).to(out_dtype)  # Eq. (attn_adapt)


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
