"""`PiAttention`: the π-Attention layer of the paper's appendix (projections, gate MLP, operator)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn import functional as F

from ..config import PI_DEFAULTS, ModelConfig, PiSettings
from .gate import gate_hooked, gate_mlp, gate_values
from .windowed import WindowedAttention


class PiAttention(WindowedAttention):
    """Multi-head π-Attention on [B, T, d_model] inputs.

    Parameter names match the paper's appendix module (`qkv`, `out`, `gate.0`, `gate.2`), so its state
    dict loads strictly and, with rotary=False, gives the same output.

    Args:
        d_model: model width d; must be divisible by n_heads.
        n_heads: H; head width d / H.
        n_kv_heads: H_kv key/value heads dividing H (grouped-query attention; None: H). The operator reads
            k, v with H_kv heads directly, nothing is repeated.
        window, period, causal, variant, prior, logit_clamp, eps, sinks, backend: as in `piattn.pi_attention`;
            period may be one int or a sequence of n_heads ints, one per query head (multi-scale π).
        dropout: attention-weight dropout, active in training mode only.
        rotary: apply rotary position embeddings to q and k (off by default, as in the appendix).
        rope_base: rotary frequency base.
        gate_hidden: width of the gate MLP (default d/2, as in the paper).

    The gate α = ε + (1 − 2ε)·σ(MLP(x)) is computed from the layer input x (one value per head and
    token) for the variants that use it ("adaptive", "separate"); "union" and "fixed" have no gate MLP.
    Inside `piattn.layers.sharding.sequence_parallel(group)` it runs on a shard of the sequence: the gate
    is per token, and the operator exchanges the halo rows the shard's queries read with the other ranks.
    `observe_gate` lets a caller (the trainer's gate statistics, `piattn inspect`) read the α̃ each forward
    computes, at no cost while no observer is set. Cached decoding steps of a few tokens run `pi_decode`
    (`attend_recent`), which reads only the keys the new queries attend to; with sinks the cache keeps
    the first `sinks` positions besides its ring, so it stays constant in size. The operator's settings
    are `settings` (`PiSettings`, see `WindowedAttention`).
    """

    def __init__(self, d_model: int, n_heads: int, *, n_kv_heads: int | None = None, window: int = PI_DEFAULTS.window,
                 period: int | Sequence[int] = PI_DEFAULTS.period, causal: bool = True,
                 variant: str = PI_DEFAULTS.variant, prior: float = PI_DEFAULTS.prior,
                 logit_clamp: float | None = PI_DEFAULTS.logit_clamp,
                 eps: float = PI_DEFAULTS.eps, sinks: int = PI_DEFAULTS.sinks, dropout: float = 0.0,
                 rotary: bool = False,
                 rope_base: float = 10000.0, gate_hidden: int | None = None, backend: str = "auto"):
        settings = PiSettings(window=window, period=period, variant=variant, prior=prior, logit_clamp=logit_clamp,
                              eps=eps, sinks=sinks)
        super().__init__(d_model, n_heads, settings, n_kv_heads=n_kv_heads, causal=causal, dropout=dropout,
                         rotary=rotary, rope_base=rope_base, backend=backend)
        # Created after the base's projections: a seed draws the weights in the appendix module's order.
        self.gate = gate_mlp(d_model, n_heads, gate_hidden) if settings.gated else None

    @classmethod
    def config_kwargs(cls, cfg: ModelConfig, layer: int) -> dict:
        return dict(**cfg.pi_settings(layer).as_kwargs(), backend=cfg.backend)

    def gate_values(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [B, T, d] -> α̃ [B, H, T] in [ε, 1 − ε] (Eq. app_gate), or None for ungated variants."""
        return None if self.gate is None else gate_values(self.gate, x, self.settings.eps)

    def ring_gate(self, x: torch.Tensor) -> tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
        """The gate arguments of `decode_ring` (one new token) and `_decode_rows` (a few) for x [B, t, d].

        For "adaptive", the gate MLP's hidden pre-activation [B, t, d_hidden] and its last layer (weight,
        bias): the step finishes the gate itself (GELU, linear, σ, clip: in the compiled step, one call for
        all of it); a gate someone observes or hooks is computed whole here instead."""
        if self.settings.variant == "adaptive" and self._gate_observer is None and not gate_hooked(self.gate):
            first, _, last, _ = self.gate._modules.values()
            return F.linear(x, first.weight, first.bias), (last.weight, last.bias)
        return super().ring_gate(x)
