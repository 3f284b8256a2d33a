"""Fast eager backend: blocked matrix products for the window, shifted rows for the skips, gathered rows for
the sinks, and a hand-derived backward (ops/pi/README.md, "Backward" and "How the torch backend is fast").

`torch_forward` and `torch_backward` are the computation, plain functions of tensors, a slot plan
(`slot_plan`) and `OpSettings`; `PiAttentionFunction` only connects them to autograd, and `compiled.py`
registers the same two as custom operators for torch.compile.

Queries are cut into blocks of `block` rows. A block's local keys are its own rows plus a halo of `window`
rows before it (and after it, when bidirectional), so one batched matrix product per block gives every
local score and a strided view picks the band out of it; the same view scatters weights back for the
products with V (forward) and with dY, Q, K (backward).

Grouped-query attention: the G = H / H_kv query heads that share one key/value head are stacked as the rows
of one matrix, [G·block, D] per block, against that head's one key window, so K and V are never repeated
and the products with the weights sum dK and dV over the group by themselves.

The work runs over chunks of a few blocks, each chunk carried from scores to outputs before the next
starts: every step in a query's computation is row-local, and a chunk's temporaries (key windows, score
blocks) stay in cache instead of streaming through memory once per step.

Per-slot tensors are slot-major, [N, G, |U|, T] with N = B·H_kv, so that softmax and reductions over the
few slots of a query run over contiguous rows of T. Inside this backend the slots are ordered local, sink,
skip (the contract's order is local, skip, sink), so that the local group of "separate" is one run of
slots. Saved for backward: the inputs and two such tensors (weights and clamp mask; three for
"separate"), never a [B, H, T, |U|, D] copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .backends import by_keywords, refuse_double_backward
from .dtypes import accumulation_dtype
from .pattern import Pattern, log_priors, slot_keys
from .settings import OpSettings
from .validate import all_finite

BLOCK = 16  # query rows per matrix product: few enough that the band wastes little work (see benchmarks)
CHUNK_BYTES = 1 << 22  # Q bytes per chunk: large enough to amortise per-op overhead, small enough for cache


class _Chunk:
    """Query rows [start, stop) of a [N, T, ·] sequence, cut into `nb` blocks of `block` rows.

    Block b owns rows start + b·block …; its key window adds `left` rows before and `right` after
    (window and 0 when causal, window and window when bidirectional), zeros outside [0, T).
    """

    def __init__(self, start: int, stop: int, T: int, left: int, right: int, block: int):
        self.start, self.stop, self.T = start, stop, T
        self.left, self.right, self.block = left, right, block
        self.nb = -(-(stop - start) // block)
        self.end = start + self.nb * block  # padded end (may exceed stop on the last chunk)
        self.span = block + left + right
        self.n_local = left + right + 1

    @property
    def rows(self) -> slice:
        return slice(self.start, self.stop)

    @property
    def length(self) -> int:
        return self.stop - self.start

    def blocks(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, T, C] -> this chunk's rows as [N, nb, block, C] (zero rows past T; a view when possible)."""
        N, _, C = x.shape
        if self.end <= self.T:
            return x[:, self.start : self.end].unflatten(1, (self.nb, self.block))
        out = x.new_zeros(N, self.nb * self.block, C)
        out[:, : self.length] = x[:, self.rows]
        return out.view(N, self.nb, self.block, C)

    def group_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, G, T, C] -> [N, nb, G·block, C]: block b stacks the rows of block b of the G query heads
        that share one key head (a view of x when G = 1, as `blocks`)."""
        N, G, _, C = x.shape
        if G == 1:
            return self.blocks(x[:, 0])
        rows = x[:, :, self.rows]
        if self.length < self.nb * self.block:
            rows = torch.nn.functional.pad(rows, (0, 0, 0, self.nb * self.block - self.length))
        out = x.new_empty(N, self.nb, G, self.block, C)
        out.permute(0, 2, 1, 3, 4).copy_(rows.unflatten(2, (self.nb, self.block)))
        return out.flatten(2, 3)

    def windows(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, T, D] -> [N, nb, span, D]: each block's rows with their halos, zeros outside [0, T)."""
        N, T, D = x.shape
        out = x.new_empty(N, self.nb, self.span, D)
        own = out[:, :, self.left : self.left + self.block]
        own.copy_(self.blocks(x))
        if self.left:
            out[:, 1:, : self.left] = own[:, :-1, self.block - self.left :]
            lo = max(self.start - self.left, 0)
            out[:, 0, : self.left - (self.start - lo)] = 0
            out[:, 0, self.left - (self.start - lo) : self.left] = x[:, lo : self.start]
        if self.right:
            out[:, :-1, self.left + self.block :] = own[:, 1:, : self.right]
            n = max(min(self.end + self.right, T) - self.end, 0)
            out[:, -1, self.left + self.block : self.left + self.block + n] = x[:, self.end : self.end + n]
            out[:, -1, self.left + self.block + n :] = 0
        return out

    def fold_into(self, g: torch.Tensor, out: torch.Tensor) -> None:
        """Adjoint of `windows`: add g [N, nb, span, D] into the rows of out [N, T, D] it came from."""
        if self.left:  # a block's left halo is the previous block's last rows
            g[:, :-1, self.block : self.block + self.left] += g[:, 1:, : self.left]
            lo = max(self.start - self.left, 0)
            out[:, lo : self.start] += g[:, 0, self.left - (self.start - lo) : self.left]
        if self.right:  # and its right halo the next block's first rows
            g[:, 1:, self.left : self.left + self.right] += g[:, :-1, self.left + self.block :]
            n = max(min(self.end + self.right, self.T) - self.end, 0)
            out[:, self.end : self.end + n] += g[:, -1, self.left + self.block : self.left + self.block + n]
        own = g[:, :, self.left : self.left + self.block]
        if self.end == self.stop:  # whole blocks: add in place through a view, no reshaped copy
            out[:, self.rows].unflatten(1, (self.nb, self.block)).add_(own)
        else:
            out[:, self.rows] += own.flatten(1, 2)[:, : self.length]

    def band(self, full: torch.Tensor, G: int) -> torch.Tensor:
        """View [N, nb, G·block, span] (contiguous) -> [N, nb, G, block, n_local]: (g, r, m) is
        full[g·block + r, r + m]."""
        s = full.stride()
        return full.as_strided((full.shape[0], self.nb, G, self.block, self.n_local),
                               (s[0], s[1], self.block * s[2], s[2] + 1, 1))

    def extract(self, full: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the band of `full` [N, nb, G·block, span] into out [N, G, n_local, stop - start]."""
        band = self.band(full, out.shape[1]).permute(0, 2, 4, 1, 3).flatten(3)  # [N, G, n_local, nb·block]
        out.copy_(band[..., : self.length])

    def scatter(self, w: torch.Tensor, zeros: dict) -> torch.Tensor:
        """w [N, G, n_local, stop - start] -> [N, nb, G·block, span]: w on the band, zeros elsewhere.

        The result lives in a buffer from `zeros` (one per shape, reused by later calls): only band
        cells are ever written to it, so everything off the band stays zero without a fresh fill.
        """
        N, G, _, L = w.shape
        shape = (N, self.nb, G * self.block, self.span)
        full = zeros.get(shape)
        if full is None:
            full = zeros[shape] = w.new_zeros(shape)
        if self.nb * self.block != L:
            w = torch.nn.functional.pad(w, (0, self.nb * self.block - L))
        self.band(full, G).copy_(w.unflatten(3, (self.nb, self.block)).permute(0, 3, 1, 4, 2))
        return full


def _chunks(T: int, window: int, causal: bool, q: torch.Tensor):
    """Work plan for q [N, G, T, D]: (key heads, chunk) pairs covering all N·G·T query rows, each about
    CHUNK_BYTES of q.

    A chunk is either a group of whole key heads or a run of rows of one key head (with its G query
    heads), so that its rows of any [N, ·, T, D] tensor form one contiguous block per head and batched
    products need no copies. Off the CPU there is one chunk: a GPU wants few, large kernels, and has no
    cache small enough for chunking to matter.
    """
    N, G, _, D = q.shape
    block = max(BLOCK, window)  # a halo must fit inside one neighbouring block
    right = 0 if causal else window
    if q.device.type != "cpu":
        return [(slice(0, N), _Chunk(0, T, T, window, right, block))]
    row_bytes = G * D * q.element_size()
    if T * row_bytes >= CHUNK_BYTES:
        rows = max(block, CHUNK_BYTES // row_bytes // block * block)
        return [(slice(n, n + 1), _Chunk(s, min(s + rows, T), T, window, right, block))
                for n in range(N) for s in range(0, T, rows)]
    heads = max(1, CHUNK_BYTES // (T * row_bytes))
    whole = _Chunk(0, T, T, window, right, block)
    return [(slice(n, min(n + heads, N)), whole) for n in range(0, N, heads)]


def _skip_rows(c: _Chunk, offset: int) -> tuple[slice, slice, slice]:
    """For queries of chunk c whose key i + offset lies in [0, T): (query rows, key rows, chunk-relative rows)."""
    lo, hi = max(c.start, -offset), min(c.stop, c.T - offset)
    hi = max(hi, lo)
    return slice(lo, hi), slice(lo + offset, hi + offset), slice(lo - c.start, hi - c.start)


@dataclass
class _Part:
    """The slots of one chunk's queries, for n key heads.

    valid [n or 1, 1, |U|, L] bool (invalid: its negation); has_skip [n or 1, 1, 1, L]: the query has a valid
    skip slot; the leading dim is 1 without documents (every head sees the same slots). sink_key [n, sinks,
    L] long: the key row of each sink slot (0 where invalid), with documents; else None.
    """

    valid: torch.Tensor
    invalid: torch.Tensor
    sink_key: torch.Tensor | None
    has_skip: torch.Tensor


class _Slots:
    """The slots of one call in this backend's order: local, sink, skip; where each reads and which are valid.

    Built from `pattern.slot_keys`, so validity (documents, causal sinks, precedence local > skip > sink)
    has one definition. Local and skip slots read the key i + offset (a shifted view of K); a sink slot
    reads a key that depends on the query's document, so its key rows are kept per batch element.
    """

    def __init__(self, pat: Pattern, T: int, document_ids: torch.Tensor | None, kv_heads: int, n_heads: int,
                 device: torch.device):
        self.n_local, self.sinks, self.n_slots = pat.n_local, pat.sinks, pat.n_slots
        self.n_first = pat.n_local + pat.sinks  # the local group of "separate": local and sink slots
        self.order = _internal_order(pat)
        key, valid = slot_keys(pat, T, document_ids, device)  # [B or 1, T, |U|], the contract's order
        if self.order is not None:
            valid = valid[..., self.order]
        self.valid = valid.transpose(1, 2)  # [B or 1, |U|, T]
        # The sink keys of each query, where documents make them differ between queries: [B, S, T].
        self.sink_key = None if document_ids is None else key[..., len(pat.offsets) :].transpose(1, 2)
        self.relative = tuple(enumerate(pat.local_offsets)) + tuple(enumerate(pat.skip_offsets, self.n_first))
        # The batch element of each key head, to pick its document's slots (none: one document for all).
        self.batch = None if document_ids is None else torch.arange(n_heads, device=device) // kv_heads

    def part(self, heads: slice, c: _Chunk) -> _Part:
        """The slots of chunk c's queries, for key heads `heads`."""
        valid = self.valid[:, :, c.rows]
        sink_key = None if self.sink_key is None else self.sink_key[:, :, c.rows]
        if self.batch is not None:
            b = self.batch[heads]
            valid, sink_key = valid[b], None if sink_key is None else sink_key[b]
        valid = valid.unsqueeze(1)
        return _Part(valid, ~valid, sink_key, valid[:, :, self.n_first :].any(2, keepdim=True))

    def each(self, c: _Chunk, part: _Part, exact: bool):
        """(slot, query rows, chunk-relative rows, key) for the slots products take one at a time: skips and
        sinks, and local slots too when `exact`. key (see `_read`): a slice of key rows for a relative slot
        (the queries whose key i + offset lies in [0, T)); for a sink (every query of the chunk) an int
        without documents, else long [n, L]."""
        for m, offset in self.relative:
            if exact or m >= self.n_first:
                rows, keys, rel = _skip_rows(c, offset)
                yield m, rows, rel, keys
        for s in range(self.sinks):  # without documents, sink s reads key s for every query
            key = s if part.sink_key is None else part.sink_key[:, s]
            yield self.n_local + s, c.rows, slice(0, c.length), key


def _internal_order(pat: Pattern) -> list[int] | None:
    """Contract slot order (local, skip, sink) -> this backend's (local, sink, skip); None if they agree."""
    n_rel = len(pat.offsets)
    if not pat.sinks or not pat.n_skip:
        return None
    return [*range(pat.n_local), *range(n_rel, n_rel + pat.sinks), *range(pat.n_local, n_rel)]


def _head_rows(key: torch.Tensor, n: int, T: int) -> torch.Tensor:
    """long key [n, L] of rows within each head -> [n·L] rows of the heads flattened to [n·T, ·]."""
    return (key + T * torch.arange(n, device=key.device)[:, None]).flatten()


def _read(x: torch.Tensor, key) -> torch.Tensor:
    """Key rows of x [n, T, D] -> [n, L, D]. key: a slice of rows; an int, one row for every query (L = 1,
    broadcasting); or long [n, L], a row per query (whole rows picked, not element by element)."""
    if isinstance(key, slice):
        return x[:, key]
    if isinstance(key, int):
        return x[:, key : key + 1]
    n, T, D = x.shape
    return x.reshape(n * T, D).index_select(0, _head_rows(key, n, T)).view(n, -1, D)


def _add_rows(out: torch.Tensor, key, g: torch.Tensor) -> None:
    """Adjoint of `_read`: out[:, key] += g (out [n, T, D], g [n, L, D]; the rows of a long key may repeat,
    and add up)."""
    if isinstance(key, slice):
        out[:, key] += g
    elif isinstance(key, int):
        out[:, key] += g.sum(1)
    else:
        n, T, D = out.shape
        out.view(n * T, D).index_add_(0, _head_rows(key, n, T), g.reshape(-1, D))


def _slot_scores(a, b, c: _Chunk, slots: _Slots, part: _Part, out, finite: bool = True) -> None:
    """out[:, g, m, i - start] = a[:, g, i] · b[key_m(i)] for i in the chunk (a [n, G, T, D], b [n, T, D];
    out [n, G, |U|, L]).

    Relative slots whose key lies outside [0, T) are left untouched. `finite=False` (some input is NaN or
    ±inf) computes slot by slot and zeroes invalid slots, so that a bad row only reaches the queries that
    read it: a blocked product would multiply it by the zeros off the band (0·NaN = NaN).
    """
    if finite:
        c.extract(c.group_blocks(a) @ c.windows(b).transpose(-1, -2), out[:, :, : slots.n_local])
    for m, rows, rel, key in slots.each(c, part, exact=not finite):
        s = torch.linalg.vecdot(a[:, :, rows], _read(b, key).unsqueeze(1))
        out[:, :, m, rel] = s if finite else torch.where(part.valid[:, :, m, rel], s, 0.0)


def _apply_weights(w, x, c: _Chunk, slots: _Slots, part: _Part, out, zeros: dict, finite: bool = True) -> None:
    """out[:, g, i] = Σ_m w[:, g, m, i - start] · x[key_m(i)] for i in the chunk (w [n, G, |U|, L], x [n, T, D],
    out [n, G, T, D]).

    `finite=False`: slot by slot over valid slots only (see `_slot_scores`).
    """
    if finite:
        weights, values = c.scatter(w[:, :, : slots.n_local], zeros), c.windows(x)
        if out.shape[1] == 1 and c.end == c.stop:  # one head per key head, whole blocks: straight into out
            torch.matmul(weights, values, out=out[:, 0, c.rows].unflatten(1, (c.nb, c.block)))
        else:
            y = (weights @ values).unflatten(2, (out.shape[1], c.block)).transpose(1, 2).flatten(2, 3)
            out[:, :, c.rows] = y[:, :, : c.length]
    else:
        out[:, :, c.rows] = 0
    for m, rows, rel, key in slots.each(c, part, exact=not finite):
        xk = _read(x, key).unsqueeze(1)
        if finite:
            out[:, :, rows].addcmul_(w[:, :, m, rel, None], xk)
        else:
            out[:, :, rows] += torch.where(part.valid[:, :, m, rel, None], w[:, :, m, rel, None] * xk, 0.0)


def _apply_weights_transposed(w, x, c: _Chunk, slots: _Slots, part: _Part, out, zeros: dict,
                              finite: bool = True) -> None:
    """out[key_m(i)] += Σ_g w[:, g, m, i - start] · x[:, g, i] for i in the chunk: the adjoint of
    `_apply_weights` (x [n, G, T, D], out [n, T, D]); the sum over the group comes with the products."""
    if finite:
        c.fold_into(c.scatter(w[:, :, : slots.n_local], zeros).transpose(-1, -2) @ c.group_blocks(x), out)
    for m, rows, rel, key in slots.each(c, part, exact=not finite):
        if finite and isinstance(key, slice):  # no temporary: one fused multiply-add per query head
            for g in range(x.shape[1]):
                out[:, key].addcmul_(w[:, g, m, rel, None], x[:, g, rows])
        elif finite and isinstance(key, int):  # one key row for all queries: a vector-matrix product per head
            out[:, key] += (w[:, :, m, rel].unsqueeze(-2) @ x[:, :, rows]).sum(1).squeeze(-2)
        else:
            term = w[:, :, m, rel, None] * x[:, :, rows]
            if not finite:
                term = torch.where(part.valid[:, :, m, rel, None], term, 0.0)
            _add_rows(out, key, term.sum(1))


def _weights(logits: torch.Tensor, variant: str, gate: torch.Tensor | None, n_first: int, has_skip: torch.Tensor):
    """Softmax of the fused logits [n, G, |U|, L] over slots (dim -2). Returns (w, probs, coef): w = coef·probs.

    One group (every slot) for all variants but "separate", which normalises the local group (local and
    sink slots, the first n_first) and the skip slots apart and mixes them with coef = (α, 1 − α), or
    (1, 0) where no skip key exists (has_skip: from the pattern, not the logits, so that a NaN logit is not
    taken for none).
    """
    if variant != "separate" or logits.shape[-2] == n_first:
        p = torch.softmax(logits, -2)
        return p, p, None
    local, skip = logits[..., :n_first, :], logits[..., n_first:, :]
    p_skip = torch.softmax(skip.masked_fill(~has_skip, 0.0), -2) * has_skip
    probs = torch.cat([torch.softmax(local, -2), p_skip], -2)
    a = torch.where(has_skip, gate.unsqueeze(-2), torch.ones_like(gate).unsqueeze(-2))
    coef = torch.cat([a.expand_as(local), (1 - a).expand_as(skip)], -2)
    return coef * probs, probs, coef


def _softmax_backward(dw, w, probs, coef, n_first):
    """d logits [n, G, |U|, L] from d weights; also dL/dα through coef for "separate" ([n, G, L], else None)."""
    if coef is None:
        return w * (dw - (w * dw).sum(-2, keepdim=True)), None
    d_logits = torch.empty_like(dw)
    dcoef = []
    for part in (slice(0, n_first), slice(n_first, None)):
        p, g = probs[..., part, :], dw[..., part, :]
        pg = (p * g).sum(-2, keepdim=True)
        d_logits[..., part, :] = coef[..., part, :] * p * (g - pg)
        dcoef.append(pg.squeeze(-2))
    # coef_local = α, coef_skip = 1 − α where a skip exists; where none exists coef is constant.
    has_skip = coef[..., n_first, :] != 0
    return d_logits, (dcoef[0] - dcoef[1]) * has_skip


def _gate_grad(d_logits, d_coef, a, variant, eps, n_first):
    """dL/dα [n, G, L] (Eqs. ddelta_da, dalpha_da): local and sink logits carry log max(α, ε), skips
    log max(1 − α, ε)."""
    if variant == "separate":
        return torch.zeros_like(a) if d_coef is None else d_coef
    g = d_logits[..., :n_first, :].sum(-2) * (a >= eps) / a
    if d_logits.shape[-2] > n_first:
        g = g - d_logits[..., n_first:, :].sum(-2) * ((1 - a) >= eps) / (1 - a)
    return g


def _chunk_addend(x, heads: slice, rows: slice):
    """A log-prior, float or [N, G, T] tensor, as an addend for the per-slot logits [n, G, ·, L] of a chunk."""
    return x if isinstance(x, float) else x[heads, :, rows].unsqueeze(-2)


def saved_layout(q: torch.Tensor, k: torch.Tensor, settings: OpSettings
                 ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """What `torch_forward` keeps for `torch_backward` besides its inputs, for q [B, H, T, D] and k
    [B, H_kv, T, D]: name -> (shape, dtype), all [N, G, |U|, T] slot-major (N = B·H_kv key heads, G = H / H_kv
    query heads per key head, |U| the pattern's slots, sinks included).

    w: the attention weights, in the accumulation dtype. probs, coef: "separate" with a skip slot only, the
    per-branch softmax and the mixing coefficients. clamp_pass (bool): with a logit clamp only, where the
    score was inside it. `torch_forward` allocates exactly these, so the two cannot disagree; the forward
    operator's fake implementation (`compiled.py`) gives their shapes from here.
    """
    B, H, T, _ = q.shape
    H_kv = k.shape[1]
    pat = settings.pattern
    shape = (B * H_kv, H // H_kv, pat.n_slots, T)
    acc = accumulation_dtype(q.dtype)
    saved = {"w": (shape, acc)}
    if settings.variant == "separate" and pat.skip_offsets:
        saved.update(probs=(shape, acc), coef=(shape, acc))
    if settings.logit_clamp is not None:
        saved["clamp_pass"] = (shape, torch.bool)
    return saved


def slot_plan(q: torch.Tensor, k: torch.Tensor, document_ids: torch.Tensor | None, settings: OpSettings) -> _Slots:
    """The slots of a call with q [B, H, T, D], k [B, H_kv, T, D] and document_ids [B, T] or None: built once
    by the eager Function for forward and backward, and by each operator for its own pass."""
    B, H, T, _ = q.shape
    H_kv = k.shape[1]
    return _Slots(settings.pattern, T, document_ids, H_kv, B * H_kv, q.device)


def torch_forward(q, k, v, gate, dropout_keep, slots: _Slots, settings: OpSettings
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """q [B, H, T, D], k, v [B, H_kv, T, D], gate [B, H, T] or None, dropout_keep bool [B, H, T, |U|] or None
    (contract slot order), slots from `slot_plan` -> (y [B, H, T, D] in q's dtype, the tensors of
    `saved_layout` by name)."""
    window, causal, variant, logit_clamp = settings.window, settings.causal, settings.variant, settings.logit_clamp
    B, H, T, D = q.shape
    H_kv = k.shape[1]
    N, G = B * H_kv, H // H_kv
    acc = accumulation_dtype(q.dtype)
    qf = q.reshape(N, G, T, D).to(acc)
    kf, vf = (x.reshape(N, T, D).to(acc) for x in (k, v))
    gf = None if gate is None else gate.reshape(N, G, T).to(acc)
    log_local, log_skip = log_priors(variant, gf, settings.prior, settings.eps)
    keep = _keep_multiplier(dropout_keep, settings.dropout_p, acc, slots.order, G)
    finite = all_finite(qf, kf, vf, gf)
    n_first = slots.n_first

    y = torch.empty(N, G, T, D, dtype=acc, device=q.device)
    saved = {name: torch.empty(shape, dtype=dtype, device=q.device)
             for name, (shape, dtype) in saved_layout(q, k, settings).items()}
    w, coef, clamp_pass = saved["w"], saved.get("coef"), saved.get("clamp_pass")
    probs = saved.get("probs", w)
    zeros = {}
    for h, c in _chunks(T, window, causal, qf):
        r = c.rows
        part = slots.part(h, c)
        z = torch.empty(h.stop - h.start, G, slots.n_slots, c.length, dtype=acc, device=q.device)
        _slot_scores(qf[h], kf[h], c, slots, part, z, finite)
        z *= settings.scale
        if logit_clamp is not None:
            clamp_pass[h, ..., r] = z.abs() <= logit_clamp
            z.clamp_(-logit_clamp, logit_clamp)
        z[..., :n_first, :] += _chunk_addend(log_local, h, r)
        z[..., n_first:, :] += _chunk_addend(log_skip, h, r)
        z.masked_fill_(part.invalid, float("-inf"))
        wc, pc, cc = _weights(z, variant, None if gf is None else gf[h, :, r], n_first, part.has_skip)
        w[h, ..., r] = wc
        if coef is not None:
            probs[h, ..., r], coef[h, ..., r] = pc, cc
        _apply_weights(wc if keep is None else wc * keep[h, ..., r], vf[h], c, slots, part, y[h], zeros, finite)
    return y.view(B, H, T, D).to(q.dtype), saved


def torch_backward(dy, q, k, v, gate, dropout_keep, slots: _Slots, saved: dict[str, torch.Tensor],
                   settings: OpSettings, *, want_dgate: bool):
    """The gradients (dq, dk, dv, dgate or None) for the cotangent dy [B, H, T, D] of `torch_forward`'s
    output, from its inputs, its slots and what it saved."""
    w, coef, clamp_pass = saved["w"], saved.get("coef"), saved.get("clamp_pass")
    probs = saved.get("probs", w)
    B, H, T, D = q.shape
    H_kv = k.shape[1]
    N, G = B * H_kv, H // H_kv
    acc = w.dtype
    qf, dyf = (x.reshape(N, G, T, D).to(acc) for x in (q, dy))
    kf, vf = (x.reshape(N, T, D).to(acc) for x in (k, v))
    gf = None if gate is None else gate.reshape(N, G, T).to(acc)
    keep = _keep_multiplier(dropout_keep, settings.dropout_p, acc, slots.order, G)
    finite = all_finite(qf, kf, vf, gf, dyf)
    n_first = slots.n_first

    dq = torch.empty_like(qf)
    dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)
    dgate = torch.empty_like(gf) if want_dgate else None
    zeros = {}
    for h, c in _chunks(T, settings.window, settings.causal, qf):
        r = c.rows
        part = slots.part(h, c)
        wc, pc = w[h, ..., r], probs[h, ..., r]
        dw = torch.zeros_like(wc)  # dL/dW = dY · V over U(i); relative slots without a key stay 0
        _slot_scores(dyf[h], vf[h], c, slots, part, dw, finite)
        if keep is not None:
            wc_kept = wc * keep[h, ..., r]
            dw *= keep[h, ..., r]
        _apply_weights_transposed(wc if keep is None else wc_kept, dyf[h], c, slots, part, dv[h], zeros, finite)
        d_logits, d_coef = _softmax_backward(dw, wc, pc, None if coef is None else coef[h, ..., r], n_first)
        if want_dgate:
            dgate[h, :, r] = _gate_grad(d_logits, d_coef, gf[h, :, r], settings.variant, settings.eps, n_first)
        if clamp_pass is not None:
            d_logits *= clamp_pass[h, ..., r]
        d_logits *= settings.scale
        _apply_weights(d_logits, kf[h], c, slots, part, dq[h], zeros, finite)
        _apply_weights_transposed(d_logits, qf[h], c, slots, part, dk[h], zeros, finite)
    return (dq.view(B, H, T, D).to(q.dtype), dk.view(B, H_kv, T, D).to(k.dtype),
            dv.view(B, H_kv, T, D).to(v.dtype), None if dgate is None else dgate.view_as(gate).to(gate.dtype))


class PiAttentionFunction(torch.autograd.Function):
    """Autograd around `torch_forward` and `torch_backward`. Arguments: q, k, v, gate (differentiable), the
    `OpSettings`, the dropout keep mask and the slot plan (`run_torch`)."""

    @staticmethod
    def forward(ctx, q, k, v, gate, settings: OpSettings, dropout_keep, slots):
        y, saved = torch_forward(q, k, v, gate, dropout_keep, slots, settings)
        ctx.save_for_backward(q, k, v, gate, dropout_keep, *saved.values())
        # Neither inputs nor outputs: kept on ctx as they are.
        ctx.saved_names, ctx.slots, ctx.settings = tuple(saved), slots, settings
        return y

    @staticmethod
    def backward(ctx, dy):
        refuse_double_backward("torch")
        q, k, v, gate, dropout_keep, *kept = ctx.saved_tensors
        saved = dict(zip(ctx.saved_names, kept, strict=True))
        grads = torch_backward(dy, q, k, v, gate, dropout_keep, ctx.slots, saved, ctx.settings,
                               want_dgate=ctx.needs_input_grad[3])
        return grads + (None, None, None)


def _keep_multiplier(keep: torch.Tensor | None, p: float, dtype: torch.dtype, order: list[int] | None,
                     G: int) -> torch.Tensor | None:
    """Dropout keep mask [B, H, T, |U|] (bool, contract slot order) -> weight multiplier keep / (1 - p),
    slot-major in this backend's slot order, [B·H_kv, G, |U|, T]."""
    if keep is None:
        return None
    B, H, T, M = keep.shape
    keep = keep.reshape(B * H // G, G, T, M)
    if order is not None:
        keep = keep[..., order]
    return keep.transpose(-1, -2).to(dtype) / (1 - p)


def run_torch(q, k, v, gate, settings: OpSettings, dropout_keep=None, document_ids=None):
    """The contract, `backends.BackendRun` (one period), through `PiAttentionFunction`."""
    return PiAttentionFunction.apply(q, k, v, gate, settings, dropout_keep, slot_plan(q, k, document_ids, settings))


pi_attention_torch = by_keywords(run_torch)
