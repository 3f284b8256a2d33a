"""Decoding caches: a fixed-size ring per layer for windowed attention, a growing one for dense (allocated
once when the most positions it will hold are known). A hybrid stack's `Cache` holds one of each kind's.

Decoding position t with π-Attention reads keys t−window … t and t−π, so a ring of
max(window, period) + 1 positions per layer is exact: its size never depends on how far the text has run.
With a period per head (multi-scale π) the layer's ring holds max(window, largest period) + 1, shared by
all heads (`PiSettings.reach`).
With attention sinks it also reads positions 0 … sinks − 1, which the cache keeps in `sinks` fixed slots
besides the ring: still constant. Keys are stored after RoPE (rotated at their own absolute position), so
they never need touching again. Caches hold the layer's key/value heads (H_kv of grouped-query attention).

A cache knows what it was made for (batch, key/value heads, head width, and for a ring its capacity and
sinks): `check` refuses a layer that needs another, and `append` keys of another shape, in one line.
Another model's cache would otherwise give wrong rows without an error, or be read past its end.
"""

from __future__ import annotations

import torch

from ..checks import is_int

# Positions up to which a ring keeps the slot of every run as a table (2·capacity int64: 16 MiB at the bound),
# sliced in one op per decoding step; a longer ring computes them per read (an arange and a modulo) instead of
# holding a table that grows with the period (a period of 10⁹ asked 16 GB of it, whatever the batch).
SLOT_TABLE_MAX = 1 << 20


def device_memory(device: torch.device) -> int | None:
    """The bytes a new buffer on `device` can take at most: the memory available now (Linux MemAvailable on a
    CPU, free memory on CUDA), or None where that cannot be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def _refuse_beyond_memory(nbytes: int, what: str, device: torch.device | str | None, fix: str) -> None:
    """ValueError with the numbers when `nbytes` exceed what `device` (None: torch's default) has available now."""
    device = torch.get_default_device() if device is None else torch.device(device)
    available = device_memory(device)
    if available is not None and nbytes > available:
        raise ValueError(f"{what} needs {nbytes / 2**30:.1f} GiB, more than the {available / 2**30:.1f} GiB "
                         f"available on {device}: {fix}")


def _check_sizes(**sizes: int) -> None:
    for name, (value, least) in sizes.items():
        if not is_int(value) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")


def _check_rows(cache: RingCache | GrowingCache, k: torch.Tensor, v: torch.Tensor) -> None:
    """k, v [B, H_kv, t, D] with the cache's B, H_kv, D (no broadcasting: one sequence's keys written into
    every row of a larger batch would go unnoticed)."""
    B, H, D = cache.batch_size, cache.n_heads, cache.head_dim
    for name, x in (("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[0] != B or x.shape[1] != H or x.shape[3] != D:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must have shape [B, H_kv, t, D] = [{B}, {H}, t, {D}] of this cache, got {shape}")
    if v.shape != k.shape:
        raise ValueError(f"k and v must share one shape, got k {tuple(k.shape)}, v {tuple(v.shape)}")


def _check_use(cache: RingCache | GrowingCache, batch_size: int, n_heads: int, head_dim: int) -> None:
    """The part of `check` both kinds share: the rows of the batch and the heads' shape."""
    made = (cache.batch_size, cache.n_heads, cache.head_dim)
    if made != (batch_size, n_heads, head_dim):
        raise ValueError(f"cache was made for batch {made[0]} with {made[1]} key/value heads of width {made[2]}, "
                         f"but this layer runs batch {batch_size} with {n_heads} of width {head_dim}: make the "
                         f"cache with the model's init_cache({batch_size})")


class RingCache:
    """Keys and values of the first `sinks` and the last `capacity` positions of one layer:
    [B, H_kv, sinks + capacity, D] each.

    Position p < sinks lives in slot p (and in the ring too while the ring holds it); position p lives in
    ring slot sinks + p mod capacity. `recent()` reads the live positions back in the order an operator on
    a contiguous block needs. Keys and values share one buffer `kv` [2, B, H_kv, sinks + capacity, D]
    (`k`, `v` are its two halves), so a decoding step gathers both with one op.
    """

    def __init__(self, batch_size: int, n_heads: int, head_dim: int, capacity: int, *, sinks: int = 0,
                 max_positions: int | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32):
        """max_positions: the most positions this cache will be given (None: no limit). A ring that holds
        them all never overwrites one, so it serves a layer that asks for a longer ring (a period longer
        than the text: `init_cache(..., max_positions=)`); storing more than max_positions is refused."""
        _check_sizes(batch_size=(batch_size, 0), n_heads=(n_heads, 1), head_dim=(head_dim, 1), capacity=(capacity, 1),
                     sinks=(sinks, 0))
        if max_positions is not None:
            _check_sizes(max_positions=(max_positions, 1))
        self.max_positions = max_positions
        self.batch_size, self.n_heads, self.head_dim = batch_size, n_heads, head_dim
        table = 2 * capacity + sinks if capacity <= SLOT_TABLE_MAX else 0
        _refuse_beyond_memory(
            2 * batch_size * n_heads * (sinks + capacity) * head_dim * dtype.itemsize + 8 * table,
            f"a ring cache of {capacity:,} positions and {sinks} sinks for batch {batch_size}", device,
            "pass max_positions (the prompt plus the tokens to generate) to init_cache to size the ring to what "
            "decoding reaches")
        self.kv = torch.zeros((2, batch_size, n_heads, sinks + capacity, head_dim), device=device, dtype=dtype)
        self.k, self.v = self.kv[0], self.kv[1]
        self.capacity, self.sinks, self.seen = capacity, sinks, 0
        # Slot of every position in a run of up to `capacity` starting anywhere (then the sink slots): slicing
        # it costs one op per decoding step instead of an arange and a modulo (up to SLOT_TABLE_MAX).
        self._slots = torch.cat([sinks + torch.arange(2 * capacity, device=device) % capacity,
                                 torch.arange(sinks, device=device)]) if table else None
        self._recent: dict[tuple[int, int], torch.Tensor] = {}
        # What `check` accepted, (batch_size, n_heads, head_dim, capacity, sinks): a model's layers ask the same
        # on every step of generation, and the answer depends on nothing that changes.
        self._accepted: set[tuple] = set()
        # Per ring slot, the views of k and v that `append_token` writes: one copy each instead of an indexing.
        self._slot_views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def check(self, *, batch_size: int, n_heads: int, head_dim: int, capacity: int | None, sinks: int) -> None:
        """Refuse (ValueError) a layer that needs something else than this cache was made for: batch,
        key/value heads and head width equal, a ring of at least `capacity` positions (None: the layer reads
        every position, which no ring holds) and exactly `sinks` sink slots (the slot of every position
        depends on them). Asked again with what it accepted before, it answers at once."""
        key = (batch_size, n_heads, head_dim, capacity, sinks)
        if key in self._accepted:
            return
        _check_use(self, batch_size, n_heads, head_dim)
        if capacity is None:
            raise ValueError(f"cache is a ring of {self.capacity} positions, but this layer reads every position: "
                             "it needs a GrowingCache, from the model's init_cache")
        holds_every_position = self.max_positions is not None and self.capacity >= self.max_positions
        if (self.capacity < capacity and not holds_every_position) or self.sinks != sinks:
            raise ValueError(f"cache was made for a ring of {self.capacity} positions and {self.sinks} sinks, but "
                             f"this layer needs at least {capacity} positions and {sinks} sinks: make the cache "
                             f"with the model's init_cache")
        self._accepted.add(key)

    def recent_slots(self) -> torch.Tensor:
        """The slots `recent()` reads, int64 [m + n] (see there)."""
        n = min(self.seen, self.capacity)
        m = min(self.sinks, self.seen - n)
        start = (self.seen - n) % self.capacity
        if not m:
            return self._run(start, n)
        if self._slots is None:
            return torch.cat([torch.arange(m, device=self.kv.device), self._run(start, n)])
        key = (m, start)
        if key not in self._recent:  # at most `capacity` distinct ones once the sinks have left the ring
            self._recent[key] = torch.cat([self._slots[2 * self.capacity:2 * self.capacity + m],
                                           self._run(start, n)])
        return self._recent[key]

    def _run(self, start: int, n: int) -> torch.Tensor:
        """The ring slots of n consecutive positions from ring offset `start`, int64 [n]."""
        if self._slots is not None:
            return self._slots[start:start + n]
        return self.sinks + (start + torch.arange(n, device=self.kv.device)) % self.capacity

    def recent(self) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [B, H, m + n, D]: positions 0 … m − 1, then seen−n … seen−1, n = min(seen, capacity),
        m = min(sinks, seen − n), the sinks the ring no longer holds.

        When m > 0 the two runs are not adjacent in the text, but reading them as one block of m + n
        positions changes nothing for a query after them: every key it reads in the window or at −period
        is in the ring (the ring reaches back `capacity` − 1 positions), and the m sinks are farther back
        than that both in the text and in the block, so they are read as sinks only.
        """
        slots = self.recent_slots()
        return self.k.index_select(2, slots), self.v.index_select(2, slots)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [B, H, t, D] of positions seen … seen+t−1 (only the last `capacity` and the first
        `sinks` positions can matter). The cache keeps values, not autograd graphs (decoding is inference)."""
        _check_rows(self, k, v)
        k, v = k.detach(), v.detach()
        t = k.shape[2]
        if self.max_positions is not None and self.seen + t > self.max_positions:
            raise ValueError(f"cache was made for at most {self.max_positions} positions (init_cache's "
                             f"max_positions) and holds {self.seen}; {t} more do not fit: make it with a larger "
                             f"max_positions, or None")
        if t == 1 and self.seen >= self.sinks:  # the decoding step: one slot, no index tensor
            slot = self.sinks + self.seen % self.capacity
            self.k[:, :, slot:slot + 1] = k
            self.v[:, :, slot:slot + 1] = v
            self.seen += 1
            return
        if self.seen < self.sinks:  # some of these are sinks: slots seen … min(sinks, seen + t) − 1
            n = min(self.sinks, self.seen + t) - self.seen
            self.k[:, :, self.seen:self.seen + n] = k[:, :, :n]
            self.v[:, :, self.seen:self.seen + n] = v[:, :, :n]
        keep = min(t, self.capacity)
        start = (self.seen + t - keep) % self.capacity
        slots = self._run(start, keep)
        self.k.index_copy_(2, slots, k[:, :, t - keep:].to(self.k.dtype))
        self.v.index_copy_(2, slots, v[:, :, t - keep:].to(self.v.dtype))
        self.seen += t

    def next_token_slot(self) -> int | None:
        """The ring row the next position goes to, for a step that writes it itself (the compiled one-token step
        of a decoding layer, which then calls `token_stored`); None where `append` must store it (a sink
        position, or one more than max_positions, which `append` refuses)."""
        if self.seen < self.sinks or (self.max_positions is not None and self.seen >= self.max_positions):
            return None
        return self.sinks + self.seen % self.capacity

    def token_stored(self) -> None:
        """The next position was written into row `next_token_slot()` by the caller: count it as seen."""
        self.seen += 1

    def append_token(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """`append` of one token, k, v [B, H, 1, D], for a layer that `check` accepted and whose k, v have this
        cache's shape by construction (the decoding layers' one-token step, under no_grad): the slot's k and v
        views take one copy each, with no shape check (`append` has them). Positions that are sinks still go
        through `append`."""
        slot = self.next_token_slot()
        if slot is None:
            self.append(k, v)  # sink slots, or the refusal of one position too many
            return
        views = self._slot_views.get(slot)
        if views is None:
            views = self._slot_views[slot] = (self.k[:, :, slot:slot + 1], self.v[:, :, slot:slot + 1])
        views[0].copy_(k)
        views[1].copy_(v)
        self.seen += 1

    @property
    def nbytes(self) -> int:
        """Every buffer it holds: keys and values, the slot table and the sink-and-ring slot runs kept."""
        tables = [] if self._slots is None else [self._slots]
        return self.kv.nbytes + sum(t.nbytes for t in (*tables, *self._recent.values()))


class GrowingCache:
    """Every key and value seen so far, [B, H, seen, D] each: what dense attention must keep.

    max_positions: the most positions it will be given (prompt + new tokens), when known: the buffer is then
    allocated once at that size and `k`, `v` are views of its first `seen` positions (no copy of the whole
    cache per step); storing more is refused. None: the buffers grow by concatenation, with no limit."""

    def __init__(self, batch_size: int, n_heads: int, head_dim: int, *, max_positions: int | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32):
        _check_sizes(batch_size=(batch_size, 0), n_heads=(n_heads, 1), head_dim=(head_dim, 1))
        self.batch_size, self.n_heads, self.head_dim = batch_size, n_heads, head_dim
        self.max_positions, self._kv = max_positions, None
        if max_positions is not None:
            _check_sizes(max_positions=(max_positions, 1))
            _refuse_beyond_memory(2 * batch_size * n_heads * max_positions * head_dim * dtype.itemsize,
                                  f"a dense cache of {max_positions:,} positions for batch {batch_size}", device,
                                  "lower max_positions (the prompt plus the tokens to generate)")
            self._kv = torch.zeros((2, batch_size, n_heads, max_positions, head_dim), device=device, dtype=dtype)
            self.k, self.v = self._kv[0, :, :, :0], self._kv[1, :, :, :0]
        else:
            shape = (batch_size, n_heads, 0, head_dim)
            self.k = torch.zeros(shape, device=device, dtype=dtype)
            self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.seen = 0

    def check(self, *, batch_size: int, n_heads: int, head_dim: int, capacity: int | None, sinks: int) -> None:
        """Refuse (ValueError) a layer whose batch, key/value heads or head width differ from what this cache
        was made for; any `capacity` and `sinks` are served, since every position is kept."""
        _check_use(self, batch_size, n_heads, head_dim)

    def recent(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k, self.v

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        _check_rows(self, k, v)
        t = k.shape[2]
        if self._kv is None:
            self.k = torch.cat([self.k, k.to(self.k.dtype)], 2)
            self.v = torch.cat([self.v, v.to(self.v.dtype)], 2)
            self.seen += t
            return
        if self.seen + t > self.max_positions:
            raise ValueError(f"cache was made for at most {self.max_positions} positions (init_cache's "
                             f"max_positions) and holds {self.seen}; {t} more do not fit: make it with a larger "
                             f"max_positions, or None")
        self._kv[0, :, :, self.seen:self.seen + t] = k.detach()
        self._kv[1, :, :, self.seen:self.seen + t] = v.detach()
        self.seen += t
        self.k, self.v = self._kv[0, :, :, :self.seen], self._kv[1, :, :, :self.seen]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes if self._kv is None else self._kv.nbytes


LayerCache = RingCache | GrowingCache


class Cache:
    """One cache per layer of a model; `position` = tokens seen, `nbytes` = bytes held now."""

    def __init__(self, layers: list[LayerCache]):
        self.layers = layers

    def check(self, n_layers: int) -> None:
        """Refuse (ValueError) a model of another depth; each layer checks its own cache (`RingCache.check`)."""
        if len(self.layers) != n_layers:
            raise ValueError(f"cache was made for {len(self.layers)} layers, but this model has {n_layers}: make it "
                             "with the model's init_cache")

    @property
    def position(self) -> int:
        return self.layers[0].seen if self.layers else 0

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    @property
    def nbytes_by_layer(self) -> list[int]:
        """Bytes each layer's cache holds now (a ring stays constant, a growing cache grows with the text):
        what a hybrid stack's windowed and dense layers each cost; they sum to `nbytes`."""
        return [layer.nbytes for layer in self.layers]

    def describe(self) -> str:
        """One line per layer: its cache's kind, positions held and bytes, then the total."""
        lines = []
        for i, layer in enumerate(self.layers):
            if isinstance(layer, RingCache):
                held = f"ring of {layer.capacity} + {layer.sinks} sinks"
            elif layer.max_positions is not None:
                held = f"dense, {layer.seen} of {layer.max_positions} positions"
            else:
                held = f"growing, {layer.seen} positions"
            lines.append(f"layer {i}: {held}, {layer.nbytes:,} bytes")
        lines.append(f"total: {self.nbytes:,} bytes at position {self.position}")
        return "\n".join(lines)
