"""Fast eager backend: blocked matrix products for the window, shifted rows for the skips, and a
hand-derived backward (ops/pi/README.md, "Backward").

Queries are cut into blocks of `block` rows. A block's local keys are its own rows plus a halo of `window`
rows before it (and after it, when bidirectional), so one batched matrix product per block gives every
local score and a strided view picks the band out of it; the same view scatters weights back for the
products with V (forward) and with dY, Q, K (backward).

The work runs over chunks of a few blocks, each chunk carried from scores to outputs before the next
starts: every step in a query's computation is row-local, and a chunk's temporaries (key windows, score
blocks) stay in cache instead of streaming through memory once per step.

Per-slot tensors are slot-major, [N, |U|, T] with N = B·H, so that softmax and reductions over the few
slots of a query run over contiguous rows of T. Saved for backward: the inputs and two such tensors
(weights and clamp mask; three for "separate"), never a [B, H, T, |U|, D] copy.
"""

from __future__ import annotations

import torch

from .backends import refuse_double_backward
from .pattern import Pattern, log_priors

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

    def blocks(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, T, C] -> this chunk's rows as [N, nb, block, C] (zero rows past T; a view when possible)."""
        N, _, C = x.shape
        if self.end <= self.T:
            return x[:, self.start : self.end].unflatten(1, (self.nb, self.block))
        out = x.new_zeros(N, self.nb * self.block, C)
        out[:, : self.stop - self.start] = x[:, self.rows]
        return out.view(N, self.nb, self.block, C)

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
            out[:, self.rows] += own.flatten(1, 2)[:, : self.stop - self.start]

    def band(self, full: torch.Tensor) -> torch.Tensor:
        """View [N, nb, block, span] (contiguous) -> [N, nb, block, n_local]: (r, m) is full[r, r + m]."""
        s = full.stride()
        return full.as_strided((full.shape[0], self.nb, self.block, self.n_local), (s[0], s[1], s[2] + 1, 1))

    def extract(self, full: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the band of `full` [N, nb, block, span] into out [N, n_local, stop - start]."""
        band = self.band(full).permute(0, 3, 1, 2).flatten(2)  # [N, n_local, nb·block]
        out.copy_(band[..., : self.stop - self.start])

    def scatter(self, w: torch.Tensor, zeros: dict) -> torch.Tensor:
        """w [N, n_local, stop - start] -> [N, nb, block, span]: w on the band, zeros elsewhere.

        The result lives in a buffer from `zeros` (one per shape, reused by later calls): only band
        cells are ever written to it, so everything off the band stays zero without a fresh fill.
        """
        N, M, L = w.shape
        shape = (N, self.nb, self.block, self.span)
        full = zeros.get(shape)
        if full is None:
            full = zeros[shape] = w.new_zeros(shape)
        if self.nb * self.block != L:
            w = torch.nn.functional.pad(w, (0, self.nb * self.block - L))
        self.band(full).copy_(w.unflatten(2, (self.nb, self.block)).permute(0, 2, 3, 1))
        return full


def _chunks(T: int, window: int, causal: bool, x: torch.Tensor):
    """Work plan for x [N, T, D]: (heads, chunk) pairs covering all N·T query rows, each about CHUNK_BYTES.

    A chunk is either a group of whole heads or a run of rows of one head, so that its rows of any
    [N, T, D] tensor form one contiguous block and batched products need no copies. Off the CPU there is
    one chunk: a GPU wants few, large kernels, and has no cache small enough for chunking to matter.
    """
    N, _, D = x.shape
    block = max(BLOCK, window)  # a halo must fit inside one neighbouring block
    right = 0 if causal else window
    if x.device.type != "cpu":
        return [(slice(0, N), _Chunk(0, T, T, window, right, block))]
    row_bytes = D * x.element_size()
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


def _slot_scores(a, b, c: _Chunk, pat: Pattern, out, finite: bool = True) -> None:
    """out[:, m, i - start] = a[i] · b[i + offset_m] for i in the chunk (a, b [N, T, D]; out [N, M, L]).

    Slots whose key lies outside [0, T) are left untouched when not `finite` (skip slots always).
    `finite=False` (some input is NaN or ±inf) computes slot by slot, so that a bad row only reaches the
    queries that read it: a blocked product would multiply it by the zeros off the band (0·NaN = NaN).
    """
    if finite:
        c.extract(c.blocks(a) @ c.windows(b).transpose(-1, -2), out[:, : pat.n_local])
    else:
        for m, o in enumerate(pat.local_offsets):
            rows, keys, rel = _skip_rows(c, o)
            out[:, m, rel] = torch.linalg.vecdot(a[:, rows], b[:, keys])
    for m, o in enumerate(pat.skip_offsets, start=pat.n_local):
        rows, keys, rel = _skip_rows(c, o)
        out[:, m, rel] = torch.linalg.vecdot(a[:, rows], b[:, keys])


def _apply_weights(w, x, c: _Chunk, pat: Pattern, out, zeros: dict, finite: bool = True) -> None:
    """out[i] = Σ_m w[:, m, i - start] · x[i + offset_m] for i in the chunk (w [N, M, L], x, out [N, T, D]).

    `finite=False`: slot by slot over keys inside [0, T) only (see `_slot_scores`).
    """
    if not finite:
        out[:, c.rows] = 0
        for m, o in enumerate(pat.offsets):
            rows, keys, rel = _skip_rows(c, o)
            out[:, rows].addcmul_(w[:, m, rel, None], x[:, keys])
        return
    weights, values = c.scatter(w[:, : pat.n_local], zeros), c.windows(x)
    if c.end == c.stop:  # whole blocks: the product lands in `out` directly
        torch.matmul(weights, values, out=out[:, c.rows].unflatten(1, (c.nb, c.block)))
    else:
        out[:, c.rows] = (weights @ values).flatten(1, 2)[:, : c.stop - c.start]
    for m, o in enumerate(pat.skip_offsets, start=pat.n_local):
        rows, keys, rel = _skip_rows(c, o)
        out[:, rows].addcmul_(w[:, m, rel, None], x[:, keys])


def _apply_weights_transposed(w, x, c: _Chunk, pat: Pattern, out, zeros: dict, finite: bool = True) -> None:
    """out[i + offset_m] += w[:, m, i - start] · x[i] for i in the chunk: the adjoint of `_apply_weights`."""
    if finite:
        c.fold_into(c.scatter(w[:, : pat.n_local], zeros).transpose(-1, -2) @ c.blocks(x), out)
    else:
        for m, o in enumerate(pat.local_offsets):
            rows, keys, rel = _skip_rows(c, o)
            out[:, keys].addcmul_(w[:, m, rel, None], x[:, rows])
    for m, o in enumerate(pat.skip_offsets, start=pat.n_local):
        rows, keys, rel = _skip_rows(c, o)
        out[:, keys].addcmul_(w[:, m, rel, None], x[:, rows])


def _weights(logits: torch.Tensor, variant: str, gate: torch.Tensor | None, n_local: int, valid: torch.Tensor):
    """Softmax of the fused logits [N, M, L] over slots. Returns (w, probs, coef): w = coef·probs.

    One group (every slot) for all variants but "separate", which normalises local and skip slots
    apart and mixes them with coef = (α, 1 − α), or (1, 0) where no skip key exists (valid [M, L]: the
    slot's key lies in [0, T); from the pattern, not the logits, so that a NaN logit is not taken for none).
    """
    if variant != "separate" or logits.shape[1] == n_local:
        p = torch.softmax(logits, 1)
        return p, p, None
    local, skip = logits[:, :n_local], logits[:, n_local:]
    has_skip = valid[None, n_local:].any(1, keepdim=True)
    p_skip = torch.softmax(skip.masked_fill(~has_skip, 0.0), 1) * has_skip
    probs = torch.cat([torch.softmax(local, 1), p_skip], 1)
    a = torch.where(has_skip, gate.unsqueeze(1), torch.ones_like(gate).unsqueeze(1))
    coef = torch.cat([a.expand_as(local), (1 - a).expand_as(skip)], 1)
    return coef * probs, probs, coef


def _softmax_backward(dw, w, probs, coef, n_local):
    """d logits [N, M, L] from d weights; also dL/dα through coef for "separate" ([N, L], else None)."""
    if coef is None:
        return w * (dw - (w * dw).sum(1, keepdim=True)), None
    d_logits = torch.empty_like(dw)
    dcoef = []
    for part in (slice(0, n_local), slice(n_local, None)):
        p, g = probs[:, part], dw[:, part]
        pg = (p * g).sum(1, keepdim=True)
        d_logits[:, part] = coef[:, part] * p * (g - pg)
        dcoef.append(pg.squeeze(1))
    # coef_local = α, coef_skip = 1 − α where a skip exists; where none exists coef is constant.
    has_skip = coef[:, n_local] != 0
    return d_logits, (dcoef[0] - dcoef[1]) * has_skip


def _gate_grad(d_logits, d_coef, a, variant, eps, n_local):
    """dL/dα [N, L] (Eqs. ddelta_da, dalpha_da): local logits carry log max(α, ε), skips log max(1 − α, ε)."""
    if variant == "separate":
        return torch.zeros_like(a) if d_coef is None else d_coef
    g = d_logits[:, :n_local].sum(1) * (a >= eps) / a
    if d_logits.shape[1] > n_local:
        g = g - d_logits[:, n_local:].sum(1) * ((1 - a) >= eps) / (1 - a)
    return g


def _chunk_addend(x, heads: slice, rows: slice):
    """A log-prior, float or [N, T] tensor, as an addend for the per-slot logits [n, ·, L] of a chunk."""
    return x if isinstance(x, float) else x[heads, rows].unsqueeze(1)


class PiAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, gate, window, period, causal, variant, prior, logit_clamp, eps, scale,
                dropout_keep, dropout_p):
        B, H, T, D = q.shape
        N = B * H
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        pat = Pattern(window, period, causal)
        qf, kf, vf = (x.reshape(N, T, D).to(acc) for x in (q, k, v))
        gf = None if gate is None else gate.reshape(N, T).to(acc)
        log_local, log_skip = log_priors(variant, gf, prior, eps)
        valid = pat.valid(T, q.device).T  # [M, T]
        keep = _keep_multiplier(dropout_keep, dropout_p, acc)
        finite = _all_finite(qf, kf, vf, gf)

        y = torch.empty(N, T, D, dtype=acc, device=q.device)
        w = torch.empty(N, pat.n_slots, T, dtype=acc, device=q.device)
        probs = w if variant != "separate" or not pat.skip_offsets else torch.empty_like(w)
        coef = None if probs is w else torch.empty_like(w)
        clamp_pass = None if logit_clamp is None else torch.empty(w.shape, dtype=torch.bool, device=q.device)
        zeros = {}
        for h, c in _chunks(T, window, causal, qf):
            r = c.rows
            z = torch.empty(h.stop - h.start, pat.n_slots, c.stop - c.start, dtype=acc, device=q.device)
            _slot_scores(qf[h], kf[h], c, pat, z, finite)
            z *= scale
            if logit_clamp is not None:
                clamp_pass[h, :, r] = z.abs() <= logit_clamp
                z.clamp_(-logit_clamp, logit_clamp)
            z[:, : pat.n_local] += _chunk_addend(log_local, h, r)
            z[:, pat.n_local :] += _chunk_addend(log_skip, h, r)
            z.masked_fill_(~valid[:, r], float("-inf"))
            wc, pc, cc = _weights(z, variant, None if gf is None else gf[h, r], pat.n_local, valid[:, r])
            w[h, :, r] = wc
            if coef is not None:
                probs[h, :, r], coef[h, :, r] = pc, cc
            _apply_weights(wc if keep is None else wc * keep[h, :, r], vf[h], c, pat, y[h], zeros, finite)

        ctx.save_for_backward(q, k, v, gate, w, None if probs is w else probs, coef, clamp_pass, dropout_keep)
        ctx.cfg = (window, period, causal, variant, eps, scale, dropout_p)
        return y.view(B, H, T, D).to(q.dtype)

    @staticmethod
    def backward(ctx, dy):
        refuse_double_backward("torch")
        q, k, v, gate, w, probs, coef, clamp_pass, keep = ctx.saved_tensors
        probs = w if probs is None else probs
        window, period, causal, variant, eps, scale, dropout_p = ctx.cfg
        B, H, T, D = q.shape
        N = B * H
        acc = w.dtype
        pat = Pattern(window, period, causal)
        qf, kf, vf = (x.reshape(N, T, D).to(acc) for x in (q, k, v))
        dyf = dy.reshape(N, T, D).to(acc)
        gf = None if gate is None else gate.reshape(N, T).to(acc)
        keep = _keep_multiplier(keep, dropout_p, acc)
        want_gate = ctx.needs_input_grad[3]
        finite = _all_finite(qf, kf, vf, gf, dyf)

        dq = torch.empty_like(qf)
        dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)
        dgate = torch.empty_like(gf) if want_gate else None
        zeros = {}
        for h, c in _chunks(T, window, causal, qf):
            r = c.rows
            wc, pc = w[h, :, r], probs[h, :, r]
            dw = torch.zeros_like(wc)  # dL/dW = dY · V over U(i); invalid skip slots stay 0
            _slot_scores(dyf[h], vf[h], c, pat, dw, finite)
            if keep is not None:
                wc_kept = wc * keep[h, :, r]
                dw *= keep[h, :, r]
            _apply_weights_transposed(wc if keep is None else wc_kept, dyf[h], c, pat, dv[h], zeros, finite)
            d_logits, d_coef = _softmax_backward(dw, wc, pc, None if coef is None else coef[h, :, r],
                                                 pat.n_local)
            if want_gate:
                dgate[h, r] = _gate_grad(d_logits, d_coef, gf[h, r], variant, eps, pat.n_local)
            if clamp_pass is not None:
                d_logits *= clamp_pass[h, :, r]
            d_logits *= scale
            _apply_weights(d_logits, kf[h], c, pat, dq[h], zeros, finite)
            _apply_weights_transposed(d_logits, qf[h], c, pat, dk[h], zeros, finite)
        return (dq.view(B, H, T, D).to(q.dtype), dk.view(B, H, T, D).to(k.dtype),
                dv.view(B, H, T, D).to(v.dtype), None if dgate is None else dgate.view_as(gate).to(gate.dtype),
                ) + (None,) * 10


def _all_finite(*xs: torch.Tensor | None) -> bool:
    """Whether every element is finite: then blocked products (fast); else slot by slot (a host sync).

    From the sums (one fast reduction each): a NaN or ±inf element makes its sum NaN or ±inf. A sum that
    overflows from finite elements only sends the call down the slow path, which gives the same results.
    """
    return bool(torch.isfinite(torch.stack([x.sum() for x in xs if x is not None])).all())


def _keep_multiplier(keep: torch.Tensor | None, p: float, dtype: torch.dtype) -> torch.Tensor | None:
    """Dropout keep mask [B, H, T, M] (bool) -> weight multiplier keep / (1 - p), slot-major [B·H, M, T]."""
    if keep is None:
        return None
    B, H, T, M = keep.shape
    return keep.reshape(B * H, T, M).transpose(1, 2).to(dtype) / (1 - p)


def pi_attention_torch(q, k, v, gate, *, window, period, causal, variant, prior, logit_clamp, eps, scale,
                       dropout_keep, dropout_p, sinks=0, document_ids=None):
    """Same contract as `pi_attention_reference`."""
    return PiAttentionFunction.apply(q, k, v, gate, window, period, causal, variant, prior, logit_clamp,
                                     eps, scale, dropout_keep, dropout_p)
