"""Streaming generation: constant-size caches for windowed attention, sampling, the `generate` command."""

from .cache import Cache, GrowingCache, RingCache
from .sampling import sample_next

__all__ = ["Cache", "GrowingCache", "RingCache", "sample_next"]
