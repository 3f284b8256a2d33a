"""Gate statistics during training: the π gate α of every gated layer, summarised on logging steps only.

A layer takes part when it has `observe_gate(observer) -> bool` (`piattn.layers.PiAttention`): the method
sets or clears a callback that receives the layer's gate α̃ [B, H, T] at each forward, and says whether
the layer has a gate at all (variants "adaptive" and "separate" do; "union", "fixed" and the other
attention kinds do not, and then nothing is logged). The trainer turns the callbacks on for the micro
batches of a step it will log and off again afterwards, so the other steps pay nothing and no extra
forward pass is ever run.

Keys of a summary (layer i counts the gated layers in module order, i.e. the block index):

    alpha/layer{i}/mean, /std, /min, /max, /q05, /q25, /q50, /q75, /q95   floats over tokens and heads
    alpha/layer{i}/head_mean                                            [H] floats, one per head

Padding tokens of classification batches are counted like any other token. `condensed` shortens a record
to a few per-layer lists, for a summary people read (metrics.jsonl keeps everything).
"""

from __future__ import annotations

import contextlib
import math
import re

import torch
from torch import nn

QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)
# torch.quantile takes at most 2**24 elements; a larger capture is thinned by an even stride (deterministic).
MAX_QUANTILE_ELEMENTS = 1 << 20
KEY = re.compile(r"alpha/layer(\d+)/(\w+)")
# the statistics a condensed summary keeps, one list over the layers each
CONDENSED = ("mean", "q05", "q50", "q95")


def gated_layers(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` with a gate, in module order (each `observe_gate(None)` returns True)."""
    return [m for m in model.modules() if callable(getattr(m, "observe_gate", None)) and m.observe_gate(None)]


def alpha_statistics(values: torch.Tensor) -> dict[str, float | list[float]]:
    """values [..., H, T] (gates of one layer, batches stacked in front) -> mean, std, min, max, quantiles,
    head_mean (keys without the `alpha/layer{i}/` prefix)."""
    heads = values.shape[-2]
    per_head = values.transpose(0, -2).reshape(heads, -1).double()
    flat = per_head.reshape(-1)
    sample = flat[:: math.ceil(flat.numel() / MAX_QUANTILE_ELEMENTS)]
    quantiles = torch.quantile(sample, torch.tensor(QUANTILES, dtype=sample.dtype, device=sample.device))
    stats = {"mean": flat.mean(), "std": flat.std(correction=0), "min": flat.min(), "max": flat.max()}
    stats |= {f"q{round(100 * q):02d}": value for q, value in zip(QUANTILES, quantiles, strict=True)}
    out: dict[str, float | list[float]] = {k: float(v) for k, v in stats.items()}
    out["head_mean"] = per_head.mean(1).tolist()
    return out


class GateMonitor:
    """Collects the gate values of `model`'s gated layers while `capture()` is active; `summary()` reduces them."""

    def __init__(self, model: nn.Module):
        self.layers = gated_layers(model)
        self._captured: list[list[torch.Tensor]] = [[] for _ in self.layers]

    @property
    def active(self) -> bool:
        """Whether the model has any gated layer (otherwise capture and summary do nothing)."""
        return bool(self.layers)

    @contextlib.contextmanager
    def capture(self, enabled: bool = True):
        """Within the block, every forward of a gated layer appends its α̃ to the capture (when `enabled`)."""
        if not (enabled and self.layers):
            yield
            return
        for layer, store in zip(self.layers, self._captured, strict=True):
            layer.observe_gate(store.append)
        try:
            yield
        finally:
            for layer in self.layers:
                layer.observe_gate(None)

    def summary(self) -> dict[str, float | list[float]]:
        """The statistics of what was captured since the last summary, as `alpha/layer{i}/…` keys ({} if none);
        the capture is emptied."""
        out: dict[str, float | list[float]] = {}
        for i, store in enumerate(self._captured):
            if store:
                # micro batches and the two halves of a dual encoder may differ in length: one [1, H, T] each
                values = torch.cat([g.transpose(0, 1).reshape(1, g.shape[1], -1) for g in store], -1)
                out |= {f"alpha/layer{i}/{k}": v for k, v in alpha_statistics(values).items()}
            store.clear()
        return out


def condensed(record: dict, digits: int = 3) -> dict:
    """`record` with its `alpha/layer{i}/…` keys replaced by one "alpha" entry: {"layers", and for each of
    `CONDENSED` a list over the layers, rounded to `digits`} (the record itself when it has no such key)."""
    stats: dict[str, dict[int, float]] = {}
    rest = {}
    for key, value in record.items():
        match = KEY.fullmatch(key)
        if match is None:
            rest[key] = value
        elif match[2] in CONDENSED:
            stats.setdefault(match[2], {})[int(match[1])] = value
    if len(rest) == len(record):
        return record
    layers = sorted(stats.get("mean", {}))
    rest["alpha"] = {"layers": len(layers), **{name: [round(stats[name][i], digits) for i in layers]
                                                for name in CONDENSED if name in stats}}
    return rest
