"""Attention layers, one module per kind, and the registry models pick them from by name.

Every kind subclasses `AttentionLayer` (shared projections and RoPE) and implements `attend`.
`sequence_parallel(group)` (sharding.py) runs the kinds built on the π operator on a shard of each sequence.
"""

from .base import AttentionLayer
from .bigbird import BigBirdAttention
from .dense import DenseAttention
from .local import LocalAttention
from .longformer import LongformerAttention
from .pi import PiAttention
from .reformer import ReformerAttention
from .sharding import sequence_parallel

ATTENTION: dict[str, type[AttentionLayer]] = {
    "bigbird": BigBirdAttention,
    "dense": DenseAttention,
    "local": LocalAttention,
    "longformer": LongformerAttention,
    "pi": PiAttention,
    "reformer": ReformerAttention,
}



def attention_class(name: str) -> type[AttentionLayer]:
    """The module class registered under `name`; ValueError listing the registered names otherwise."""
    if name not in ATTENTION:
        raise ValueError(f"attention must be one of {sorted(ATTENTION)}, got {name!r}")
    return ATTENTION[name]


__all__ = ["ATTENTION", "attention_class", "AttentionLayer", "BigBirdAttention", "DenseAttention", "LocalAttention",
           "LongformerAttention", "PiAttention", "ReformerAttention", "sequence_parallel"]
