"""The built-in attention kinds, registered by name in `ATTENTION`; which kinds can do what is asked of each
kind's class (`kinds_with`, beside the registry in base.py, below every kind).

A capability is one of:
- a boolean class variable of `AttentionLayer` that a kind sets (`sequence_parallel`, `grouped_query`,
  `documents`, `ring_step`);
- "decoding": the kind sets `cache_capacity`, so it decodes incrementally;
- "reach": the kind declares the lags its layers reach (`lag_reach`), so the copy-distance classes and the
  reachability marks of `piattn eval` can be asked of it;
- a model setting it takes (a `ModelConfig` field such as "window", "sinks", "backend";
  `AttentionLayer.model_settings`).

Training flags scoped by a capability (`piattn.config.flags.Capability`), the refusals of `AttentionLayer`
and the tests all ask `kinds_with`, so a new kind is its module plus its line in `ATTENTION`.
"""

from __future__ import annotations

from ..config.flags import Registry
from .base import ATTENTION, AttentionLayer, kinds_with
from .bigbird import BigBirdAttention
from .dense import DenseAttention
from .local import LocalAttention
from .longformer import LongformerAttention
from .neighbourhood import NeighbourhoodAttention
from .pi import PiAttention
from .reformer import ReformerAttention
from .strided import StridedAttention

ATTENTION.update({
    "bigbird": BigBirdAttention,
    "dense": DenseAttention,
    "local": LocalAttention,
    "longformer": LongformerAttention,
    "neighbourhood": NeighbourhoodAttention,
    "pi": PiAttention,
    "reformer": ReformerAttention,
    "strided": StridedAttention,
})


def attention_class(name: str) -> type[AttentionLayer]:
    """The module class registered under `name`; ValueError listing the registered names otherwise."""
    if name not in ATTENTION:
        raise ValueError(f"attention must be one of {sorted(ATTENTION)}, got {name!r}")
    return ATTENTION[name]


def attention_registry() -> Registry:
    """The kinds as the training flags' checks take them (`TrainConfig.check(registries)`): their names now, and
    `kinds_with` to say which have a capability, asked at each check."""
    return Registry(tuple(ATTENTION), kinds_with)
