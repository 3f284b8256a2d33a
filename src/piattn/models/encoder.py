"""`Encoder`: the bidirectional classifier of the long-range tasks (LRA ListOps, Pathfinder, Retrieval)."""

from __future__ import annotations

import torch
from torch import nn

from ..config import EncoderConfig
from .block import Block, init_weights


class Encoder(nn.Module):
    """Token embedding → n_layer Pre-LN blocks with bidirectional attention → LN → pooled → class logits.

    Pooling is the mean over non-padding tokens (`pad_id`, 0 by default) or the first token ("cls").
    Padding tokens still take part in attention (the sparse kernels have no key mask); they are excluded
    from the pooled summary. With `dual`, two sequences are encoded by the same weights and classified from
    [u, v, u·v, |u − v|], the LRA Retrieval matching head.
    """

    def __init__(self, cfg: EncoderConfig, pad_id: int = 0):
        super().__init__()
        self.config, self.pad_id = cfg, pad_id
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, causal=False, layer=i) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        width = 4 * cfg.d_model if cfg.dual else cfg.d_model
        self.head = nn.Sequential(nn.Linear(width, cfg.d_model), nn.GELU(), nn.Linear(cfg.d_model, cfg.num_classes))
        init_weights(self, cfg.init_std)

    def encode(self, idx: torch.Tensor) -> torch.Tensor:
        """idx int64 [B, T] -> pooled [B, d_model]."""
        x = self.drop(self.embed(idx))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        if self.config.pool == "cls":
            return x[:, 0]
        keep = (idx != self.pad_id).unsqueeze(-1).to(x.dtype)
        return (x * keep).sum(1) / keep.sum(1).clamp_min(1.0)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx int64 [B, T] (or [B, 2, T] when dual) -> logits [B, num_classes]."""
        if self.config.dual:
            if idx.dim() != 3 or idx.shape[1] != 2:
                raise ValueError(f"a dual encoder takes idx [B, 2, T], got shape {tuple(idx.shape)}")
            u, v = self.encode(idx[:, 0]), self.encode(idx[:, 1])
            return self.head(torch.cat([u, v, u * v, (u - v).abs()], -1))
        if idx.dim() != 2:
            raise ValueError(f"idx must be [B, T] token ids, got shape {tuple(idx.shape)}")
        return self.head(self.encode(idx))
