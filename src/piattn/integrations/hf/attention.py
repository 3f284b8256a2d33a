"""The attention and mask functions HF dispatches to for "pi_attention", and the settings they read."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface, AttentionMaskInterface

from ...config.pi import PI_DEFAULTS, PiSettings
from ...layers.gate import gate_values
from ...ops.pi import BACKENDS, pi_attention

ATTENTION_NAME = "pi_attention"


@dataclass(frozen=True)
class HFPiSettings:
    """The settings of a converted model: the π settings and the backend that runs them.

    Stored flat in `config.pi_attention` as {window, period, variant, prior, logit_clamp, eps, backend}.
    """

    pi: PiSettings = PI_DEFAULTS
    backend: str = "auto"

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS} on this install, got {self.backend!r}")

    @classmethod
    def of(cls, config) -> HFPiSettings:
        """The settings in `config.pi_attention` (missing keys take their defaults), range-checked."""
        stored = getattr(config, "pi_attention", None)
        if stored is None:
            raise ValueError("config has no pi_attention settings: convert the model with convert_to_pi first")
        stored = dict(stored)
        backend = stored.pop("backend", cls.backend)
        unknown = sorted(set(stored) - set(PI_DEFAULTS.as_kwargs()))
        if unknown:
            raise ValueError(f"config.pi_attention has unknown settings {unknown}")
        return cls(PiSettings(**stored), backend)

    def as_dict(self) -> dict:
        """What `config.pi_attention` holds."""
        return {**self.pi.as_kwargs(), "backend": self.backend}

    @property
    def reach(self) -> int:
        """How far back a query looks: query i reads no key older than i − reach."""
        return self.pi.reach

    def operator_kwargs(self) -> dict:
        return dict(**self.pi.as_kwargs(), causal=True, backend=self.backend)


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
    settings = HFPiSettings.of(module.config)
    B, H, Tq, D = query.shape
    gate = _gate_values(module, settings.pi)
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
    if not settings.gated:
        return None
    x = getattr(module, "_pi_gate_input", None)
    if x is None:
        raise ValueError("this attention module recorded no gate input; convert the model with convert_to_pi "
                         "(it adds the pre-hook that records it)")
    module._pi_gate_input = None  # don't keep the activation alive past its one use
    return gate_values(module.pi_gate, x, settings.eps)


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
