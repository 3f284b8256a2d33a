"""The attention probabilities of one layer, read three ways, none of them building [T, T] for a long text.

- **slots** (`pi`, `local`: the kinds that run on `pi_attention`): the probability of each candidate slot
  of `Pattern` (local keys i − k … i (… i + k), then skip keys i − π (then i + π)), [B, H, T, |U|],
  computed with the operator's formulation (`ops/pi/reference.py`: clamped scaled scores, the log priors
  of the variant, one softmax, or two mixed by α for "separate"). Each slot has a key class: "local" or
  "skip" (a kind with attention sinks would add slots of class "sink": the masses below are per class,
  so a class appears only where a model has slots of it).
- **dense rows** (`dense`): softmax(q·kᵀ/√D) for a chunk of query rows at a time, [B, H, rows, T].
- **probe** (any other `AttentionLayer`): attention is linear in v, so `attend(q, k, V, x)` with V the
  one-hot columns of some key positions returns exactly those columns of the layer's probabilities,
  D columns per call. Exact for every kind (longformer, bigbird, reformer, and the three above, which
  the tests check against it).

Masses per key class and the mean distance |i − j| are summed here per head, weighted by a query mask;
`capture.py` averages them over a data set.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..layers import AttentionLayer, DenseAttention
from ..ops.pi.pattern import Pattern, log_priors

# The order key classes are reported and drawn in. "sink" is for attention sinks (docs/design.md §7), which
# no kind has yet; "all" is the one class of kinds whose keys are not split into local and skip.
KEY_CLASSES = ("local", "skip", "sink", "all")
# query rows (dense) or key columns (probe) handled at once: bounds the [B, H, rows, T] working tensors
CHUNK = 256


def reader(layer: AttentionLayer) -> str:
    """How `layer`'s probabilities are read: "slots", "dense" or "probe"."""
    if isinstance(layer, DenseAttention):
        return "dense"
    if "period" in getattr(layer, "op_kwargs", {}):
        return "slots"
    return "probe"


def slot_pattern(layer: AttentionLayer) -> Pattern:
    kw = layer.op_kwargs
    return Pattern(kw["window"], kw["period"], kw["causal"])


def slot_classes(pattern: Pattern) -> tuple[str, ...]:
    """The key class of each slot of `pattern`, in slot order (design.md §3.1: a skip inside the band is local)."""
    return ("local",) * pattern.n_local + ("skip",) * len(pattern.skip_offsets)


def layer_gate(layer: AttentionLayer, x: torch.Tensor) -> torch.Tensor | None:
    """The gate α̃ [B, H, T] the layer computes from its input x, or None for kinds and variants without one."""
    gate_values = getattr(layer, "gate_values", None)
    return gate_values(x) if callable(gate_values) else None


def slot_probabilities(layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor,
                       gate: torch.Tensor | None) -> torch.Tensor:
    """q, k [B, H, T, D] of a layer that runs on `pi_attention`, gate [B, H, T] or None -> [B, H, T, |U|].

    Slot m of query i is the probability of key i + offsets[m] (0 where that key lies outside the text);
    each row sums to 1. Dropout is not applied (eval mode).
    """
    kw = layer.op_kwargs
    pattern = slot_pattern(layer)
    variant, eps = kw.get("variant", "union"), kw.get("eps", 1e-4)
    clamp, scale = kw.get("logit_clamp"), kw.get("scale") or q.shape[-1] ** -0.5
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k = q.to(acc), k.to(acc)
    gate = None if gate is None else gate.to(acc)
    B, H, T, D = q.shape
    log_local, log_skip = log_priors(variant, gate, kw.get("prior", 0.5), eps)
    idx = torch.arange(T, device=q.device)
    logits = []
    for o in pattern.offsets:
        raw = idx + o
        valid = (raw >= 0) & (raw < T)
        z = (q * k[:, :, raw.clamp(0, T - 1)]).sum(-1) * scale
        if clamp is not None:
            z = z.clamp(-clamp, clamp)
        z = z + (log_local if abs(o) <= pattern.window else log_skip)
        logits.append(z.masked_fill(~valid, float("-inf")))
    logits = torch.stack(logits, -1)
    if variant != "separate":
        return torch.softmax(logits, -1)
    n = pattern.n_local
    local, skip = logits[..., :n], logits[..., n:]
    has_skip = torch.isfinite(skip).any(-1, keepdim=True)
    skip_w = torch.softmax(torch.where(has_skip, skip, torch.zeros_like(skip)), -1) * has_skip
    a = torch.where(has_skip, gate.unsqueeze(-1), torch.ones_like(gate).unsqueeze(-1))
    return torch.cat([a * torch.softmax(local, -1), (1 - a) * skip_w], -1)


def slots_to_columns(w: torch.Tensor, offsets: tuple[int, ...], rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Slot probabilities w [B, H, T, |U|] -> the probabilities of queries `rows` on keys `cols` [B, H, R, C]."""
    B, H = w.shape[:2]
    out = w.new_zeros(B, H, len(rows), len(cols))
    col_of = {int(c): n for n, c in enumerate(cols.tolist())}
    for m, o in enumerate(offsets):
        for r, i in enumerate(rows.tolist()):
            n = col_of.get(i + o)
            if n is not None:
                out[:, :, r, n] += w[:, :, i, m]
    return out


def dense_rows(layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """softmax(q·kᵀ/√D) of the queries `rows` over every key (causal: keys ≤ the query) -> [B, H, R, T]."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = q[:, :, rows].to(acc) @ k.to(acc).transpose(-1, -2) * q.shape[-1] ** -0.5
    if layer.causal:
        future = torch.arange(k.shape[2], device=q.device)[None, :] > rows[:, None]
        scores = scores.masked_fill(future, float("-inf"))
    return torch.softmax(scores, -1)


def probe_columns(layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, x: torch.Tensor,
                  cols: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(key positions c, probabilities of every query on them [B, H, T, len(c)]) for chunks c of `cols`,
    by running the layer's own `attend` on one-hot values (D key columns per call)."""
    B, H, T, D = q.shape
    for start in range(0, len(cols), D):
        c = cols[start:start + D]
        v = q.new_zeros(B, H, T, D)
        v[:, :, c, torch.arange(len(c), device=q.device)] = 1.0
        yield c, layer.attend(q, k, v, x)[..., :len(c)].to(torch.float64 if q.dtype == torch.float64 else torch.float32)


def columns(layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, x: torch.Tensor, rows: torch.Tensor,
            cols: torch.Tensor) -> torch.Tensor:
    """The probabilities of queries `rows` on keys `cols`, [B, H, R, C], whatever the kind."""
    how = reader(layer)
    if how == "slots":
        w = slot_probabilities(layer, q, k, layer_gate(layer, x))
        return slots_to_columns(w, slot_pattern(layer).offsets, rows, cols)
    if how == "dense":
        return dense_rows(layer, q, k, rows)[..., cols]
    return torch.cat([p[:, :, rows] for _, p in probe_columns(layer, q, k, x, cols)], -1)


def masses(layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, x: torch.Tensor,
           mask: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """({key class: Σ over masked queries of its probability, [H]}, Σ over masked queries of the expected
    distance |i − j|, [H]) for one batch; `mask` [B, T] weights the queries (0 for padding)."""
    B, H, T, _ = q.shape
    m = mask.to(torch.float64)
    pos = torch.arange(T, device=q.device)
    how = reader(layer)
    if how == "slots":
        pattern = slot_pattern(layer)
        w = slot_probabilities(layer, q, k, layer_gate(layer, x)).double()
        weighted = w * m[:, None, :, None]
        sums: dict[str, torch.Tensor] = {}
        for cls, column in zip(slot_classes(pattern), weighted.unbind(-1), strict=True):
            sums[cls] = sums.get(cls, 0) + column.sum((0, 2))
        distance = torch.tensor([abs(o) for o in pattern.offsets], dtype=torch.float64, device=q.device)
        return sums, (weighted * distance).sum((0, 2, 3))
    total = q.new_zeros(H, dtype=torch.float64)
    distance = q.new_zeros(H, dtype=torch.float64)
    if how == "dense":
        for start in range(0, T, CHUNK):
            rows = pos[start:start + CHUNK]
            p = dense_rows(layer, q, k, rows).double() * m[:, None, rows, None]
            total += p.sum((0, 2, 3))
            distance += (p * (rows[:, None] - pos[None, :]).abs()).sum((0, 2, 3))
    else:
        for c, p in probe_columns(layer, q, k, x, pos):
            p = p.double() * m[:, None, :, None]
            total += p.sum((0, 2, 3))
            distance += (p * (pos[:, None] - c[None, :]).abs()).sum((0, 2, 3))
    return {"all": total}, distance
