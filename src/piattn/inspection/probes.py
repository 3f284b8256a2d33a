"""The attention probabilities of one layer, read three ways, none of them building [T, T] for a long text.

- **slots** (`WindowedAttention`: `pi`, `local`, the kinds that run on `pi_attention`): the operator's own
  weights over the slots of U(i), from `piattn.ops.pi.weights.pi_attention_weights` with the layer's
  `settings` (grouped-query heads, sinks and documents as the operator has them), [B, H, T, |U|], and
  the key each slot reads. Each slot has a key class: "local" (the window i − k … i (… i + k)), "skip"
  (i − π, then i + π) or "sink" (the first `sinks` keys of the query's document); the masses below are
  per class, so a class appears only where a model has slots of it.
- **dense rows** (`dense`): softmax(q·kᵀ/√D) for a chunk of query rows at a time, [B, H, rows, T], over
  the keys of the query's document (query head h reading key head h // (H / H_kv)).
- **probe** (any other `AttentionLayer`): attention is linear in v, so `attend(q, k, V, x)` with V the
  one-hot columns of some key positions returns exactly those columns of the layer's probabilities,
  D columns per call. Exact for every kind (longformer, bigbird, reformer, and the three above, which
  the tests check against it).

Masses per key class and the mean distance |i − j| are summed here per head, weighted by a query mask;
`capture.py` averages them over a data set. `document_ids` [B, T] (or None) are those the layer ran with.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..layers import AttentionLayer, DenseAttention
from ..layers.windowed import WindowedAttention
from ..ops.pi.dtypes import accumulation_dtype
from ..ops.pi.pattern import Pattern, document_bounds
from ..ops.pi.weights import SlotWeights, pi_attention_weights, settings_pattern

# The order key classes are reported and drawn in. "sink" is for attention sinks (docs/design.md §3.8); "all"
# is the one class of kinds whose keys are not split into local, skip and sink.
KEY_CLASSES = ("local", "skip", "sink", "all")
# query rows (dense) or key columns (probe) handled at once: bounds the [B, H, rows, T] working tensors
CHUNK = 256


def reader(layer: AttentionLayer) -> str:
    """How `layer`'s probabilities are read: "slots", "dense" or "probe"."""
    if isinstance(layer, WindowedAttention):
        return "slots"
    if isinstance(layer, DenseAttention):
        return "dense"
    return "probe"


def slot_classes(pattern: Pattern) -> tuple[str, ...]:
    """The key class of each slot of `pattern`, in slot order (design.md §3.1: a skip inside the band is local;
    §7: a sink slot reads only keys that are neither local nor skip)."""
    return ("local",) * pattern.n_local + ("skip",) * pattern.n_skip + ("sink",) * pattern.sinks


def layer_gate(layer: AttentionLayer, x: torch.Tensor) -> torch.Tensor | None:
    """The gate α̃ [B, H, T] the layer computes from its input x, or None for kinds and variants without one."""
    return layer.gate_values(x) if isinstance(layer, WindowedAttention) else None


def layer_weights(layer: WindowedAttention, q: torch.Tensor, k: torch.Tensor, gate: torch.Tensor | None,
                  document_ids: torch.Tensor | None = None) -> SlotWeights:
    """q [B, H, T, D], k [B, H_kv, T, D] of a layer that runs on `pi_attention`, gate [B, H, T] or None ->
    the operator's weights [B, H, T, |U|] with the key [B, T, |U|] each slot reads (`SlotWeights`;
    [B, H, T, |U|] with per-head periods).

    Each row sums to 1, with 0 on slots that read no key. Dropout is not applied (eval mode).
    """
    return pi_attention_weights(q, k, gate, settings=layer.settings, causal=layer.causal, document_ids=document_ids)


def slots_to_columns(slots: SlotWeights, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """The probabilities of queries `rows` on keys `cols`, [B, H, R, C], from the weights over slots."""
    w, key, valid = by_head(slots)
    B, H, T, _ = w.shape
    C = len(cols)
    column = torch.full((T,), C, dtype=torch.long, device=w.device)  # C: a key outside `cols`, dropped below
    column[cols] = torch.arange(C, device=w.device)
    index = torch.where(valid[:, :, rows], column[key[:, :, rows]], C)  # [B, 1 or H, R, |U|]
    out = w.new_zeros(B, H, len(rows), C + 1)
    out.scatter_add_(-1, index.expand(B, H, -1, -1), w[:, :, rows])
    return out[..., :C]


def by_head(slots: SlotWeights) -> SlotWeights:
    """`slots` with key and valid [B, 1 or H, T, |U|]: one key per head with per-head periods, else one
    shared by the heads (a broadcast dimension)."""
    w, key, valid = slots
    return slots if key.dim() == 4 else SlotWeights(w, key[:, None], valid[:, None])


def dense_rows(layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor,
               document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q·kᵀ/√D) of the queries `rows` over every key (causal: keys ≤ the query; with documents: keys
    of the query's document) -> [B, H, R, T]."""
    acc = accumulation_dtype(q.dtype)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    scores = q[:, :, rows].to(acc) @ k.to(acc).transpose(-1, -2) * q.shape[-1] ** -0.5
    T = k.shape[2]
    hidden = torch.zeros(1, len(rows), T, dtype=torch.bool, device=q.device)
    if layer.causal:
        hidden = hidden | (torch.arange(T, device=q.device)[None, :] > rows[:, None])
    if document_ids is not None:
        start, _ = document_bounds(document_ids)  # same document = same start
        hidden = hidden | (start[:, None, :] != start[:, rows, None])
    return torch.softmax(scores.masked_fill(hidden[:, None], float("-inf")), -1)


def probe_columns(layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, x: torch.Tensor, cols: torch.Tensor,
                  document_ids: torch.Tensor | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(key positions c, probabilities of every query on them [B, H, T, len(c)]) for chunks c of `cols`,
    by running the layer's own `attend` on one-hot values (D key columns per call; v has k's H_kv heads)."""
    B, H_kv, T, D = k.shape
    # Only kinds with `documents` take document_ids; the others never run with them (forward refuses).
    documents = {} if document_ids is None else {"document_ids": document_ids}
    for start in range(0, len(cols), D):
        c = cols[start:start + D]
        v = q.new_zeros(B, H_kv, T, D)
        v[:, :, c, torch.arange(len(c), device=q.device)] = 1.0
        p = layer.attend(q, k, v, x, **documents)[..., :len(c)]
        yield c, p.to(accumulation_dtype(q.dtype))


def columns(layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, x: torch.Tensor, rows: torch.Tensor,
            cols: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The probabilities of queries `rows` on keys `cols`, [B, H, R, C], whatever the kind."""
    how = reader(layer)
    if how == "slots":
        return slots_to_columns(layer_weights(layer, q, k, layer_gate(layer, x), document_ids), rows, cols)
    if how == "dense":
        return dense_rows(layer, q, k, rows, document_ids)[..., cols]
    return torch.cat([p[:, :, rows] for _, p in probe_columns(layer, q, k, x, cols, document_ids)], -1)


def masses(layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, x: torch.Tensor, mask: torch.Tensor,
           document_ids: torch.Tensor | None = None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """({key class: Σ over masked queries of its probability, [H]}, Σ over masked queries of the expected
    distance |i − j|, [H]) for one batch; `mask` [B, T] weights the queries (0 for padding)."""
    B, H, T, _ = q.shape
    m = mask.to(torch.float64)
    pos = torch.arange(T, device=q.device)
    how = reader(layer)
    if how == "slots":
        w, key, _ = by_head(layer_weights(layer, q, k, layer_gate(layer, x), document_ids))
        weighted = w.double() * m[:, None, :, None]
        sums: dict[str, torch.Tensor] = {}
        for cls, column in zip(slot_classes(settings_pattern(layer.settings, layer.causal)), weighted.unbind(-1),
                               strict=True):
            sums[cls] = sums.get(cls, 0) + column.sum((0, 2))
        distance = (pos[None, None, :, None] - key).abs().double()  # [B, 1 or H, T, |U|]; no key: weight 0
        return sums, (weighted * distance).sum((0, 2, 3))
    total = q.new_zeros(H, dtype=torch.float64)
    distance = q.new_zeros(H, dtype=torch.float64)
    if how == "dense":
        for start in range(0, T, CHUNK):
            rows = pos[start:start + CHUNK]
            p = dense_rows(layer, q, k, rows, document_ids).double() * m[:, None, rows, None]
            total += p.sum((0, 2, 3))
            distance += (p * (rows[:, None] - pos[None, :]).abs()).sum((0, 2, 3))
    else:
        for c, p in probe_columns(layer, q, k, x, pos, document_ids):
            p = p.double() * m[:, None, :, None]
            total += p.sum((0, 2, 3))
            distance += (p * (pos[:, None] - c[None, :]).abs()).sum((0, 2, 3))
    return {"all": total}, distance
