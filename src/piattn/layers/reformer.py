"""`ReformerAttention`: LSH attention with shared queries and keys (Kitaev et al., 2020, "Reformer").

Each hash round puts every token in a bucket by angular LSH; a query attends to the keys of its own bucket
that lie near it in position order. Sorting the tokens by (bucket, position) turns "near within the
bucket" into "near in the sorted sequence", so a round costs O(T · bucket_size) memory, never [T, T].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..checks import is_int
from ..config import ModelConfig
from ..ops.pi.dtypes import accumulation_dtype
from .base import AttentionLayer

# Reformer's logit for a token attending to itself: finite, unlike a mask, so a token with no other key
# still gets its own value, and otherwise vanishing (with shared QK, q·q/|q| would dominate every row).
SELF_LOGIT = -1e5


def _check_positive_int(name: str, value) -> None:
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _with_neighbours(chunks: torch.Tensor, fill, after: bool) -> torch.Tensor:
    """chunks [B, H, R, M, c, ...] -> [B, H, R, M, 2c or 3c, ...]: every chunk preceded by the chunk before
    it (and followed by the chunk after it when `after`), `fill` past either end."""
    edge = torch.full_like(chunks[:, :, :, :1], fill)
    parts = [torch.cat([edge, chunks[:, :, :, :-1]], 3), chunks]
    if after:
        parts.append(torch.cat([chunks[:, :, :, 1:], edge], 3))
    return torch.cat(parts, 4)


def _lookup(table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """table [B, H, T] per position, positions [B, H, R, ...] (clamped into [0, T)) -> table values there."""
    B, H, R = positions.shape[:3]
    index = positions.clamp(0, table.shape[-1] - 1).reshape(B, H, R, -1)
    return table[:, :, None].expand(B, H, R, -1).gather(-1, index).view_as(positions)


def _gather_rows(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D], positions [B, H, R, L] in [0, T) -> rows [B, H, R, L, D]."""
    B, H, T, D = x.shape
    R, L = positions.shape[2:]
    return x[:, :, None].expand(B, H, R, T, D).gather(3, positions[..., None].expand(B, H, R, L, D))


def lsh_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, buckets: torch.Tensor, *,
                  bucket_size: int, causal: bool = True, dropout_p: float = 0.0) -> torch.Tensor:
    """Attention within buckets, R rounds combined exactly under one softmax. Scale 1/sqrt(D).

    Args:
        q, k, v: [B, H, T, D]; query i and key i share bucket `buckets[..., r, i]` in round r.
        buckets: [B, H, R, T] non-negative integer bucket ids of R rounds.
        bucket_size: c; in round r, query i attends key j when both are in one bucket, at most c places
            apart in that bucket's position order, and (causal) j <= i.
        causal: see above.
        dropout_p: dropout on the attention weights.

    Query i attends to itself only with logit SELF_LOGIT, so only when it has no other key. The result is
    the softmax over the union of the rounds' key sets, each key counted once: a key that several rounds hold
    enters each with its logit lowered by log(n), n the number of rounds that hold it (the correction the
    Reformer paper describes), and round outputs are weighted by exp(lse_r − logsumexp_r lse_r).

    Causal mode reads no future: a query's bucket, and the places of earlier tokens within its bucket,
    depend on earlier tokens only. (Reformer's fixed chunks of the sorted sequence would not: a later
    token changes how many tokens sort before a query, so which past keys share its chunk.)

    Low-precision inputs are computed in fp32. Returns [B, H, T, D] in q's dtype.
    """
    B, H, T, D = q.shape
    _check_positive_int("bucket_size", bucket_size)
    if buckets.dim() != 4 or buckets.shape[:2] != (B, H) or buckets.shape[3] != T:
        raise ValueError(f"buckets must have shape [B, H, R, T] = [{B}, {H}, R, {T}], got {tuple(buckets.shape)}")
    R, c = buckets.shape[2], bucket_size
    n_chunks = -(-T // c)
    out_dtype, dtype = q.dtype, accumulation_dtype(q.dtype)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)

    positions = torch.arange(T, device=q.device)
    order = torch.argsort(buckets * T + positions, dim=-1)  # [B, H, R, T]: by bucket, then position
    # Where each position sits in the sorted sequence; within a bucket, place differences are the
    # differences of in-bucket ranks, which is what the "c places apart" rule measures.
    place = torch.empty_like(order).scatter_(-1, order, positions.expand_as(order))
    # Padding rows T … T_pad − 1 (distinct, so each is "itself" only) fill the last chunk; they are dropped.
    padding = torch.arange(T, n_chunks * c, device=q.device).expand(B, H, R, -1)
    sorted_positions = torch.cat([order, padding], -1)

    shape = (B, H, R, n_chunks, c)
    pos_q = sorted_positions.view(shape)
    pos_k = _with_neighbours(pos_q, -1, after=not causal)  # -1: no key beyond the ends
    rows = sorted_positions.clamp(max=T - 1)
    q_chunks = _gather_rows(q, rows).view(*shape, D)
    k_chunks = _with_neighbours(_gather_rows(k, rows).view(*shape, D), 0.0, after=not causal)
    v_chunks = _with_neighbours(_gather_rows(v, rows).view(*shape, D), 0.0, after=not causal)

    eligible = (pos_q < T)[..., :, None] & (pos_k >= 0)[..., None, :] & (pos_k < T)[..., None, :]
    if causal:
        eligible = eligible & (pos_k[..., None, :] <= pos_q[..., :, None])
    # Round r's windows hold candidate pairs of round r; every round is asked whether it also holds each
    # pair, which both decides membership (the own round) and counts duplicates (all rounds).
    in_round = torch.zeros_like(eligible)
    rounds_holding = torch.zeros(eligible.shape, dtype=dtype, device=q.device)
    for r in range(R):
        bucket_q, bucket_k = _lookup(buckets[:, :, r], pos_q), _lookup(buckets[:, :, r], pos_k)
        place_q, place_k = _lookup(place[:, :, r], pos_q), _lookup(place[:, :, r], pos_k)
        held = eligible & (bucket_q[..., :, None] == bucket_k[..., None, :])
        held = held & ((place_q[..., :, None] - place_k[..., None, :]).abs() <= c)
        rounds_holding += held
        in_round[:, :, r] = held[:, :, r]

    is_self = pos_k[..., None, :] == pos_q[..., :, None]
    scores = torch.matmul(q_chunks, k_chunks.transpose(-1, -2)) * D ** -0.5  # [B, H, R, M, c, 2c or 3c]
    scores = torch.where(is_self, SELF_LOGIT, scores) - rounds_holding.clamp_min(1).log()
    scores = scores.masked_fill(~(in_round | is_self), float("-inf"))  # every row keeps its finite self

    lse = torch.logsumexp(scores, -1)
    weights = F.dropout(torch.exp(scores - lse[..., None]), dropout_p)
    out = torch.matmul(weights, v_chunks).view(B, H, R, n_chunks * c, D)
    out = out.gather(3, place[..., None].expand(B, H, R, T, D))  # back to position order, padding dropped
    lse = lse.view(B, H, R, n_chunks * c).gather(3, place)
    return (torch.softmax(lse, 2)[..., None] * out).sum(2).to(out_dtype)


class ReformerAttention(AttentionLayer):
    """Reformer's LSH self-attention with shared queries and keys, on [B, T, d_model].

    Args:
        d_model, n_heads, causal, dropout, rotary, rope_base: as in `AttentionLayer`.
        n_hashes: R, hash rounds; their key sets are united under one softmax (see `lsh_attention`).
        bucket_size: c, how many same-bucket neighbours a query reaches back (and forward, when not
            causal); also the chunk length of the sorted sequence, so memory is O(R · T · c).
        n_buckets: buckets per round; None picks 2·ceil(T / c) for each input length T. Must be 1 (no
            hashing: every token in one bucket, a sliding window of c places) or even.
        seed: seed of the random rotations of the hash.

    Shared QK: the key of token i is its query normalised to unit length, as in Reformer, so `qkv`
    projects to queries and values only (weight [2·d_model, d_model]). Hashing is angular LSH: with a
    random matrix W [D, n_buckets/2] per round, bucket = argmax([k·W, −k·W]). W is drawn from `seed`
    alone (not from the input, not per step), so training and evaluation hash alike and a seed gives the
    same buckets on every device; heads share W. Because W's shape follows n_buckets, outputs depend on
    T when n_buckets is None; fix n_buckets for outputs that are the same on every prefix.
    """

    def __init__(self, d_model: int, n_heads: int, *, n_hashes: int = 2, bucket_size: int = 32,
                 n_buckets: int | None = None, causal: bool = True, dropout: float = 0.0, rotary: bool = False,
                 rope_base: float = 10000.0, seed: int = 0):
        super().__init__(d_model, n_heads, causal=causal, dropout=dropout, rotary=rotary, rope_base=rope_base)
        _check_positive_int("n_hashes", n_hashes)
        _check_positive_int("bucket_size", bucket_size)
        if n_buckets is not None:
            _check_positive_int("n_buckets", n_buckets)
            if n_buckets > 1 and n_buckets % 2:
                raise ValueError(f"n_buckets must be 1 or even (angular LSH pairs each direction with its "
                                 f"opposite), got {n_buckets}")
        if not is_int(seed):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        self.n_hashes, self.bucket_size, self.n_buckets, self.seed = n_hashes, bucket_size, n_buckets, seed
        self.qkv = nn.Linear(d_model, 2 * d_model)

    @classmethod
    def config_kwargs(cls, cfg: ModelConfig, layer: int) -> dict:
        """Hash rounds and bucket width from the config; each layer hashes with its own rotations."""
        return dict(n_hashes=cfg.n_hashes, bucket_size=cfg.bucket_size, seed=layer)

    def heads(self, x: torch.Tensor, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, d] at positions offset … -> q, k, v [B, H, T, D]; k = q / |q| (q after RoPE)."""
        B, T, _ = x.shape
        q, v = (t.view(B, T, self.n_heads, self.head_dim).transpose(1, 2) for t in self.qkv(x).chunk(2, -1))
        if self.rotary is not None:
            q = self.rotary(q, offset)
        # Normalised in fp32 at least: a bf16 sum of D squares loses the key's length.
        return q, F.normalize(q.to(accumulation_dtype(q.dtype)), dim=-1), v

    def bucket_count(self, T: int) -> int:
        """Buckets per round for sequences of length T."""
        return self.n_buckets or 2 * -(-T // self.bucket_size)

    @torch.no_grad()
    def buckets(self, k: torch.Tensor) -> torch.Tensor:
        """k [B, H, T, D] -> bucket ids [B, H, R, T] (int64) of the R hash rounds."""
        B, H, T, D = k.shape
        n = self.bucket_count(T)
        if n == 1:
            return torch.zeros(B, H, self.n_hashes, T, dtype=torch.long, device=k.device)
        generator = torch.Generator().manual_seed(self.seed)
        rotations = torch.randn(self.n_hashes, D, n // 2, generator=generator, dtype=torch.float64)
        dtype = accumulation_dtype(k.dtype)
        projected = torch.einsum("bhtd,rdn->bhrtn", k.to(dtype), rotations.to(k.device, dtype))
        return torch.cat([projected, -projected], -1).argmax(-1)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """q, k, v [B, H, T, D] (k the shared keys from `heads`) -> [B, H, T, D]."""
        return lsh_attention(q, k, v, self.buckets(k), bucket_size=self.bucket_size, causal=self.causal,
                             dropout_p=self.attention_dropout)
