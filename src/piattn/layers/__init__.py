"""Attention layers, one module per kind, and the registry models pick them from by name.

Every kind subclasses `AttentionLayer` (shared projections and RoPE) and implements `attend`.
"""

from .base import AttentionLayer
from .dense import DenseAttention
from .local import LocalAttention
from .pi import PiAttention
from .reformer import ReformerAttention

ATTENTION: dict[str, type[AttentionLayer]] = {
    "dense": DenseAttention,
    "local": LocalAttention,
    "pi": PiAttention,
    "reformer": ReformerAttention,
}

__all__ = ["ATTENTION", "AttentionLayer", "DenseAttention", "LocalAttention", "PiAttention", "ReformerAttention"]
