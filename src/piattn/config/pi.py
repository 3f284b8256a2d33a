"""The settings of the π-Attention operator, their defaults (written here once) and their allowed ranges.

Defaults are the paper's (Table app_pi): window k = 4, period π = 16, adaptive fusion, logit clamp 20,
gate clip ε = 1e-4; the fixed prior α = 0.5 is Variant 2's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

VARIANTS = ("union", "separate", "fixed", "adaptive")
# Variants whose local/skip prior is the per-query gate α (and so need a gate MLP).
GATED_VARIANTS = ("separate", "adaptive")


def is_int(x) -> bool:
    """An int that is not a bool (True would otherwise pass as 1)."""
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class PiSettings:
    """The operator's knobs, beyond the tensors: see `piattn.pi_attention` for their meaning.

    window: local radius k >= 0; period: skip distance π >= 1; variant: one of VARIANTS; prior: the
    constant α of variant "fixed", in (0, 1); logit_clamp: > 0 or None (no clamp); eps: gate floor in
    (0, 0.5); sinks: the first `sinks` keys of each document are visible to all its later queries (0: none).
    """

    window: int = 4
    period: int = 16
    variant: str = "adaptive"
    prior: float = 0.5
    logit_clamp: float | None = 20.0
    eps: float = 1e-4
    sinks: int = 0

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        """ValueError naming the setting and what it allows, for the first one out of range."""
        check_pi_settings(**dataclasses.asdict(self))

    @property
    def gated(self) -> bool:
        """Whether the variant reads a per-query gate α."""
        return self.variant in GATED_VARIANTS

    @property
    def reach(self) -> int:
        """How far back a causal query looks: besides its document's first `sinks` keys, it reads no key
        older than i − max(window, period)."""
        return max(self.window, self.period)

    def as_kwargs(self) -> dict:
        return dataclasses.asdict(self)


def check_pi_settings(*, window, period, variant, prior, logit_clamp, eps, sinks=0) -> None:
    """The range checks of `PiSettings`, for callers that hold the values loose (the operator itself)."""
    if not is_int(window) or window < 0:
        raise ValueError(f"window must be an int >= 0, got {window!r}")
    if not is_int(period) or period < 1:
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
