"""`PiAttention`: the π-Attention layer of the seed's appendix (projections, gate MLP, operator)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..ops.pi import pi_attention
from ..ops.pi.pattern import GATED_VARIANTS, VARIANTS
from .base import AttentionLayer

if TYPE_CHECKING:
    from ..models.config import ModelConfig


class PiAttention(AttentionLayer):
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
        super().__init__(d_model, n_heads, causal=causal, dropout=dropout, rotary=rotary, rope_base=rope_base)
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        self.op_kwargs = dict(window=window, period=period, causal=causal, variant=variant, prior=prior,
                              logit_clamp=logit_clamp, eps=eps, backend=backend)
        self.eps = eps
        self.gate = None
        if variant in GATED_VARIANTS:
            hidden = gate_hidden or d_model // 2
            self.gate = nn.Sequential(nn.Linear(d_model, hidden), nn.GELU(), nn.Linear(hidden, n_heads),
                                      nn.Sigmoid())

    @classmethod
    def config_kwargs(cls, cfg: ModelConfig, layer: int) -> dict:
        return dict(window=cfg.window, period=cfg.period, variant=cfg.variant, prior=cfg.prior,
                    logit_clamp=cfg.logit_clamp, eps=cfg.gate_eps, backend=cfg.backend)

    def gate_values(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [B, T, d] -> α̃ [B, H, T] in [ε, 1 − ε] (Eq. app_gate), or None for ungated variants."""
        if self.gate is None:
            return None
        a = self.gate(x).transpose(1, 2)
        # At least fp32: in bf16, ε + (1 − 2ε)·σ rounds to exactly 1 once σ > 0.998, outside (0, 1).
        return a.to(torch.promote_types(a.dtype, torch.float32)) * (1 - 2 * self.eps) + self.eps

    def cache_capacity(self) -> int:
        """Decoding position t reads t−window … t and t−period (design.md: not O(window) as the paper says)."""
        if not self.causal:
            raise ValueError("incremental decoding needs causal attention")
        return max(self.op_kwargs["window"], self.op_kwargs["period"]) + 1

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """q, k, v [B, H, T, D], x [B, T, d] (the gate's input) -> [B, H, T, D]."""
        return pi_attention(q, k, v, self.gate_values(x), dropout_p=self.attention_dropout, **self.op_kwargs)
