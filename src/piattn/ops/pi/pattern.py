"""The π-Attention neighbourhood U(i) = N_r(i) ∪ N_π(i) (Eqs. Nr, Npi, U), sinks, documents, and the priors
(Eq. omega).

Every backend orders the candidate keys of a query the same way, so that per-candidate tensors
(weights, dropout masks) line up across backends:

    slot m < n_local             : local key i - window + m   (m = 0 … window causal, 0 … 2·window otherwise)
    n_local ≤ m < n_local+n_skip : skip keys, i - period first, then i + period (bidirectional only)
    last `sinks` slots           : sink key s = 0 … sinks-1, the s-th key of the query's document

A skip offset that is already local (period ≤ window) is not repeated: it stays local, with the local prior.
A sink key that is already local or a skip is not repeated either (precedence local > skip > sink); sinks
take the local prior and belong to the local branch of "separate".

Documents (`document_ids` [B, T]): a new document starts wherever the id changes from the previous
position. A slot is valid only when its key lies in the query's own document, so each document gets what
the operator gives on it alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Re-exported: the variant names live in piattn.config.pi, with the operator's other settings.
from ...config.pi import GATED_VARIANTS, VARIANTS

__all__ = ["GATED_VARIANTS", "VARIANTS", "Pattern", "document_bounds", "log_priors", "slot_keys"]


@dataclass(frozen=True)
class Pattern:
    """Offsets of U(i) relative to the query position i, and the number of sink keys."""

    window: int
    period: int
    causal: bool
    sinks: int = 0

    @property
    def local_offsets(self) -> tuple[int, ...]:
        right = 0 if self.causal else self.window
        return tuple(range(-self.window, right + 1))

    @property
    def skip_offsets(self) -> tuple[int, ...]:
        if self.period <= self.window:
            return ()
        return (-self.period,) if self.causal else (-self.period, self.period)

    @property
    def offsets(self) -> tuple[int, ...]:
        """The relative slots (local, then skip); the sink slots follow them."""
        return self.local_offsets + self.skip_offsets

    @property
    def n_local(self) -> int:
        return len(self.local_offsets)

    @property
    def n_skip(self) -> int:
        return len(self.skip_offsets)

    @property
    def n_slots(self) -> int:
        return len(self.offsets) + self.sinks

    def slot_is_local(self) -> tuple[bool, ...]:
        """Per slot: whether it takes the local prior (local and sink slots) or the skip prior."""
        return (True,) * self.n_local + (False,) * self.n_skip + (True,) * self.sinks

    def valid(self, T: int, device: torch.device | str | None = None) -> torch.Tensor:
        """bool [T, n_slots]: slot m of query i reads a key (one document of length T)."""
        return slot_keys(self, T, device=device)[1][0]


def document_bounds(
    document_ids: torch.Tensor | None, dtype: torch.dtype = torch.int64, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
    """document_ids [B, T] -> (start, end), each [B, T], contiguous, of `dtype`: the first position of each
    position's document and one past its last. A document is a maximal run of equal ids.

    dtype: the index dtype (int64; the Triton kernels read int32). device: where the bounds are computed and
    returned (None: document_ids' device; the C kernels of "fused" read CPU memory). document_ids None (no
    documents) -> (None, None), which every backend takes as "one document per sequence".
    """
    if document_ids is None:
        return None, None
    if device is not None:
        document_ids = document_ids.to(device)
    B, T = document_ids.shape
    pos = torch.arange(T, device=document_ids.device).expand(B, T)
    new = torch.ones_like(document_ids, dtype=torch.bool)
    new[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    start = torch.where(new, pos, 0).cummax(1).values
    last = torch.ones_like(new)
    last[:, :-1] = new[:, 1:]
    # end: flip, take the running minimum of the positions where a document ends, flip back.
    end = torch.where(last, pos + 1, T).flip(1).cummin(1).values.flip(1)
    return start.to(dtype).contiguous(), end.to(dtype).contiguous()


def slot_keys(
    pattern: Pattern, T: int, document_ids: torch.Tensor | None = None, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The key each slot of each query reads: (key [B', T, n_slots] int64, valid [B', T, n_slots] bool).

    B' is B with `document_ids` [B, T], else 1 (one document of length T). Invalid slots (outside the
    query's document, in its future for a sink of a causal query, or repeating a key a slot of higher
    precedence already reads) hold key 0 and must be masked by the caller.
    """
    if document_ids is not None:
        device = document_ids.device
        start, end = document_bounds(document_ids)
    else:
        start = torch.zeros(1, T, dtype=torch.long, device=device)
        end = torch.full((1, T), T, dtype=torch.long, device=device)
    pos = torch.arange(T, device=device)[None, :, None]
    start, end = start[..., None], end[..., None]
    rel = pos + torch.tensor(pattern.offsets, dtype=torch.long, device=device)
    rel_ok = (rel >= start) & (rel < end)
    keys, ok = [rel.expand(start.shape[0], -1, -1)], [rel_ok]
    if pattern.sinks:
        sink = start + torch.arange(pattern.sinks, device=device)
        sink_ok = sink < end
        if pattern.causal:
            sink_ok &= sink <= pos
        d = sink - pos  # offset of the sink key from the query
        lo, hi = pattern.local_offsets[0], pattern.local_offsets[-1]
        repeat = (d >= lo) & (d <= hi)
        for o in pattern.skip_offsets:
            repeat |= d == o
        keys.append(sink)
        ok.append(sink_ok & ~repeat)
    key, valid = torch.cat(keys, -1), torch.cat(ok, -1)
    return torch.where(valid, key, 0), valid


def log_priors(
    variant: str, gate: torch.Tensor | None, prior: float, eps: float
) -> tuple[torch.Tensor | float, torch.Tensor | float]:
    """log ω for local and skip slots (Eqs. delta, omega): log max(α, ε) and log max(1 − α, ε).

    Returns floats for the constant variants, tensors shaped and typed like `gate` for "adaptive" (the
    caller casts it to the accumulation dtype), and zeros for
    "union" and "separate" (the separate variant mixes with α after normalising, not inside the logits).
    """
    if variant == "adaptive":
        a = gate
        return a.clamp_min(eps).log(), (1 - a).clamp_min(eps).log()
    if variant == "fixed":
        return math.log(max(prior, eps)), math.log(max(1 - prior, eps))
    if variant in ("union", "separate"):
        return 0.0, 0.0
    # A new variant must say its priors here: a silent 0 would make it "union" inside the logits.
    raise ValueError(f"variant must be one of {list(VARIANTS)}, got {variant!r}")
