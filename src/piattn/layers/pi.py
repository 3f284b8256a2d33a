"""`PiAttention`: the π-Attention layer of the seed's appendix (projections, gate MLP, operator)."""

from __future__ import annotations

import torch
from torch import nn

from ..ops.pi import pi_attention
from ..ops.pi.pattern import GATED_VARIANTS, VARIANTS
from .rotary import Rotary


class PiAttention(nn.Module):
    """Multi-head π-Attention on [B, T, d_model] inputs.

    Parameter names match the seed's appendix module (`qkv`, `out`, `gate.0`, `gate.2`), so its state
    dict loads strictly and, with rotary=False, gives the same output.

    Args:
        d_model: model width d; must be divisible by n_heads.
        n_heads: H; head width d / H.
        window, period, causal, variant, prior, logit_clamp, eps, backend: as in `piattn.pi_attention`.
        dropout: attention-weight dropout, active in training mode only.
        rotary: apply rotary position embeddings to q and k (off by default, as in the appendix).
        rope_base: rotary frequency base.
        gate_hidden: width of the gate MLP (default d/2, as in the paper).

    The gate α = ε + (1 − 2ε)·σ(MLP(x)) is computed from the layer input x (one value per head and
    token) for the variants that use it ("adaptive", "separate"); "union" and "fixed" have no gate MLP.
    """

    def __init__(self, d_model: int, n_heads: int, *, window: int = 4, period: int = 16, causal: bool = True,
                 variant: str = "adaptive", prior: float = 0.5, logit_clamp: float | None = 20.0,
                 eps: float = 1e-4, dropout: float = 0.0, rotary: bool = False, rope_base: float = 10000.0,
                 gate_hidden: int | None = None, backend: str = "auto"):
        super().__init__()
        if n_heads < 1 or d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be a positive multiple of n_heads ({n_heads})")
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        self.n_heads, self.head_dim = n_heads, d_model // n_heads
        self.op_kwargs = dict(window=window, period=period, causal=causal, variant=variant, prior=prior,
                              logit_clamp=logit_clamp, eps=eps, backend=backend)
        self.eps, self.dropout = eps, dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.gate = None
        if variant in GATED_VARIANTS:
            hidden = gate_hidden or d_model // 2
            self.gate = nn.Sequential(nn.Linear(d_model, hidden), nn.GELU(), nn.Linear(hidden, n_heads),
                                      nn.Sigmoid())
        self.rotary = Rotary(self.head_dim, rope_base) if rotary else None

    def gate_values(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [B, T, d] -> α̃ [B, H, T] in [ε, 1 − ε] (Eq. app_gate), or None for ungated variants."""
        if self.gate is None:
            return None
        a = self.gate(x).transpose(1, 2)
        # At least fp32: in bf16, ε + (1 − 2ε)·σ rounds to exactly 1 once σ > 0.998, outside (0, 1).
        return a.to(torch.promote_types(a.dtype, torch.float32)) * (1 - 2 * self.eps) + self.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, d_model] -> [B, T, d_model]."""
        B, T, d = x.shape
        q, k, v = (t.view(B, T, self.n_heads, self.head_dim).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        if self.rotary is not None:
            q, k = self.rotary(q), self.rotary(k)
        y = pi_attention(q, k, v, self.gate_values(x), dropout_p=self.dropout if self.training else 0.0,
                         **self.op_kwargs)
        return self.out(y.transpose(1, 2).reshape(B, T, d))
