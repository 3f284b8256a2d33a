"""Ground truth: the seed's offset loop (appendix, Fig. code), written plainly and extended to all variants.

The weights over the slots come from `weights.slot_weights` (per-slot logits, a softmax over the stacked
slots); here one gather of V per slot and their weighted sum. Autograd does the backward. Memory is
O(T·|U|·D): this backend exists to be right, not fast.
"""

from __future__ import annotations

import torch

from .pattern import Pattern
from .weights import slot_weights


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
    B, H, T, D = q.shape
    w, key, valid = slot_weights(q, k, gate, Pattern(window, period, causal, sinks), variant=variant, prior=prior,
                                 logit_clamp=logit_clamp, eps=eps, scale=scale, document_ids=document_ids)
    if dropout_keep is not None:
        w = w * dropout_keep / (1 - dropout_p)
    # Grouped-query attention, as in `slot_weights`: the repeat is materialised here only.
    v = v.repeat_interleave(H // v.shape[1], 1).to(w.dtype)
    values = []
    for m in range(w.shape[-1]):
        g = key[:, None, :, m, None].expand(B, H, T, D)
        # An unread value is zeros: 0·NaN would carry a NaN in a row the query never reads to it.
        values.append(torch.where(valid[:, None, :, m, None], torch.gather(v, 2, g), 0.0))
    return (w.unsqueeze(-1) * torch.stack(values, -2)).sum(-2).to(q.dtype)  # Eq. (attn_adapt)
