"""The bounded decoding cache of a converted model: per layer, the last max(window, period) + 1 positions
(the layer's largest period) and each row's first `sinks` positions of text."""

from __future__ import annotations

import torch
from transformers import Cache
from transformers.cache_utils import DynamicLayer

from .attention import HFPiSettings, dense_kv_heads


class PiCacheLayer(DynamicLayer):
    """One layer's bounded cache: each row's first `sinks` positions of text and the last min(seen, capacity)
    positions, in one ring written in place.

    Storage: `kv` [2, B, Hkv, sinks + size, D], keys then values in one contiguous block (as the compiled
    decoding step reads a ring: `piattn.ops.pi.decode_native`), made at the first update and grown by doubling up to
    size = capacity (a short text never holds a long layer's whole ring):

    - slots 0 … sinks − 1: row b's sinks, positions text_start[b] … text_start[b] + sinks − 1 (`sink_keys`,
      `sink_values` [B, Hkv, sinks, D]: views; None with sinks = 0 or before the first update). The converted
      model sets `text_start` [B] from the padding mask before each update (None: every row starts at 0); a
      sink slot is written when its position arrives.
    - slot sinks + p mod capacity: position p, for the last min(seen, capacity) positions (`keys`, `values`
      [B, Hkv, size, D]: views of the ring in slot order, not oldest first; `ordered()` reads them oldest
      first, `positions` says which they are). Until the ring is full, position p is in slot sinks + p.

    `update(k, v)` of t new positions [B, Hkv, t, D]:

    - t = 1 (a decoding step): writes the position into its slot, overwriting the oldest, and returns the
      ring itself, (keys, values) in slot order, with `stored_in_ring` True: O(1) per step, where
      concatenating and trimming copied the whole ring twice per step and layer. The attention function
      (`pi_attention_forward`) reads the ring by slot (the layer's `DecodePlan`, as the decoding layers read a
      `RingCache`), or `ordered()` off its decoding path.
    - t > 1 (a prompt, or a step of a few tokens): returns the stored positions oldest first followed by the
      new ones [B, Hkv, n + t, D] (n = min(seen, capacity); one copy, none for the first update), as a
      DynamicLayer does, and writes the last min(t, capacity) of them into the ring; `stored_in_ring` False.
      The queries of a few-token step may read positions that writing them overwrites, hence the block.

    Dense heads (`dense_heads`, the layer's key/value heads that `convert_to_pi(dense_heads=...)` kept dense):
    besides the ring, every position of those heads in `dense_kv` [2, B, len(dense_heads), size, D], grown by
    doubling; `dense_keys`, `dense_values` [B, len(dense_heads), seen, D] are its views of the positions seen,
    which the attention function reads for those heads. The ring keeps all heads (the π operator runs on all
    of them), so a dense head costs its ring slots twice: capacity positions beside the seen ones.
    """

    is_sliding = True
    is_croppable = False  # dropped positions cannot come back

    def __init__(self, capacity: int, sinks: int = 0, dense_heads: tuple[int, ...] = ()):
        super().__init__()
        self.dense_heads = tuple(dense_heads)
        self.dense_kv: torch.Tensor | None = None
        self.capacity = capacity
        self.sinks = sinks
        self.cumulative_length = 0  # positions seen; the name lets CacheLayerMixin.reset zero it
        self.text_start: torch.Tensor | None = None
        self.kv: torch.Tensor | None = None
        self.sink_keys: torch.Tensor | None = None
        self.sink_values: torch.Tensor | None = None
        self.stored_in_ring = False  # whether the last update wrote in place and returned the ring (t = 1)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """An empty ring (size 0) beside the sink slots, in the dtype and on the device of key_states."""
        B, Hkv, _, D = key_states.shape
        self.device, self.dtype = key_states.device, key_states.dtype
        self._store(key_states.new_zeros(2, B, Hkv, self.sinks, D))
        self.is_initialized = True

    def _store(self, kv: torch.Tensor) -> None:
        """Make kv [2, B, Hkv, sinks + size, D] the storage, and keys, values, sink_keys, sink_values its views."""
        self.kv = kv
        self.keys, self.values = kv[0, :, :, self.sinks:], kv[1, :, :, self.sinks:]
        if self.sinks:
            self.sink_keys, self.sink_values = kv[0, :, :, :self.sinks], kv[1, :, :, :self.sinks]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store key_states, value_states [B, Hkv, t, D] of positions seen … seen + t − 1; returns the ring
        (t = 1) or the stored positions and the new ones oldest first (t > 1): see the class."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        else:
            # One cache serves one batch of one model: say so, rather than fail on the sizes of a copy.
            held, new = self.kv.shape, key_states.shape
            if len(new) != 4 or (held[1], held[2], held[4]) != (new[0], new[1], new[3]):
                raise ValueError(f"key_states must have shape [B, Hkv, t, D] = [{held[1]}, {held[2]}, t, {held[4]}] "
                                 f"like the positions this cache holds, got {tuple(new)}: a cache serves one batch of "
                                 "one model")
        seen, t = self.cumulative_length, key_states.shape[-2]
        if self.dense_heads:
            self._keep_dense(key_states, value_states, seen)
        if self.sinks and (self.text_start is not None or seen < self.sinks):
            self._keep_sinks(key_states, value_states)  # else no sink position can be among the new ones
        self._reserve(seen + t)
        if t == 1:
            slot = seen % self.capacity
            self.keys[:, :, slot:slot + 1].copy_(key_states)
            self.values[:, :, slot:slot + 1].copy_(value_states)
            self.cumulative_length = seen + 1
            self.stored_in_ring = True
            return self.keys, self.values
        if seen:
            old_k, old_v = self._read(seen - min(seen, self.capacity), seen)
            keys, values = torch.cat([*old_k, key_states], 2), torch.cat([*old_v, value_states], 2)
        else:
            keys, values = key_states, value_states
        keep = min(t, self.capacity)
        for slot, offset, length in self._runs(seen + t - keep, keep):
            first = t - keep + offset
            self.keys[:, :, slot:slot + length].copy_(key_states[:, :, first:first + length])
            self.values[:, :, slot:slot + length].copy_(value_states[:, :, first:first + length])
        self.cumulative_length = seen + t
        self.stored_in_ring = False
        return keys, values

    def _keep_dense(self, k: torch.Tensor, v: torch.Tensor, seen: int) -> None:
        """Append the dense heads of k, v [B, Hkv, t, D] (positions seen … seen + t − 1) to `dense_kv`, doubling
        its length when full."""
        index = torch.tensor(self.dense_heads, device=k.device)
        k, v = k.index_select(1, index), v.index_select(1, index)
        B, Hd, t, D = k.shape
        size = 0 if self.dense_kv is None else self.dense_kv.shape[3]
        if seen + t > size:
            kv = k.new_zeros(2, B, Hd, max(seen + t, 2 * size), D)
            if self.dense_kv is not None:
                kv[:, :, :, :seen] = self.dense_kv[:, :, :, :seen]
            self.dense_kv = kv
        self.dense_kv[0, :, :, seen:seen + t] = k
        self.dense_kv[1, :, :, seen:seen + t] = v

    @property
    def dense_keys(self) -> torch.Tensor | None:
        """Keys [B, len(dense_heads), seen, D] of the dense heads at every position seen (None: none stored)."""
        return None if self.dense_kv is None else self.dense_kv[0, :, :, :self.cumulative_length]

    @property
    def dense_values(self) -> torch.Tensor | None:
        """Values [B, len(dense_heads), seen, D] of the dense heads at every position seen."""
        return None if self.dense_kv is None else self.dense_kv[1, :, :, :self.cumulative_length]

    @property
    def nbytes(self) -> int:
        """Bytes this layer holds now: its ring and sinks, and its dense heads' storage."""
        return sum(t.nbytes for t in (self.kv, self.dense_kv) if t is not None)

    def _reserve(self, seen: int) -> None:
        """Grow the ring (doubling, at most to `capacity`) until it has a slot for each of the last
        min(seen, capacity) positions. A ring smaller than capacity has never wrapped (it holds positions
        0 … seen − 1 in slots sinks + p), so growing copies it as it lies."""
        size = self.keys.shape[2]
        need = min(seen, self.capacity)
        if need <= size:
            return
        two, B, Hkv, _, D = self.kv.shape
        kv = self.kv.new_zeros(two, B, Hkv, self.sinks + min(self.capacity, max(need, 2 * size)), D)
        kv[:, :, :, :self.sinks + size] = self.kv
        self._store(kv)

    def _runs(self, first: int, count: int) -> list[tuple[int, int, int]]:
        """(ring slot, offset among the positions, length) of the at most two runs of ring slots that hold
        positions first … first + count − 1 (count <= capacity)."""
        slot = first % self.capacity
        head = min(count, self.capacity - slot)
        return [(slot, 0, head)] + ([(0, head, count - head)] if count > head else [])

    def _read(self, first: int, end: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Views [B, Hkv, ·, D] of the runs of ring slots that hold positions first … end − 1, oldest first."""
        runs = self._runs(first, end - first)
        return ([self.keys[:, :, s:s + n] for s, _, n in runs], [self.values[:, :, s:s + n] for s, _, n in runs])

    def ordered(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, Hkv, n, D] of the stored ring positions oldest first (`positions`), n =
        min(seen, capacity): a view of the ring while it has not wrapped, else one copy."""
        if not self.is_initialized:
            raise ValueError("this PiCache layer holds nothing yet")
        k, v = self._read(self.cumulative_length - min(self.cumulative_length, self.capacity), self.cumulative_length)
        return (k[0], v[0]) if len(k) == 1 else (torch.cat(k, 2), torch.cat(v, 2))

    def _keep_sinks(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Copy the sink positions among the new ones, k, v [B, Hkv, n, D] at positions seen … seen + n − 1,
        into the sink slots."""
        B, Hkv, n, D = k.shape
        start = self.text_start if self.text_start is not None else torch.zeros(B, dtype=torch.long)
        index = start.to(k.device)[:, None] + torch.arange(self.sinks, device=k.device) - self.cumulative_length
        arrived = ((index >= 0) & (index < n))[:, None, :, None]  # [B, 1, sinks, 1]
        g = index.clamp(0, n - 1)[:, None, :, None].expand(B, Hkv, self.sinks, D)
        self.sink_keys.copy_(torch.where(arrived, k.gather(2, g), self.sink_keys))
        self.sink_values.copy_(torch.where(arrived, v.gather(2, g), self.sink_values))

    @property
    def positions(self) -> torch.Tensor:
        """Absolute positions of the stored ring keys, oldest first (those of `ordered()`): [n] int64."""
        n = min(self.cumulative_length, self.capacity) if self.is_initialized else 0
        return torch.arange(self.cumulative_length - n, self.cumulative_length)

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return self.capacity

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        n = min(self.cumulative_length, self.capacity) if self.is_initialized else 0
        return n + query_length, self.cumulative_length - n

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise ValueError("PiCache has dropped old positions and cannot be cropped")

    def reset(self) -> None:
        super().reset()
        self.text_start = self.kv = self.sink_keys = self.sink_values = self.dense_kv = None
        self.stored_in_ring = False

    # The batch-row operations act on the one storage (keys, values and sinks are its views), and on the text
    # starts; the base classes' would replace `keys` and `values` by copies detached from it.
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._rows(lambda t, dim: t.index_select(dim, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._rows(lambda t, dim: t.repeat_interleave(repeats, dim=dim))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._rows(lambda t, dim: t[(slice(None),) * dim + (indices,)])

    def _rows(self, pick) -> None:
        """Apply a batch-row selection pick(tensor, batch dim) to the storage and the text starts."""
        if self.kv is not None:
            self._store(pick(self.kv, 1))
        if self.dense_kv is not None:
            self.dense_kv = pick(self.dense_kv, 1)
        if self.text_start is not None:
            self.text_start = pick(self.text_start, 0)

    def offload(self) -> None:
        if self.is_initialized:
            self._store(self.kv.to("cpu", non_blocking=True))
            if self.dense_kv is not None:
                self.dense_kv = self.dense_kv.to("cpu", non_blocking=True)

    def prefetch(self) -> None:
        if self.is_initialized and self.kv.device != self.device:
            self._store(self.kv.to(self.device, non_blocking=True))
            if self.dense_kv is not None:
                self.dense_kv = self.dense_kv.to(self.device, non_blocking=True)


class PiCache(Cache):
    """Decoding cache of a converted model: per layer, max(window, period) + 1 positions (that layer's
    largest period, with per-head or per-layer periods) and the `sinks` first positions of each row's text,
    whatever the length.

    A layer with dense key/value heads (`convert_to_pi(dense_heads=...)`) also keeps every position of those
    heads (`PiCacheLayer`), so its memory grows with the text; `nbytes_by_layer` says what each layer holds.

    Pass it to `model.generate(..., cache=PiCache(model.config))` or to a forward call.
    """

    def __init__(self, config):
        capacities, sinks = _needs(config)
        self.dense_heads = _dense(config)
        super().__init__(layers=[PiCacheLayer(capacity, sinks, dense)
                                 for capacity, dense in zip(capacities, self.dense_heads, strict=True)])
        # What it was made for: (layers, ring capacity per layer, sinks).
        self.made_for = (config.num_hidden_layers, capacities, sinks)
        self._accepted = None  # the settings that `check` last accepted

    def check(self, config) -> None:
        """Refuse (ValueError) a model this cache was not made for: another depth, a pattern reaching farther
        back than its ring, or another number of sinks (the attention would otherwise fail deep inside, or
        index past the sink copies).

        Every layer asks on every step: settings it accepted last (`HFPiSettings.of` returns the same object
        while the config's settings and sizes stay the same: the object is resolved for one number of layers)
        are accepted at once, instead of working out every layer's ring again (a millisecond per step of a
        30-layer model)."""
        settings = HFPiSettings.of(config)
        if settings is self._accepted:
            return
        capacities, sinks = _needs(config)
        layers, made, made_sinks = self.made_for
        if config.num_hidden_layers != layers or any(n > m for n, m in zip(capacities, made, strict=False)) \
                or sinks != made_sinks:
            raise ValueError(f"cache was made for {layers} layers, rings of {_sizes(made)} positions and {made_sinks} "
                             f"sinks, but this model has {config.num_hidden_layers} layers and needs "
                             f"{_sizes(capacities)} positions and {sinks} sinks: make it with PiCache(model.config)")
        if _dense(config) != self.dense_heads:
            raise ValueError(f"cache was made for dense key/value heads {self.dense_heads} per layer, but this model "
                             f"has {_dense(config)}: make it with PiCache(model.config)")
        self._accepted = settings

    @property
    def nbytes(self) -> int:
        return cache_nbytes(self)

    @property
    def nbytes_by_layer(self) -> list[int]:
        """Bytes each layer holds now (ring, sinks and dense heads); they sum to `nbytes`."""
        return [layer.nbytes for layer in self.layers]


def _dense(config) -> tuple[tuple[int, ...], ...]:
    """The dense key/value heads of each layer of a converted model's config (`dense_kv_heads`)."""
    return tuple(dense_kv_heads(config, i) for i in range(config.num_hidden_layers))


def _needs(config) -> tuple[tuple[int, ...], int]:
    """(ring capacity of each layer: its reach + 1, sinks) of a converted model's config."""
    settings = HFPiSettings.of(config)
    return tuple(settings.layer(i).reach + 1 for i in range(config.num_hidden_layers)), settings.pi.sinks


def _sizes(capacities: tuple[int, ...]) -> str:
    """"9" when every layer's ring holds 9 positions, else "(9, 17)"."""
    return str(capacities[0]) if len(set(capacities)) == 1 else str(tuple(capacities))


def cache_nbytes(cache: Cache) -> int:
    """Bytes of the keys and values a transformers `Cache` holds now (any cache type, PiCache's sinks and dense
    heads included)."""
    held = [(layer.keys, layer.values, getattr(layer, "sink_keys", None), getattr(layer, "sink_values", None),
             getattr(layer, "dense_kv", None)) for layer in cache.layers]
    return sum(t.nbytes for tensors in held for t in tensors if t is not None)
