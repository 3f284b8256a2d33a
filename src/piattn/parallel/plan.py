"""Which key/value rows each rank of a sequence-parallel π-Attention needs, and where they sit.

P ranks hold contiguous shards of S positions each: rank r owns [rS, rS + S) of a sequence of T = P·S.
Query i reads keys i + o for o in {−k … 0} ∪ {−π} (causal) or {−k … k} ∪ {±π} (bidirectional), positions
outside [0, T) masked. So rank r needs, besides its own rows,

    left halo   [rS − k, rS)            left skip block   [rS − π, rS + S − π)
    right halo  [rS + S, rS + S + k)    right skip block  [rS + π, rS + S + π)    (bidirectional only)

clipped to [0, T). The rank runs the ordinary operator on an *extended* array of rows (its own rows plus
the received ones, queries zero in the received rows, their outputs dropped), laid out so that the
operator's offsets land on the right keys:

- **contiguous** (π ≤ S + k, or π ≤ k): the extended array is every position of
  [rS − R, rS + S + R') ∩ [0, T) with R = max(k, π) (R' = R bidirectional, 0 causal), and the operator
  runs with its own window and period. Exact because offsets are preserved and positions outside [0, T)
  are outside the array. For π ≤ S + k the halo and the skip block touch, so this is exactly the needed
  rows.
- **gapped** (π > S + k): the skip blocks lie beyond the halos with a gap between; the array is
  [left skip block, left halo, own rows, right halo, right skip block] (each clipped to [0, T)) and the
  operator runs with period' = S + k. For own row i = rS + j, its array index is e = |left skip| +
  |left halo| + j, and

  * the left skip key e − (S + k) is row i − π of the left skip block when that block is whole
    (|left skip| = S, |left halo| = k); when its front is clipped at 0 the block starts at position 0 and
    the arithmetic still gives index i − π, negative (masked) exactly when i − π < 0. When the left halo
    is clipped (rS < k), rS + S − π < rS − k < 0, so the skip block is empty and the array starts at
    position 0: indices equal positions and both the window and the skip offset are exact.
  * the right skip key e + (S + k) is row i + π of the right skip block when the right halo is whole
    (k rows); rows past T are clipped off the end, so they fall past the array and are masked. When the
    right halo is clipped (rS + S + k > T), rS + π > rS + S + k > T and there is no right skip block:
    e + S + k lies past the array, masked as i + π > T is.
  * the window e − k … e + k stays inside [halo, own, halo] (the halos have k rows, or are clipped where
    the sequence ends, where the array ends too), and never reaches a skip block.

  period' = S + k > k, so the skip slot stays a skip slot, with the skip prior.

Every rank computes every rank's plan from (P, S, k, π, causal) alone, so senders know what to send without
a handshake.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from ..checks import is_int

Interval = tuple[int, int]  # positions [start, end)



@dataclass(frozen=True)
class Transfer:
    """Rows [start, end) of the sequence, owned by `src`, placed at row `at` of `dst`'s received block."""

    src: int
    dst: int
    start: int
    end: int
    at: int

    @property
    def rows(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class HaloPlan:
    """The exchange of one sequence-parallel π-Attention call: `world` ranks of `shard` positions each."""

    world: int
    shard: int
    window: int
    period: int
    causal: bool

    def __post_init__(self):
        for name, low in (("world", 1), ("shard", 1), ("window", 0), ("period", 1)):
            value = getattr(self, name)
            if not is_int(value) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if not isinstance(self.causal, bool):
            raise ValueError(f"causal must be True or False, got {self.causal!r}")

    @property
    def length(self) -> int:
        """T = world · shard."""
        return self.world * self.shard

    @property
    def gapped(self) -> bool:
        """Whether the skip blocks are separated from the halos (π > S + k); see the module docstring."""
        return self.period > self.shard + self.window

    @property
    def ext_period(self) -> int:
        """The period the operator runs with on the extended array."""
        return self.shard + self.window if self.gapped else self.period

    def own(self, rank: int) -> Interval:
        self._check_rank(rank)
        return rank * self.shard, (rank + 1) * self.shard

    def segments(self, rank: int) -> tuple[Interval, ...]:
        """The extended array of `rank` as position intervals in array order (own rows included, some
        intervals possibly empty). Positions increase along the array."""
        T, k, p = self.length, self.window, self.period
        a, b = self.own(rank)
        clip = lambda x: min(max(x, 0), T)
        if not self.gapped:
            reach = max(k, p)
            right = 0 if self.causal else reach
            return (clip(a - reach), a), (a, b), (b, clip(b + right))
        left = ((clip(a - p), clip(b - p)), (clip(a - k), a), (a, b))
        if self.causal:
            return left
        return (*left, (b, clip(b + k)), (clip(a + p), clip(b + p)))

    def own_offset(self, rank: int) -> int:
        """Row of the extended array at which `rank`'s own rows start."""
        a, _ = self.own(rank)
        return sum(e - s for s, e in self.segments(rank) if e <= a)

    def needs(self, rank: int) -> tuple[Interval, ...]:
        """The non-empty intervals of other ranks' rows `rank` receives, in array order."""
        own = self.own(rank)
        return tuple(seg for seg in self.segments(rank) if seg != own and seg[1] > seg[0])

    @cached_property
    def _transfers(self) -> tuple[tuple[Transfer, ...], ...]:
        out = []
        for dst in range(self.world):
            rows, at = [], 0
            for start, end in self.needs(dst):
                pos = start
                while pos < end:  # split the interval by owner
                    src = pos // self.shard
                    stop = min(end, (src + 1) * self.shard)
                    rows.append(Transfer(src, dst, pos, stop, at))
                    at += stop - pos
                    pos = stop
            out.append(tuple(rows))
        return tuple(out)

    def receives(self, rank: int) -> tuple[Transfer, ...]:
        """Everything `rank` receives, in the order of its received block."""
        self._check_rank(rank)
        return self._transfers[rank]

    def sends(self, rank: int) -> tuple[Transfer, ...]:
        """Everything `rank` sends, ordered by destination, then by the destination's received block."""
        self._check_rank(rank)
        return tuple(t for dst in range(self.world) for t in self._transfers[dst] if t.src == rank)

    def rows_received(self, rank: int) -> int:
        return sum(t.rows for t in self.receives(rank))

    def rows_sent(self, rank: int) -> int:
        return sum(t.rows for t in self.sends(rank))

    def max_rows_received(self) -> int:
        return max(self.rows_received(r) for r in range(self.world))

    def bytes_per_rank(self, *, batch: int, heads: int, head_dim: int, dtype_bytes: int) -> dict:
        """Bytes the busiest rank sends and receives in one layer's forward (keys and values) and
        backward (their gradients, the same rows in the other direction)."""
        per_row = 2 * batch * heads * head_dim * dtype_bytes  # a key and a value row
        recv = self.max_rows_received() * per_row
        sent = max(self.rows_sent(r) for r in range(self.world)) * per_row
        return {"forward_recv": recv, "forward_sent": sent, "backward_recv": sent, "backward_sent": recv}

    def _check_rank(self, rank: int) -> None:
        if not is_int(rank) or not 0 <= rank < self.world:
            raise ValueError(f"rank must be an int in [0, {self.world}), got {rank!r}")
