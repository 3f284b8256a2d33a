"""Ground truth: the seed's offset loop (appendix, Fig. code), written plainly and extended to all variants.

The weights over the slots come from `weights.slot_weights` (per-slot logits, a softmax over the stacked
slots); here one gather of V per slot and their weighted sum. Autograd does the backward. Memory is
O(T·|U|·D): this backend exists to be right, not fast.
"""

from __future__ import annotations

import torch

from .backends import by_keywords
from .settings import OpSettings
from .weights import slot_weights


def run_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None, settings: OpSettings,
                  dropout_keep: torch.Tensor | None = None, document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The contract, `backends.BackendRun` (one period): q [B, H, T, D], k, v [B, H_kv, T, D], gate [B, H, T]
    or None, dropout_keep bool [B, H, T, |U|] or None, document_ids [B, T] or None -> [B, H, T, D]."""
    B, H, T, D = q.shape
    s = settings
    w, key, valid = slot_weights(q, k, gate, s.pattern, variant=s.variant, prior=s.prior, logit_clamp=s.logit_clamp,
                                 eps=s.eps, scale=s.scale, document_ids=document_ids)
    if dropout_keep is not None:
        w = w * dropout_keep / (1 - s.dropout_p)
    # Grouped-query attention, as in `slot_weights`: the repeat is materialised here only.
    v = v.repeat_interleave(H // v.shape[1], 1).to(w.dtype)
    values = []
    for m in range(w.shape[-1]):
        g = key[:, None, :, m, None].expand(B, H, T, D)
        # An unread value is zeros: 0·NaN would carry a NaN in a row the query never reads to it.
        values.append(torch.where(valid[:, None, :, m, None], torch.gather(v, 2, g), 0.0))
    return (w.unsqueeze(-1) * torch.stack(values, -2)).sum(-2).to(q.dtype)  # Eq. (attn_adapt)


pi_attention_reference = by_keywords(run_reference)
