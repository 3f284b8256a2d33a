"""Rotary position embedding (RoPE), applied to queries and keys before attention."""

from __future__ import annotations

import torch
from torch import nn


class Rotary(nn.Module):
    """Rotates channel pairs (i, i + D/2) of q and k by position·θ_i, θ_i = base^(-2i/D).

    Args:
        head_dim: D, even.
        base: the frequency base (10000 in RoFormer and most LMs).
    """

    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {head_dim}")
        inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """x [B, H, T, D] at positions offset … offset + T - 1 -> rotated, same shape and dtype."""
        T = x.shape[-2]
        pos = torch.arange(offset, offset + T, device=x.device, dtype=torch.float32)
        angles = pos[:, None] * self.inv_freq.to(x.device)[None, :]  # [T, D/2]
        cos, sin = angles.cos(), angles.sin()
        x1, x2 = x.float().chunk(2, -1)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).to(x.dtype)
