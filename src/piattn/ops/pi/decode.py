"""`pi_decode` and `decode_ring`: the last rows of the causal π-Attention operator, from the keys they read.

A decoding step adds t (usually 1) query rows at the end of a causal sequence whose keys are cached. Query i
reads at most window + 2 + sinks keys (i − window … i, i − period, then the sink keys 0 … sinks − 1; `Pattern`
slot order), so a step gathers exactly those, scores them, clamps, adds the variant's log priors (`log_priors`),
takes one small softmax (two for "separate") and the weighted sum of the gathered values: O(t·(window + 2 +
sinks)·D) work, no blocking, no dropout (decoding runs in eval). Its rows equal the last t rows of
`pi_attention` (causal) on the N given rows; positions before the first given key count as outside the text,
as they do for the full operator, and the sinks are the first given rows.

Every decoding call goes through a `DecodePlan` (`decode_plan.py`): built once per layer (here once per call's
settings, remembered), it holds the slot tables of every query head and the steps that run them
(`decode_steps.py`: the compiled C step, `decode_native.py`, where it takes the call, else the torch ops,
`decode_torch.py`). This module is the checked front door: `pi_decode` (keyword settings, a block of keys) and
`decode_ring` (an `OpSettings`, one query read from a ring cache), whose checks (`check_ring`) name the argument
at the first inconsistency in one line.

Grouped-query attention (k, v with H_kv heads dividing the H of q): the H / H_kv query heads of a group are
scored against the one gathered copy of their key/value head; nothing is repeated. Per-head periods
(multi-scale π): `decode_ring` takes settings whose period is one per query head; `pi_decode` takes one period.
"""

from __future__ import annotations

import functools

import torch

from ...checks import is_int
from ...config.pi import GATED_VARIANTS, PI_DEFAULTS, check_pi_settings, period_tuple
from .decode_plan import DecodePlan, decode_plan, decode_settings  # noqa: F401 (public: the plan and its settings)
from .decode_torch import TORCH_OPS_VARIANTS, gate_tail  # noqa: F401 (public: the torch step's variants, the gate)
from .settings import OpSettings
from .validate import check_qkv_tensors, head_periods, validate_gate


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
    validate_gate(q, gate, variant)
    settings = OpSettings(window=window, period=period, causal=True, variant=variant, prior=prior,
                          logit_clamp=logit_clamp, eps=eps, scale=q.shape[3]**-0.5 if scale is None else scale,
                          dropout_p=0.0, sinks=sinks)
    return decode_plan(settings, q.shape[1], device=q.device).rows(q, (k, v), gate)


def decode_ring(q: torch.Tensor, kv_store: torch.Tensor, gate: torch.Tensor | None, settings: OpSettings, *,
                capacity: int, position: int,
                gate_head: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The row of one new query at `position`, read straight from a ring cache's storage, checked.

    q [B, H, 1, D]; kv_store [2, B, H_kv, sinks + capacity, D], keys then values, of a `RingCache` that
    already holds the new key (capacity >= max(window, period) + 1, or > position while the ring still holds
    every position; H_kv dividing H); gate [B, H, 1] α or None; settings the call's `OpSettings` (causal, no
    dropout, the scale resolved: `decode_settings`; the period one int or one per query head). With gate_head =
    (weight [H, n_hidden], bias [H]), the last layer of the gate MLP (variant "adaptive" only), gate is instead
    the MLP's hidden pre-activation [B, 1, n_hidden] and α = ε + (1 − 2ε)·σ(weight·GELU(gate) + bias) is computed
    in the step. Inconsistent arguments raise ValueError (`check_ring`); then the plan of the settings and ring
    reads the row (`DecodePlan.rows`): one call of the compiled step where it takes the call, else the torch ops.
    """
    check_ring(q, kv_store, gate, capacity, position, settings, gate_head)
    return decode_plan(settings, q.shape[1], capacity=capacity, device=q.device).rows(q, kv_store, gate, gate_head,
                                                                                     position)


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
    Its period may be one period per query head: each distinct one is checked, and the ring must
    reach as far as the largest.
    """
    if type(settings) is not OpSettings:
        raise ValueError(f"settings must be an OpSettings (`decode_settings` builds one from a PiSettings), got "
                         f"{type(settings).__name__}")
    window, period, causal, variant, prior, logit_clamp, eps, scale, dropout_p, sinks = settings
    if causal is not True or dropout_p != 0:
        raise ValueError(f"decoding is causal and without dropout: settings must have causal=True and "
                         f"dropout_p=0.0, got causal={causal!r}, dropout_p={dropout_p!r}")
    for p in dict.fromkeys(period_tuple(period)):  # each distinct period once, in head order
        _settings_checked(window, p, variant, prior, logit_clamp, eps, sinks)
    period = max(period_tuple(period))
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
    head_periods(settings.period, H)  # ValueError unless one period or one per query head
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

