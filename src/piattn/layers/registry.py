"""The built-in attention kinds, registered by name in `ATTENTION`; which kinds can do what is asked of each
kind's class (`kinds_with`, beside the registry in base.py, below every kind).

A capability is one of:
- a boolean class variable of `AttentionLayer` that a kind sets (`sequence_parallel`, `grouped_query`,
  `documents`, `ring_step`);
- "decoding": the kind sets `cache_capacity`, so it decodes incrementally;
- "reach": the kind declares the lags its layers reach (`lag_reach`), so the copy-distance classes and the
  reachability marks of `piattn eval` can be asked of it;
- a model setting it takes (a `ModelConfig` field such as "window", "sinks", "backend";
  `AttentionLayer.model_settings`).

Training flags scoped by a capability (`piattn.config.flags.Capability`), the refusals of `AttentionLayer`
and the tests all ask `kinds_with`, so a new kind is its module plus its line in `ATTENTION`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..analysis.copy_distance import Reach
from ..analysis.multiscale import periods_per_layer
from ..config import ModelConfig
from ..config.flags import Registry
from ..config.model import check_pattern_settings, layer_fields, parse_layers
from .base import ATTENTION, AttentionLayer, kinds_with
from .bigbird import BigBirdAttention
from .dense import DenseAttention
from .local import LocalAttention
from .longformer import LongformerAttention
from .neighbourhood import NeighbourhoodAttention
from .pi import PiAttention
from .reformer import ReformerAttention
from .strided import StridedAttention

ATTENTION.update({
    "bigbird": BigBirdAttention,
    "dense": DenseAttention,
    "local": LocalAttention,
    "longformer": LongformerAttention,
    "neighbourhood": NeighbourhoodAttention,
    "pi": PiAttention,
    "reformer": ReformerAttention,
    "strided": StridedAttention,
})


def attention_class(name: str) -> type[AttentionLayer]:
    """The module class registered under `name`; ValueError listing the registered names otherwise."""
    if name not in ATTENTION:
        raise ValueError(f"attention must be one of {sorted(ATTENTION)}, got {name!r}")
    return ATTENTION[name]


def attention_registry() -> Registry:
    """The kinds as the training flags' checks take them (`TrainConfig.check(registries)`): their names now, and
    `kinds_with` to say which have a capability, asked at each check."""
    return Registry(tuple(ATTENTION), kinds_with)


def layer_attention(cfg: ModelConfig, layer: int) -> type[AttentionLayer]:
    """The module class of layer `layer` of a model of config `cfg` (its kind in `cfg.layer_kinds()`), once the
    settings its pattern item gives it are known to be ones its kind takes ("dense(window=4)" is refused,
    `check_pattern_settings` asking `kinds_with`). ValueError naming the kind or the item otherwise."""
    kind = attention_class(cfg.layer_kinds()[layer])
    check_pattern_settings(cfg.layers, kinds_with)
    return kind


def model_kinds(model: Mapping[str, Any]) -> tuple[str, ...]:
    """The attention kind of each layer of a model of settings `model` (a checkpoint's config "model"): its
    `layers` pattern expanded (`parse_layers`), or `attention` in every layer."""
    if model.get("layers"):
        return parse_layers(model["layers"], model["n_layer"])
    return (model["attention"],) * model["n_layer"]


def model_reach(model: Mapping[str, Any], max_lag: int) -> Reach:
    """The lags 0 … max_lag a model of settings `model` reaches: its kind's `lag_reach`, or for a hybrid stack
    (`layers`) the sum set of its layers' reaches, each asked of its kind as a one-layer model with that
    layer's settings (`layer_fields`: the window, sinks and period its pattern item gives it) and periods (a
    path takes one hop per layer, so a dense layer makes every lag reachable). ValueError from a kind that
    declares no reach, or for an item that gives its kind a setting the kind does not take."""
    kinds = model_kinds(model)
    if len(set(kinds)) == 1 and not model.get("layers"):
        return attention_class(kinds[0]).lag_reach(model, max_lag)
    classes = [attention_class(kind) for kind in kinds]  # unknown kinds first, then what their items give them
    check_pattern_settings(model["layers"], kinds_with)
    mask = (1 << (max_lag + 1)) - 1
    bits, span = 1, 0  # before any layer: lag 0, the query itself
    for layer, (kind, cls) in enumerate(zip(kinds, classes, strict=True)):
        fields = layer_fields(model, layer)
        periods = periods_per_layer(fields.get("period"), model["n_layer"], model["n_head"])[layer]
        one = cls.lag_reach(
            {**fields, "attention": kind, "layers": None, "n_layer": 1, "period": [list(periods)]}, max_lag)
        span += one.span
        if bool(one.reachable.all()):
            bits = mask
            continue
        out = 0
        for hop in one.reachable.nonzero().flatten().tolist():
            out |= bits << hop
        bits = out & mask
    reachable = torch.tensor([bool(bits >> d & 1) for d in range(max_lag + 1)])
    return Reach(reachable, span)
