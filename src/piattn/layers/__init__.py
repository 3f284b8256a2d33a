"""Attention layers, one module per kind, and the registry models pick them from by name.

Every kind subclasses `AttentionLayer` (shared projections and RoPE) and implements `attend`.
"""

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

__all__ = ["ATTENTION", "AttentionLayer", "BigBirdAttention", "DenseAttention", "LocalAttention",
           "LongformerAttention", "PiAttention", "ReformerAttention"]
