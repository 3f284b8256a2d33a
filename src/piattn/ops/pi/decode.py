"""`pi_decode`: the last few rows of the causal π-Attention operator, computed from the keys they read.

A decoding step adds t (usually 1) query rows at the end of a causal sequence whose keys are cached.
Query i reads at most window + 2 + sinks keys (i − window … i, i − period, then the sink keys 0 … sinks − 1;
`Pattern` slot order), so this gathers exactly those, scores them, clamps, adds the variant's log priors
(`log_priors`), takes one small softmax (two for "separate") and the weighted sum of the gathered values:
O(t·(window + 2 + sinks)·D) work in a handful of plain torch ops, no blocking, no dropout (decoding runs
in eval). Its rows equal the last t rows of `pi_attention` (causal) on the N given rows; positions before
the first given key count as outside the text, as they do for the full operator, and the sinks are the
first given rows.

Grouped-query attention (k, v with H_kv heads dividing the H of q): the H / H_kv query heads of a group
are scored against the one gathered copy of their key/value head; nothing is repeated.

Two steps compute these rows, and each declares the variants it runs: the torch ops here
(`TORCH_OPS_VARIANTS`, `decode_gathered`) and the compiled C step (`native.PRIOR_MODES`), for one query read
from a ring cache (`decode_ring`) or a few read from a block of rows (`_decode_rows`, each query its own
one-query step in the same call). Both take the compiled step for a variant it declares where it applies
(`native.applies`), else the torch ops; a variant the torch ops do not declare is refused with the reason,
never run as another.

The call's settings travel as one `OpSettings` (`settings.py`, the type `pi_attention` hands its backends),
with causal True, dropout_p 0.0 and the scale resolved: `pi_decode` builds it from its keywords once, a
decoding layer or the Hugging Face attention from its `PiSettings` (`decode_settings`) once per layer and
scale, and every function below takes it whole.

Per-head periods (multi-scale π): `decode_ring`, `_decode_rows` and `_compiled_rows` also take settings whose
period is a tuple of one period per query head, and run their one-period step once per distinct period on
that period's heads (`_per_period`, through `heads.by_period`, as `pi_attention` does), the outputs in head
order; their callers hand them per-head periods whole. A step that must read the key/value heads where they
lie runs once per period on every head and keeps each head's own rows (`per_period_masked`). `pi_decode`
takes one period.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.nn import functional as F

from ...checks import is_int
from ...config.pi import GATED_VARIANTS, PI_DEFAULTS, PiSettings, check_pi_settings
from . import native
from .dtypes import accumulation_dtype
from .heads import by_period
from .pattern import Pattern, log_priors
from .settings import OpSettings
from .validate import _check_gate, check_qkv_tensors, head_periods

# The variants `decode_gathered` computes ("separate" included: two softmaxes, mixed by α).
TORCH_OPS_VARIANTS = frozenset({"union", "separate", "fixed", "adaptive"})


@functools.lru_cache(maxsize=256)
def _slots(window: int, period: int, sinks: int, n_queries: int, n_keys: int, device: torch.device):
    """For t new queries over N keys: the flat index [t·S] of each query's slots into the N keys (0 where
    the slot reads nothing), which slots read a key ([t, S] bool, or None when all do), the prior of each
    slot ([S]: 0 local or sink, 1 skip), and the number of local slots, in `Pattern` slot order."""
    pat = Pattern(window, period, causal=True, sinks=sinks)
    rows = torch.arange(n_keys - n_queries, n_keys)[:, None]  # the queries' positions
    idx = rows + torch.tensor(pat.offsets)
    valid = idx >= 0
    if sinks:
        sink = torch.arange(sinks)[None, :]
        d = sink - rows  # a sink already in the window or at −period is not counted twice
        repeat = (d >= -window) | ((d == -period) if pat.n_skip else torch.zeros_like(d, dtype=torch.bool))
        idx = torch.cat([idx, sink.expand(n_queries, -1)], 1)
        valid = torch.cat([valid, (sink <= rows) & ~repeat], 1)
    kind = torch.tensor([0 if local else 1 for local in pat.slot_is_local()], device=device)
    idx = torch.where(valid, idx, 0).flatten().to(device)
    return idx, None if bool(valid.all()) else valid.to(device), kind, pat.n_local, pat.n_skip


@functools.lru_cache(maxsize=256)
def _per_head_slots(window: int, periods: tuple[int, ...], sinks: int, n_queries: int, n_keys: int,
                    device: torch.device):
    """`_slots` of every query head at once, for per-head periods read in one call of the compiled step:
    (idx [H, t·S], valid [H, t, S] bool or None, kind [S], n_local, n_skip), head h's table that of its own period,
    from the same table of key offsets as `per_head_ring_slots` (`_head_table`); a head whose period lies within
    the window reads nothing in the others' skip place. A slot that reads nothing indexes key 0, as in `_slots`."""
    offsets, present, skip_period, sink_index, _, kind, n_local, n_skip = _head_table(window, periods, sinks, device)
    positions = torch.arange(n_keys - n_queries, n_keys, device=device)[:, None]  # the queries' positions [t, 1]
    keys = offsets[:, None, :] + positions  # [H, t, n_local + n_skip]
    valid = (keys >= 0) & present[:, None, :]
    idx = keys.clamp(min=0)
    if sinks:  # a sink not yet reached, or already read as a local or skip key, reads nothing
        back = positions - sink_index
        sink_valid = (back >= 0) & ~((back <= window) | (back == skip_period[:, :, None]))
        valid = torch.cat([valid, sink_valid], 2)
        idx = torch.cat([idx, torch.where(sink_valid, sink_index, 0)], 2)
    return idx.flatten(1), None if bool(valid.all()) else valid, kind, n_local, n_skip


def ring_slots(window: int, period: int, sinks: int, capacity: int, position: int, device: torch.device):
    """`_slots` for one query at `position` whose keys sit in a ring cache (`piattn.decoding.RingCache`) of
    `capacity` >= max(window, period) + 1 positions that has just stored it: position p < sinks in slot
    p, position p in slot sinks + p mod capacity. Returns (slot [S] into the cache's storage, valid [1, S]
    bool or None, kind [S], n_local, n_skip).

    Past the first sinks + max(window, period) positions every slot is valid and nothing depends on the
    position but its phase in the ring, so at most `capacity` distinct answers are ever built.
    """
    steady = sinks + max(window, period)
    if position >= steady:
        position = steady + (position - steady) % capacity
    return _ring_slots(window, period, sinks, capacity, position, device)


@functools.lru_cache(maxsize=1024)
def _ring_slots(window: int, period: int, sinks: int, capacity: int, position: int, device: torch.device):
    idx, valid, kind, n_local, n_skip = _slots(window, period, sinks, 1, position + 1, torch.device("cpu"))
    pat = Pattern(window, period, causal=True, sinks=sinks)
    ring = sinks + idx[:len(pat.offsets)] % capacity  # local and skip slots: the ring; sink slots: themselves
    slot = torch.cat([ring, idx[len(pat.offsets):]])
    return (slot.to(device), None if valid is None else valid.to(device), kind.to(device), n_local, n_skip)


def per_head_ring_slots(window: int, periods: tuple[int, ...], sinks: int, capacity: int, position: int,
                        device: torch.device):
    """`ring_slots` of every query head at once, for per-head periods (one per head) read in one call of the
    compiled step: (slot [H, S], valid [H, 1, S] bool or None, kind [S], n_local, n_skip), head h's row that of
    its own period. A head whose period lies within the window has no skip slot of its own (`Pattern`): its row
    gets one that reads nothing (invalid) where the other heads' skip slot is, so that every head has the same
    slots in the same order, and its own slots are read as its own step reads them.

    Past the first sinks + max(window, periods) positions every key exists and no sink is among them, and only
    the slots' ring rows move: there the tables are read from one per phase of the ring (`_steady_slots`) where
    those fit in STEADY_SLOTS_BYTES, else computed from one cached table of key offsets per set of periods
    (`_head_table`), a few tensor ops a step. Before that point they are `_per_head_slots`' for the query at
    `position`, mapped onto the ring as `ring_slots` maps `_slots`'. (Caching each period's `ring_slots` instead
    would hold `capacity` phases per period and miss on a designer's long periods.)"""
    if position >= sinks + max(window, *periods):
        offsets, _, _, sink_index, steady_valid, kind, n_local, n_skip = _head_table(window, periods, sinks, device)
        by_phase = _steady_slots(window, periods, sinks, capacity, device)
        if by_phase is not None:
            return by_phase[position % capacity], steady_valid, kind, n_local, n_skip
        slot = (offsets + position).remainder_(capacity).add_(sinks)
        if sinks:
            slot = torch.cat([slot, sink_index.expand(len(periods), sinks)], 1)
        return slot, steady_valid, kind, n_local, n_skip
    idx, valid, kind, n_local, n_skip = _per_head_slots(window, periods, sinks, 1, position + 1, device)
    n_ring = idx.shape[1] - sinks  # the local and skip slots: ring rows; the sink slots: the sinks' own rows
    slot = torch.cat([idx[:, :n_ring].remainder(capacity).add_(sinks), idx[:, n_ring:]], 1)
    return slot, valid, kind, n_local, n_skip


# The most bytes `_steady_slots` holds for one set of periods and ring: a table per phase of the ring, read in
# place of a few tensor ops a step (a tenth of a small model's step per layer); larger rings take the ops.
STEADY_SLOTS_BYTES = 1 << 20


@functools.lru_cache(maxsize=64)
def _steady_slots(window: int, periods: tuple[int, ...], sinks: int, capacity: int,
                  device: torch.device) -> tuple[torch.Tensor, ...] | None:
    """`per_head_ring_slots`' slot tables past its first positions, one per phase of the ring: `capacity` views
    [H, S] int64 of one table (position p's at p mod capacity; a tuple, so that a step picks its table without a
    tensor op), or None where that would pass STEADY_SLOTS_BYTES."""
    offsets, _, _, sink_index, _, _, _, _ = _head_table(window, periods, sinks, device)
    H, n_ring = offsets.shape
    if capacity * H * (n_ring + sinks) * 8 > STEADY_SLOTS_BYTES:
        return None
    phase = torch.arange(capacity, device=device)[:, None, None]
    slot = (offsets + phase).remainder_(capacity).add_(sinks)
    return torch.cat([slot, sink_index.expand(capacity, H, sinks)], 2).contiguous().unbind(0)


@functools.lru_cache(maxsize=256)
def _head_table(window: int, periods: tuple[int, ...], sinks: int, device: torch.device):
    """What `per_head_ring_slots` computes from: (the key offsets of each head's local and skip slots
    [H, n_local + n_skip] int64, whether each is a slot of the head's own pattern [H, n_local + n_skip] bool,
    each head's skip period [H, 1] (−1 without a skip slot of its own), the sink indices [1, sinks], the valid
    mask past the first positions [H, 1, S] or None, kind [S], n_local, n_skip)."""
    patterns = [Pattern(window, p, causal=True, sinks=sinks) for p in periods]
    n_skip = max(pat.n_skip for pat in patterns)
    widest = next(pat for pat in patterns if pat.n_skip == n_skip)
    present = [[True] * len(pat.offsets) + [False] * (n_skip - pat.n_skip) for pat in patterns]
    steady = [row + [True] * sinks for row in present]
    return (torch.tensor([list(pat.offsets) + [0] * (n_skip - pat.n_skip) for pat in patterns], device=device),
            torch.tensor(present, device=device),
            torch.tensor([[p if pat.n_skip else -1] for p, pat in zip(periods, patterns, strict=True)],
                         device=device),
            torch.arange(sinks, device=device)[None, :],
            None if all(all(row) for row in steady) else torch.tensor(steady, device=device)[:, None, :],
            torch.tensor([0 if local else 1 for local in widest.slot_is_local()], device=device),
            widest.n_local, n_skip)


def _check(q, k, v) -> None:
    check_qkv_tensors(q, k, v, layout="[B, H, *, D]")
    if k.shape != v.shape:
        raise ValueError(f"k and v must share one shape [B, H_kv, N, D]; got k {tuple(k.shape)}, v {tuple(v.shape)}")
    B, H, t, D = q.shape
    if (k.shape[0], k.shape[3]) != (B, D) or k.shape[1] < 1 or H % k.shape[1]:
        raise ValueError(f"k must have shape [B, H_kv, N, D] with B, D of q {tuple(q.shape)} and H_kv dividing "
                         f"its H, got {tuple(k.shape)}")
    if t < 1 or D < 1:
        raise ValueError(f"q must have at least one row and D >= 1, got shape {tuple(q.shape)}")
    if k.shape[2] < t:
        raise ValueError(f"k must hold at least the t = {t} new rows of q, got N = {k.shape[2]}")


def pi_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate: torch.Tensor | None = None,
    *,
    window: int = PI_DEFAULTS.window,
    period: int = PI_DEFAULTS.period,
    variant: str = PI_DEFAULTS.variant,
    prior: float = PI_DEFAULTS.prior,
    logit_clamp: float | None = PI_DEFAULTS.logit_clamp,
    eps: float = PI_DEFAULTS.eps,
    sinks: int = PI_DEFAULTS.sinks,
    scale: float | None = None,
) -> torch.Tensor:
    """The last t rows of causal `pi_attention` on N rows, from those rows' queries and all N keys.

    Args:
        q: [B, H, t, D] queries of positions N − t … N − 1 (the new tokens).
        k, v: [B, H_kv, N, D] keys and values of positions 0 … N − 1 (N >= t), the new ones last; H_kv
            divides H. Only the first `sinks` and the last max(window, period) + t matter; when N is
            smaller, the text starts at the first row.
        gate: [B, H, t] the α of the new queries, for variants "adaptive" and "separate"; else None.
        window, period, variant, prior, logit_clamp, eps, sinks, scale: as in `piattn.pi_attention`.

    Returns:
        [B, H, t, D] in the dtype of q, equal to `pi_attention(q_full, k, v, gate_full, causal=True, …)
        [:, :, -t:]` for any q_full, gate_full whose last t rows are q, gate.
    """
    _check(q, k, v)
    check_pi_settings(window=window, period=period, variant=variant, prior=prior, logit_clamp=logit_clamp,
                      eps=eps, sinks=sinks)
    if scale is not None and not scale > 0:
        raise ValueError(f"scale must be > 0 or None (None means 1/sqrt(D)), got {scale!r}")
    _check_gate(q, gate, variant)
    settings = OpSettings(window=window, period=period, causal=True, variant=variant, prior=prior,
                          logit_clamp=logit_clamp, eps=eps, scale=q.shape[3]**-0.5 if scale is None else scale,
                          dropout_p=0.0, sinks=sinks)
    return _decode_rows(q, k, v, gate, settings)


@functools.lru_cache(maxsize=256)
def decode_settings(pi: PiSettings, scale: float) -> OpSettings:
    """The settings the decoding functions take for a layer's `PiSettings` (checked when it was made) and its
    score scale: causal, no dropout (decoding runs in eval), `pi`'s period as it is (one int, or one per query
    head). Built once per layer and scale (remembered here for callers that ask per step)."""
    return OpSettings(causal=True, scale=scale, dropout_p=0.0, **pi.as_kwargs())


def _decode_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None,
                 settings: OpSettings, *, gate_head: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """`pi_decode` without its argument checks, for callers whose inputs are right by construction (the
    decoding layers: a step is a few dozen small ops, and the checks would be a third of them), with the call's
    `settings` (causal, no dropout, the scale resolved; `decode_settings`).

    With gate_head = (weight [H, n_hidden], bias [H]) (variant "adaptive" only), gate is the gate MLP's hidden
    pre-activation [B, t, n_hidden] and α = ε + (1 − 2ε)·σ(weight·GELU(gate) + bias), as in `decode_ring`.

    One call of the compiled step (`native._rows_step_unchecked`: the t queries each their own one-query step)
    where it applies (`_compiled_slot_rows`), else one gather for keys and values and `decode_gathered`.
    With settings.period a tuple of H per-head periods, that once per distinct period on its heads
    (`_per_period`).
    """
    if isinstance(settings.period, tuple):
        y = _compiled_per_head_rows(q, k, v, gate, gate_head, settings)
        if y is not None:
            return y

        def rows(s: OpSettings, q_g: torch.Tensor, gate_g: torch.Tensor | None, head_g, k_g: torch.Tensor,
                 v_g: torch.Tensor) -> torch.Tensor:
            return _decode_rows(q_g, k_g, v_g, gate_g, s, gate_head=head_g)

        return _per_period(rows, settings, q, gate, gate_head, [(k, 1), (v, 1)])
    t = q.shape[2]
    idx, valid, kind, n_local, n_skip = _slots(settings.window, settings.period, settings.sinks, t, k.shape[2],
                                               q.device)
    y = _compiled_slot_rows(q, k, v, gate, gate_head, idx, valid, kind, settings)
    if y is not None:
        return y
    gate_is_sigmoid = gate_head is not None
    if gate_is_sigmoid:
        gate = gate_tail(gate, *gate_head).transpose(1, 2)
    kg = k.index_select(2, idx)
    vg = v.index_select(2, idx)
    return decode_gathered(q, kg, vg, valid, kind, n_local, n_skip, gate, settings, gate_is_sigmoid=gate_is_sigmoid)


def _per_period(step, settings: OpSettings, q: torch.Tensor, gate: torch.Tensor | None,
                gate_head: tuple[torch.Tensor, torch.Tensor] | None,
                per_kv: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """The decoding functions' one place that groups heads by period: step(settings_g, q_g, gate_g, gate_head_g,
    *per_kv_g) -> [B, H_g, …] once per distinct period of settings.period (a tuple of one per query head) on its
    query heads (`heads.by_period`), settings_g the settings with that one period, put back in head order.
    q [B, H, …] and, without gate_head, the gate α [B, H, …] are cut along their heads; with gate_head =
    (weight [H, n_hidden], bias [H]) the gate is the MLP's hidden layer, shared by every head, and the gate
    head's rows are cut instead. per_kv: (tensor, dim) pairs holding the key/value heads along dim (k and v, or
    a ring's storage)."""
    weight, bias = (None, None) if gate_head is None else gate_head
    alpha = gate if gate_head is None else None

    def run(period: int, q_g: torch.Tensor, alpha_g: torch.Tensor | None, weight_g: torch.Tensor | None,
            bias_g: torch.Tensor | None, *kv_g: torch.Tensor) -> torch.Tensor:
        one = settings._replace(period=period)
        if gate_head is None:
            return step(one, q_g, alpha_g, None, *kv_g)
        return step(one, q_g, gate, (weight_g, bias_g), *kv_g)

    x, dim = per_kv[0]
    return by_period(settings.period, x.shape[dim], run, [(q, 1), (alpha, 1), (weight, 0), (bias, 0)], per_kv)


def per_period_masked(step: Callable[[OpSettings], torch.Tensor | None], settings: OpSettings, n_heads: int,
                      device: torch.device) -> torch.Tensor | None:
    """step(settings_p) -> rows [B, H, …] of all n_heads query heads (or None), once per distinct period p of
    settings.period (increasing; settings_p the settings with that one period), each head's rows taken from the
    step of its own period: [B, H, …], or None as soon as one step gives None. One period: one step, as it is.

    For a step that reads key/value heads where they lie (the Hugging Face `PiCache` ring step,
    `integrations/hf/attention._ring_step`): grouping heads by period (`_per_period`) would hand each group its
    key/value heads as a block of their own, a copy of the ring per step; each row is computed on its own, so a
    head's row of its period's step is the row of that head alone. The decoding functions' other place that
    splits heads by period (with `_per_period`)."""
    y = None
    for one, heads in _period_masks(settings, n_heads, device):
        y_p = step(one)
        if y_p is None:
            return None
        y = y_p if y is None else torch.where(heads, y_p, y)
    return y


@functools.lru_cache(maxsize=64)
def _period_masks(settings: OpSettings, n_heads: int,
                  device: torch.device) -> tuple[tuple[OpSettings, torch.Tensor | None], ...]:
    """(the settings with one period, the heads that have it as a bool mask [1, H, 1, 1]) for each distinct
    period of settings.period over n_heads query heads, increasing; one period: ((settings, None),)."""
    if not isinstance(settings.period, tuple):
        return ((settings, None),)
    periods = head_periods(settings.period, n_heads)  # ValueError unless one per query head
    return tuple((settings._replace(period=p),
                  torch.tensor([h == p for h in periods], device=device)[None, :, None, None])
                 for p in sorted(set(periods)))


class _NotCompiled(Exception):
    """A period group that the compiled step does not take (`_compiled_rows`)."""


def _compiled_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None,
                   settings: OpSettings, *,
                   gate_head: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
    """`_decode_rows` through the compiled step alone: its rows [B, H, t, D], or None where that step does not
    apply (a variant outside `native.PRIOR_MODES`, or what `native.applies` refuses). For a caller that asked
    for compiled code explicitly and must say so rather than run torch ops in its place. With settings.period
    a tuple of H per-head periods, once per distinct period on its heads (`_per_period`), and None where the
    step does not take any one of them: the caller then runs the whole call another way, never half of it."""
    if isinstance(settings.period, tuple):
        y = _compiled_per_head_rows(q, k, v, gate, gate_head, settings)
        if y is not None:
            return y

        def rows(s: OpSettings, q_g: torch.Tensor, gate_g: torch.Tensor | None, head_g, k_g: torch.Tensor,
                 v_g: torch.Tensor) -> torch.Tensor:
            y = _compiled_rows(q_g, k_g, v_g, gate_g, s, gate_head=head_g)
            if y is None:
                raise _NotCompiled  # out of `by_period`'s loop and cat: no group's rows are of use then
            return y

        try:
            return _per_period(rows, settings, q, gate, gate_head, [(k, 1), (v, 1)])
        except _NotCompiled:
            return None
    idx, valid, kind, _, _ = _slots(settings.window, settings.period, settings.sinks, q.shape[2], k.shape[2],
                                    q.device)
    return _compiled_slot_rows(q, k, v, gate, gate_head, idx, valid, kind, settings)


def _compiled_prior(settings: OpSettings, gate: torch.Tensor | None, gate_head) -> tuple[int, dict] | None:
    """(prior mode, its arguments) of the compiled step for settings.variant, or None for one it does not
    declare."""
    variant = settings.variant
    mode = native.PRIOR_MODES.get(variant)
    if mode is None:
        return None
    if gate_head is not None:
        return native.PRIOR_HIDDEN, dict(gate=gate, gate_weight=gate_head[0], gate_bias=gate_head[1])
    if mode == native.PRIOR_ALPHA:
        return mode, dict(gate=gate)
    if mode == native.PRIOR_CONST:
        return mode, dict(log_priors=log_priors(variant, None, settings.prior, settings.eps))
    return mode, {}


def _compiled_per_head_rows(q, k, v, gate, gate_head, settings: OpSettings) -> torch.Tensor | None:
    """`_compiled_slot_rows` for per-head periods in one call, each head over its own slot table
    (`_per_head_slots`), or None where the compiled step does not take it."""
    idx, valid, kind, _, _ = _per_head_slots(settings.window, settings.period, settings.sinks, q.shape[2],
                                             k.shape[2], q.device)
    return _compiled_slot_rows(q, k, v, gate, gate_head, idx, valid, kind, settings)


def _compiled_slot_rows(q, k, v, gate, gate_head, idx, valid, kind, settings: OpSettings) -> torch.Tensor | None:
    compiled = _compiled_prior(settings, gate, gate_head)
    if compiled is None:
        return None
    mode, extra = compiled
    tensors = [x for x in extra.values() if isinstance(x, torch.Tensor)]
    if not native.applies(q, k, v, *tensors, n_slots=kind.shape[0]):
        return None  # decided before stacking keys and values, which only the compiled step reads
    # The step reads keys and values from one contiguous [2, B, H_kv, N, D] block, as from a ring cache's storage.
    return native._rows_step_unchecked(q, torch.stack([k, v]), idx, valid, kind, prior_mode=mode,
                                       logit_clamp=settings.logit_clamp, eps=settings.eps, scale=settings.scale,
                                       **extra)


def gate_tail(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The gate MLP after its first linear layer (Eq. app_gate): hidden [B, T, n_hidden] pre-activation ->
    σ(weight·GELU(hidden) + bias) [B, T, H], in at least fp32 (`piattn.layers.gate.gate_mlp`)."""
    s = F.linear(F.gelu(hidden), weight, bias).sigmoid_()
    return s.to(accumulation_dtype(s.dtype))


@functools.lru_cache(maxsize=64, typed=True)
def _settings_checked(window, period, variant, prior, logit_clamp, eps, sinks) -> None:
    """`check_pi_settings`, once per distinct setting: a layer passes the same ones on every step of generation.
    Positional (a keyword call costs four times as much to look up) and typed (True and 1 are equal keys,
    but only 1 is a valid window): the fields of an `OpSettings` one by one, since a tuple key would compare
    True and 1 equal again."""
    check_pi_settings(window=window, period=period, variant=variant, prior=prior, logit_clamp=logit_clamp, eps=eps,
                      sinks=sinks)


def _shape(x) -> str:
    return str(tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__


def check_ring(q: torch.Tensor, kv_store: torch.Tensor, gate: torch.Tensor | None, capacity: int, position: int,
               settings: OpSettings, gate_head: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """The checks of `decode_ring`: a one-line ValueError naming the argument at the first inconsistency.
    Positional arguments: passing a dozen by keyword costs as much as half the checks.

    Every size is compared with what the ring layout implies (a cache made for another model, another
    batch or another pattern would give wrong rows, or have its buffers read past their end), in plain
    comparisons of sizes: they run on every step of generation. The gate's values are not read (that
    would cost a device sync per step); a layer's gate is a sigmoid by construction.

    settings: an `OpSettings` with causal True and dropout_p 0 (`decode_settings`), each field range-checked.
    Its period may be a tuple of one period per query head: each distinct one is checked, and the ring must
    reach as far as the largest.
    """
    if type(settings) is not OpSettings:
        raise ValueError(f"settings must be an OpSettings (`decode_settings` builds one from a PiSettings), got "
                         f"{type(settings).__name__}")
    window, period, causal, variant, prior, logit_clamp, eps, scale, dropout_p, sinks = settings
    if causal is not True or dropout_p != 0:
        raise ValueError(f"decoding is causal and without dropout: settings must have causal=True and "
                         f"dropout_p=0.0, got causal={causal!r}, dropout_p={dropout_p!r}")
    periods = period if isinstance(period, tuple) else None
    if periods is None:
        _settings_checked(window, period, variant, prior, logit_clamp, eps, sinks)
    else:
        if len(periods) == 0:
            raise ValueError("period must be an int >= 1 or one int >= 1 per query head, got ()")
        for p in dict.fromkeys(periods):  # each distinct period once, in head order
            _settings_checked(window, p, variant, prior, logit_clamp, eps, sinks)
        period = max(periods)
    if not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale must be a number > 0, got {scale!r}")
    if not is_int(position) or position < 0:
        raise ValueError(f"position must be an int >= 0 (the new query's position), got {position!r}")
    # A ring shorter than the pattern's reach is right while it still holds every position (a ring capped
    # by init_cache's max_positions): nothing has been overwritten, and what lies farther back does not exist.
    if not is_int(capacity) or capacity < 1 or (capacity <= max(window, period) and position >= capacity):
        raise ValueError(f"capacity must be an int >= max(window, period) + 1 = {max(window, period) + 1} "
                         f"(the ring must reach back as far as the pattern reads), or > position = {position} "
                         f"(a ring that still holds every position), got {capacity!r}")
    qs = q.shape if isinstance(q, torch.Tensor) else ()
    if len(qs) != 4 or qs[2] != 1 or qs[1] < 1 or qs[3] < 1:
        raise ValueError(f"q must be a tensor [B, H, 1, D] with H, D >= 1, got {_shape(q)}")
    B, H, _, D = qs
    if periods is not None and len(periods) != H:
        raise ValueError(f"period has {len(periods)} entries; per-head periods need one per query head, H={H}")
    ks = kv_store.shape if isinstance(kv_store, torch.Tensor) else ()
    if len(ks) != 5 or ks[0] != 2 or ks[1] != B or ks[3] != sinks + capacity or ks[4] != D:
        raise ValueError(f"kv_store must be a ring cache's storage [2, B, H_kv, sinks + capacity, D] = "
                         f"[2, {B}, H_kv, {sinks + capacity}, {D}] for q {tuple(qs)}, sinks = {sinks} and "
                         f"capacity = {capacity}, got {_shape(kv_store)}")
    H_kv = ks[2]
    if H_kv < 1 or H % H_kv:
        raise ValueError(f"kv_store's H_kv = {H_kv} key/value heads must divide the H = {H} heads of q")
    if kv_store.device != q.device or not kv_store.is_floating_point():
        raise ValueError(f"kv_store must be a floating-point tensor on the device of q ({q.device}), got "
                         f"{kv_store.dtype} on {kv_store.device}")
    if gate_head is not None:
        if variant != "adaptive":
            raise ValueError(f"gate_head is taken by variant 'adaptive' only, got variant {variant!r}")
        gs = gate.shape if isinstance(gate, torch.Tensor) else ()
        if len(gs) != 3 or gs[0] != B or gs[1] != 1 or gs[2] < 1:
            raise ValueError(f"gate must be the gate MLP's hidden layer [B, 1, n_hidden] with B = {B} when "
                             f"gate_head is given, got {_shape(gate)}")
        weight, bias = gate_head
        if (not isinstance(weight, torch.Tensor) or weight.shape != (H, gs[2])
                or not isinstance(bias, torch.Tensor) or bias.shape != (H,)):
            raise ValueError(f"gate_head must be (weight [H, n_hidden] = {(H, gs[2])}, bias [H] = {(H,)}), "
                             f"got ({_shape(weight)}, {_shape(bias)})")
    elif variant in GATED_VARIANTS:
        if not isinstance(gate, torch.Tensor) or gate.shape != (B, H, 1):
            raise ValueError(f"gate must be α [B, H, 1] = {(B, H, 1)} for variant {variant!r}, got {_shape(gate)}")
    elif gate is not None:
        raise ValueError(f"gate is only used by variants {GATED_VARIANTS}; variant {variant!r} takes gate=None")
    if gate is not None and gate.device != q.device:
        raise ValueError(f"gate must be on the device of q ({q.device}), got {gate.device}")


def decode_ring(q: torch.Tensor, kv_store: torch.Tensor, gate: torch.Tensor | None, settings: OpSettings, *,
                capacity: int, position: int,
                gate_head: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """`_decode_rows` for one new query at `position`, read straight from a ring cache's storage.

    q [B, H, 1, D]; kv_store [2, B, H_kv, sinks + capacity, D], keys then values, of a `RingCache` that
    already holds the new key (layout in `ring_slots`; capacity >= max(window, period) + 1, H_kv dividing
    H); gate [B, H, 1] α or None; settings the call's `OpSettings` (causal, no dropout, the scale resolved:
    `decode_settings`). With gate_head = (weight [H, n_hidden], bias [H]), the last layer of the gate MLP
    (variant "adaptive" only), gate is instead the MLP's hidden pre-activation [B, 1, n_hidden] and
    α = ε + (1 − 2ε)·σ(weight·GELU(gate) + bias) is computed here (`gate_tail`). Inconsistent arguments raise
    ValueError (`check_ring`). settings.period may be a tuple of H per-head periods (capacity then
    >= max(window, largest period) + 1): the step runs once per distinct period on its heads (`_per_period`).

    The step of generation: one call of the compiled C step (`native.ring_step`) where it applies (a variant
    of `native.PRIOR_MODES`, and see there), else one gather for keys and values and `decode_gathered`, with
    no reordering of the ring and no concatenation with the new row.
    """
    check_ring(q, kv_store, gate, capacity, position, settings, gate_head)
    return _decode_ring(q, kv_store, gate, capacity, position, settings, gate_head)


def _decode_ring(q: torch.Tensor, kv_store: torch.Tensor, gate: torch.Tensor | None, capacity: int, position: int,
                 settings: OpSettings, gate_head: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """`decode_ring` without `check_ring`, its arguments positional, for the decoding layers' one-token step
    (`WindowedAttention`), whose arguments are right by construction: q and the gate come from the layer's own
    projections, kv_store is the storage of a cache that `RingCache.check` accepted for the layer (batch,
    key/value heads, head width, a ring reaching as far as the pattern reads, its sinks) and that has just stored
    the new key, position is the cache's, and the settings are the layer's, checked when it was made
    (`decode_settings`, built once per layer). Per-head periods: one compiled call over a slot table per head
    (`per_head_ring_step`), else the step once per distinct period on its heads (`_per_period`)."""
    if not isinstance(settings.period, tuple):
        return _decode_ring_period(q, kv_store, gate, capacity, position, settings, gate_head)
    y = per_head_ring_step(q, kv_store, gate, capacity, position, settings, gate_head)
    if y is not None:
        return y

    def step(s: OpSettings, q_g: torch.Tensor, gate_g: torch.Tensor | None, head_g, kv_g: torch.Tensor) -> torch.Tensor:
        return _decode_ring_period(q_g, kv_g, gate_g, capacity, position, s, head_g)

    # The ring's heads are copied for the step unless the periods' order is the heads': O(capacity) a step.
    return _per_period(step, settings, q, gate, gate_head, [(kv_store, 2)])


def per_head_ring_step(q: torch.Tensor, kv_store: torch.Tensor, gate: torch.Tensor | None, capacity: int,
                       position: int, settings: OpSettings,
                       gate_head: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor | None:
    """The rows [B, H, 1, D] of one new query per sequence over a ring's storage, for per-head periods
    (settings.period a tuple) in one call of the compiled step, each head over its own slots
    (`per_head_ring_slots`): each head's row the bits of its own period's step. None where the compiled step
    does not take the call (the caller then runs the heads period by period). Unchecked, as `_decode_ring`; the
    decoding layers' ring step and the Hugging Face `PiCache` ring step take it."""
    compiled = _compiled_prior(settings, gate, gate_head)
    if compiled is None:
        return None
    slot, valid, kind, _, _ = per_head_ring_slots(settings.window, settings.period, settings.sinks, capacity,
                                                  position, q.device)
    mode, extra = compiled
    return native._rows_step_unchecked(q, kv_store, slot, valid, kind, prior_mode=mode,
                                       logit_clamp=settings.logit_clamp, eps=settings.eps, scale=settings.scale,
                                       **extra)


def _decode_ring_period(q: torch.Tensor, kv_store: torch.Tensor, gate: torch.Tensor | None, capacity: int,
                        position: int, settings: OpSettings,
                        gate_head: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """`_decode_ring` for settings of one period."""
    window, period, _, variant, prior, logit_clamp, eps, scale, _, sinks = settings
    slot, valid, kind, n_local, n_skip = ring_slots(window, period, sinks, capacity, position, q.device)
    compiled = _compiled_prior(settings, gate, gate_head)
    if compiled is not None:
        mode, extra = compiled
        # Unchecked: check_ring (or the layer's cache check) covered what ring_step's own checks would, and the
        # slots are ring_slots'. The C step still checks every size, slot and kind before reading anything.
        y = native._ring_step_unchecked(q, kv_store, slot, valid, kind, prior_mode=mode, logit_clamp=logit_clamp,
                                        eps=eps, scale=scale, **extra)
        if y is not None:
            return y
    gate_is_sigmoid = gate_head is not None
    if gate_is_sigmoid:
        gate = gate_tail(gate, *gate_head).transpose(1, 2)
    # Gathered as rows of a [2·B·H_kv, N, D] view: index_select along a middle dim of the 5-d store is
    # about twice as slow for these few rows (reshape: a view of a cache's contiguous store, a copy of any
    # other). The slot count is spelled out, not -1: with B = 0 there is no element to infer it from.
    two, B, H_kv, N, D = kv_store.shape
    kg, vg = kv_store.reshape(two * B * H_kv, N, D).index_select(1, slot).view(two, B, H_kv, slot.shape[0],
                                                                                D).unbind(0)
    return decode_gathered(q, kg, vg, valid, kind, n_local, n_skip, gate, settings, gate_is_sigmoid=gate_is_sigmoid)


def _decode_token(proj: torch.Tensor, n_heads: int, kv_store: torch.Tensor, gate: torch.Tensor | None,
                  gate_layers: tuple[torch.Tensor, ...] | None, fresh_slot: int,
                  rotation: tuple[torch.Tensor, torch.Tensor, int] | None, capacity: int, position: int,
                  settings: OpSettings) -> torch.Tensor | None:
    """A decoding layer's whole one-token step in one call of the compiled step (`native._token_step_unchecked`):
    the new token at `position` stored in ring row `fresh_slot` (its key rotated by `rotation`), then its query
    (rotated) read over the ring as `_decode_ring` reads it. y [B, H, 1, D], or None where the compiled step does
    not apply, with nothing written: the caller then stores the token and calls `_decode_ring`.

    proj [B, 1, P]: the new token's q (n_heads heads), k, v columns. The gate: None, α̃ [B, H, 1] (gate_layers
    None), the gate MLP's hidden pre-activation with gate_layers = its last layer (weight, bias) as `gate_head`
    in `decode_ring`, or the MLP's input [B, 1, d] with gate_layers = its first and last layers (four tensors:
    the whole gate in the step). Settings of one period or one per head (`per_head_ring_slots`), as
    `_decode_ring` takes them. Unchecked, for `WindowedAttention` (see `_decode_ring`)."""
    window, period, _, variant, prior, logit_clamp, eps, scale, _, sinks = settings
    mode = native.PRIOR_MODES.get(variant)
    if mode is None:
        return None
    # `_compiled_prior` spelled out without its dict: this runs once per layer and token.
    log_prior = (0.0, 0.0)
    if gate_layers is not None:
        mode = native.PRIOR_HIDDEN if len(gate_layers) == 2 else native.PRIOR_INPUT
    elif mode == native.PRIOR_CONST:
        log_prior = log_priors(variant, None, prior, eps)
    slots = per_head_ring_slots if isinstance(period, tuple) else ring_slots  # per-head: a slot table per head
    slot, valid, kind, _, _ = slots(window, period, sinks, capacity, position, kv_store.device)
    return native._token_step_unchecked(proj, n_heads, kv_store, slot, valid, kind, fresh_slot, rotation, log_prior,
                                        gate, gate_layers, logit_clamp, eps, scale, prior_mode=mode)


@functools.lru_cache(maxsize=16)
def _ignored(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 0-dim tensor for baddbmm's ignored input (beta = 0)."""
    return torch.zeros((), dtype=dtype, device=device)


@functools.lru_cache(maxsize=256)
def _prior_rows(kind: torch.Tensor, floor: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(offset, slope) [S] with which addcmul(offset, slope, s) is each slot's prior in one op (`kind` is one
    of the cached tensors of `_slots`): for floor 0 and s = α, α on local and sink slots and 1 − α on the
    skip slot, exactly; for floor ε and s = σ, the same for the clipped α = ε + (1 − 2ε)·σ."""
    skip = kind.to(dtype)
    sign = 1 - 2 * skip
    return skip + floor * sign, (1 - 2 * floor) * sign


def decode_gathered(q: torch.Tensor, kg: torch.Tensor, vg: torch.Tensor, valid: torch.Tensor | None,
                    kind: torch.Tensor, n_local: int, n_skip: int, gate: torch.Tensor | None, settings: OpSettings, *,
                    gate_is_sigmoid: bool = False) -> torch.Tensor:
    """The rows of `_decode_rows` from the keys and values each query reads, already gathered.

    q [B, H, t, D]; kg, vg [B, H_kv, t·S, D]: slot s of query j at row j·S + s (`Pattern` slot order, any
    key where the slot reads nothing); valid [t, S] bool or None (every slot reads a key); kind [S] int64,
    0 for the local prior (local and sink slots), 1 for the skip prior; gate [B, H, t] or None: α, or
    with gate_is_sigmoid (variant "adaptive" only) the σ whose clip ε + (1 − 2ε)·σ is α (`gate_tail`: the
    clip then costs no op of its own); settings the call's `OpSettings` of one period (its variant, prior,
    logit_clamp, eps and scale are read here; the slots already say which keys the pattern reads).
    Returns [B, H, t, D] in the dtype of q.

    Laid out as R = B·H_kv·t batched products of the g = H / H_kv query heads of a group against the S
    keys their query reads, in as few tensor ops as the maths allows: a decoding step is dominated by
    the fixed cost of each op, not by its arithmetic. A variant outside `TORCH_OPS_VARIANTS` raises
    ValueError.
    """
    _, _, _, variant, prior, logit_clamp, eps, scale, _, _ = settings
    if variant not in TORCH_OPS_VARIANTS:
        raise ValueError(f"no decoding step runs variant {variant!r}: torch ops run "
                         f"{', '.join(sorted(TORCH_OPS_VARIANTS))}; the compiled step runs "
                         f"{', '.join(sorted(native.PRIOR_MODES))} (fp32 and fp64 CPU tensors without autograd)")
    B, H, t, D = q.shape
    H_kv, S = kg.shape[1], kind.shape[0]
    g = H // H_kv
    R = B * H_kv * t
    out_dtype = q.dtype
    acc = accumulation_dtype(q.dtype)
    # With one query (t = 1) the heads of a group are already adjacent: plain views, no transposes.
    q3 = q.reshape(R, g, D) if t == 1 else q.view(B, H_kv, g, t, D).transpose(2, 3).reshape(R, g, D)
    k3, v3 = kg.view(R, S, D), vg.view(R, S, D)
    if valid is not None:
        # A slot that reads nothing still gathered some key and value (row 0, a sink slot not yet written):
        # its weight is 0, but 0·inf and 0·NaN are NaN, so a non-finite value there would reach rows that
        # never read it. Replaced, not multiplied (as the operator does); its key's score is replaced by
        # -inf below.
        v3 = torch.where(valid[None, :, :, None], v3.view(B * H_kv, t, S, D), 0.0).view(R, S, D)
    # Each converted on its own: the cache may hold another dtype than q (an fp32 step reading a bf16 or
    # fp64 cache), and baddbmm takes one dtype.
    q3, k3, v3 = (x if x.dtype == acc else x.to(acc) for x in (q3, k3, v3))
    z = torch.baddbmm(_ignored(acc, q.device), q3, k3.transpose(1, 2), beta=0, alpha=scale)  # [R, g, S]: Eq. (z)
    if logit_clamp is not None:
        z.clamp_(-logit_clamp, logit_clamp)
    a = None
    if gate is not None:
        a = gate.reshape(R, g, 1) if t == 1 else gate.view(B, H_kv, g, t).transpose(2, 3).reshape(R, g, 1)
        a = a if a.dtype == acc else a.to(acc)
    if variant == "adaptive":  # log max(α, ε) on local and sink slots, log max(1 − α, ε) on the skip slot
        if gate_is_sigmoid:  # α = ε + (1 − 2ε)·σ lies in [ε, 1 − ε]: the clip folds into the rows, no max
            z.add_(torch.addcmul(*_prior_rows(kind, eps, acc), a).log_())
        else:
            z.add_(torch.addcmul(*_prior_rows(kind, 0.0, acc), a).clamp_min_(eps).log_())
    elif variant == "fixed":
        log_local, log_skip = log_priors(variant, None, prior, eps)
        z.add_(torch.tensor((log_local, log_skip), dtype=acc, device=z.device).index_select(0, kind))
    if valid is not None:
        z.view(B * H_kv, t, g, S).masked_fill_(~valid[:, None, :], float("-inf"))
    if variant == "separate" and n_skip:  # Variant 1: α·softmax(local and sinks) and (1 − α)·softmax(skip)
        skip = z[..., n_local:n_local + n_skip]
        local = torch.cat([z[..., :n_local], z[..., n_local + n_skip:]], -1)
        if valid is None:
            has_skip = torch.ones(1, 1, 1, dtype=torch.bool, device=z.device)
        else:  # [t, 1, 1] -> one per row of z
            has_skip = valid[:, None, n_local:n_local + n_skip].any(-1, keepdim=True)
            has_skip = has_skip.expand(t, g, 1).repeat(B * H_kv, 1, 1)
        skip_w = torch.softmax(torch.where(has_skip, skip, torch.zeros_like(skip)), -1) * has_skip
        a = torch.where(has_skip, a, torch.ones_like(a))
        local_w = a * torch.softmax(local, -1)
        w = torch.cat([local_w[..., :n_local], (1 - a) * skip_w, local_w[..., n_local:]], -1)
    else:  # one softmax ("separate" with no skip slot, period <= window, is the local softmax alone)
        w = torch.softmax(z, -1)
    y = torch.bmm(w, v3)
    y = y.view(B, H, 1, D) if t == 1 else y.view(B, H_kv, t, g, D).transpose(2, 3).reshape(B, H, t, D)
    return y if y.dtype == out_dtype else y.to(out_dtype)
