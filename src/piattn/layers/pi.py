"""`PiAttention`: the π-Attention layer of the paper's appendix (projections, gate MLP, operator)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..analysis.copy_distance import Reach, reach
from ..analysis.cost import mean_keys
from ..analysis.multiscale import periods_per_layer
from ..analysis.reachability import step_mask
from ..config import PI_DEFAULTS, ModelConfig, PiSettings
from .gate import clip_stays_open, gate_hidden, gate_hooked, gate_mlp, gate_values, global_hooks
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
        settings: the operator settings (window … sinks) whole, a `piattn.config.PiSettings`, in place of
            those keywords, which are then left at their defaults: what a model config hands each π layer
            (`config_kwargs`, `ModelConfig.pi_settings`), built and checked once there. The layer keeps the
            object and hands it to the operator whole.
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
                 rope_base: float = 10000.0, gate_hidden: int | None = None, backend: str = "auto",
                 settings: PiSettings | None = None):
        if settings is None:
            settings = PiSettings(window=window, period=period, variant=variant, prior=prior, logit_clamp=logit_clamp,
                                  eps=eps, sinks=sinks)
        elif not isinstance(settings, PiSettings):
            raise ValueError(f"settings must be a piattn.config.PiSettings or None, got {type(settings).__name__}")
        else:
            given = [name for name, value in (("window", window), ("period", period), ("variant", variant),
                                              ("prior", prior), ("logit_clamp", logit_clamp), ("eps", eps),
                                              ("sinks", sinks))
                     if not _is_default(value, getattr(PI_DEFAULTS, name))]
            if given:
                raise ValueError(f"PiAttention takes its operator settings whole (settings=) or by keyword, not "
                                 f"both: got settings and {', '.join(given)}")
        super().__init__(d_model, n_heads, settings, n_kv_heads=n_kv_heads, causal=causal, dropout=dropout,
                         rotary=rotary, rope_base=rope_base, backend=backend)
        # Created after the base's projections: a seed draws the weights in the appendix module's order.
        self.gate = gate_mlp(d_model, n_heads, gate_hidden) if settings.gated else None
        self._own_ring_gate = type(self).ring_gate is PiAttention.ring_gate
        self._gated_adaptive = settings.variant == "adaptive"

    @classmethod
    def config_kwargs(cls, cfg: ModelConfig, layer: int) -> dict:
        """The layer's `PiSettings` as the config built it (handed over whole) and the backend."""
        return dict(settings=cfg.pi_settings(layer), backend=cfg.backend)

    @classmethod
    def lag_reach(cls, model: Mapping[str, Any], max_lag: int) -> Reach:
        """The window plus the skip periods: layer l hops 0 … window or any of its heads' periods (an int, n_head
        per-head ints, or n_layer lists of them: `periods_per_layer`)."""
        schedule = periods_per_layer(model.get("period"), model["n_layer"], model["n_head"])
        return reach(model.get("window"), schedule, max_lag)

    @classmethod
    def keys_per_query(cls, model: Mapping[str, Any], n: int, causal: bool = True) -> float:
        """Window, skip and sinks, counted on the pattern's mask (window + 2 inside, causal), averaged over the
        heads and layers when their periods differ."""
        periods = [p for heads in periods_per_layer(model.get("period"), model["n_layer"], model["n_head"])
                   for p in heads]
        count = {p: mean_keys(step_mask(n, model.get("window"), p, causal, model.get("sinks") or 0))
                 for p in set(periods)}
        return sum(count[p] for p in periods) / len(periods)

    def gate_in_range(self) -> bool:
        """True for the layer's own gate: ε + (1 − 2ε)·σ(MLP(x)) in fp32 (`gate_values`) lies in [ε, 1 − ε],
        inside (0, 1) for every ε the settings take (`clip_stays_open`). Not when hooks on the gate MLP (or on
        every module) may change its output, nor when a subclass computes the gate or its observed value
        differently: `pi_attention` then checks the values (a host sync on a GPU)."""
        return (self.gate is not None and type(self).gate_values is PiAttention.gate_values
                and type(self).observed_gate is WindowedAttention.observed_gate
                and clip_stays_open(self.settings.eps) and not gate_hooked(self.gate))

    def gate_values(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [B, T, d] -> α̃ [B, H, T] in [ε, 1 − ε] (Eq. app_gate), or None for ungated variants."""
        return None if self.gate is None else gate_values(self.gate, x, self.settings.eps)

    def ring_gate(self, x: torch.Tensor) -> tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
        """The gate arguments of `decode_ring` (one new token) and `DecodePlan.rows` (a few) for x [B, t, d].

        For "adaptive", the gate MLP's hidden pre-activation [B, t, d_hidden] and its last layer (weight,
        bias): the step finishes the gate itself (GELU, linear, σ, clip: in the compiled step, one call for
        all of it); a gate someone observes or hooks is computed whole here instead."""
        if self.settings.variant == "adaptive" and self._gate_observer is None and not gate_hooked(self.gate):
            return gate_hidden(self.gate, x)
        return super().ring_gate(x)

    def whole_gate_layers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The gate MLP's first and last layers (weight [n_hidden, d], bias [n_hidden], weight [H, n_hidden], bias
        [H]) for the compiled one-token step to run the whole gate from the layer input (`native.PRIOR_INPUT`):
        no linear of its own in torch. None where that does not apply: not "adaptive", a gate observed or hooked
        (its modules are then called), or layers that are not plain `nn.Linear` with biases. The parameters
        themselves, read on every step: nothing is cached, so every change of the weights (an optimizer step,
        `load_state_dict`, `.to()`, an update through `.data`) is seen by the next step."""
        gate = self._modules["gate"] if self._gated_adaptive else None
        if gate is None or self._gate_observer is not None or global_hooks():
            return None
        first, act, last, sigmoid = gate._modules.values()
        # Written out, not `gate_hooked` and generators: this runs on every step of every layer.
        if (type(first) is not nn.Linear or type(last) is not nn.Linear or gate._forward_hooks
                or gate._forward_pre_hooks or first._forward_hooks or first._forward_pre_hooks or act._forward_hooks
                or act._forward_pre_hooks or last._forward_hooks or last._forward_pre_hooks
                or sigmoid._forward_hooks or sigmoid._forward_pre_hooks):
            return None
        fp, lp = first._parameters, last._parameters
        b_in, b = fp["bias"], lp["bias"]
        if b_in is None or b is None:
            return None
        return fp["weight"], b_in, lp["weight"], b

    def _ring_projection(self, x: torch.Tensor, modules) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                  tuple[torch.Tensor, ...] | None]:
        """`WindowedAttention._ring_projection`, handing the compiled step the whole gate MLP where it can run
        it (`whole_gate_layers`): gate = x, gate_layers its first and last layers."""
        layers = self.whole_gate_layers() if self._own_ring_gate else None
        if layers is None:
            return super()._ring_projection(x, modules)
        return self._ring_qkv(x, modules), x, layers


def _is_default(value, default) -> bool:
    """Whether a settings keyword was left at its default (an equal value of the same type: 16, not [16] or 16.0)."""
    return type(value) is type(default) and value == default
