"""Streaming generation: constant-size caches for windowed attention, and sampling."""

from .cache import Cache, GrowingCache, RingCache
from .sampling import check_sampling, sample_next

__all__ = ["Cache", "GrowingCache", "RingCache", "check_sampling", "sample_next"]
