"""The attention kinds by name, and the one answer to "which kinds can do X", asked of each kind's class.

A capability is one of:
- a boolean class variable of `AttentionLayer` that a kind sets (`sequence_parallel`, `grouped_query`,
  `documents`, `ring_step`);
- "decoding": the kind sets `cache_capacity`, so it decodes incrementally;
- a model setting it takes (a `ModelConfig` field such as "window", "sinks", "backend";
  `AttentionLayer.model_settings`).

Training flags scoped by a capability (`piattn.config.flags.Capability`), the refusals of `AttentionLayer`
and the tests all ask `kinds_with`, so a new kind is its module plus its line in `ATTENTION`.
"""

from __future__ import annotations

import dataclasses

from ..config import ModelConfig
from ..config.flags import answer_capabilities
from .base import AttentionLayer
from .bigbird import BigBirdAttention
from .dense import DenseAttention
from .local import LocalAttention
from .longformer import LongformerAttention
from .pi import PiAttention
from .reformer import ReformerAttention

ATTENTION: dict[str, type[AttentionLayer]] = {
    "bigbird": BigBirdAttention,
    "dense": DenseAttention,
    "local": LocalAttention,
    "longformer": LongformerAttention,
    "pi": PiAttention,
    "reformer": ReformerAttention,
}

# The capabilities `AttentionLayer` declares as boolean class variables (False unless a kind sets them).
DECLARED = tuple(name for name, value in vars(AttentionLayer).items() if isinstance(value, bool))
MODEL_SETTINGS = tuple(f.name for f in dataclasses.fields(ModelConfig))
CAPABILITIES = (*DECLARED, "decoding", *MODEL_SETTINGS)


def attention_class(name: str) -> type[AttentionLayer]:
    """The module class registered under `name`; ValueError listing the registered names otherwise."""
    if name not in ATTENTION:
        raise ValueError(f"attention must be one of {sorted(ATTENTION)}, got {name!r}")
    return ATTENTION[name]


def check_capability(capability: str) -> None:
    """ValueError unless `capability` is one of CAPABILITIES (a misspelt one would match no kind)."""
    if capability not in CAPABILITIES:
        raise ValueError(f"capability must be one of {list(CAPABILITIES)}, got {capability!r}")


def has_capability(kind: type[AttentionLayer], capability: str) -> bool:
    """Whether the attention class `kind` has `capability`."""
    check_capability(capability)
    if capability in DECLARED:
        return getattr(kind, capability)
    if capability == "decoding":
        return kind.cache_capacity is not AttentionLayer.cache_capacity
    return capability in kind.model_settings()


def kinds_with(capability: str) -> tuple[str, ...]:
    """The registered kinds that have `capability`, sorted."""
    check_capability(capability)
    return tuple(sorted(name for name, kind in ATTENTION.items() if has_capability(kind, capability)))


# The --attention flags scoped by a capability are checked against this registry, whatever is registered then.
answer_capabilities("attention", kinds_with)
