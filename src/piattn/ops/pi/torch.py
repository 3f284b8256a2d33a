"""Fast eager backend: blocked matrix products for the window, shifted views for the skips, and a
hand-derived backward (ops/pi/README.md, "Backward").

Queries are cut into blocks of `block` rows. A block's local keys are the `block + halo` rows of the padded
key sequence that start where the block starts (halo = window, or 2·window when bidirectional), so one
batched matrix product per block gives every local score; a strided view picks the band out of it.
The same view scatters weights back for P·V and the backward products.

Saved for backward: the inputs and two [B, H, T, |U|] tensors (weights and clamp mask), never a
[B, H, T, |U|, D] copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .pattern import Pattern, log_priors

_MIN_BLOCK = 64


class _Blocks:
    """Geometry of the blocked local band for one call: T queries in `nb` blocks of `block` rows."""

    def __init__(self, T: int, window: int, causal: bool):
        self.T, self.window = T, window
        self.left = window
        self.halo = window if causal else 2 * window
        self.n_local = self.halo + 1
        self.block = max(_MIN_BLOCK, 1 << (self.halo - 1).bit_length() if self.halo else 1)
        self.nb = -(-T // self.block)
        self.span = self.block + self.halo  # key rows seen by one query block

    def pad_queries(self, x: torch.Tensor) -> torch.Tensor:
        """[N, T, C] -> [N, nb, block, C] (zero rows past T)."""
        N, T, D = x.shape
        if self.nb * self.block != T:
            x = F.pad(x, (0, 0, 0, self.nb * self.block - T))
        return x.view(N, self.nb, self.block, D)

    def key_windows(self, x: torch.Tensor) -> torch.Tensor:
        """[N, T, D] -> [N, nb, span, D]: rows block·b - left … of the zero-padded keys (a strided view)."""
        total = (self.nb + 1) * self.block  # one spare block so that every window fits
        xp = F.pad(x, (0, 0, self.left, total - self.left - x.shape[1]))
        return xp.unfold(1, self.span, self.block)[:, : self.nb].transpose(-1, -2)

    def band(self, full: torch.Tensor) -> torch.Tensor:
        """View [N, nb, block, span] -> [N, nb, block, n_local]: element (r, m) is full[r, r + m]."""
        N = full.shape[0]
        s = full.stride()
        assert full.is_contiguous()
        return full.as_strided((N, self.nb, self.block, self.n_local), (s[0], s[1], s[2] + 1, 1))

    def extract(self, full: torch.Tensor) -> torch.Tensor:
        """[N, nb, block, span] -> [N, T, n_local] (a copy)."""
        N = full.shape[0]
        return self.band(full).reshape(N, self.nb * self.block, self.n_local)[:, : self.T]

    def scatter(self, w: torch.Tensor) -> torch.Tensor:
        """[N, T, n_local] -> [N, nb, block, span] with w on the band and zeros elsewhere."""
        N = w.shape[0]
        full = w.new_zeros(N, self.nb, self.block, self.span)
        self.band(full).copy_(self.pad_queries(w))
        return full

    def fold_windows(self, g: torch.Tensor) -> torch.Tensor:
        """Adjoint of `key_windows`: [N, nb, span, D] -> [N, T, D], overlapping rows summed."""
        N, _, _, D = g.shape
        out = g.new_zeros(N, (self.nb + 1) * self.block, D)
        out[:, : self.nb * self.block] = g[:, :, : self.block].reshape(N, -1, D)
        if self.halo:
            tail = out[:, self.block :].view(N, self.nb, self.block, D)[:, :, : self.halo]
            tail += g[:, :, self.block :]
        return out[:, self.left : self.left + self.T]


def _shift_pairs(T: int, offset: int) -> tuple[slice, slice]:
    """Query rows i and key rows i + offset, both inside [0, T)."""
    n = max(T - abs(offset), 0)
    if offset < 0:
        return slice(T - n, T), slice(0, n)
    return slice(0, n), slice(T - n, T)


def _weights(logits: torch.Tensor, variant: str, gate: torch.Tensor | None, n_local: int):
    """Softmax of the fused logits [N, T, M]. Returns (w, probs, coef): w = coef·probs per group.

    One group (every slot) for all variants but "separate", which normalises local and skip slots
    apart and mixes them with coef = (α, 1 − α), or (1, 0) where no skip key exists.
    """
    if variant != "separate" or logits.shape[-1] == n_local:
        p = torch.softmax(logits, -1)
        return p, p, None
    local, skip = logits[..., :n_local], logits[..., n_local:]
    has_skip = torch.isfinite(skip).any(-1, keepdim=True)
    p_skip = torch.softmax(skip.masked_fill(~has_skip, 0.0), -1) * has_skip
    probs = torch.cat([torch.softmax(local, -1), p_skip], -1)
    a = torch.where(has_skip, gate.unsqueeze(-1), torch.ones_like(gate).unsqueeze(-1))
    coef = torch.cat([a.expand_as(local), (1 - a).expand_as(skip)], -1)
    return coef * probs, probs, coef


def _softmax_backward(dw, w, probs, coef, n_local):
    """d logits from d weights; also the gradient reaching coef's α for "separate" ([N, T] or None)."""
    if coef is None:
        return w * (dw - (w * dw).sum(-1, keepdim=True)), None
    d_logits = torch.empty_like(dw)
    dcoef = []
    for part in (slice(0, n_local), slice(n_local, None)):
        p, g = probs[..., part], dw[..., part]
        pg = (p * g).sum(-1, keepdim=True)
        d_logits[..., part] = coef[..., part] * p * (g - pg)
        dcoef.append(pg.squeeze(-1))
    # coef_local = α, coef_skip = 1 − α where a skip exists; where none exists coef is constant.
    has_skip = coef[..., n_local] != 0
    return d_logits, (dcoef[0] - dcoef[1]) * has_skip


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

        z = torch.empty(B * H, T, pat.n_slots, dtype=acc, device=q.device)
        z[..., : pat.n_local] = geo.extract(geo.pad_queries(qf) @ geo.key_windows(kf).transpose(-1, -2))
        for m, o in enumerate(pat.skip_offsets, start=pat.n_local):
            rows, keys = _shift_pairs(T, o)
            z[:, rows, m] = (qf[:, rows] * kf[:, keys]).sum(-1)
        z *= scale
        clamp_pass = None
        if logit_clamp is not None:
            clamp_pass = z.abs() <= logit_clamp
            z.clamp_(-logit_clamp, logit_clamp)
        log_local, log_skip = log_priors(variant, gf, prior, eps)
        z[..., : pat.n_local] += _unsqueeze(log_local)
        z[..., pat.n_local :] += _unsqueeze(log_skip)
        z.masked_fill_(~pat.valid(T, q.device), float("-inf"))

        w, probs, coef = _weights(z, variant, gf, pat.n_local)
        del z
        wd = w if dropout_keep is None else w * dropout_keep.reshape(w.shape) / (1 - dropout_p)
        y = _apply_weights(wd, vf, geo, pat)

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
        keep = None if keep is None else keep.reshape(w.shape) / (1 - dropout_p)

        # dW = dY · V over U(i)
        dw = torch.empty_like(w)
        dw[..., : pat.n_local] = geo.extract(geo.pad_queries(dyf) @ geo.key_windows(vf).transpose(-1, -2))
        for m, o in enumerate(pat.skip_offsets, start=pat.n_local):
            rows, keys = _shift_pairs(T, o)
            dw[:, :, m] = 0
            dw[:, rows, m] = (dyf[:, rows] * vf[:, keys]).sum(-1)
        dv = _apply_weights_transposed(w if keep is None else w * keep, dyf, geo, pat)
        if keep is not None:
            dw *= keep

        d_logits, d_coef = _softmax_backward(dw, w, probs, coef, pat.n_local)
        dgate = None
        if ctx.needs_input_grad[3]:
            dgate = _gate_grad(d_logits, d_coef, gate, variant, eps, pat.n_local)
        ds = d_logits if clamp_pass is None else d_logits * clamp_pass
        ds = ds * scale
        dq = _apply_weights(ds, kf, geo, pat)
        dk = _apply_weights_transposed(ds, qf, geo, pat)
        return (dq.view(B, H, T, D).to(q.dtype), dk.view(B, H, T, D).to(k.dtype),
                dv.view(B, H, T, D).to(v.dtype), dgate) + (None,) * 10


def _unsqueeze(x):
    return x.unsqueeze(-1) if isinstance(x, torch.Tensor) else x


def _gate_grad(d_logits, d_coef, gate, variant, eps, n_local):
    """dL/dα (Eqs. ddelta_da, dalpha_da): local logits carry log max(α, ε), skips log max(1 − α, ε)."""
    if variant == "separate":
        g = torch.zeros_like(d_logits[..., 0]) if d_coef is None else d_coef
    else:
        a = gate.reshape(d_logits.shape[:2]).to(d_logits.dtype)
        g = d_logits[..., :n_local].sum(-1) * (a >= eps) / a
        if d_logits.shape[-1] > n_local:
            g = g - d_logits[..., n_local:].sum(-1) * ((1 - a) >= eps) / (1 - a)
    return g.reshape(gate.shape).to(gate.dtype)


def _apply_weights(w: torch.Tensor, x: torch.Tensor, geo: _Blocks, pat: Pattern) -> torch.Tensor:
    """out[i] = Σ_m w[i, m] · x[i + offset_m]   (w [N, T, M], x [N, T, D] -> [N, T, D])."""
    N, T, D = x.shape
    out = (geo.scatter(w[..., : pat.n_local]) @ geo.key_windows(x)).view(N, -1, D)[:, :T]
    for m, o in enumerate(pat.skip_offsets, start=pat.n_local):
        rows, keys = _shift_pairs(T, o)
        out[:, rows] += w[:, rows, m, None] * x[:, keys]
    return out


def _apply_weights_transposed(w: torch.Tensor, x: torch.Tensor, geo: _Blocks, pat: Pattern) -> torch.Tensor:
    """out[j] = Σ_{i, m: i + offset_m = j} w[i, m] · x[i]   (the adjoint of `_apply_weights` in x)."""
    N, T, D = x.shape
    out = geo.fold_windows(geo.scatter(w[..., : pat.n_local]).transpose(-1, -2) @ geo.pad_queries(x))
    for m, o in enumerate(pat.skip_offsets, start=pat.n_local):
        rows, keys = _shift_pairs(T, o)
        out[:, keys] += w[:, rows, m, None] * x[:, rows]
    return out


def pi_attention_torch(q, k, v, gate, *, window, period, causal, variant, prior, logit_clamp, eps, scale,
                       dropout_keep, dropout_p):
    """Same contract as `pi_attention_reference`."""
    return PiAttentionFunction.apply(q, k, v, gate, window, period, causal, variant, prior, logit_clamp,
                                     eps, scale, dropout_keep, dropout_p)
