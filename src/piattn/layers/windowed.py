"""`WindowedAttention`: the attention kinds that run on the π operator (`pi`, `local`), with their settings."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..config import PiSettings
from ..decoding.cache import RingCache
from ..ops.pi.decode import _decode_rows, decode_ring
from ..ops.pi.heads import by_period
from .base import AttentionLayer
from .sharding import pi_operator


class WindowedAttention(AttentionLayer):
    """An `AttentionLayer` whose `attend` is `pi_attention` with the typed `settings` (`PiSettings`),
    `causal` and `backend`, and whose decoding reads a ring of `settings.reach + 1` positions (plus
    `settings.sinks` fixed ones).

    `settings.period` may hold one period per query head (multi-scale π, n_heads of them): the forward
    hands them to `pi_attention`, and the cached decoding paths (`attend_recent`, `attend_ring`) run their
    one-period functions once per distinct period on that period's heads (`piattn.ops.pi.heads`), the
    ring holding max(window, largest period) + 1 positions. Sequence-parallel, each period group runs its own
    halo exchange (`piattn.parallel.sequence_parallel_pi_attention`).

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
        if settings.periods is not None and len(settings.periods) != n_heads:
            raise ValueError(f"period has {len(settings.periods)} entries; per-head periods need one per query "
                             f"head, n_heads={n_heads}")
        self.settings = settings
        self.backend = backend
        self.gate: nn.Module | None = None
        # The decoding functions' settings (no causal, no backend; the scale spelled out), once rather than per step.
        self._decode_kwargs = dict(**settings.as_kwargs(), scale=self.head_dim**-0.5)
        self._gate_observer: Callable[[torch.Tensor], None] | None = None

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

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor,
               document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, H, T, D], k, v [B, H_kv, T, D], x [B, T, d] (the gate's input), document_ids [B, T] or None
        -> [B, H, T, D]."""
        return pi_operator(q, k, v, self.observed_gate(x), causal=self.causal, dropout_p=self.attention_dropout,
                           document_ids=document_ids, backend=self.backend, **self.settings.as_kwargs())

    def attend_recent(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The last t rows of `attend` (causal, eval) from the t new rows' q, x and all N rows' k, v: one call
        of the compiled step where it applies (`_decode_rows`), the gate's last layers included as in
        `attend_ring`."""
        gate, gate_head = self.ring_gate(x)
        if self.settings.periods is None:
            return _decode_rows(q, k, v, gate, gate_head=gate_head, **self._decode_kwargs)

        weight, bias = (None, None) if gate_head is None else gate_head
        alpha = gate if gate_head is None else None

        def run(period: int, q_g: torch.Tensor, alpha_g: torch.Tensor | None, weight_g: torch.Tensor | None,
                bias_g: torch.Tensor | None, k_g: torch.Tensor, v_g: torch.Tensor) -> torch.Tensor:
            head = None if gate_head is None else (weight_g, bias_g)
            return _decode_rows(q_g, k_g, v_g, gate if head is not None else alpha_g, gate_head=head,
                                **{**self._decode_kwargs, "period": period})

        return by_period(self.settings.periods, k.shape[1], run, [(q, 1), (alpha, 1), (weight, 0), (bias, 0)],
                         [(k, 1), (v, 1)])

    def attend_ring(self, q: torch.Tensor, cache: RingCache, x: torch.Tensor) -> torch.Tensor:
        """One new query's output [B, H, 1, D] read from the ring `cache` that already holds its key."""
        gate, gate_head = self.ring_gate(x)
        ring = dict(capacity=cache.capacity, position=cache.seen - 1)
        if self.settings.periods is None:
            return decode_ring(q, cache.kv, gate, gate_head=gate_head, **ring, **self._decode_kwargs)

        # gate: α [B, H, 1] (heads on dim 1), or with gate_head the MLP's hidden layer, shared by all heads,
        # whose last layer (weight [H, n_hidden], bias [H]) is cut to each period's heads instead.
        weight, bias = (None, None) if gate_head is None else gate_head
        alpha = gate if gate_head is None else None

        def run(period: int, q_g: torch.Tensor, alpha_g: torch.Tensor | None, weight_g: torch.Tensor | None,
                bias_g: torch.Tensor | None, kv_g: torch.Tensor) -> torch.Tensor:
            head = None if gate_head is None else (weight_g, bias_g)
            return decode_ring(q_g, kv_g, gate if head is not None else alpha_g, gate_head=head, **ring,
                               **{**self._decode_kwargs, "period": period})

        # The ring's heads are copied for the step unless the periods' order is the heads': O(capacity) a step.
        return by_period(self.settings.periods, cache.kv.shape[2], run, [(q, 1), (alpha, 1), (weight, 0), (bias, 0)],
                         [(cache.kv, 2)])

    def ring_gate(self, x: torch.Tensor) -> tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
        """The gate arguments of `decode_ring` / `_decode_rows` for new tokens x [B, t, d]: (α̃ [B, H, t] or None,
        None)."""
        return self.observed_gate(x), None
