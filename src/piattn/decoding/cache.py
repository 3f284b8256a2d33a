"""Decoding caches: a fixed-size ring per layer for windowed attention, a growing one for dense.

Decoding position t with π-Attention reads keys t−window … t and t−π, so a ring of
max(window, period) + 1 positions per layer is exact: its size never depends on how far the text has run.
Keys are stored after RoPE (rotated at their own absolute position), so they never need touching again.
"""

from __future__ import annotations

import torch


class RingCache:
    """Keys and values of the last `capacity` positions of one layer: [B, H, capacity, D] each.

    Position p lives in slot p mod capacity; `recent()` reads the live slots back in position order.
    """

    def __init__(self, batch_size: int, n_heads: int, head_dim: int, capacity: int, *,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        shape = (batch_size, n_heads, capacity, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.capacity, self.seen = capacity, 0
        # Slot of every position in a run of up to `capacity` starting anywhere: slicing it costs one op
        # per decoding step instead of an arange and a modulo.
        self._slots = torch.arange(2 * capacity, device=device) % capacity

    def recent(self) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [B, H, n, D] of positions seen−n … seen−1, n = min(seen, capacity), oldest first."""
        n = min(self.seen, self.capacity)
        start = (self.seen - n) % self.capacity
        slots = self._slots[start:start + n]
        return self.k.index_select(2, slots), self.v.index_select(2, slots)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [B, H, t, D] of positions seen … seen+t−1 (only the last `capacity` can matter)."""
        t = k.shape[2]
        keep = min(t, self.capacity)
        start = (self.seen + t - keep) % self.capacity
        slots = self._slots[start:start + keep]
        self.k.index_copy_(2, slots, k[:, :, t - keep:].to(self.k.dtype))
        self.v.index_copy_(2, slots, v[:, :, t - keep:].to(self.v.dtype))
        self.seen += t

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class GrowingCache:
    """Every key and value seen so far, [B, H, seen, D] each: what dense attention must keep."""

    def __init__(self, batch_size: int, n_heads: int, head_dim: int, *,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32):
        shape = (batch_size, n_heads, 0, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.seen = 0

    def recent(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k, self.v

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k = torch.cat([self.k, k.to(self.k.dtype)], 2)
        self.v = torch.cat([self.v, v.to(self.v.dtype)], 2)
        self.seen += k.shape[2]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


LayerCache = RingCache | GrowingCache


class Cache:
    """One cache per layer of a model; `position` = tokens seen, `nbytes` = bytes held now."""

    def __init__(self, layers: list[LayerCache]):
        self.layers = layers

    @property
    def position(self) -> int:
        return self.layers[0].seen if self.layers else 0

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)
