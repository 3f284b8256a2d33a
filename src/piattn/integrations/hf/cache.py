"""The bounded decoding cache of a converted model: max(window, period) + 1 positions per layer."""

from __future__ import annotations

import torch
from transformers import Cache
from transformers.cache_utils import DynamicLayer

from .attention import HFPiSettings


class PiCacheLayer(DynamicLayer):
    """One layer's keys and values [B, Hkv, n, D] of the last n = min(seen, capacity) positions.

    `update` returns the stored positions followed by the new ones, then keeps the last `capacity`.
    """

    is_sliding = True
    is_croppable = False  # dropped positions cannot come back

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.cumulative_length = 0  # positions seen; the name lets CacheLayerMixin.reset zero it

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = super().update(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        if keys.shape[-2] > self.capacity:
            # Copies, not views: a view would keep the whole concatenation's storage alive.
            self.keys = keys[..., -self.capacity :, :].clone()
            self.values = values[..., -self.capacity :, :].clone()
        return keys, values

    @property
    def positions(self) -> torch.Tensor:
        """Absolute positions of the stored keys, oldest first: [n] int64."""
        n = self.keys.shape[-2] if self.is_initialized else 0
        return torch.arange(self.cumulative_length - n, self.cumulative_length)

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return self.capacity

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        n = self.keys.shape[-2] if self.is_initialized else 0
        return n + query_length, self.cumulative_length - n

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise ValueError("PiCache has dropped old positions and cannot be cropped")


class PiCache(Cache):
    """Decoding cache of a converted model: max(window, period) + 1 positions per layer, whatever the length.

    Pass it to `model.generate(..., past_key_values=PiCache(model.config))` or to a forward call.
    """

    def __init__(self, config):
        capacity = HFPiSettings.of(config).reach + 1
        super().__init__(layers=[PiCacheLayer(capacity) for _ in range(config.num_hidden_layers)])

    @property
    def nbytes(self) -> int:
        return cache_nbytes(self)


def cache_nbytes(cache: Cache) -> int:
    """Bytes of the keys and values a transformers `Cache` holds now (any cache type)."""
    return sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values) if t is not None)
