"""`DecodePlan`: one layer's decoding, planned once from its settings, its scale and its cache's geometry.

A plan holds what every step of generation reads the same way: the settings (causal, no dropout, the scale
resolved, one period per query head: one period is H equal ones, per-head is the only form inside), the slot
tables of every query head (`decode_slots.py`; over a ring, one per phase once every key exists), the prior mode
of the compiled step, and the steps that run it, in order (`decode_steps.REGISTRY`): the first that takes a call
runs it. It exposes two calls, which the layers (`WindowedAttention`), the Hugging Face attention (`PiCache`'s
steps) and `pi_decode` / `decode_ring` all use:

- `rows(q, kv, gate, gate_head, position=None)`: the rows of t new queries over a block of keys (kv = (k, v),
  the queries' own keys last), or, with `position`, of one new query read straight from a ring cache's storage
  that has just stored its key (kv = `RingCache.kv`).
- `token(proj, kv, gate, gate_layers, fresh_slot, rotation, position)`: a decoding layer's whole one-token
  step (its key and value stored, RoPE, the attention) where a step of the plan does that in one call (the
  compiled one), else None, having written nothing.

`decode_plan` builds (and remembers) the plan of a settings, head count, ring capacity (None: a block of keys),
device and operator backend: "auto" decodes with every registered step, in order, "fused" (compiled code asked
for by name) with the compiled step only (`decode_steps.FOR_BACKEND`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType

import torch

from ...config.pi import PiSettings
from . import native
from .decode_slots import HeadTable, block_slots, head_table, ring_slots
from .decode_steps import DecodeStep, steps_for
from .pattern import log_priors
from .settings import OpSettings
from .validate import head_periods

# The most bytes a plan holds of a ring's tables per phase, read in place of a few tensor ops a step (a tenth of
# a small model's step per layer); larger rings take the ops.
STEADY_SLOTS_BYTES = 1 << 20


@functools.lru_cache(maxsize=256)
def decode_settings(pi: PiSettings, scale: float) -> OpSettings:
    """The decoding settings of a layer's `PiSettings` (checked when it was made) and its score scale: causal,
    no dropout (decoding runs in eval), `pi`'s period as it is. Built once per layer and scale."""
    return OpSettings.of(pi, causal=True, scale=scale, dropout_p=0.0)


@dataclass(frozen=True, eq=False)
class DecodePlan:
    """See the module. Built by `decode_plan`; read-only."""

    settings: OpSettings  # period: one per query head
    n_heads: int
    capacity: int | None  # of the ring the plan reads; None: a block of keys
    device: torch.device
    steps: tuple[DecodeStep, ...]  # in the order they are tried
    modules: tuple[ModuleType, ...]  # their modules (`run`), read at each call
    token_module: ModuleType | None  # the step that runs a layer's whole one-token step, if any
    table: HeadTable  # the key offsets of every head's slots (`decode_slots.head_table`)
    kind: torch.Tensor  # [S] int64: 0 local prior (local and sink slots), 1 skip prior
    n_local: int
    n_skip: int
    prior_mode: int | None  # the compiled step's (`native.PRIOR_MODES`), None where it does not run the variant
    log_priors: tuple[float, float]  # PRIOR_CONST's (local, skip)
    groups: tuple[tuple[int, torch.Tensor | None], ...]  # per distinct period: a head of it, its heads [1, H, 1, 1]
    steady: int  # the first position at which every key of the pattern exists
    phases: tuple[torch.Tensor, ...] | None  # a ring's tables [H, S] per phase past `steady`, where they fit

    def __deepcopy__(self, memo) -> DecodePlan:
        return self  # read-only: a copied layer shares its plans

    def __reduce__(self):  # pickled as what builds it again (its modules are not picklable)
        return _plan, (self.settings, self.n_heads, self.capacity, self.device, True, self.steps)

    @property
    def gate_in_step(self) -> bool:
        """Whether the first step of the plan finishes the gate from its MLP's hidden layer (`rows`' gate_head)."""
        return bool(self.steps) and self.steps[0].gate_in_step

    def ring_slots(self, position: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(slot [H, S] rows of the ring's storage, valid [H, 1, S] or None) of the query at `position`, whose
        ring has just stored it: position p < sinks in slot p, position p in slot sinks + p mod capacity."""
        s = self.settings
        if position < self.steady:
            return ring_slots(s.window, s.period, s.sinks, self.capacity, position, self.device)
        table = self.table
        if self.phases is not None:
            return self.phases[position % self.capacity], table.steady_valid
        slot = (table.offsets + position).remainder_(self.capacity).add_(s.sinks)
        if s.sinks:
            slot = torch.cat([slot, table.sink_index.expand(self.n_heads, s.sinks)], 1)
        return slot, table.steady_valid

    def rows(self, q: torch.Tensor, kv, gate: torch.Tensor | None,
             gate_head: tuple[torch.Tensor, torch.Tensor] | None = None,
             position: int | None = None) -> torch.Tensor | None:
        """The rows [B, H, t, D] of the new queries q [B, H, t, D] (q's dtype), by the first step that takes the
        call; None where none does (a plan of the compiled step alone).

        kv: a block (k, v) [B, H_kv, N, D] each, the queries' own keys its last t rows; or, with `position` (the
        one new query's, t = 1), a ring cache's storage [2, B, H_kv, sinks + capacity, D] that already holds its
        key. gate: α [B, H, t] or None; with gate_head = (weight [H, n_hidden], bias [H]) (variant "adaptive"),
        the gate MLP's hidden pre-activation [B, t, n_hidden], which the step finishes. Unchecked (the callers'
        shapes are right by construction, or checked: `decode.pi_decode`, `decode.check_ring`)."""
        s = self.settings
        if position is None:
            slot, valid = block_slots(s.window, s.period, s.sinks, q.shape[2], kv[0].shape[2], self.device)
        else:
            slot, valid = self.ring_slots(position)
        for module in self.modules:
            y = module.run(self, q, kv, slot, valid, gate, gate_head)
            if y is not None:
                return y
        return None

    def token(self, proj: torch.Tensor, kv: torch.Tensor, gate: torch.Tensor | None,
              gate_layers: tuple[torch.Tensor, ...] | None, fresh_slot: int,
              rotation: tuple[torch.Tensor, torch.Tensor, int] | None, position: int) -> torch.Tensor | None:
        """A decoding layer's whole one-token step in one call: the new token at `position` (its projection proj
        [B, 1, P]: q, k, v columns) stored in ring row `fresh_slot` of kv (its key rotated by `rotation`, (cos,
        sin, position) or None), then its query (rotated) read over the ring as `rows` reads it. y [B, H, 1, D],
        or None where no step of the plan does that (nothing written: the caller stores the token and calls
        `rows`). The gate: None, α̃ [B, H, 1], the hidden pre-activation with gate_layers = the MLP's last layer,
        or the MLP's input [B, 1, d] with gate_layers = its first and last layers (four tensors)."""
        if self.token_module is None:
            return None
        slot, valid = self.ring_slots(position)
        return self.token_module.run(self, proj, kv, slot, valid, gate, gate_layers, fresh_slot=fresh_slot,
                                     rotation=rotation)


_CPU = torch.device("cpu")


def decode_plan(settings: OpSettings, n_heads: int, *, capacity: int | None = None, device: torch.device = _CPU,
                backend: str = "auto") -> DecodePlan | None:
    """The plan of `settings` (causal, no dropout, the scale resolved: `decode_settings`; the period one int or
    one per query head) for n_heads query heads, over a ring of `capacity` (None: blocks of keys), with tables on
    `device`, decoding a model whose operator backend is `backend`. None for a backend with no decoding steps
    (`FOR_BACKEND`; such a model runs its operator) or whose steps all refuse the variant; ValueError where none
    of "auto"'s does (no step declares the variant), with each one's reason. Remembered per distinct arguments
    and registered steps."""
    candidates = steps_for(backend)
    if candidates is None:
        return None
    return _plan(settings, n_heads, capacity, device, backend == "auto", candidates)


@functools.lru_cache(maxsize=256)
def _plan(settings: OpSettings, n_heads: int, capacity: int | None, device: torch.device, required: bool,
          candidates: tuple[DecodeStep, ...]) -> DecodePlan | None:
    variant = settings.variant
    periods = head_periods(settings.period, n_heads)  # the one form: one period per query head
    per_head = len(set(periods)) > 1
    steps = tuple(step for step in candidates if step.refusal(variant, per_head=per_head) is None)
    if not steps:
        if not required:
            return None
        raise ValueError(f"no decoding step runs variant {variant!r}: "
                         + "; ".join(step.refusal(variant, per_head=per_head) for step in candidates))
    settings = settings._replace(period=periods)
    window, sinks = settings.window, settings.sinks
    table = head_table(window, periods, sinks, device)
    distinct = sorted(set(periods))
    groups = tuple((periods.index(p), None if len(distinct) == 1 else
                    torch.tensor([h == p for h in periods], device=device)[None, :, None, None]) for p in distinct)
    mode = native.PRIOR_MODES.get(variant)
    phases = None
    n_slots = table.kind.shape[0]
    if capacity is not None and capacity * n_heads * n_slots * 8 <= STEADY_SLOTS_BYTES:
        phase = torch.arange(capacity, device=device)[:, None, None]
        slot = (table.offsets + phase).remainder_(capacity).add_(sinks)
        phases = torch.cat([slot, table.sink_index.expand(capacity, n_heads, sinks)], 2).contiguous().unbind(0)
    modules = tuple(step.load() for step in steps)
    token = next((module for step, module in zip(steps, modules, strict=True) if step.token), None)
    return DecodePlan(settings, n_heads, capacity, device, steps, modules, token, table, table.kind, table.n_local,
                      table.n_skip, mode, log_priors(variant, None, settings.prior, settings.eps)
                      if mode == native.PRIOR_CONST else (0.0, 0.0), groups, sinks + max(window, *periods), phases)
