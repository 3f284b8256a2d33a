"""`AttentionLayer`: what every attention kind shares (projections, heads, RoPE); kinds differ in `attend`."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from ..analysis.copy_distance import Reach
from ..checks import is_int
from ..config import ModelConfig
from ..config.model import check_kv_heads
from ..decoding.cache import GrowingCache, LayerCache, RingCache
from ..ops.pi.pattern import document_bounds
from .rotary import Rotary
from .sharding import active_shard


class AttentionLayer(nn.Module):
    """Multi-head self-attention on [B, T, d_model]: x → qkv → (RoPE) → `attend` → out.

    Args:
        d_model: model width d, divisible by n_heads.
        n_heads: H; head width D = d / H.
        n_kv_heads: H_kv, the key/value heads (grouped-query attention: query head h reads key/value head
            h // (H / H_kv)); None means H. Must divide H; only kinds with `grouped_query` accept H_kv < H.
            `qkv` then projects to d + 2·H_kv·D channels (q, then k, then v).
        causal: queries see only keys at positions <= their own.
        dropout: attention-weight dropout, active in training mode only.
        rotary: rotate q and k by position (RoPE) before `attend`.
        rope_base: RoPE frequency base.

    A subclass implements `attend(q, k, v, x) -> [B, H, T, D]` from q [B, H, T, D] and k, v [B, H_kv, T, D]
    (x [B, T, d] is passed for kinds that compute something from the layer input, like π-Attention's gate)
    and may override `config_kwargs` to read its own fields of the model config.

    Cached decoding: a kind whose query i reads no key older than i − (capacity − 1) (besides the first
    `cache_sinks()` positions) sets `cache_capacity()`; it then decodes from a fixed-size `RingCache` with
    no code of its own (see `attend_cached`), or faster with `attend_ring` / `attend_recent`. Dense
    attention overrides both; kinds that set neither cannot decode incrementally.

    Packed documents: `forward(x, document_ids=ids)` with ids [B, T] (a new document wherever the id
    changes) runs every document as if it were alone: RoPE positions restart at each document's start and
    kinds with `documents = True` take `attend(q, k, v, x, document_ids=ids)` and keep keys inside the
    query's document; the other kinds refuse document ids.

    Sequence parallelism: inside `piattn.layers.sharding.sequence_parallel(group)` the input x is this
    rank's shard of each sequence; `forward` then rotates by the shard's global positions, and a kind whose
    `attend` calls `pi_operator` (which then exchanges halo rows with the other shards) says so with
    `sequence_parallel = True`. The other kinds refuse to run sharded.

    Reach: a kind whose layers read a fixed set of lags (query back to key) declares it, `lag_reach`: the lags
    a model of its layers reaches, which `piattn eval --by-copy-distance` and the reachability marks of
    `piattn eval` ask the kind for. A kind that does not is refused there.

    Capabilities: each boolean class variable below is one, and so are incremental decoding (a kind that
    sets `cache_capacity`), a declared reach (`lag_reach`) and the model settings a kind takes
    (`model_settings`); `has_capability` answers for one class, and `kinds_with` says which registered kinds
    (`ATTENTION`) have one.
    """

    # True for kinds whose `attend` is exact on a shard (it calls `sharding.pi_operator`); see `forward`.
    sequence_parallel: ClassVar[bool] = False
    # True for kinds that accept n_kv_heads < n_heads (their `attend` takes k, v with H_kv heads).
    grouped_query: ClassVar[bool] = False
    # True for kinds whose `attend` takes `document_ids` [B, T] and keeps every key in its query's document.
    documents: ClassVar[bool] = False
    # The model settings (`ModelConfig` fields) this kind takes: the flags of those settings apply to the
    # kinds that take them (`--window` to the windowed ones). None: its constructor's own keywords named like
    # a field, which is what `config_kwargs` passes; a kind that converts a field lists its settings here.
    declared_settings: ClassVar[frozenset[str] | None] = None

    def __init__(self, d_model: int, n_heads: int, *, n_kv_heads: int | None = None, causal: bool = True,
                 dropout: float = 0.0, rotary: bool = False, rope_base: float = 10000.0):
        super().__init__()
        if not is_int(n_heads) or n_heads < 1 or d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be a positive multiple of n_heads ({n_heads})")
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        check_kv_heads(n_heads, n_kv_heads)
        if n_kv_heads != n_heads and not self.grouped_query:
            raise ValueError(f"n_kv_heads must equal n_heads ({n_heads}) for attention kind "
                             f"{type(self).__name__}, got {n_kv_heads}; kinds with grouped-query attention: "
                             f"{kinds_listed('grouped_query')}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        self.n_heads, self.head_dim, self.causal, self.dropout = n_heads, d_model // n_heads, causal, dropout
        self.n_kv_heads = n_kv_heads
        self.qkv = nn.Linear(d_model, d_model + 2 * n_kv_heads * self.head_dim)
        self.out = nn.Linear(d_model, d_model)
        self.rotary = Rotary(self.head_dim, rope_base) if rotary else None

    @classmethod
    def model_settings(cls) -> frozenset[str]:
        """The `ModelConfig` fields this kind takes beyond the shared ones (d_model, dropout, rope_base, …):
        `declared_settings`, or else its constructor's own keywords named like a field."""
        if cls.declared_settings is not None:
            return cls.declared_settings
        own = inspect.signature(cls).parameters.keys() - inspect.signature(AttentionLayer).parameters.keys()
        return frozenset(own & {f.name for f in dataclasses.fields(ModelConfig)})

    @classmethod
    def lag_reach(cls, model: Mapping[str, Any], max_lag: int) -> Reach:
        """The lags 0 … max_lag a model of this kind's layers reaches, a query reading key i − d through a path
        of one hop per layer (`piattn.analysis.copy_distance.Reach`, with the span of the longest path).

        model: the model's settings by `ModelConfig` field (a checkpoint's config "model", `to_dict()`):
        n_layer, n_head and the kind's own (window, period, …). A kind whose reach is a fixed set of lags
        overrides this, asking the analysis for it (`reach`, `local_reach`, `full_reach`); sinks are not a
        lag (they add the first tokens of the window at every lag). A kind that does not declares none: this
        refuses it, naming the kinds that do."""
        name = next((n for n, kind in ATTENTION.items() if kind is cls), cls.__name__)
        raise ValueError(f"attention must be one of {list(kinds_with('reach'))} (kinds whose reach is a fixed set "
                         f"of lags, which they declare: `lag_reach`), got {name!r}, which declares none")

    @classmethod
    def keys_per_query(cls, model: Mapping[str, Any], n: int, causal: bool = True) -> float:
        """The mean number of keys a query of a length-n sequence sees in one layer (queries near the ends, or
        an image's sides, see fewer), from the model's settings by `ModelConfig` field: what a layer's work
        grows with, for study tables. A kind with a fixed pattern overrides this; the others refuse."""
        name = next((key for key, kind in ATTENTION.items() if kind is cls), cls.__name__)
        raise ValueError(f"attention kind {name!r} declares no keys_per_query (no fixed pattern of keys)")

    @classmethod
    def config_kwargs(cls, cfg: ModelConfig, layer: int) -> dict:
        """Constructor keywords this kind reads from a model config (beyond the shared ones); `layer` is
        the block's index, for kinds that draw a random pattern per layer."""
        return {}

    @classmethod
    def from_config(cls, cfg: ModelConfig, *, causal: bool, layer: int = 0) -> AttentionLayer:
        """The attention of block `layer` of a model of config `cfg`: RoPE on (off on the dense layers of a
        `nope_global` config: `ModelConfig.rotary_at`), dropout and sizes from it."""
        heads = {}
        if cfg.kv_heads != cfg.n_head:
            if not cls.grouped_query:
                name = next((n for n, kind in ATTENTION.items() if kind is cls), cls.__name__)
                raise ValueError(f"n_kv_head must equal n_head ({cfg.n_head}) for attention {name!r}, "
                                 f"got {cfg.kv_heads}; kinds with grouped-query attention: "
                                 f"{kinds_listed('grouped_query')}")
            heads["n_kv_heads"] = cfg.kv_heads
        return cls(cfg.d_model, cfg.n_head, causal=causal, dropout=cfg.dropout, rotary=cfg.rotary_at(layer),
                   rope_base=cfg.rope_base, **heads, **cls.config_kwargs(cfg, layer))

    @property
    def attention_dropout(self) -> float:
        """The dropout probability to apply now (0 outside training)."""
        return self.dropout if self.training else 0.0

    def heads(self, x: torch.Tensor, offset: int = 0, positions: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, d] at positions offset … offset+T−1 (or at `positions` [B, T] int64) -> q [B, H, T, D],
        k, v [B, H_kv, T, D], q and k rotated by RoPE."""
        B, T, _ = x.shape
        H, H_kv, D = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.qkv(x).view(B, T, H + 2 * H_kv, D)
        qk, v = qkv[:, :, :H + H_kv], qkv[:, :, H + H_kv:]
        if self.rotary is not None:  # q and k rotated in one go: a decoding step is made of such small ops
            qk = self.rotary.rotate(qk, *self.rotary.cos_sin(T, offset, positions, x.device))
        return qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2), v.transpose(1, 2)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def cache_capacity(self) -> int | None:
        """Positions a decoding cache must hold (None: all of them); raises if the kind cannot decode."""
        raise ValueError(f"attention kind {type(self).__name__} has no incremental decoding; "
                         f"kinds that have one: {kinds_listed('decoding')}")

    def cache_sinks(self) -> int:
        """Positions 0 … n − 1 a ring cache keeps besides its ring (attention sinks): 0 unless overridden."""
        return 0

    def init_cache(self, batch_size: int, *, max_positions: int | None = None, device=None,
                   dtype=torch.float32) -> LayerCache:
        """An empty cache for this layer (H_kv heads): a ring of `cache_capacity()` positions (plus
        `cache_sinks()` fixed ones), or a growing one (allocated once at max_positions when given).
        max_positions: the most positions it will be given (prompt + generated tokens), which caps the ring: a
        period of 10^9 then costs what the text needs, not a ring of 10^9 positions."""
        capacity = self.cache_capacity()
        if capacity is None:
            return GrowingCache(batch_size, self.n_kv_heads, self.head_dim, max_positions=max_positions,
                                device=device, dtype=dtype)
        if max_positions is not None:
            capacity = max(1, min(capacity, max_positions))
        return RingCache(batch_size, self.n_kv_heads, self.head_dim, capacity, sinks=self.cache_sinks(),
                         max_positions=max_positions, device=device, dtype=dtype)

    # `attend_cached` uses `attend_recent` (when the kind has one) for steps of at most this many new tokens.
    # Its cost is t·(window + 2) gathered keys against the blocked operator's fixed per-call overhead plus
    # O((n + t)·window): a win for the one-token steps of generation and for short drafts, while prompts
    # (hundreds of rows) are better served by the blocked operator, which never materialises [t, |U|, D].
    fast_decode_max_tokens: ClassVar[int] = 4

    def attend_recent(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      x: torch.Tensor) -> torch.Tensor | None:
        """The last t rows of `attend` on N rows, from q [B, H, t, D] and x [B, t, d] of those t rows and
        k, v [B, H_kv, N, D] of all N, in eval (no dropout); None for kinds without such a path."""
        return None

    def attend_ring(self, q: torch.Tensor, cache: RingCache, x: torch.Tensor) -> torch.Tensor | None:
        """The output [B, H, 1, D] of one new query q [B, H, 1, D] (layer input x [B, 1, d]) read from
        `cache`, which already holds its key, in eval; None for kinds without such a path."""
        return None

    # Whether `attend_ring` is implemented (checked before the new key is stored, which it needs done).
    ring_step: ClassVar[bool] = False

    def attend_cached(self, x: torch.Tensor, cache: LayerCache) -> torch.Tensor:
        """x [B, t, d] of the t tokens after what `cache` has seen -> [B, H, t, D]; appends them to cache.

        One new token, a ring cache and a kind with `ring_step`: the token's key is stored first and
        `attend_ring` reads its few keys straight from the ring (generation's step: the fewest ops).
        Few new tokens (t <= `fast_decode_max_tokens`, no dropout, not sharded): `attend_recent` on the
        new queries against the n cached and t new keys, if the kind has it (`pi`, `local`: only the
        <= window + 2 keys each query reads are touched). Otherwise the n cached positions are put back in
        front of the new ones and `attend` runs on the n + t rows; the outputs of the n old rows are
        dropped. Both are exact because the cache reaches back as far as any new query looks
        (`cache_capacity`), and when it holds fewer positions than that the text starts there, so
        positions outside the block are outside the text too. The old rows cost O(capacity) per step:
        constant.
        """
        q, k, v = self.heads(x, offset=cache.seen)
        t = x.shape[1]
        fast = t <= self.fast_decode_max_tokens and self.attention_dropout == 0 and active_shard() is None
        if fast and t == 1 and self.ring_step and isinstance(cache, RingCache):
            cache.append(k, v)
            return self.attend_ring(q, cache, x)
        k_old, v_old = cache.recent()
        cache.append(k, v)
        k_all, v_all = torch.cat([k_old, k], 2), torch.cat([v_old, v], 2)
        n = k_old.shape[2]
        if fast:
            y = self.attend_recent(q, k_all, v_all, x)
            if y is not None:
                return y
        pad = x.new_zeros(x.shape[0], n, x.shape[2])
        y = self.attend(torch.cat([q.new_zeros(*q.shape[:2], n, q.shape[3]), q], 2), k_all, v_all,
                        torch.cat([pad, x], 1))
        return y[:, :, n:]

    def shard_offset(self, shard_len: int) -> int:
        """Global position of the first row of x: 0, or r·S inside `sequence_parallel` (ValueError for a
        kind that cannot run sharded)."""
        shard = active_shard()
        if shard is None:
            return 0
        if not self.sequence_parallel:
            raise ValueError(f"attention kind {type(self).__name__} cannot run sequence-parallel; "
                             f"kinds that can: {kinds_listed('sequence_parallel')}")
        return shard.offset(shard_len)

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, d_model] -> [B, T, d_model]; with `cache`, x continues the text the cache has seen; with
        `document_ids` [B, T], each document of x is attended to (and rotated) as if it were alone.

        Inside `sequence_parallel(group)`, x is positions r·T … r·T + T − 1 of a sequence sharded over group.
        """
        B, T, d = x.shape
        if document_ids is not None:
            y = self.attend_documents(x, cache, document_ids)
        elif cache is None:
            y = self.attend(*self.heads(x, offset=self.shard_offset(T)), x)
        elif active_shard() is not None:
            raise ValueError("cached decoding cannot run sequence-parallel")
        else:
            # Another model's cache (batch, heads, ring, sinks) would give wrong rows, or be read past its end.
            cache.check(batch_size=B, n_heads=self.n_kv_heads, head_dim=self.head_dim,
                        capacity=self.cache_capacity(), sinks=self.cache_sinks())
            y = self.attend_cached(x, cache)
        return self.out(y.transpose(1, 2).reshape(B, T, d))

    def attend_documents(self, x: torch.Tensor, cache: LayerCache | None, document_ids: torch.Tensor) -> torch.Tensor:
        """x [B, T, d] of packed documents, document_ids [B, T] -> [B, H, T, D]; RoPE position t − start(t)."""
        if not self.documents:
            raise ValueError(f"document_ids are not supported by attention kind {type(self).__name__}; "
                             f"kinds that support them: {kinds_listed('documents')}")
        if cache is not None or active_shard() is not None:
            raise ValueError("document_ids cannot be combined with cached decoding or sequence parallelism")
        if document_ids.shape != x.shape[:2] or document_ids.dtype.is_floating_point:
            raise ValueError(f"document_ids must be integer ids of shape [B, T] = {tuple(x.shape[:2])}, "
                             f"got {document_ids.dtype} {tuple(document_ids.shape)}")
        document_ids = document_ids.to(x.device)
        start, _ = document_bounds(document_ids)
        positions = torch.arange(x.shape[1], device=x.device) - start
        return self.attend(*self.heads(x, positions=positions), x, document_ids=document_ids)


# The capabilities `AttentionLayer` declares as boolean class variables (False unless a kind sets them).
DECLARED = tuple(name for name, value in vars(AttentionLayer).items() if isinstance(value, bool))
MODEL_SETTINGS = tuple(f.name for f in dataclasses.fields(ModelConfig))
CAPABILITIES = (*DECLARED, "decoding", "reach", *MODEL_SETTINGS)


def check_capability(capability: str) -> None:
    """ValueError unless `capability` is one of CAPABILITIES (a misspelt one would match no kind)."""
    if capability not in CAPABILITIES:
        raise ValueError(f"capability must be one of {list(CAPABILITIES)}, got {capability!r}")


def has_capability(kind: type[AttentionLayer], capability: str) -> bool:
    """Whether the attention class `kind` has `capability`."""
    check_capability(capability)
    if capability in DECLARED:
        return getattr(kind, capability)
    if capability == "decoding":
        return kind.cache_capacity is not AttentionLayer.cache_capacity
    if capability == "reach":
        return kind.lag_reach.__func__ is not AttentionLayer.lag_reach.__func__
    return capability in kind.model_settings()


# The attention kinds by name: filled with the built-in kinds by `registry` (which the package imports first,
# so it is full whenever a layer exists), open to more. It lives here, below every kind, so that the refusals
# above can list the kinds that can do what they refuse.
ATTENTION: dict[str, type[AttentionLayer]] = {}


def kinds_with(capability: str) -> tuple[str, ...]:
    """The registered kinds that have `capability`, sorted."""
    check_capability(capability)
    return tuple(sorted(name for name, kind in ATTENTION.items() if has_capability(kind, capability)))


def kinds_listed(capability: str) -> str:
    """"dense, local, pi": the registered kinds that have `capability`, for the refusals above."""
    return ", ".join(kinds_with(capability))
