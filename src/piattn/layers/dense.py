"""`DenseAttention`: full softmax attention, the quality ceiling and the quadratic-cost baseline."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ..analysis.copy_distance import Reach, full_reach
from ..decoding.cache import GrowingCache
from ..ops.pi.pattern import document_bounds
from .base import AttentionLayer


class DenseAttention(AttentionLayer):
    """Every query attends to every key (causal: every key at or before it), Eq. (attn) of the paper.

    Runs on `scaled_dot_product_attention`, which picks FlashAttention on CUDA where it applies and a
    fused CPU kernel otherwise; memory is O(T) with those kernels, time O(T²). Grouped-query attention
    (n_kv_heads < n_heads) uses SDPA's `enable_gqa`; packed documents (`document_ids`) a block-diagonal
    boolean mask, which costs a [B, 1, T, T] mask and keeps SDPA off its flash path.
    """

    grouped_query = True
    documents = True

    @classmethod
    def lag_reach(cls, model: Mapping[str, Any], max_lag: int) -> Reach:
        """Every lag, in one layer (span max_lag)."""
        return full_reach(max_lag)

    @classmethod
    def keys_per_query(cls, model: Mapping[str, Any], n: int, causal: bool = True) -> float:
        """n, or (n + 1) / 2 causal (query i sees i + 1 keys)."""
        return (n + 1) / 2 if causal else float(n)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor,
               document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, H, T, D], k, v [B, H_kv, T, D], document_ids [B, T] or None -> [B, H, T, D]."""
        gqa = k.shape[1] != q.shape[1]
        if document_ids is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, dropout_p=self.attention_dropout,
                                                  enable_gqa=gqa)
        # Same document = same start: an id may come back later as another document (runs, not values).
        start, _ = document_bounds(document_ids)
        mask = start[:, :, None] == start[:, None, :]  # [B, T, T]
        if self.causal:
            T = q.shape[2]
            mask &= torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], dropout_p=self.attention_dropout,
                                              enable_gqa=gqa)

    def cache_capacity(self) -> int | None:
        if not self.causal:
            raise ValueError("incremental decoding needs causal attention")
        return None

    def attend_cached(self, x: torch.Tensor, cache: GrowingCache) -> torch.Tensor:
        """x [B, t, d] after the n cached tokens -> [B, H, t, D]: new query j sees keys 0 … n + j."""
        q, k, v = self.heads(x, offset=cache.seen)
        cache.append(k, v)
        t, n = q.shape[2], cache.seen - q.shape[2]
        # SDPA's is_causal aligns the mask to the top-left corner; new queries sit at the bottom-right
        mask = None if t == 1 else torch.ones(t, n + t, dtype=torch.bool, device=q.device).tril(n)
        return F.scaled_dot_product_attention(q, cache.k, cache.v, attn_mask=mask,
                                              enable_gqa=cache.k.shape[1] != q.shape[1])
