"""The slot tables of a decoding plan: which key row each slot of each query head reads.

One form for every call: a table per query head (`[H, t·S]` rows and, where some slot reads nothing, a valid
mask `[H, t, S]`). One period is H equal rows; per-head periods (multi-scale π) give each head its own skip
key, and a head whose period lies within the window (no skip slot of its own, `Pattern`) gets an invalid slot
where the other heads' skip slot is, so that every head has the same slots in the same order (`Pattern` slot
order: local keys i − window … i, the skip i − π, then the sinks). A slot that reads nothing indexes key 0 (a
ring's row `sinks`).

- `block_slots`: t new queries over a block of N keys (the last t of them the queries' own): indices into the
  block.
- `ring_slots`: the first positions of a ring cache (`piattn.decoding.RingCache`: position p < sinks in slot p,
  position p in slot sinks + p mod capacity), before every key of the pattern exists; past them the plan
  reads its tables per phase of the ring (`DecodePlan.ring_slots`).
- `head_table`: what both are computed from, per set of periods.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from .pattern import Pattern


class HeadTable(NamedTuple):
    """The key offsets of every head's local and skip slots [H, n_local + n_skip] int64; whether each is a slot
    of the head's own pattern [H, n_local + n_skip] bool; each head's skip period [H, 1] (−1 without a skip slot
    of its own); the sink indices [1, sinks]; the valid mask once every key exists [H, 1, S] bool or None (all
    valid); kind [S] int64 (0: local prior, local and sink slots; 1: skip prior); n_local; n_skip."""

    offsets: torch.Tensor
    present: torch.Tensor
    skip_period: torch.Tensor
    sink_index: torch.Tensor
    steady_valid: torch.Tensor | None
    kind: torch.Tensor
    n_local: int
    n_skip: int


@functools.lru_cache(maxsize=256)
def head_table(window: int, periods: tuple[int, ...], sinks: int, device: torch.device) -> HeadTable:
    """The `HeadTable` of causal decoding with these settings, one period per query head."""
    patterns = [Pattern(window, p, causal=True, sinks=sinks) for p in periods]
    n_skip = max(pat.n_skip for pat in patterns)
    widest = next(pat for pat in patterns if pat.n_skip == n_skip)
    present = [[True] * len(pat.offsets) + [False] * (n_skip - pat.n_skip) for pat in patterns]
    steady = [row + [True] * sinks for row in present]
    return HeadTable(
        torch.tensor([list(pat.offsets) + [0] * (n_skip - pat.n_skip) for pat in patterns], device=device),
        torch.tensor(present, device=device),
        torch.tensor([[p if pat.n_skip else -1] for p, pat in zip(periods, patterns, strict=True)], device=device),
        torch.arange(sinks, device=device)[None, :],
        None if all(all(row) for row in steady) else torch.tensor(steady, device=device)[:, None, :],
        torch.tensor([0 if local else 1 for local in widest.slot_is_local()], device=device),
        widest.n_local, n_skip)


@functools.lru_cache(maxsize=256)
def block_slots(window: int, periods: tuple[int, ...], sinks: int, n_queries: int, n_keys: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """For t = n_queries new queries, the last of N = n_keys keys: (idx [H, t·S] into the N keys, valid
    [H, t, S] bool or None when every slot reads a key). A sink not yet reached, or already read as a local or
    skip key, reads nothing; so does a key before the first."""
    table = head_table(window, periods, sinks, device)
    positions = torch.arange(n_keys - n_queries, n_keys, device=device)[:, None]  # the queries' positions [t, 1]
    keys = table.offsets[:, None, :] + positions  # [H, t, n_local + n_skip]
    valid = (keys >= 0) & table.present[:, None, :]
    idx = keys.clamp(min=0)
    if sinks:
        back = positions - table.sink_index
        sink_valid = (back >= 0) & ~((back <= window) | (back == table.skip_period[:, :, None]))
        valid = torch.cat([valid, sink_valid], 2)
        idx = torch.cat([idx, torch.where(sink_valid, table.sink_index, 0)], 2)
    return idx.flatten(1), None if bool(valid.all()) else valid


@functools.lru_cache(maxsize=1024)
def ring_slots(window: int, periods: tuple[int, ...], sinks: int, capacity: int, position: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`block_slots` of the one query at `position` mapped onto a ring of `capacity` that has just stored it:
    (slot [H, S] rows of the ring's storage, valid [H, 1, S] or None). For the first positions of a ring,
    before every key of the pattern exists (`DecodePlan.ring_slots` reads the later ones per phase)."""
    idx, valid = block_slots(window, periods, sinks, 1, position + 1, device)
    n_ring = idx.shape[1] - sinks  # the local and skip slots: ring rows; the sink slots: the sinks' own rows
    return torch.cat([idx[:, :n_ring].remainder(capacity).add_(sinks), idx[:, n_ring:]], 1), valid
