"""π-Attention inside Hugging Face transformers (written against transformers 5.23).

    model = LlamaForCausalLM(config)                     # any Llama-style *ForCausalLM
    convert_to_pi(model, window=4, period=16)            # gate MLP per attention module, attention switched
    out = model.generate(ids, past_key_values=PiCache(model.config), max_new_tokens=64)
    model.save_pretrained(path)
    model = from_pretrained_pi(path)

How it plugs in:
- `register()` adds `pi_attention_forward` to HF's `AttentionInterface` and `pi_attention_mask` to its
  `AttentionMaskInterface`, both as "pi_attention". The operator knows its own sparse causal pattern, so the
  mask function builds no [T, T] mask: it only rejects padding and returns None.
- The gate reads the attention module's input x, but an HF attention function receives only q, k and v. A
  forward pre-hook on each attention module stores x on the module; the attention function takes it from
  there and computes α̃ = ε + (1 − 2ε)·σ(pi_gate(x)) itself, inside the autograd graph, as `PiAttention` does.
- The operator settings live in `config.pi_attention` (a dict), so they travel with save_pretrained.
- Cached decoding: the new queries are put behind the cached keys (zero queries in front, their outputs
  dropped) and the operator runs on the block, exactly as `AttentionLayer.attend_cached` does. Keys older
  than max(window, period) are never read, so a step costs O(max(window, period)) with any cache;
  `PiCache` also bounds the memory.

Supported: causal decoder LMs whose attention modules have q_proj/k_proj/v_proj/o_proj and dispatch through
`ALL_ATTENTION_FUNCTIONS` (tested with Llama), grouped-query attention, training (attention dropout),
generation with `DynamicCache` (the default; grows) or `PiCache` (bounded).
Not supported, and rejected with a ValueError: padding (any zero in a 2D attention_mask) and packed or
non-consecutive position_ids. π-Attention's pattern is relative positions, so a padded row would attend its
pad tokens as if they were text; batch sequences of equal length instead.
"""

from __future__ import annotations

import json
import logging
import math
import os
import warnings
from dataclasses import asdict, dataclass

import torch
from safetensors import safe_open
from torch import nn
from transformers import AttentionInterface, AttentionMaskInterface, AutoModelForCausalLM, Cache, PreTrainedModel
from transformers.cache_utils import DynamicLayer
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

from ..ops.pi import BACKENDS, pi_attention
from ..ops.pi.pattern import GATED_VARIANTS, VARIANTS

ATTENTION_NAME = "pi_attention"
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class PiSettings:
    """The `pi_attention` arguments of a converted model, stored as a dict in `config.pi_attention`."""

    window: int = 4
    period: int = 16
    variant: str = "adaptive"
    prior: float = 0.5
    logit_clamp: float | None = 20.0
    eps: float = 1e-4
    backend: str = "auto"

    @classmethod
    def of(cls, config) -> PiSettings:
        stored = getattr(config, "pi_attention", None)
        if stored is None:
            raise ValueError("config has no pi_attention settings: convert the model with convert_to_pi first")
        return cls(**stored)

    @property
    def reach(self) -> int:
        """How far back a query looks: query i reads no key older than i − reach."""
        return max(self.window, self.period)

    def operator_kwargs(self) -> dict:
        return dict(window=self.window, period=self.period, causal=True, variant=self.variant, prior=self.prior,
                    logit_clamp=self.logit_clamp, eps=self.eps, backend=self.backend)


# ---------------------------------------------------------------------------------------------------------
# The attention and mask functions HF dispatches to
# ---------------------------------------------------------------------------------------------------------


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

    Tk > Tq when a cache supplied Tk − Tq earlier keys: those of the positions just before the queries.
    `dropout` is HF's (already 0 outside training); `scaling` is the module's score scale.
    """
    if attention_mask is not None:
        raise ValueError("pi_attention applies its own sparse causal pattern and takes no attention_mask; "
                         "got a prepared mask (padding and custom masks are not supported)")
    if not getattr(module, "is_causal", True):
        raise ValueError("pi_attention in transformers supports causal attention only")
    settings = PiSettings.of(module.config)
    B, H, Tq, D = query.shape
    gate = _gate_values(module, settings)
    past = key.shape[2] - Tq
    _check_positions(kwargs.get("position_ids"), Tq, past, settings.reach)
    # Keys older than `reach` before the first query are never read: drop them, so that a decoding step
    # costs O(reach) however much the cache holds.
    past = min(past, settings.reach)
    first = key.shape[2] - Tq - past
    key, value = _repeat_kv(key[:, :, first:], H), _repeat_kv(value[:, :, first:], H)
    if past:
        # Rows for the cached positions, so that relative offsets line up; their outputs are dropped.
        query = torch.cat([query.new_zeros(B, H, past, D), query], 2)
        if gate is not None:
            gate = torch.cat([gate.new_full((B, H, past), 0.5), gate], 2)
    out = pi_attention(query, key, value, gate, scale=scaling, dropout_p=dropout, **settings.operator_kwargs())
    return out[:, :, past:].transpose(1, 2), None


def pi_attention_mask(*, attention_mask: torch.Tensor | None = None, **kwargs) -> None:
    """HF mask function for "pi_attention": no dense mask at all; a 2D padding mask with zeros raises."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("pi_attention does not support padding (attention_mask has zeros): its pattern is "
                         "relative positions, so padded rows would attend their pad tokens; batch sequences "
                         "of equal length instead")


def register(name: str = ATTENTION_NAME) -> None:
    """Make `name` a valid `attn_implementation` (attention and mask function); safe to call repeatedly."""
    AttentionInterface.register(name, pi_attention_forward)
    AttentionMaskInterface.register(name, pi_attention_mask)


def _repeat_kv(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[B, Hkv, T, D] -> [B, n_heads, T, D]: each key/value head serves n_heads / Hkv consecutive query heads."""
    groups, rest = divmod(n_heads, x.shape[1])
    if rest:
        raise ValueError(f"query heads ({n_heads}) must be a multiple of key/value heads ({x.shape[1]})")
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _gate_values(module: nn.Module, settings: PiSettings) -> torch.Tensor | None:
    """α̃ [B, H, Tq] from the input the pre-hook stored on `module`, or None for ungated variants."""
    if settings.variant not in GATED_VARIANTS:
        return None
    x = getattr(module, "_pi_gate_input", None)
    if x is None:
        raise ValueError("this attention module recorded no gate input; convert the model with convert_to_pi "
                         "(it adds the pre-hook that records it)")
    module._pi_gate_input = None  # don't keep the activation alive past its one use
    a = module.pi_gate(x).transpose(1, 2)
    # At least fp32: in bf16, ε + (1 − 2ε)·σ rounds to exactly 1 once σ > 0.998, outside (0, 1).
    return a.to(torch.promote_types(a.dtype, torch.float32)) * (1 - 2 * settings.eps) + settings.eps


def _check_positions(position_ids: torch.Tensor | None, Tq: int, past: int, reach: int) -> None:
    """Queries must sit at p0 … p0+Tq−1 in every row, and the `past` keys before them must be all positions
    0 … p0−1 or at least the last `reach` of them."""
    if position_ids is None or torch.compiler.is_compiling():
        return
    rows = position_ids.reshape(-1, Tq)
    p0 = int(rows[0, 0])
    if not torch.equal(rows, p0 + torch.arange(Tq, device=rows.device).expand_as(rows)):
        raise ValueError("pi_attention needs position_ids p0 … p0+T−1, the same in every row "
                         "(no padding, no packed sequences)")
    if past != p0 and past < reach:
        raise ValueError(f"the cache gave {past} keys before position {p0}, but pi_attention reads the last "
                         f"{reach}: use PiCache or DynamicCache")


# ---------------------------------------------------------------------------------------------------------
# Conversion, loading
# ---------------------------------------------------------------------------------------------------------


def convert_to_pi(
    model: PreTrainedModel,
    *,
    window: int = 4,
    period: int = 16,
    variant: str = "adaptive",
    prior: float = 0.5,
    logit_clamp: float | None = 20.0,
    eps: float = 1e-4,
    backend: str = "auto",
    gate_init_alpha: float = 0.98,
) -> PreTrainedModel:
    """Switch a Llama-style causal LM to π-Attention, in place; returns the model.

    Each attention module gets `pi_gate` = Sequential(Linear(d, d/2), GELU, Linear(d/2, H), Sigmoid) (for
    the gated variants "adaptive" and "separate"), initialised to output `gate_init_alpha` everywhere:
    last weight zero, last bias logit(gate_init_alpha). With α near 1 the model starts close to local
    attention over its window. (The zero weight also means the first gate layer gets no gradient until
    the last one has moved, as with LoRA's zero-initialised B.)

    The other arguments are those of `piattn.pi_attention`; they are stored in `config.pi_attention`.
    """
    settings = PiSettings(window=window, period=period, variant=variant, prior=prior, logit_clamp=logit_clamp,
                          eps=eps, backend=backend)
    if not 0.0 < gate_init_alpha < 1.0:
        raise ValueError(f"gate_init_alpha must lie in (0, 1), got {gate_init_alpha!r}")
    if any(hasattr(m, "pi_gate") for m in model.modules()):
        raise ValueError("model is already converted to pi_attention (its attention modules have pi_gate)")
    _attach(model, settings, gate_init_alpha)
    return model


def from_pretrained_pi(path: str | os.PathLike, *, model_class=AutoModelForCausalLM, **kwargs) -> PreTrainedModel:
    """Load a model that was converted with `convert_to_pi` and saved with `save_pretrained` (local directory).

    The base weights load through `model_class.from_pretrained(path, **kwargs)` (so dtype, device_map …
    work as usual), then the model is converted with the settings in its config and the gate weights are
    read from the checkpoint's safetensors files. HF's load report would list the gates as unexpected
    (the plain class has none); it is replaced by a warning about anything else that did not load.
    """
    hf_logger = logging.getLogger("transformers.modeling_utils")
    drop_report = _DropLoadReport()
    hf_logger.addFilter(drop_report)
    try:
        model, info = model_class.from_pretrained(path, output_loading_info=True, **kwargs)
    finally:
        hf_logger.removeFilter(drop_report)
    problems = {kind: sorted(map(str, keys)) for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")
                if (keys := [k for k in info.get(kind, ()) if ".pi_gate." not in str(k)])}
    if problems:
        warnings.warn(f"loading {path}: {problems}", stacklevel=2)
    _attach(model, PiSettings.of(model.config), gate_init_alpha=0.5)  # the init is overwritten just below
    names = [name for name, _ in model.named_parameters() if ".pi_gate." in name]
    missing = model.load_state_dict(_read_safetensors(path, names), strict=False).missing_keys
    absent = sorted(set(missing) & set(names))
    if absent:
        raise ValueError(f"checkpoint at {path} lacks gate weights {absent[:4]}… (was it saved after convert_to_pi?)")
    return model


class _DropLoadReport(logging.Filter):
    """Hides transformers' load report, which would list the gates as unexpected; the caller reports the rest."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in record.getMessage()


def _check_settings(s: PiSettings) -> None:
    if not isinstance(s.window, int) or isinstance(s.window, bool) or s.window < 0:
        raise ValueError(f"window must be an int >= 0, got {s.window!r}")
    if not isinstance(s.period, int) or isinstance(s.period, bool) or s.period < 1:
        raise ValueError(f"period must be an int >= 1, got {s.period!r}")
    if s.variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {s.variant!r}")
    if s.backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} on this install, got {s.backend!r}")


def _attach(model: PreTrainedModel, settings: PiSettings, gate_init_alpha: float) -> None:
    """Add gates and pre-hooks to every attention module, store the settings, switch the attention."""
    _check_settings(settings)
    config = model.config
    if getattr(config, "is_encoder_decoder", False) or not getattr(config, "is_causal", True):
        raise ValueError("convert_to_pi supports causal decoder-only language models only")
    attention = [m for m in model.modules() if all(hasattr(m, p) for p in _PROJECTIONS)]
    if not attention:
        raise ValueError(f"found no attention modules with {_PROJECTIONS} in {type(model).__name__}")
    if settings.variant in GATED_VARIANTS:
        for module in attention:
            module.pi_gate = _gate_mlp(module.q_proj, config.num_attention_heads, gate_init_alpha)
            module._pi_gate_input = None
            module.register_forward_pre_hook(_record_gate_input, with_kwargs=True)
    config.pi_attention = asdict(settings)
    register()
    model.set_attn_implementation(ATTENTION_NAME)
    if config._attn_implementation != ATTENTION_NAME:
        raise ValueError(f"{type(model).__name__} does not dispatch attention through transformers' "
                         "AttentionInterface, so pi_attention cannot be plugged in")


def _gate_mlp(q_proj: nn.Linear, n_heads: int, alpha: float) -> nn.Sequential:
    """The gate of `PiAttention` on the module's input width, outputting `alpha` for every input at first."""
    d = q_proj.in_features
    gate = nn.Sequential(nn.Linear(d, d // 2), nn.GELU(), nn.Linear(d // 2, n_heads), nn.Sigmoid())
    nn.init.zeros_(gate[2].weight)
    nn.init.constant_(gate[2].bias, math.log(alpha / (1 - alpha)))
    return gate.to(device=q_proj.weight.device, dtype=q_proj.weight.dtype)


def _record_gate_input(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook: keep the attention module's input x [B, T, d] for the gate."""
    module._pi_gate_input = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]


def _read_safetensors(path: str | os.PathLike, names: list[str]) -> dict[str, torch.Tensor]:
    """The tensors `names` (those present) from a local checkpoint, single file or sharded."""
    index = os.path.join(path, SAFE_WEIGHTS_INDEX_NAME)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    else:
        weight_map = dict.fromkeys(names, SAFE_WEIGHTS_NAME)
    by_file: dict[str, list[str]] = {}
    for name in names:
        if name in weight_map:
            by_file.setdefault(weight_map[name], []).append(name)
    tensors = {}
    for file, file_names in by_file.items():
        with safe_open(os.path.join(path, file), framework="pt") as f:
            stored = set(f.keys())
            tensors.update({n: f.get_tensor(n) for n in file_names if n in stored})
    return tensors


# ---------------------------------------------------------------------------------------------------------
# Bounded cache
# ---------------------------------------------------------------------------------------------------------


class PiCacheLayer(DynamicLayer):
    """One layer's keys and values [B, Hkv, n, D] of the last n = min(seen, capacity) positions.

    `update` returns the stored positions followed by the new ones, then keeps the last `capacity`.
    """

    is_sliding = True
    is_croppable = False  # dropped positions cannot come back

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.cumulative_length = 0  # positions seen; the name lets CacheLayerMixin.reset zero it

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = super().update(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        if keys.shape[-2] > self.capacity:
            # Copies, not views: a view would keep the whole concatenation's storage alive.
            self.keys = keys[..., -self.capacity :, :].clone()
            self.values = values[..., -self.capacity :, :].clone()
        return keys, values

    @property
    def positions(self) -> torch.Tensor:
        """Absolute positions of the stored keys, oldest first: [n] int64."""
        n = self.keys.shape[-2] if self.is_initialized else 0
        return torch.arange(self.cumulative_length - n, self.cumulative_length)

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return self.capacity

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        n = self.keys.shape[-2] if self.is_initialized else 0
        return n + query_length, self.cumulative_length - n

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise ValueError("PiCache has dropped old positions and cannot be cropped")


class PiCache(Cache):
    """Decoding cache of a converted model: max(window, period) + 1 positions per layer, whatever the length.

    Pass it to `model.generate(..., past_key_values=PiCache(model.config))` or to a forward call.
    """

    def __init__(self, config):
        capacity = PiSettings.of(config).reach + 1
        super().__init__(layers=[PiCacheLayer(capacity) for _ in range(config.num_hidden_layers)])

    @property
    def nbytes(self) -> int:
        return cache_nbytes(self)


def cache_nbytes(cache: Cache) -> int:
    """Bytes of the keys and values a transformers `Cache` holds now (any cache type)."""
    return sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values) if t is not None)
