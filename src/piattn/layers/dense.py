"""`DenseAttention`: full softmax attention, the quality ceiling and the quadratic-cost baseline."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import AttentionLayer


class DenseAttention(AttentionLayer):
    """Every query attends to every key (causal: every key at or before it), Eq. (attn) of the paper.

    Runs on `scaled_dot_product_attention`, which picks FlashAttention on CUDA where it applies and a
    fused CPU kernel otherwise; memory is O(T) with those kernels, time O(T²).
    """

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """q, k, v [B, H, T, D] -> [B, H, T, D]."""
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, dropout_p=self.attention_dropout)
