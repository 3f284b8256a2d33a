"""`GPT`: the causal language model of the paper's experiments (RoPE, Pre-LN, GELU, tied embeddings)."""

from __future__ import annotations

import torch
from torch import nn

from .block import Block, init_weights
from .config import GPTConfig


class GPT(nn.Module):
    """Token embedding → n_layer Pre-LN blocks with causal attention of kind `cfg.attention` → LN → logits.

    Positions enter only through RoPE inside attention, so there is no position table and `block_size`
    bounds nothing but the data. The output projection is the embedding matrix (tied).
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, causal=True) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        init_weights(self, cfg.init_std)
        self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx int64 [B, T] -> logits [B, T, vocab_size]."""
        if idx.dim() != 2:
            raise ValueError(f"idx must be [B, T] token ids, got shape {tuple(idx.shape)}")
        x = self.drop(self.embed(idx))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def num_params(self) -> int:
        """Trainable parameters, the tied embedding counted once."""
        return sum(p.numel() for p in self.parameters())
