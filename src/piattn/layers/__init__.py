"""Attention layers, one module per kind, and the registry models pick them from by name.

Every kind subclasses `AttentionLayer` (shared projections and RoPE) and implements `attend`; `registry`
names the kinds (`ATTENTION`) and says which can do what (`kinds_with`).
`sequence_parallel(group)` (sharding.py) runs the kinds built on the π operator on a shard of each sequence.
"""

from .base import AttentionLayer
from .bigbird import BigBirdAttention
from .dense import DenseAttention
from .local import LocalAttention
from .longformer import LongformerAttention
from .neighbourhood import NeighbourhoodAttention
from .pi import PiAttention
from .reformer import ReformerAttention
from .registry import (
    ATTENTION,
    attention_class,
    attention_registry,
    kinds_with,
    layer_attention,
    model_kinds,
    model_reach,
)
from .sharding import sequence_parallel
from .strided import StridedAttention

__all__ = ["ATTENTION", "attention_class", "attention_registry", "kinds_with", "layer_attention", "model_kinds",
           "model_reach",
           "AttentionLayer", "BigBirdAttention",
           "DenseAttention", "LocalAttention", "LongformerAttention", "NeighbourhoodAttention", "PiAttention",
           "ReformerAttention", "StridedAttention", "sequence_parallel"]
