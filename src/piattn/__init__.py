"""piattn: π-Attention, a local window plus one long-range key π positions away under one softmax."""

from . import layers
from .layers import PiAttention
from .ops.pi import BACKENDS, pi_attention

__all__ = ["BACKENDS", "PiAttention", "layers", "pi_attention"]
__version__ = "0.1.0"
