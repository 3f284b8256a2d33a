"""`PiAttention`: the π-Attention layer of the paper's appendix (projections, gate MLP, operator)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ..analysis.copy_distance import Reach, reach
from ..analysis.multiscale import periods_per_layer
from ..config import PI_DEFAULTS, ModelConfig, PiSettings
from .gate import gate_hidden, gate_hooked, gate_mlp, gate_values
from .windowed import WindowedAttention, global_hooks

# The largest folded weight `folded_projection` makes (elements): the fold saves one op of a few microseconds,
# which matters where the products are small (the tiny config: 448 × 128), and costs a copy of the q, k, v and
# gate weights, which would be memory for nothing where the products dominate (width 768: 2,688 × 768).
FOLD_MAX_ELEMENTS = 1 << 20


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
        # The q, k, v projection and the gate's first linear as one (`folded_projection`), with what it was made
        # from; rebuilt when any of those changes.
        self._fold: tuple | None = None
        self._own_ring_gate = type(self).ring_gate is PiAttention.ring_gate
        self._gated_adaptive = settings.variant == "adaptive"

    @classmethod
    def config_kwargs(cls, cfg: ModelConfig, layer: int) -> dict:
        return dict(**cfg.pi_kwargs(layer), backend=cfg.backend)

    @classmethod
    def lag_reach(cls, model: Mapping[str, Any], max_lag: int) -> Reach:
        """The window plus the skip periods: layer l hops 0 … window or any of its heads' periods (an int, n_head
        per-head ints, or n_layer lists of them: `periods_per_layer`)."""
        schedule = periods_per_layer(model.get("period"), model["n_layer"], model["n_head"])
        return reach(model.get("window"), schedule, max_lag)

    def gate_values(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [B, T, d] -> α̃ [B, H, T] in [ε, 1 − ε] (Eq. app_gate), or None for ungated variants."""
        return None if self.gate is None else gate_values(self.gate, x, self.settings.eps)

    def ring_gate(self, x: torch.Tensor) -> tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
        """The gate arguments of `decode_ring` (one new token) and `_decode_rows` (a few) for x [B, t, d].

        For "adaptive", the gate MLP's hidden pre-activation [B, t, d_hidden] and its last layer (weight,
        bias): the step finishes the gate itself (GELU, linear, σ, clip: in the compiled step, one call for
        all of it); a gate someone observes or hooks is computed whole here instead."""
        if self.settings.variant == "adaptive" and self._gate_observer is None and not gate_hooked(self.gate):
            return gate_hidden(self.gate, x)
        return super().ring_gate(x)

    def folded_projection(self) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """(weight, bias, n): the q, k, v projection and the gate MLP's first linear in one linear layer,
        [n + n_hidden, d] and [n + n_hidden], its first n outputs the projection's, the rest the gate's hidden
        pre-activation; None where it does not apply (not "adaptive", a gate observed or hooked, layers that are
        not plain `nn.Linear` with biases, or of other dtypes or devices, or a fold larger than
        `FOLD_MAX_ELEMENTS`).

        A decoding step then makes one matrix product instead of two (one op less, a few microseconds a layer).
        Kept while the four tensors it was made from are the same, unchanged (their version counters: an
        optimizer step or `load_state_dict` bumps them) and in the same memory (`.to()`, `.data =`); made
        afresh otherwise. For inference: the folded tensors carry no autograd graph (`_ring_forward` takes it
        only without autograd). Equal to the two linears up to the rounding of the matrix product."""
        gate = self._modules["gate"] if self._gated_adaptive else None
        if gate is None or self._gate_observer is not None or global_hooks():
            return None
        qkv = self._modules["qkv"]
        first, act, last, sigmoid = gate._modules.values()
        # Written out, not `gate_hooked` and generators: this runs on every step of every layer.
        if (type(qkv) is not nn.Linear or type(first) is not nn.Linear or qkv._forward_hooks
                or qkv._forward_pre_hooks or gate._forward_hooks or gate._forward_pre_hooks or first._forward_hooks
                or first._forward_pre_hooks or act._forward_hooks or act._forward_pre_hooks or last._forward_hooks
                or last._forward_pre_hooks or sigmoid._forward_hooks or sigmoid._forward_pre_hooks):
            return None
        qp, fp = qkv._parameters, first._parameters
        w, b, gw, gb = qp["weight"], qp["bias"], fp["weight"], fp["bias"]
        if b is None or gb is None:
            return None
        stamp = (w._version, b._version, gw._version, gb._version, w.data_ptr(), b.data_ptr(), gw.data_ptr(),
                 gb.data_ptr())
        fold = self._fold
        if fold is not None:
            made_from, made_stamp, folded = fold
            if (made_from[0] is w and made_from[1] is b and made_from[2] is gw and made_from[3] is gb
                    and made_stamp == stamp):
                return folded
        if len({(t.dtype, t.device) for t in (w, b, gw, gb)}) != 1 or w.numel() + gw.numel() > FOLD_MAX_ELEMENTS:
            return None
        with torch.no_grad():
            folded = (torch.cat([w, gw]), torch.cat([b, gb]), w.shape[0])
        self._fold = ((w, b, gw, gb), stamp, folded)
        return folded

    def _ring_projection(self, x: torch.Tensor, modules) -> tuple[torch.Tensor, int, torch.Tensor | None,
                                                                  tuple[torch.Tensor, torch.Tensor] | None]:
        """`WindowedAttention._ring_projection` in one matrix product where the gate folds into the projection
        (`folded_projection`): the q, k, v columns, then the gate's hidden pre-activation, whose last layers the
        decoding step finishes (as `ring_gate` gives them)."""
        folded = self.folded_projection() if self._own_ring_gate else None
        if folded is None:
            return super()._ring_projection(x, modules)
        weight, bias, n = folded
        last = modules["gate"]._modules["2"]._parameters
        return F.linear(x, weight, bias), n, None, (last["weight"], last["bias"])
