"""Attention layers, one module per kind, and the registry models pick them from by name."""

from .pi import PiAttention

ATTENTION: dict[str, type] = {"pi": PiAttention}

__all__ = ["ATTENTION", "PiAttention"]
