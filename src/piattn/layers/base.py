"""`AttentionLayer`: what every attention kind shares (projections, heads, RoPE); kinds differ in `attend`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from .rotary import Rotary

if TYPE_CHECKING:
    from ..models.config import ModelConfig


class AttentionLayer(nn.Module):
    """Multi-head self-attention on [B, T, d_model]: x → qkv → (RoPE) → `attend` → out.

    Args:
        d_model: model width d, divisible by n_heads.
        n_heads: H; head width D = d / H.
        causal: queries see only keys at positions <= their own.
        dropout: attention-weight dropout, active in training mode only.
        rotary: rotate q and k by position (RoPE) before `attend`.
        rope_base: RoPE frequency base.

    A subclass implements `attend(q, k, v, x) -> [B, H, T, D]` from q, k, v [B, H, T, D] (x [B, T, d] is
    passed for kinds that compute something from the layer input, like π-Attention's gate) and may
    override `from_config` to read its own fields of the model config.
    """

    def __init__(self, d_model: int, n_heads: int, *, causal: bool = True, dropout: float = 0.0,
                 rotary: bool = False, rope_base: float = 10000.0):
        super().__init__()
        if isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads < 1 or d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be a positive multiple of n_heads ({n_heads})")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        self.n_heads, self.head_dim, self.causal, self.dropout = n_heads, d_model // n_heads, causal, dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.rotary = Rotary(self.head_dim, rope_base) if rotary else None

    @classmethod
    def config_kwargs(cls, cfg: ModelConfig) -> dict:
        """Constructor keywords this kind reads from a model config (beyond the shared ones)."""
        return {}

    @classmethod
    def from_config(cls, cfg: ModelConfig, *, causal: bool) -> AttentionLayer:
        """The layer a model of config `cfg` uses: RoPE on, dropout and sizes from the config."""
        return cls(cfg.d_model, cfg.n_head, causal=causal, dropout=cfg.dropout, rotary=True,
                   rope_base=cfg.rope_base, **cls.config_kwargs(cfg))

    @property
    def attention_dropout(self) -> float:
        """The dropout probability to apply now (0 outside training)."""
        return self.dropout if self.training else 0.0

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, d] -> q, k, v [B, H, T, D], q and k rotated when RoPE is on."""
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, self.n_heads, self.head_dim).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        if self.rotary is not None:
            q, k = self.rotary(q), self.rotary(k)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, d_model] -> [B, T, d_model]."""
        B, T, d = x.shape
        y = self.attend(*self.heads(x), x)
        return self.out(y.transpose(1, 2).reshape(B, T, d))
