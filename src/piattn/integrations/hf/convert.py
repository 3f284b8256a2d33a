"""Conversion of a transformers causal LM to π-Attention, and loading of a converted checkpoint."""

from __future__ import annotations

import json
import logging
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

from ...config.pi import PI_DEFAULTS
from ...layers.gate import gate_mlp, start_gate_at
from .attention import ATTENTION_NAME, HFPiSettings, register
from .cache import PiCache
from .padding import text_bounds

_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def convert_to_pi(
    model: PreTrainedModel,
    *,
    window: int = PI_DEFAULTS.window,
    period: int | Sequence | str = PI_DEFAULTS.period,
    variant: str = PI_DEFAULTS.variant,
    prior: float = PI_DEFAULTS.prior,
    logit_clamp: float | None = PI_DEFAULTS.logit_clamp,
    eps: float = PI_DEFAULTS.eps,
    sinks: int = PI_DEFAULTS.sinks,
    backend: str = HFPiSettings.backend,
    gate_init_alpha: float = 0.98,
    dense_heads: Mapping[int, Iterable[int]] | None = None,
) -> PreTrainedModel:
    """Switch a Llama-style causal LM to π-Attention, in place; returns the model.

    Each attention module gets `pi_gate` = `piattn.layers.gate.gate_mlp` on its input width,
    Sequential(Linear(d, d/2), GELU, Linear(d/2, H), Sigmoid) (for the gated variants "adaptive" and
    "separate"), initialised to output `gate_init_alpha` everywhere: last weight zero, last bias
    logit(gate_init_alpha). With α near 1 the model starts close to local attention over its window. (The
    zero weight also means the first gate layer gets no gradient until the last one has moved, as with
    LoRA's zero-initialised B.)

    `sinks`: the first `sinks` tokens of each sequence (of its text, with left padding) stay visible to all
    later tokens, with the local prior; streaming LMs lean on their first tokens, and a window alone drops
    them. `PiCache` keeps a copy of them.

    `period` takes every form `GPTConfig.period` does: an int, one per query head (num_attention_heads
    ints), one list of per-head periods per layer (num_hidden_layers lists), or a schedule name
    ("single[:N]", "geometric[:N]", "cover[:N]"; cover's default target is max_position_embeddings − 1),
    resolved by `piattn.config.model.resolve_periods` and stored resolved; `PiCache` then holds each layer's
    max(window, its largest period) + 1 positions.

    `dense_heads`: {layer index: key/value head indices} kept dense (causal attention over every position, as
    in the original model); the rest of the heads are converted. Under grouped-query attention a dense key/value
    head carries all its query heads. Stored in `config.pi_dense_heads` (one sorted list per layer; absent
    when no head is dense, so that None or {} converts exactly as without it). Choose them by hand, or by
    `retrieval_head_scores` and `top_dense_heads`.

    The other arguments are those of `piattn.pi_attention`; they are stored in `config.pi_attention`.
    Every argument is checked before the model is touched: a ValueError leaves it as it was.
    """
    settings = HFPiSettings.resolve(model.config, backend=backend, window=window, period=period, variant=variant,
                                    prior=prior, logit_clamp=logit_clamp, eps=eps, sinks=sinks)
    if not 0.0 < gate_init_alpha < 1.0:  # checked for ungated variants too, which build no gate
        raise ValueError(f"gate_init_alpha must lie in (0, 1), got {gate_init_alpha!r}")
    if any(hasattr(m, "pi_gate") for m in model.modules()):
        raise ValueError("model is already converted to pi_attention (its attention modules have pi_gate)")
    dense = dense_head_lists(model.config, dense_heads)
    _attach(model, settings, gate_init_alpha)
    if any(dense):
        model.config.pi_dense_heads = dense
    return model


def dense_head_lists(config, dense_heads: Mapping[int, Iterable[int]] | None) -> list[list[int]]:
    """`dense_heads` ({layer: key/value heads}) checked against `config` (ValueError naming the argument: a layer
    or head out of range, a head twice) as one sorted list of key/value heads per layer."""
    n_layer = config.num_hidden_layers
    n_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    lists: list[list[int]] = [[] for _ in range(n_layer)]
    if dense_heads is None:
        return lists
    if not isinstance(dense_heads, Mapping):
        raise ValueError(f"dense_heads must map layer index -> key/value head indices, got {dense_heads!r}")
    for layer, heads in dense_heads.items():
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n_layer:
            raise ValueError(f"dense_heads: layer {layer!r} is not a layer index in 0 … {n_layer - 1}")
        heads = list(heads)
        for h in heads:
            if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < n_kv:
                raise ValueError(f"dense_heads: layer {layer} head {h!r} is not a key/value head index in "
                                 f"0 … {n_kv - 1}")
        if len(set(heads)) != len(heads):
            raise ValueError(f"dense_heads: layer {layer} lists a head twice: {heads}")
        lists[layer] = sorted(heads)
    return lists


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
    _attach(model, HFPiSettings.of(model.config), gate_init_alpha=0.5)  # the init is overwritten just below
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


def _attach(model: PreTrainedModel, settings: HFPiSettings, gate_init_alpha: float) -> None:
    """Switch the attention, then add gates and pre-hooks to every attention module and store the settings.

    Everything that can fail happens before the model is changed, and a refused switch is undone, so that
    a ValueError leaves the model as it was.
    """
    config = model.config
    if getattr(config, "is_encoder_decoder", False) or not getattr(config, "is_causal", True):
        raise ValueError("convert_to_pi supports causal decoder-only language models only")
    attention = [m for m in model.modules() if all(hasattr(m, p) for p in _PROJECTIONS)]
    if not attention:
        raise ValueError(f"found no attention modules with {_PROJECTIONS} in {type(model).__name__}")
    gates = [_new_gate(m.q_proj, config.num_attention_heads, gate_init_alpha) for m in attention
             if settings.pi.gated]
    register()
    previous = config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    if config._attn_implementation != ATTENTION_NAME:
        model.set_attn_implementation(previous)  # submodels may have switched
        raise ValueError(f"{type(model).__name__} does not dispatch attention through transformers' "
                         "AttentionInterface, so pi_attention cannot be plugged in")
    config.pi_attention = settings.as_dict(config.num_attention_heads)
    for i, module in enumerate(attention):
        if settings.pi.gated:
            module.pi_gate = gates[i]
            module._pi_gate_input = None
        module._pi_cache_layer = None
        module.register_forward_pre_hook(_record_inputs, with_kwargs=True)


def _new_gate(q_proj: nn.Linear, n_heads: int, alpha: float) -> nn.Sequential:
    """The gate of `PiAttention` on the module's input width, outputting `alpha` for every input at first."""
    gate = gate_mlp(q_proj.in_features, n_heads)
    start_gate_at(gate, alpha)
    return gate.to(device=q_proj.weight.device, dtype=q_proj.weight.dtype)


def _record_inputs(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook: what the attention function needs beyond q, k, v.

    Keeps the module's input x [B, T, d] for the gate; with a PiCache, tells the module's cache layer where
    each row's text starts (before the module's `update` stores the new keys, so that it can copy the sinks)
    and hands that layer to the attention function, which reads the sink copies from it.
    """
    if hasattr(module, "pi_gate"):
        module._pi_gate_input = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    cache = kwargs.get("cache")  # its name from transformers 5.24 (`check_transformers`)
    if isinstance(cache, PiCache):
        cache.check(module.config)  # another model's PiCache fails in one line, not deep in the attention
        layer = cache.layers[module.layer_idx]
        mask = kwargs.get("attention_mask")
        if mask is not None:
            layer.text_start = text_bounds(mask)[0]
        module._pi_cache_layer = layer


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
