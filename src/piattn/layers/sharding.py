"""Model-level sequence parallelism: attention layers that run on this rank's shard of every sequence.

    with sequence_parallel(group):              # group: the ranks that share each sequence (P of them)
        logits = model(idx[:, r * S:(r + 1) * S])   # r = this rank in group, S = T / P

Inside the context every `AttentionLayer` takes its input x [B, S, d] as positions r·S … r·S + S − 1 of a
sequence of T = P·S positions: RoPE rotates q and k by those global positions, and the kinds whose
`attend` calls `pi_operator` (`pi`, `local`) reach the keys of other shards through
`piattn.parallel.sequence_parallel_pi_attention_with_settings` (a point-to-point halo exchange, exact in
forward and backward). Everything else in a Transformer (embedding, norms, the π gate MLP, the FFN, the LM head) works
per token, so it runs on the shard unchanged and no model class has sequence-parallel code. Other kinds,
and cached decoding, raise ValueError inside the context. See docs/sequence_parallel.md §5.

The context holds for the forward pass only; backward needs none (the exchange remembers its group).
"""

from __future__ import annotations

import contextlib
import threading
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import PiSettings
from ..ops.pi import pi_attention_with_settings
from ..parallel import sequence_parallel_pi_attention_with_settings


@dataclass(frozen=True)
class SequenceShard:
    """This process's place in a sequence group: rank `rank` of `size` ranks, over ProcessGroup `group`."""

    group: object
    rank: int
    size: int

    def offset(self, shard_len: int) -> int:
        """Position of this shard's first row in the whole sequence."""
        return self.rank * shard_len


_ACTIVE: ContextVar[SequenceShard | None] = ContextVar("piattn_sequence_shard", default=None)
# How many `sequence_parallel` contexts are open in this process, in any thread. While none is, the
# ContextVar is not read: torch.compile cannot trace ContextVar.get, and guards on this int instead.
_OPEN = 0
_OPEN_LOCK = threading.Lock()


def active_shard() -> SequenceShard | None:
    """The shard set by the innermost `sequence_parallel` context, or None (whole sequences)."""
    return _ACTIVE.get() if _OPEN else None


@contextlib.contextmanager
def sequence_parallel(group):
    """Run the forward passes inside as this rank's contiguous shard of sequences split over `group`.

    group: a torch.distributed ProcessGroup this process belongs to, or None (no sharding: a no-op, as is a
    group of one rank).
    """
    if group is None:
        yield None
        return
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"sequence_parallel: this process (global rank {dist.get_rank()}) is not a member "
                         "of the group")
    size = dist.get_world_size(group)
    shard = SequenceShard(group, rank, size) if size > 1 else None
    global _OPEN
    with _OPEN_LOCK:
        _OPEN += 1
    token = _ACTIVE.set(shard)
    try:
        yield shard
    finally:
        _ACTIVE.reset(token)
        with _OPEN_LOCK:
            _OPEN -= 1


def pi_operator(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None, settings: PiSettings,
                *, causal: bool = True, scale: float | None = None, dropout_p: float = 0.0,
                document_ids: torch.Tensor | None = None, backend: str = "auto", check_gate: bool = True
                ) -> torch.Tensor:
    """The π operator with the operator settings `settings` (a layer's `PiSettings`, handed over whole:
    `pi_attention_with_settings`), or, inside `sequence_parallel(group)`, the same operator on the sequence
    whose shard q, k, v [B, H, S, D] are (`sequence_parallel_pi_attention_with_settings` over group, with the
    same settings object). The keywords are the call's own, as `pi_attention`'s; check_gate: `pi_attention`'s
    (sequence-parallel calls check the gate as `sequence_parallel_pi_attention` does)."""
    shard = active_shard()
    if shard is None:
        return pi_attention_with_settings(q, k, v, gate, settings, causal=causal, scale=scale, dropout_p=dropout_p,
                                          document_ids=document_ids, backend=backend, check_gate=check_gate)
    return sequence_parallel_pi_attention_with_settings(q, k, v, gate, settings, group=shard.group, causal=causal,
                                                        scale=scale, dropout_p=dropout_p, document_ids=document_ids,
                                                        backend=backend)
