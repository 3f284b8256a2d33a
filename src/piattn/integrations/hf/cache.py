"""The bounded decoding cache of a converted model: per layer, the last max(window, period) + 1 positions
(the layer's largest period) and each row's first `sinks` positions of text."""

from __future__ import annotations

import torch
from transformers import Cache
from transformers.cache_utils import DynamicLayer

from .attention import HFPiSettings


class PiCacheLayer(DynamicLayer):
    """One layer's keys and values [B, Hkv, n, D] of the last n = min(seen, capacity) positions, and a copy of
    each row's sink keys, sink_keys/sink_values [B, Hkv, sinks, D] (None until the first update, or with
    sinks = 0).

    `update` returns the stored positions followed by the new ones (not the sinks: the attention function
    reads those from here), then keeps the last `capacity`. Row b's sinks are positions text_start[b] …
    text_start[b] + sinks − 1; the converted model sets `text_start` [B] from the padding mask before each
    update (None: every row starts at position 0). A sink slot is written when its position arrives.
    """

    is_sliding = True
    is_croppable = False  # dropped positions cannot come back

    def __init__(self, capacity: int, sinks: int = 0):
        super().__init__()
        self.capacity = capacity
        self.sinks = sinks
        self.cumulative_length = 0  # positions seen; the name lets CacheLayerMixin.reset zero it
        self.text_start: torch.Tensor | None = None
        self.sink_keys: torch.Tensor | None = None
        self.sink_values: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.is_initialized and self.keys.dim() == 4:
            # One cache serves one batch of one model: say so, rather than let torch.cat fail on the sizes.
            held, new = self.keys.shape, key_states.shape
            if (held[0], held[1], held[3]) != (new[0], new[1], new[3]):
                raise ValueError(f"key_states must have shape [B, Hkv, t, D] = [{held[0]}, {held[1]}, t, {held[3]}] "
                                 f"like the positions this cache holds, got {tuple(new)}: a cache serves one batch of "
                                 "one model")
        if self.sinks:
            self._keep_sinks(key_states, value_states)
        keys, values = super().update(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        if keys.shape[-2] > self.capacity:
            # Copies, not views: a view would keep the whole concatenation's storage alive.
            self.keys = keys[..., -self.capacity :, :].clone()
            self.values = values[..., -self.capacity :, :].clone()
        return keys, values

    def _keep_sinks(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Copy the sink positions among the new ones, k, v [B, Hkv, n, D] at positions seen … seen + n − 1."""
        B, Hkv, n, D = k.shape
        if self.sink_keys is None:
            self.sink_keys = k.new_zeros(B, Hkv, self.sinks, D)
            self.sink_values = v.new_zeros(B, Hkv, self.sinks, D)
        start = self.text_start if self.text_start is not None else torch.zeros(B, dtype=torch.long)
        index = start.to(k.device)[:, None] + torch.arange(self.sinks, device=k.device) - self.cumulative_length
        arrived = ((index >= 0) & (index < n))[:, None, :, None]  # [B, 1, sinks, 1]
        g = index.clamp(0, n - 1)[:, None, :, None].expand(B, Hkv, self.sinks, D)
        self.sink_keys = torch.where(arrived, k.gather(2, g), self.sink_keys)
        self.sink_values = torch.where(arrived, v.gather(2, g), self.sink_values)

    @property
    def positions(self) -> torch.Tensor:
        """Absolute positions of the stored ring keys, oldest first: [n] int64."""
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

    def reset(self) -> None:
        super().reset()
        self.text_start = self.sink_keys = self.sink_values = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._rows(lambda t: t[indices])

    def _rows(self, pick) -> None:
        """Apply a batch-row selection to the sink copies and the text starts, as the base class does to the ring."""
        for name in ("text_start", "sink_keys", "sink_values"):
            if getattr(self, name) is not None:
                setattr(self, name, pick(getattr(self, name)))


class PiCache(Cache):
    """Decoding cache of a converted model: per layer, max(window, period) + 1 positions (that layer's
    largest period, with per-head or per-layer periods) and the `sinks` first positions of each row's text,
    whatever the length.

    Pass it to `model.generate(..., past_key_values=PiCache(model.config))` or to a forward call.
    """

    def __init__(self, config):
        capacities, sinks = _needs(config)
        super().__init__(layers=[PiCacheLayer(capacity, sinks) for capacity in capacities])
        # What it was made for: (layers, ring capacity per layer, sinks).
        self.made_for = (config.num_hidden_layers, capacities, sinks)

    def check(self, config) -> None:
        """Refuse (ValueError) a model this cache was not made for: another depth, a pattern reaching farther
        back than its ring, or another number of sinks (the attention would otherwise fail deep inside, or
        index past the sink copies)."""
        capacities, sinks = _needs(config)
        layers, made, made_sinks = self.made_for
        if config.num_hidden_layers != layers or any(n > m for n, m in zip(capacities, made, strict=False)) \
                or sinks != made_sinks:
            raise ValueError(f"cache was made for {layers} layers, rings of {_sizes(made)} positions and {made_sinks} "
                             f"sinks, but this model has {config.num_hidden_layers} layers and needs "
                             f"{_sizes(capacities)} positions and {sinks} sinks: make it with PiCache(model.config)")

    @property
    def nbytes(self) -> int:
        return cache_nbytes(self)


def _needs(config) -> tuple[tuple[int, ...], int]:
    """(ring capacity of each layer: its reach + 1, sinks) of a converted model's config."""
    settings = HFPiSettings.of(config)
    return tuple(settings.layer(i).reach + 1 for i in range(config.num_hidden_layers)), settings.pi.sinks


def _sizes(capacities: tuple[int, ...]) -> str:
    """"9" when every layer's ring holds 9 positions, else "(9, 17)"."""
    return str(capacities[0]) if len(set(capacities)) == 1 else str(tuple(capacities))


def cache_nbytes(cache: Cache) -> int:
    """Bytes of the keys and values a transformers `Cache` holds now (any cache type, PiCache's sinks included)."""
    held = [(layer.keys, layer.values, getattr(layer, "sink_keys", None), getattr(layer, "sink_values", None))
            for layer in cache.layers]
    return sum(t.nbytes for tensors in held for t in tensors if t is not None)
