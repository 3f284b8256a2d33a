"""The attention and mask functions HF dispatches to for "pi_attention", and the settings they read."""

from __future__ import annotations

import copy
import dataclasses
import functools
import weakref
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn
from transformers import AttentionInterface, AttentionMaskInterface

from ...analysis.multiscale import periods_per_layer
from ...config.model import layer_settings, resolve_periods
from ...config.pi import PI_DEFAULTS, PiSettings
from ...layers.base import AttentionLayer
from ...layers.gate import gate_hidden, gate_hooked, gate_values
from ...ops.pi import BACKENDS, pi_attention_with_settings
from ...ops.pi.decode_plan import decode_plan, decode_settings
from ...ops.pi.validate import head_periods
from .padding import EMPTY, TEXT, document_ids, text_bounds

ATTENTION_NAME = "pi_attention"


@dataclass(frozen=True)
class HFPiSettings:
    """The settings of a converted model, typed: each layer's operator settings whole (`layers`, one
    `piattn.config.PiSettings` per layer, as `ModelConfig.pi_settings` hands a GPT's layers theirs) and the
    backend that runs them. It holds `PiSettings` objects, not a copy of their fields: the attention function
    hands its layer's object to the operator whole (`pi_attention_with_settings`) and to the decoding plans
    (`decode_settings`).

    Stored flat in `config.pi_attention` as {window, period, variant, prior, logit_clamp, eps, sinks, backend}
    (`as_dict`, the one conversion to that dict; `of` reads it back). `period` takes every form `GPTConfig.period`
    does (an int, one per query head, one list of per-head periods per layer, or a schedule name), resolved for
    the model's layers and heads by `piattn.config.model.resolve_periods` and stored resolved. Layers of equal
    periods share one object; `pi` is layer 0's (the layers differ in their periods only).
    """

    layers: tuple[PiSettings, ...]
    backend: str = "auto"

    def __post_init__(self):
        if not self.layers or not all(isinstance(s, PiSettings) for s in self.layers):
            raise ValueError(f"layers must be one piattn.config.PiSettings per layer, got {self.layers!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS} on this install, got {self.backend!r}")

    @classmethod
    def resolve(cls, config, *, window: int = PI_DEFAULTS.window, period=PI_DEFAULTS.period,
                variant: str = PI_DEFAULTS.variant, prior: float = PI_DEFAULTS.prior,
                logit_clamp: float | None = PI_DEFAULTS.logit_clamp, eps: float = PI_DEFAULTS.eps,
                sinks: int = PI_DEFAULTS.sinks, backend: str = "auto") -> HFPiSettings:
        """The settings of `PiSettings`' fields (missing ones take their defaults; `period` in any form
        `resolve_periods` reads) and `backend` for a transformers `config`: its num_hidden_layers and
        num_attention_heads size per-layer and per-head periods, its max_position_embeddings is the block size of
        the "cover" schedule. Each layer's `PiSettings` is built, and checked, once (`layer_settings`, as a model
        config builds its own). ValueError naming the setting for anything out of range."""
        n_layer, n_head = config.num_hidden_layers, config.num_attention_heads
        resolved = resolve_periods(period, window=window, n_layer=n_layer, n_head=n_head,
                                   block_size=getattr(config, "max_position_embeddings", None) or 1)
        layers = layer_settings(periods_per_layer(resolved, n_layer, n_head), window=window, variant=variant,
                                prior=prior, logit_clamp=logit_clamp, eps=eps, sinks=sinks)
        return cls(layers, backend)

    @classmethod
    def of(cls, config) -> HFPiSettings:
        """The settings in `config.pi_attention` (missing keys take their defaults), range-checked."""
        # Read by every attention layer (and its PiCache's check) on every decoding step: the settings last
        # resolved for this config object are returned at once while what resolved them is unchanged (`_remember`).
        memo = _OF_MEMO.get(id(config))
        if memo is not None and memo[0] is cls:
            settings = memo[1](config)
            if settings is not None:
                return settings
        stored = getattr(config, "pi_attention", None)
        if stored is None:
            raise ValueError("config has no pi_attention settings: convert the model with convert_to_pi first")
        # Resolved once per distinct content (the stored dict and the sizes that resolve it), a third of a small
        # model's step otherwise.
        shape = (config.num_hidden_layers, config.num_attention_heads, getattr(config, "max_position_embeddings", None))
        try:
            key = (_frozen(dict(stored)), shape)
            hash(key)
        except TypeError:  # something unhashable stored: resolve it (and refuse it) every time
            return cls._of(dict(stored), config)
        settings = _settings_of(cls, key)
        _remember(cls, config, stored, shape, settings)
        return settings

    @classmethod
    def _of(cls, stored: dict, config) -> HFPiSettings:
        """The settings of a stored dict (`as_dict`'s form): its keys become `resolve`'s keywords."""
        unknown = sorted(set(stored) - _STORED_KEYS)
        if unknown:
            raise ValueError(f"config.pi_attention has unknown settings {unknown}")
        return cls.resolve(config, **stored)

    @property
    def pi(self) -> PiSettings:
        """Layer 0's settings (every layer's but for its periods)."""
        return self.layers[0]

    def layer(self, index: int | None) -> PiSettings:
        """The settings of layer `index` (a module's `layer_idx`; None: layer 0)."""
        return self.layers[0 if index is None else index]

    def as_dict(self, n_head: int) -> dict:
        """What `config.pi_attention` holds for a model of `n_head` query heads: the settings' fields, the
        period of every layer in the form `resolve_periods` stores it (an int, one list of per-head periods, or
        one such list per layer) and the backend."""
        heads = [list(head_periods(s.period, n_head)) for s in self.layers]
        period = resolve_periods(heads, window=self.pi.window, n_layer=len(heads), n_head=n_head, block_size=1)
        return {**self.pi.as_kwargs(), "period": period, "backend": self.backend}

    @property
    def reach(self) -> int:
        """How far back a query of any layer looks: no query reads a key older than i − reach."""
        return max(s.reach for s in self.layers)


# The keys `config.pi_attention` may hold: the fields of `PiSettings` and the backend.
_STORED_KEYS = {f.name for f in dataclasses.fields(PiSettings)} | {"backend"}


def _frozen(x):
    """A hashable copy of stored settings: lists and tuples as tuples, dicts as sorted item tuples."""
    if isinstance(x, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in x.items()))
    if isinstance(x, (list, tuple)):
        return tuple(_frozen(v) for v in x)
    return x


# id(config) -> (the class asked, a check that returns the settings resolved for that config while they hold,
# else None): `HFPiSettings.of`'s memo of the settings last resolved per config object, which a step reads without
# freezing and hashing the stored dict again (8 µs, where reading one attribute of a transformers config is 1 µs).
_OF_MEMO: dict[int, tuple] = {}


def _remember(cls, config, stored, shape: tuple, settings: HFPiSettings) -> None:
    """Remember `settings` as resolved from `stored` (config.pi_attention) and `shape` for `config`: valid while
    the config object lives and holds that very dict, with the same content (a deep copy compared: a change in
    place is seen), and the same sizes. Read from the config's own attributes (`__dict__`, past transformers'
    per-attribute lookup); a config that keeps any of them elsewhere (an attribute_map alias) is not memoized."""
    try:
        attributes = object.__getattribute__(config, "__dict__")
        ref = weakref.ref(config)
    except (AttributeError, TypeError):
        return
    if attributes.get("pi_attention") is not stored or _sizes(attributes) != shape:
        return
    snapshot = copy.deepcopy(stored)

    def valid(config) -> HFPiSettings | None:
        if ref() is not config:
            return None
        d = object.__getattribute__(config, "__dict__")
        held = d.get("pi_attention")
        return settings if held is stored and held == snapshot and _sizes(d) == shape else None

    if len(_OF_MEMO) >= 256:
        _OF_MEMO.clear()
    _OF_MEMO[id(config)] = (cls, valid)


def _sizes(attributes: dict) -> tuple:
    """The sizes that resolve the settings (as `HFPiSettings.of` reads them) from a config's `__dict__`."""
    return (attributes.get("num_hidden_layers"), attributes.get("num_attention_heads"),
            attributes.get("max_position_embeddings"))


@functools.lru_cache(maxsize=64)
def _settings_of(cls, key) -> HFPiSettings:
    stored, (n_layer, n_head, block_size) = key
    config = SimpleNamespace(num_hidden_layers=n_layer, num_attention_heads=n_head, max_position_embeddings=block_size)
    return cls._of({k: _thawed(v) for k, v in stored}, config)


def _thawed(x):
    """`_frozen`'s tuples back to the lists a config stores."""
    return [_thawed(v) for v in x] if isinstance(x, tuple) else x


def dense_kv_heads(config, layer: int | None) -> tuple[int, ...]:
    """The key/value heads that `layer` keeps dense (`convert_to_pi(dense_heads=...)`, stored in
    `config.pi_dense_heads` as one sorted list per layer), in order; () for none (or no such setting)."""
    stored = getattr(config, "pi_dense_heads", None)
    if not stored or layer is None:
        return ()
    return tuple(stored[layer])


def pi_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF attention function: query [B, H, Tq, D], key/value [B, Hkv, Tk, D] -> ([B, Tq, H, D], None).

    π-Attention (`_pi_forward`) on every head, except in a layer with dense key/value heads
    (`dense_kv_heads`): there each dense key/value head and all its query heads (its grouped-query group)
    run dense causal attention over every position so far (`_dense_attention`; the keys come from key/value,
    or from a `PiCache` layer's full cache of its dense heads), and their outputs replace those of the π
    operator, which runs on all heads (its outputs of the dense heads are dropped; not at all when every head
    is dense).
    """
    mix = getattr(module, "_pi_dense_mix", None)
    if mix is not None:
        return _mixed_forward(module, mix, query, key, value, attention_mask, scaling, dropout, **kwargs)
    dense = dense_kv_heads(module.config, getattr(module, "layer_idx", None))
    if not dense:
        return _pi_forward(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    B, H, Tq, D = query.shape
    Hkv = key.shape[1]
    group = H // Hkv
    cache_layer = getattr(module, "_pi_cache_layer", None)
    if cache_layer is not None and getattr(cache_layer, "dense_heads", ()):
        if tuple(cache_layer.dense_heads) != dense:
            raise ValueError(f"the PiCache layer keeps key/value heads {cache_layer.dense_heads} dense but the "
                             f"model's layer has {dense}: make it with PiCache(model.config)")
        dense_k, dense_v = cache_layer.dense_keys, cache_layer.dense_values
    else:
        index = torch.tensor(dense, device=key.device)
        dense_k, dense_v = key.index_select(1, index), value.index_select(1, index)
    p0 = _every_position_read(attention_mask, cache_layer, kwargs.get("position_ids"), dense_k.shape[2], Tq,
                              "dense heads read", ": use PiCache or DynamicCache")
    heads = torch.tensor([h * group + j for h in dense for j in range(group)], device=query.device)
    y_dense = _dense_attention(query.index_select(1, heads), dense_k, dense_v, attention_mask, p0, scaling, dropout)
    if len(dense) == Hkv:
        for name in ("_pi_cache_layer", "_pi_gate_input"):  # what the π path would have read, and forgotten
            _forget(module, name)
        return y_dense.transpose(1, 2), None
    y, _ = _pi_forward(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    return y.index_copy(2, heads, y_dense.transpose(1, 2).to(y.dtype)), None


def _mixed_forward(module: nn.Module, mix: torch.Tensor, query, key, value, attention_mask, scaling, dropout,
                   **kwargs) -> tuple[torch.Tensor, None]:
    """DuoAttention's mix (`duo_attention_scores`, which sets `module._pi_dense_mix` while it trains): each query
    head's output is m · dense + (1 − m) · π, with m = mix [Hkv] of its key/value head. Every position in
    key/value (no PiCache)."""
    if getattr(module, "_pi_cache_layer", None) is not None:
        raise ValueError("mixing dense and pi_attention heads reads every position: run it without PiCache")
    Tq, group = query.shape[2], query.shape[1] // key.shape[1]
    p0 = _every_position_read(attention_mask, None, kwargs.get("position_ids"), key.shape[2], Tq,
                              "mixing dense heads reads")
    y_dense = _dense_attention(query, key, value, attention_mask, p0, scaling, dropout).transpose(1, 2)
    y_pi, _ = _pi_forward(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    m = mix.repeat_interleave(group).to(y_pi.dtype)[:, None]  # [H, 1]
    return m * y_dense + (1 - m) * y_pi, None


def _dense_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, p0: int,
                     scaling: float | None, dropout: float) -> torch.Tensor:
    """Causal attention of queries at p0 … p0 + Tq − 1 [B, Hq, Tq, D] over keys/values at 0 … p0 + Tq − 1
    [B, Hkv, Tk, D] (Hq a multiple of Hkv: query head h reads key/value head h // (Hq / Hkv)) -> [B, Hq, Tq, D].

    `attention_mask`: None, or the 2D padding mask [B, Tk] (`pi_attention_mask`): pads are not read; a pad's
    own row reads itself only (its output is never used, and a row with nothing to read would be NaN)."""
    Tq, Tk = query.shape[2], key.shape[2]
    i = torch.arange(p0, p0 + Tq, device=query.device)[:, None]
    j = torch.arange(Tk, device=query.device)[None, :]
    allowed = j <= i
    if attention_mask is not None:
        allowed = allowed & (attention_mask[:, None, None, :Tk].bool() | (j == i))
    # enable_gqa reads key/value head h // (Hq / Hkv) in place: no copy of every position for each query head
    # (repeating them cost an eighth of a decoding step at 2K positions)
    return nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=allowed, dropout_p=dropout,
                                                      scale=scaling, enable_gqa=query.shape[1] != key.shape[1])


def _pi_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """π-Attention on every head: query [B, H, Tq, D], key/value [B, Hkv, Tk, D] -> ([B, Tq, H, D], None).

    Tk > Tq when a cache supplied Tk − Tq earlier keys: those of the positions just before the queries; but
    after a PiCache layer's one-token update (its `stored_in_ring`), key/value are that layer's ring [B, Hkv,
    size, D] in slot order, read by slot through the layer's decoding plan (`DecodePlan.rows`), or oldest first
    (`ordered()`).
    `attention_mask` is what `pi_attention_mask` returned: None, or the 2D padding mask [B, P] over all P
    positions so far. `dropout` is HF's (already 0 outside training); `scaling` is the module's score scale.
    The key/value heads go to the operator as they are (grouped-query attention is the operator's).
    """
    if not getattr(module, "is_causal", True):
        raise ValueError("pi_attention in transformers supports causal attention only")
    settings = HFPiSettings.of(module.config)
    layer = getattr(module, "layer_idx", None)
    pi = settings.layer(layer)
    B, H, Tq, D = query.shape
    gate_input = _gate_input(module, pi)
    gate = None
    cache_layer = getattr(module, "_pi_cache_layer", None)
    _forget(module, "_pi_cache_layer")  # don't keep the cache alive past its one use
    if cache_layer is not None and cache_layer.stored_in_ring:
        # A one-token step that the PiCache layer stored in place: key/value are its ring in slot order, not
        # its positions oldest first (`PiCacheLayer`). The layer's decoding plan reads the ring by slot, copying
        # nothing; any other path (padding, dropout, a backend without decoding steps, tracing, a plan whose
        # steps decline the call) reads the positions oldest first, as from any cache (one copy of the ring).
        plan = None
        if attention_mask is None and not dropout and Tq == 1 and not torch.compiler.is_compiling():
            plan = decode_plan(decode_settings(pi, D**-0.5 if scaling is None else scaling), H,
                               capacity=cache_layer.capacity, device=query.device, backend=settings.backend)
        if plan is not None:
            # "adaptive": the gate's hidden pre-activation and last layer, which the step finishes (GELU, linear,
            # σ, clip) in the same call, as the decoding layers' `ring_gate` hands it.
            hidden, head = _ring_gate(module, gate_input, pi) if plan.gate_in_step else (None, None)
            gate = _gate_values(module, pi, gate_input) if head is None else hidden
            y = plan.rows(query, cache_layer.kv, gate, head, cache_layer.cumulative_length - 1)
            if y is not None:
                return y.transpose(1, 2), None
            if head is not None:
                gate = None  # α̃ from the gate's input below, what the step would have computed from its hidden layer
        key, value = cache_layer.ordered()
    if gate is None:
        gate = _gate_values(module, pi, gate_input)
    bounds = None if attention_mask is None else text_bounds(attention_mask)
    p0 = _first_query_position(attention_mask, cache_layer, kwargs.get("position_ids"), key.shape[2], Tq)
    past = key.shape[2] - Tq
    if past != p0 and past < pi.reach:
        raise ValueError(f"the cache gave {past} keys before position {p0}, but pi_attention reads the last "
                         f"{pi.reach}: use PiCache or DynamicCache")
    # Keys older than `reach` before the first query are never read, except the sinks: drop them, so that a
    # decoding step costs O(reach) however much the cache holds.
    recent = min(past, pi.reach)
    sinks = _old_sinks(pi.sinks, bounds, p0 - recent, key, value, None if past == p0 else cache_layer)
    key, value = key[:, :, key.shape[2] - Tq - recent :], value[:, :, value.shape[2] - Tq - recent :]
    ids = None
    if sinks is not None or bounds is not None:
        positions = torch.arange(p0 - recent, p0 + Tq, device=query.device)
        start, end = bounds if bounds is not None else _no_padding(B, p0 + Tq, query.device)
        ids = document_ids(positions, start, end)
        if sinks is not None:
            sink_k, sink_v, sink_ok = sinks
            key, value = torch.cat([sink_k, key], 2), torch.cat([sink_v, value], 2)
            ids = torch.cat([torch.where(sink_ok, TEXT, EMPTY), ids], 1)
        if bool((ids == ids[:, :1]).all()):
            ids = None  # one document: the operator's plain (faster) path
    if (ids is None and not dropout and Tq <= AttentionLayer.fast_decode_max_tokens
            and (past or cache_layer is not None) and not torch.compiler.is_compiling()):
        # A decoding step of one text per row: the block (sinks, then the recent positions: as `RingCache.recent`)
        # reads as one text without changing any row, since every local and skip key of a query lies in the recent
        # positions and the sinks lie farther back in both. The plan of the model's backend runs it where it has
        # steps that take it (`decode_steps.FOR_BACKEND`: "auto" the compiled step, else torch ops; "fused" the
        # compiled step only); else the full operator runs, or refuses with its reason.
        plan = decode_plan(decode_settings(pi, D**-0.5 if scaling is None else scaling), H, device=query.device,
                           backend=settings.backend)
        y = None if plan is None else plan.rows(query, (key, value), gate)
        if y is not None:
            return y.transpose(1, 2), None
    ahead = key.shape[2] - Tq
    if ahead:
        # Rows for the sinks and cached positions, so that relative offsets line up; their outputs are dropped.
        query = torch.cat([query.new_zeros(B, H, ahead, D), query], 2)
        if gate is not None:
            gate = torch.cat([gate.new_full((B, H, ahead), 0.5), gate], 2)
    out = pi_attention_with_settings(query, key, value, gate, pi, causal=True, scale=scaling, dropout_p=dropout,
                                     document_ids=ids, backend=settings.backend)
    return out[:, :, ahead:].transpose(1, 2), None


def pi_attention_mask(*, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """HF mask function for "pi_attention": no dense mask. None when nothing is padded; else the 2D padding
    mask [B, P] bool, checked (each row's tokens one run), which the attention function turns into documents."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    text_bounds(attention_mask)  # raises on a mask the pattern cannot follow
    return attention_mask.bool()


def register(name: str = ATTENTION_NAME) -> None:
    """Make `name` a valid `attn_implementation` (attention and mask function); safe to call repeatedly."""
    AttentionInterface.register(name, pi_attention_forward)
    AttentionMaskInterface.register(name, pi_attention_mask)


def _no_padding(B: int, P: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(start, end) [B] of rows that are all text."""
    return torch.zeros(B, dtype=torch.long, device=device), torch.full((B,), P, dtype=torch.long, device=device)


def _every_position_read(attention_mask, cache_layer, position_ids, Tk: int, Tq: int, reader: str,
                         advice: str = "") -> int:
    """`_first_query_position`, for attention that reads every position so far: ValueError (`reader` says who
    reads, `advice` what to do) unless the Tk keys are exactly the positions up to the last query."""
    p0 = _first_query_position(attention_mask, cache_layer, position_ids, Tk, Tq)
    if Tk != p0 + Tq:
        raise ValueError(f"{reader} every position, but the cache gave {Tk} keys for queries at {p0} … "
                         f"{p0 + Tq - 1}{advice}")
    return p0


def _first_query_position(attention_mask, cache_layer, position_ids, Tk: int, Tq: int) -> int:
    """The absolute position (index in the padded rows) of the first query.

    From the padding mask (it covers every position so far), else from a PiCache layer (it counts what it
    has seen), else from position_ids (equal in every row, consecutive), else the keys are all positions.
    """
    if attention_mask is not None:
        if attention_mask.shape[1] < Tk:
            raise ValueError(f"attention_mask covers {attention_mask.shape[1]} positions but the cache gave {Tk} "
                             "keys: pass the mask of every position so far")
        return attention_mask.shape[1] - Tq
    if cache_layer is not None:
        return cache_layer.cumulative_length - Tq
    if position_ids is None or torch.compiler.is_compiling():
        return Tk - Tq
    rows = position_ids.reshape(-1, Tq)
    p0 = int(rows[0, 0])
    if not torch.equal(rows, p0 + torch.arange(Tq, device=rows.device).expand_as(rows)):
        raise ValueError("pi_attention needs position_ids p0 … p0+T−1, the same in every row, or a 2D "
                         "attention_mask for padded rows (no packed sequences)")
    return p0


def _old_sinks(sinks: int, bounds, recent_start: int, key, value, cache_layer):
    """The sink keys older than the recent keys, which the block must carry in front of them.

    Row b's sinks are positions start_b … start_b + sinks − 1; those at or after `recent_start` are among the
    recent keys already. They are read from `key`/`value` [B, Hkv, Tk, D] when those hold every position
    from 0 (`cache_layer` None), else from the PiCache layer's copy. Returns (k, v [B, Hkv, F, D], ok [B, F])
    with F the most any row needs, each row's right-aligned (so that they sit just before the recent keys)
    and `ok` false on the slots a row leaves empty; or None when no row needs any.
    """
    if not sinks:
        return None
    B, Hkv, _, D = key.shape
    start, end = bounds if bounds is not None else _no_padding(B, recent_start + 1, key.device)
    need = (torch.clamp(end, max=recent_start) - start).clamp(0, sinks)  # [B] sinks row b needs in front
    F = int(need.max())
    if F == 0:
        return None
    j = torch.arange(F, device=key.device) - (F - need)[:, None]  # [B, F] which sink each slot holds
    ok = j >= 0
    j = j.clamp(min=0)
    if cache_layer is None:
        source_k, source_v, index = key, value, start[:, None] + j
    elif cache_layer.sink_keys is None:
        raise ValueError(f"the cache dropped the sink positions (sinks={sinks}) and keeps no copy: use PiCache "
                         "(it keeps them) or DynamicCache")
    else:
        source_k, source_v, index = cache_layer.sink_keys, cache_layer.sink_values, j
    g = index[:, None, :, None].expand(B, Hkv, F, D)
    return source_k.gather(2, g), source_v.gather(2, g), ok


def _gate_input(module: nn.Module, settings: PiSettings) -> torch.Tensor | None:
    """The gate's input x [B, Tq, d] the pre-hook stored on `module` (forgotten there), or None for ungated
    variants."""
    if not settings.gated:
        return None
    x = getattr(module, "_pi_gate_input", None)
    if x is None:
        raise ValueError("this attention module recorded no gate input; convert the model with convert_to_pi "
                         "(it adds the pre-hook that records it)")
    _forget(module, "_pi_gate_input")  # don't keep the activation alive past its one use
    return x


def _gate_values(module: nn.Module, settings: PiSettings, x: torch.Tensor | None) -> torch.Tensor | None:
    """α̃ [B, H, Tq] from the gate input x (`_gate_input`), or None for ungated variants."""
    return None if x is None else gate_values(module.pi_gate, x, settings.eps)


def _ring_gate(module: nn.Module, x: torch.Tensor | None,
               settings: PiSettings) -> tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
    """For "adaptive" (which a decoding step can finish from the gate's hidden layer): (the gate MLP's hidden
    pre-activation [B, Tq, n_hidden], (its last layer's weight [H, n_hidden], bias [H])), as `PiAttention.ring_gate`
    gives them; (None, None) otherwise, and for a gate with hooks registered on it (computed whole, as a module,
    by `gate_values`)."""
    if x is None or settings.variant != "adaptive" or gate_hooked(module.pi_gate):
        return None, None
    return gate_hidden(module.pi_gate, x)


def _forget(module: nn.Module, name: str) -> None:
    """module.name = None for an attribute the pre-hook sets (a plain attribute: no parameter, buffer or
    submodule of that name), without `nn.Module.__setattr__`'s lookups (2 µs, twice per layer and step)."""
    attributes = getattr(module, "__dict__", None)
    if (attributes is None or name in attributes.get("_parameters", ()) or name in attributes.get("_buffers", ())
            or name in attributes.get("_modules", ())):
        setattr(module, name, None)
    else:
        attributes[name] = None
