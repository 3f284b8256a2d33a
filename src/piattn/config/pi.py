"""The settings of the π-Attention operator, their defaults (written here once) and their allowed ranges.

Defaults are the paper's (Table app_pi): window k = 4, period π = 16, adaptive fusion, logit clamp 20,
gate clip ε = 1e-4; the fixed prior α = 0.5 is Variant 2's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from ..checks import is_int

VARIANTS = ("union", "separate", "fixed", "adaptive")
# Variants whose local/skip prior is the per-query gate α (and so need a gate MLP).
GATED_VARIANTS = ("separate", "adaptive")



@dataclass(frozen=True)
class PiSettings:
    """The operator's knobs, beyond the tensors: see `piattn.pi_attention` for their meaning.

    window: local radius k >= 0; period: skip distance π >= 1, or a tuple of them, one per query head
    (multi-scale π; a sequence is stored as a tuple, one whose entries are all equal as their int, so that
    `period` is an int exactly when every head shares it); variant: one of VARIANTS; prior: the
    constant α of variant "fixed", in (0, 1); logit_clamp: > 0 or None (no clamp); eps: gate floor in
    (0, 0.5); sinks: the first `sinks` keys of each document are visible to all its later queries (0: none).
    """

    window: int = 4
    period: int | tuple[int, ...] = 16
    variant: str = "adaptive"
    prior: float = 0.5
    logit_clamp: float | None = 20.0
    eps: float = 1e-4
    sinks: int = 0

    def __post_init__(self):
        object.__setattr__(self, "period", canonical_period(self.period))
        self.check()

    def check(self) -> None:
        """ValueError naming the setting and what it allows, for the first one out of range."""
        check_pi_settings(window=self.window, period=period_tuple(self.period)[0], variant=self.variant,
                          prior=self.prior, logit_clamp=self.logit_clamp, eps=self.eps, sinks=self.sinks)

    @property
    def gated(self) -> bool:
        """Whether the variant reads a per-query gate α."""
        return self.variant in GATED_VARIANTS

    @property
    def reach(self) -> int:
        """How far back a causal query looks: besides its document's first `sinks` keys, it reads no key
        older than i − max(window, period) (the largest period, with one per head)."""
        return max(self.window, *period_tuple(self.period))

    def as_kwargs(self) -> dict:
        # A shallow dict, not dataclasses.asdict: asdict deep-copies each value, which torch 2.11's dynamo
        # refuses to trace on Python 3.11 (a layer's forward calls this under torch.compile). The fields
        # are ints, floats, strings and tuples of ints, so nothing is shared that could be mutated.
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def period_tuple(period) -> tuple[int, ...]:
    """A period setting's entries, in head order: (period,) for an int (as given), a sequence's ints as a
    tuple. ValueError naming `period` for anything else; the range of an int is `check_pi_settings`'s, and
    the head count is the operator's (`piattn.ops.pi.validate.head_periods`, which also spreads an int over
    the heads)."""
    if is_int(period):
        return (period,)
    allowed = "an int >= 1 or a sequence of ints >= 1, one per query head"
    if not isinstance(period, Sequence) or isinstance(period, (str, bytes)) or len(period) == 0:
        raise ValueError(f"period must be {allowed}; got {period!r}")
    for h, p in enumerate(period):
        if not is_int(p) or p < 1:
            raise ValueError(f"period[{h}] must be an int >= 1, got {p!r}; period must be {allowed}")
    return tuple(int(p) for p in period)


def canonical_period(period) -> int | tuple[int, ...]:
    """The canonical (stored) form of a period setting: an int, or a tuple of per-head ints with at least two
    distinct values (a sequence of equal entries becomes their int). ValueError naming `period` for anything
    else (`period_tuple`)."""
    periods = period_tuple(period)
    return periods[0] if len(set(periods)) == 1 else periods


def check_pi_settings(*, window, period, variant, prior, logit_clamp, eps, sinks=0) -> None:
    """The range checks of `PiSettings` with one period, for callers that hold the values loose (the
    operator itself and the decoding functions, which call this once per distinct period)."""
    if not is_int(window) or window < 0:
        raise ValueError(f"window must be an int >= 0, got {window!r}")
    if not is_int(period) or period < 1:
        if isinstance(period, Sequence) and not isinstance(period, (str, bytes)):
            raise ValueError(f"period must be one int >= 1 here, got per-head periods {period!r}: they run in "
                             f"pi_attention, the layers and models (cached decoding and sequence parallelism "
                             f"included), pi_attention_weights and convert_to_pi, which call this once per period")
        raise ValueError(f"period must be an int >= 1, got {period!r}")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if not isinstance(prior, (int, float)) or isinstance(prior, bool) or not 0.0 < prior < 1.0:
        raise ValueError(f"prior must lie in (0, 1), got {prior!r}")
    if logit_clamp is not None and (not isinstance(logit_clamp, (int, float)) or not logit_clamp > 0):
        raise ValueError(f"logit_clamp must be a number > 0, or None (no clamp), got {logit_clamp!r}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0.0 < eps < 0.5:
        raise ValueError(f"eps must lie in (0, 0.5), got {eps!r}")
    if not is_int(sinks) or sinks < 0:
        raise ValueError(f"sinks must be an int >= 0 (0: no sink keys), got {sinks!r}")


PI_DEFAULTS = PiSettings()
