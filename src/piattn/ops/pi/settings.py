"""`OpSettings`: the settings of one π-Attention call besides its tensors, in the one order they cross in.

A PyTorch custom operator takes ints, floats, bools and strs, not Python objects, so the backends'
operators (`compiled.py`, the end of `triton.py`) take a call's settings as separate arguments. Their
order is the order of `OpSettings`' fields, and only that: an operator's schema writes them with
`OpSettings.schema()`, its caller passes `*settings` (a NamedTuple is the tuple of its fields) and its
implementation reads them back with `OpSettings(*args)`. The tensors (q, k, v, gate, the dropout keep
mask, document_ids) are not settings: each operator names them in its own schema.
"""

from typing import NamedTuple

from ...config.pi import PiSettings
from .pattern import Pattern

# The schema type of each field's annotation, as torch.library.infer_schema writes it. (No `from __future__
# import annotations` in this module: the annotations must stay types, not strings.)
# The period field crosses as one int: per-head periods travel beside it as the operator's `int[] periods`
# (`to_op`, `from_op`).
_SCHEMA_TYPES = {int: "SymInt", int | tuple[int, ...]: "SymInt", bool: "bool", str: "str", float: "float",
                 float | None: "float?"}


class OpSettings(NamedTuple):
    """A checked call's settings besides its tensors, built once by `piattn.pi_attention` and handed to the
    backend (`backends.BackendRun`): see `pi_attention` for their meaning. scale is never None here; period
    is one int, or a tuple of one int per query head for a backend that takes them (`per_head_periods`).
    Decoding takes one too, causal and without dropout (`decode_plan.py`): `pi_decode` builds it from its
    keywords, a layer from its `PiSettings` (`decode_plan.decode_settings`, through `of`)."""

    window: int
    period: int | tuple[int, ...]
    causal: bool
    variant: str
    prior: float
    logit_clamp: float | None
    eps: float
    scale: float
    dropout_p: float
    sinks: int

    @classmethod
    def of(cls, pi: PiSettings, *, causal: bool, scale: float, dropout_p: float) -> "OpSettings":
        """The settings of a call with the operator settings `pi` (a `PiSettings`, checked when it was made),
        handed over whole, and the call's own: field by field, `pi`'s period as it is (one int, or a tuple of
        one per query head)."""
        return cls(window=pi.window, period=pi.period, causal=causal, variant=pi.variant, prior=pi.prior,
                   logit_clamp=pi.logit_clamp, eps=pi.eps, scale=scale, dropout_p=dropout_p, sinks=pi.sinks)

    @property
    def pattern(self) -> Pattern:
        return Pattern(self.window, self.period, self.causal, self.sinks)

    def to_op(self) -> "tuple[list[int], OpSettings]":
        """What an operator with an `int[] periods` argument takes for these settings: (periods, settings),
        periods empty for one period, else the per-head ints with the first of them in the period field (an
        operator's period argument is one int). `from_op` reads them back."""
        if isinstance(self.period, int):
            return [], self
        return list(self.period), self._replace(period=self.period[0])

    @classmethod
    def from_op(cls, periods, settings) -> "OpSettings":
        """An operator's settings read back: `periods` (its `int[] periods` argument: empty for one period,
        else one per query head) replaces the period field."""
        read = cls(*settings)
        return read._replace(period=tuple(periods)) if len(periods) else read

    @classmethod
    def schema(cls) -> str:
        """The fields as the arguments of an operator schema: "SymInt window, SymInt period, …"."""
        return ", ".join(f"{_SCHEMA_TYPES[cls.__annotations__[name]]} {name}" for name in cls._fields)
