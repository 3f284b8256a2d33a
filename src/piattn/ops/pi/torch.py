"""Fast eager backend: blocked matrix products for the window, shifted views for the skips, and a
hand-derived backward (ops/pi/README.md, "Backward").

Queries are cut into blocks of `block` rows. A block's local keys are the `block + halo` rows of the padded
key sequence that start where the block starts (halo = window, or 2·window when bidirectional), so one
batched matrix product per block gives every local score; a strided view picks the band out of it.
The same view scatters weights back for P·V and the backward products.

Per-slot tensors are kept slot-major, [N, |U|, T] with N = B·H, so that softmax and reductions over the
few slots of a query run over contiguous rows of T. Saved for backward: the inputs and two such tensors
(weights and clamp mask; three for "separate"), never a [B, H, T, |U|, D] copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .pattern import Pattern, log_priors

DEFAULT_BLOCK = 32


class _Blocks:
    """Geometry of the blocked local band for one call: T queries in `nb` blocks of `block` rows.

    Block b owns rows b·block … b·block + block - 1; its key window adds `left` rows before and `right`
    rows after (window and 0 when causal, window and window when bidirectional), zeros outside [0, T).
    """

    def __init__(self, T: int, window: int, causal: bool, block: int = DEFAULT_BLOCK):
        self.T = T
        self.left, self.right = window, (0 if causal else window)
        self.n_local = self.left + self.right + 1
        self.block = max(block, self.left, self.right, 1)
        self.nb = -(-T // self.block)
        self.span = self.block + self.left + self.right  # key rows seen by one query block

    def pad_queries(self, x: torch.Tensor) -> torch.Tensor:
        """[N, T, C] -> [N, nb, block, C] (zero rows past T; a view when T is a multiple of block)."""
        N, T, C = x.shape
        if self.nb * self.block != T:
            x = F.pad(x, (0, 0, 0, self.nb * self.block - T))
        return x.view(N, self.nb, self.block, C)

    def key_windows(self, x: torch.Tensor) -> torch.Tensor:
        """[N, T, D] -> [N, nb, span, D]: each block's rows with their halo, zeros outside [0, T)."""
        N, _, D = x.shape
        out = x.new_empty(N, self.nb, self.span, D)
        own = out[:, :, self.left : self.left + self.block]
        own.copy_(self.pad_queries(x))
        if self.left:
            out[:, 0, : self.left] = 0
            out[:, 1:, : self.left] = own[:, :-1, self.block - self.left :]
        if self.right:
            out[:, -1, self.left + self.block :] = 0
            out[:, :-1, self.left + self.block :] = own[:, 1:, : self.right]
        return out

    def fold_windows(self, g: torch.Tensor) -> torch.Tensor:
        """Adjoint of `key_windows`: [N, nb, span, D] -> [N, T, D], halo rows added to their owners."""
        N, _, _, D = g.shape
        out = g[:, :, self.left : self.left + self.block].clone()
        if self.left:
            out[:, :-1, self.block - self.left :] += g[:, 1:, : self.left]
        if self.right:
            out[:, 1:, : self.right] += g[:, :-1, self.left + self.block :]
        return out.view(N, self.nb * self.block, D)[:, : self.T]

    def band(self, full: torch.Tensor) -> torch.Tensor:
        """View [N, nb, block, span] -> [N, nb, block, n_local]: element (r, m) is full[r, r + m]."""
        N = full.shape[0]
        s = full.stride()
        return full.as_strided((N, self.nb, self.block, self.n_local), (s[0], s[1], s[2] + 1, 1))

    def extract(self, full: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the band of `full` [N, nb, block, span] (contiguous) into out [N, n_local, T]."""
        band = self.band(full).permute(0, 3, 1, 2).flatten(2)  # [N, n_local, nb·block]
        out.copy_(band[..., : self.T])

    def scatter(self, w: torch.Tensor) -> torch.Tensor:
        """w [N, n_local, T] -> [N, nb, block, span] with w on the band and zeros elsewhere."""
        N = w.shape[0]
        full = w.new_zeros(N, self.nb, self.block, self.span)
        if self.nb * self.block != self.T:
            w = F.pad(w, (0, self.nb * self.block - self.T))
        self.band(full).copy_(w.view(N, self.n_local, self.nb, self.block).permute(0, 2, 3, 1))
        return full


def _shift_pairs(T: int, offset: int) -> tuple[slice, slice]:
    """Query rows i and key rows i + offset, both inside [0, T)."""
    n = max(T - abs(offset), 0)
    if offset < 0:
        return slice(T - n, T), slice(0, n)
    return slice(0, n), slice(T - n, T)


def _weights(logits: torch.Tensor, variant: str, gate: torch.Tensor | None, n_local: int):
    """Softmax of the fused logits [N, M, T] over slots. Returns (w, probs, coef): w = coef·probs.

    One group (every slot) for all variants but "separate", which normalises local and skip slots
    apart and mixes them with coef = (α, 1 − α), or (1, 0) where no skip key exists.
    """
    if variant != "separate" or logits.shape[1] == n_local:
        p = torch.softmax(logits, 1)
        return p, p, None
    local, skip = logits[:, :n_local], logits[:, n_local:]
    has_skip = torch.isfinite(skip).any(1, keepdim=True)
    p_skip = torch.softmax(skip.masked_fill(~has_skip, 0.0), 1) * has_skip
    probs = torch.cat([torch.softmax(local, 1), p_skip], 1)
    a = torch.where(has_skip, gate.unsqueeze(1), torch.ones_like(gate).unsqueeze(1))
    coef = torch.cat([a.expand_as(local), (1 - a).expand_as(skip)], 1)
    return coef * probs, probs, coef


def _softmax_backward(dw, w, probs, coef, n_local):
    """d logits [N, M, T] from d weights; also dL/dα through coef for "separate" ([N, T], else None)."""
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


def _slot_scores(a: torch.Tensor, b: torch.Tensor, geo: _Blocks, pat: Pattern, out: torch.Tensor) -> None:
    """out[:, m, i] = a[i] · b[i + offset_m]   (a, b [N, T, D] -> out [N, M, T]; invalid slots untouched)."""
    T = a.shape[1]
    geo.extract(geo.pad_queries(a) @ geo.key_windows(b).transpose(-1, -2), out[:, : pat.n_local])
    for m, o in enumerate(pat.skip_offsets, start=pat.n_local):
        rows, keys = _shift_pairs(T, o)
        out[:, m, rows] = torch.linalg.vecdot(a[:, rows], b[:, keys])


def _apply_weights(w: torch.Tensor, x: torch.Tensor, geo: _Blocks, pat: Pattern) -> torch.Tensor:
    """out[i] = Σ_m w[:, m, i] · x[i + offset_m]   (w [N, M, T], x [N, T, D] -> [N, T, D])."""
    N, T, D = x.shape
    out = (geo.scatter(w[:, : pat.n_local]) @ geo.key_windows(x)).view(N, -1, D)[:, :T]
    for m, o in enumerate(pat.skip_offsets, start=pat.n_local):
        rows, keys = _shift_pairs(T, o)
        out[:, rows].addcmul_(w[:, m, rows, None], x[:, keys])
    return out


def _apply_weights_transposed(w: torch.Tensor, x: torch.Tensor, geo: _Blocks, pat: Pattern) -> torch.Tensor:
    """out[j] = Σ_{i, m: i + offset_m = j} w[:, m, i] · x[i]   (the adjoint of `_apply_weights` in x)."""
    N, T, D = x.shape
    out = geo.fold_windows(geo.scatter(w[:, : pat.n_local]).transpose(-1, -2) @ geo.pad_queries(x))
    for m, o in enumerate(pat.skip_offsets, start=pat.n_local):
        rows, keys = _shift_pairs(T, o)
        out[:, keys].addcmul_(w[:, m, rows, None], x[:, rows])
    return out


def _gate_grad(d_logits, d_coef, gate, variant, eps, n_local):
    """dL/dα (Eqs. ddelta_da, dalpha_da): local logits carry log max(α, ε), skips log max(1 − α, ε)."""
    if variant == "separate":
        g = torch.zeros_like(d_logits[:, 0]) if d_coef is None else d_coef
    else:
        a = gate.reshape(d_logits.shape[0], -1).to(d_logits.dtype)
        g = d_logits[:, :n_local].sum(1) * (a >= eps) / a
        if d_logits.shape[1] > n_local:
            g = g - d_logits[:, n_local:].sum(1) * ((1 - a) >= eps) / (1 - a)
    return g.reshape(gate.shape).to(gate.dtype)


def _slot_major(keep: torch.Tensor | None, p: float, dtype: torch.dtype) -> torch.Tensor | None:
    """Dropout keep mask [B, H, T, M] (bool) -> weight multiplier keep / (1 - p), [B·H, M, T]."""
    if keep is None:
        return None
    B, H, T, M = keep.shape
    return keep.reshape(B * H, T, M).transpose(1, 2).to(dtype) / (1 - p)


class PiAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, gate, window, period, causal, variant, prior, logit_clamp, eps, scale,
                dropout_keep, dropout_p):
        B, H, T, D = q.shape
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        pat = Pattern(window, period, causal)
        geo = _Blocks(T, window, causal)
        qf, kf, vf = (x.reshape(B * H, T, D).to(acc) for x in (q, k, v))
        gf = None if gate is None else gate.reshape(B * H, T).to(acc)

        z = torch.empty(B * H, pat.n_slots, T, dtype=acc, device=q.device)
        _slot_scores(qf, kf, geo, pat, z)
        z *= scale
        clamp_pass = None
        if logit_clamp is not None:
            clamp_pass = z.abs() <= logit_clamp
            z.clamp_(-logit_clamp, logit_clamp)
        log_local, log_skip = log_priors(variant, gf, prior, eps)
        z[:, : pat.n_local] += _unsqueeze(log_local)
        z[:, pat.n_local :] += _unsqueeze(log_skip)
        z.masked_fill_(~pat.valid(T, q.device).T, float("-inf"))

        w, probs, coef = _weights(z, variant, gf, pat.n_local)
        del z
        keep = _slot_major(dropout_keep, dropout_p, acc)
        y = _apply_weights(w if keep is None else w * keep, vf, geo, pat)

        ctx.save_for_backward(q, k, v, gate, w, probs, coef, clamp_pass, dropout_keep)
        ctx.cfg = (window, period, causal, variant, eps, scale, dropout_p)
        return y.view(B, H, T, D).to(q.dtype)

    @staticmethod
    def backward(ctx, dy):
        q, k, v, gate, w, probs, coef, clamp_pass, keep = ctx.saved_tensors
        window, period, causal, variant, eps, scale, dropout_p = ctx.cfg
        B, H, T, D = q.shape
        acc = w.dtype
        pat = Pattern(window, period, causal)
        geo = _Blocks(T, window, causal)
        qf, kf, vf = (x.reshape(B * H, T, D).to(acc) for x in (q, k, v))
        dyf = dy.reshape(B * H, T, D).to(acc)
        keep = _slot_major(keep, dropout_p, acc)

        dw = torch.zeros_like(w)  # dL/dW = dY · V over U(i); invalid skip slots stay 0
        _slot_scores(dyf, vf, geo, pat, dw)
        dv = _apply_weights_transposed(w if keep is None else w * keep, dyf, geo, pat)
        if keep is not None:
            dw *= keep

        d_logits, d_coef = _softmax_backward(dw, w, probs, coef, pat.n_local)
        dgate = None
        if ctx.needs_input_grad[3]:
            dgate = _gate_grad(d_logits, d_coef, gate, variant, eps, pat.n_local)
        ds = d_logits if clamp_pass is None else d_logits * clamp_pass
        ds *= scale
        dq = _apply_weights(ds, kf, geo, pat)
        dk = _apply_weights_transposed(ds, qf, geo, pat)
        return (dq.view(B, H, T, D).to(q.dtype), dk.view(B, H, T, D).to(k.dtype),
                dv.view(B, H, T, D).to(v.dtype), dgate) + (None,) * 10


def _unsqueeze(x):
    return x.unsqueeze(1) if isinstance(x, torch.Tensor) else x


def pi_attention_torch(q, k, v, gate, *, window, period, causal, variant, prior, logit_clamp, eps, scale,
                       dropout_keep, dropout_p):
    """Same contract as `pi_attention_reference`."""
    return PiAttentionFunction.apply(q, k, v, gate, window, period, causal, variant, prior, logit_clamp,
                                     eps, scale, dropout_keep, dropout_p)
