"""`WindowedAttention`: the attention kinds that run on the π operator (`pi`, `local`), with their settings."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from ..config import PiSettings
from ..decoding.cache import RingCache
from ..ops.pi.decode import decode_ring
from ..ops.pi.decode_plan import DecodePlan, decode_plan, decode_settings
from ..ops.pi.validate import head_periods
from .base import AttentionLayer
from .gate import global_hooks
from .sharding import active_shard, pi_operator


def plain_linear(m: nn.Module) -> bool:
    """Whether `m` is an `nn.Linear` with no forward hooks of its own, so that `F.linear` on its weight and bias
    is exactly what calling it does (not a subclass or a wrapper, which may compute something else)."""
    return type(m) is nn.Linear and not (m._forward_hooks or m._forward_pre_hooks)


class WindowedAttention(AttentionLayer):
    """An `AttentionLayer` whose `attend` is the π operator with the typed `settings` (`PiSettings`, handed to
    `pi_attention_with_settings` whole), `causal` and `backend`, and whose decoding reads a ring of
    `settings.reach + 1` positions (plus `settings.sinks` fixed ones).

    `settings.period` may hold one period per query head (multi-scale π, n_heads of them): the forward
    hands them to `pi_attention`, and the cached decoding paths (`attend_recent`, `attend_ring`, the one-token
    step) to the layer's decoding plans (`piattn.ops.pi.decode_plan`: every head over its own slot table), the
    ring holding max(window, largest period) + 1 positions.
    Sequence-parallel, each period group runs its own halo exchange
    (`piattn.parallel.sequence_parallel_pi_attention_with_settings`, given the same settings object).

    `settings` is what the operator runs with: whoever reads the layer's attention (`piattn.inspection`,
    through `piattn.ops.pi.weights.pi_attention_weights`) reads it here. `gate` is the gate MLP of the
    gated variants, set by the subclass that has one (None otherwise); `gate_values(x)` its α̃, and
    `observe_gate` lets a caller read every α̃ a forward computes.
    """

    sequence_parallel = True
    ring_step = True
    grouped_query = True
    documents = True

    def __init__(self, d_model: int, n_heads: int, settings: PiSettings, *, n_kv_heads: int | None, causal: bool,
                 dropout: float, rotary: bool, rope_base: float, backend: str):
        super().__init__(d_model, n_heads, n_kv_heads=n_kv_heads, causal=causal, dropout=dropout, rotary=rotary,
                         rope_base=rope_base)
        head_periods(settings.period, n_heads, count="n_heads")  # ValueError unless one period or one per head
        self.settings = settings
        self.backend = backend
        self.gate: nn.Module | None = None
        # The decoding functions' settings (an `OpSettings`: causal, no dropout, the scale spelled out), once
        # rather than per step.
        self._decode_settings = decode_settings(settings, self.head_dim**-0.5)
        self._gate_observer: Callable[[torch.Tensor], None] | None = None
        # The layer's decoding plans by ring capacity (None: blocks of keys), built on first use (`_plan`).
        self._plans: dict[int | None, DecodePlan] = {}
        # `_ring_forward`'s settings (those of its plans), or None where the layer takes the general path
        # (`AttentionLayer.forward`): a subclass that overrides a method of that path (its override is then what runs).
        kind = type(self)
        lean = (kind.heads is AttentionLayer.heads
                and kind.attend_cached is AttentionLayer.attend_cached
                and kind.attend_ring is WindowedAttention.attend_ring)
        self._ring_settings = self._decode_settings if lean else None
        self._ring_capacity = settings.reach + 1  # `cache_capacity()` of a causal layer
        # Whether `ring_gate` is this package's (a subclass's own is always asked): then a layer without a gate
        # has no gate arguments, and `_ring_projection` does not ask. `PiAttention` sets it for its own.
        self._own_ring_gate = kind.ring_gate is WindowedAttention.ring_gate

    def gate_values(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [B, T, d] -> α̃ [B, H, T], or None for a layer without a gate (this base has none)."""
        return None

    def observe_gate(self, observer: Callable[[torch.Tensor], None] | None) -> bool:
        """From now on call `observer(α̃)` with the gate [B, H, T] (detached) of every forward; None stops.

        Returns whether this layer has a gate; a layer without one observes nothing.
        """
        self._gate_observer = observer if self.gate is not None else None
        return self.gate is not None

    def observed_gate(self, x: torch.Tensor) -> torch.Tensor | None:
        """`gate_values(x)`, shown to the observer if one is set."""
        gate = self.gate_values(x)
        if self._gate_observer is not None:
            self._gate_observer(gate.detach())
        return gate

    def cache_capacity(self) -> int:
        """Decoding position t reads t − window … t and t − period (docs/design.md: not O(window) as the paper
        says), besides the sinks."""
        if not self.causal:
            raise ValueError("incremental decoding needs causal attention")
        return self.settings.reach + 1

    def cache_sinks(self) -> int:
        return self.settings.sinks

    def _plan(self, capacity: int | None, device: torch.device) -> DecodePlan:
        """The layer's decoding plan over a ring of `capacity` (None: blocks of keys) on `device`, built once."""
        plan = self._plans.get(capacity)
        if plan is None or plan.device != device:
            plan = self._plans[capacity] = decode_plan(self._decode_settings, self.n_heads, capacity=capacity,
                                                       device=device)
        return plan

    def forward(self, x: torch.Tensor, cache=None, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`AttentionLayer.forward`; a step of one token on a ring cache, without autograd, takes `_ring_forward`."""
        if (type(cache) is RingCache and document_ids is None and x.dim() == 3 and x.shape[1] == 1
                and self._ring_settings is not None and self.causal and not torch.is_grad_enabled()
                and (not self.training or not self.dropout) and active_shard() is None):
            return self._ring_forward(x, cache)
        return super().forward(x, cache, document_ids)

    def _ring_forward(self, x: torch.Tensor, cache: RingCache) -> torch.Tensor:
        """The one-token step of generation, x [B, 1, d] -> [B, 1, d]: what `AttentionLayer.forward` computes
        through `attend_cached` and `attend_ring`, in fewer calls. The cache is checked as there
        (`RingCache.check`, which remembers what it accepted); then the q, k, v projection and one call of the
        compiled step that runs the gate (its whole MLP where `_ring_projection` hands it over), rotates q and
        the new key, stores the key and value in the ring and attends (`DecodePlan.token`), or where no step
        of the plan does that, RoPE, `RingCache.append_token` and `DecodePlan.rows` over the ring. The plan is
        called unchecked: every argument is the layer's or the accepted cache's. Equal to the general path
        up to the rounding of the gate's first layer in the compiled step (the rest is the same arithmetic)."""
        B = x.shape[0]
        H, H_kv, D = self.n_heads, self.n_kv_heads, self.head_dim
        settings = self._ring_settings
        cache.check(batch_size=B, n_heads=H_kv, head_dim=D, capacity=self._ring_capacity, sinks=settings.sinks)
        modules = self._modules  # submodules read once (each `self.name` of a module is a __getattr__ call)
        qkv, gate, gate_layers = self._ring_projection(x, modules)
        rotary = modules.get("rotary")  # None is kept as a plain attribute, not a module
        position = cache.seen
        plan = self._plan(cache.capacity, x.device)
        fresh_slot = cache.next_token_slot()
        if fresh_slot is not None:
            rotation = None if rotary is None else (*rotary._table(position + 1, x.device), position)
            y = plan.token(qkv, cache.kv, gate, gate_layers, fresh_slot, rotation, position)
            if y is not None:
                cache.token_stored()
                return modules["out"](y.view(B, 1, H * D))
        if gate_layers is not None and len(gate_layers) == 4:  # the whole gate MLP: its first layer here
            gate, gate_layers = F.linear(gate, gate_layers[0], gate_layers[1]), gate_layers[2:]
        qkv = qkv.view(B, 1, H + 2 * H_kv, D)
        qk, v = qkv[:, :, :H + H_kv], qkv[:, :, H + H_kv:]
        if rotary is not None:  # as `heads` does, at the cache's position
            qk = rotary.rotate(qk, *rotary.cos_sin(1, position, None, x.device))
        cache.append_token(qk[:, :, H:].transpose(1, 2), v.transpose(1, 2))
        y = plan.rows(qk[:, :, :H].transpose(1, 2), cache.kv, gate, gate_layers, position)
        return modules["out"](y.reshape(B, 1, H * D))

    def _ring_projection(self, x: torch.Tensor, modules) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                  tuple[torch.Tensor, ...] | None]:
        """For one new token x [B, 1, d]: (qkv [B, 1, (H + 2·H_kv)·D], gate, gate_layers): its q, k, v projection
        and the gate arguments of `decode_ring` (`ring_gate`: gate_layers is its gate_head). A layer whose
        compiled step can run its whole gate MLP (`PiAttention`) gives gate = x and gate_layers = the MLP's
        first and last layers (four tensors) instead."""
        qkv = self._ring_qkv(x, modules)
        if self._own_ring_gate and self.gate is None:
            return qkv, None, None  # what ring_gate gives a layer without a gate, without asking it
        return (qkv, *self.ring_gate(x))

    @staticmethod
    def _ring_qkv(x: torch.Tensor, modules) -> torch.Tensor:
        """The q, k, v projection of x [B, 1, d]: `F.linear` on a plain `nn.Linear`'s weights (what calling it
        computes, without a module call's overhead), the module called where it or every module has hooks."""
        proj = modules["qkv"]
        if plain_linear(proj) and not global_hooks():
            weights = proj._parameters
            return F.linear(x, weights["weight"], weights["bias"])
        return proj(x)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor,
               document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, H, T, D], k, v [B, H_kv, T, D], x [B, T, d] (the gate's input), document_ids [B, T] or None
        -> [B, H, T, D]."""
        return pi_operator(q, k, v, self.observed_gate(x), self.settings, causal=self.causal,
                           dropout_p=self.attention_dropout, document_ids=document_ids, backend=self.backend,
                           check_gate=not self.gate_in_range())

    def gate_in_range(self) -> bool:
        """Whether `gate_values` gives values in (0, 1) by construction, so that the operator need not read
        them (a host sync on a GPU): False here; `PiAttention` says True for its own clipped gate."""
        return False

    def attend_recent(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The last t rows of `attend` (causal, eval) from the t new rows' q, x and all N rows' k, v: one call
        of the compiled step where it applies (`DecodePlan.rows` over the block), the gate's last layers included as
        in `attend_ring`."""
        gate, gate_head = self.ring_gate(x)
        return self._plan(None, q.device).rows(q, (k, v), gate, gate_head)

    def attend_ring(self, q: torch.Tensor, cache: RingCache, x: torch.Tensor) -> torch.Tensor:
        """One new query's output [B, H, 1, D] read from the ring `cache` that already holds its key
        (`decode_ring`: checked, then the plan of the settings and ring)."""
        gate, gate_head = self.ring_gate(x)
        return decode_ring(q, cache.kv, gate, self._decode_settings, capacity=cache.capacity,
                           position=cache.seen - 1, gate_head=gate_head)

    def ring_gate(self, x: torch.Tensor) -> tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
        """The gate arguments of `decode_ring` / `DecodePlan.rows` for new tokens x [B, t, d]: (α̃ [B, H, t] or None,
        None)."""
        return self.observed_gate(x), None
