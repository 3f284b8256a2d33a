"""The Transformer block both models stack: Pre-LN attention and GELU feed-forward, each with a residual."""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..decoding.cache import LayerCache
from ..layers import layer_attention


def dropped(drop: nn.Dropout, x: torch.Tensor) -> torch.Tensor:
    """drop(x), without calling the module where it is the identity (in eval, or p = 0): a decoding step is made of
    small calls, and each module call costs a few microseconds whatever it computes."""
    return drop(x) if drop.training and drop.p else x


class FeedForward(nn.Module):
    """x [B, T, d] -> [B, T, d]: Linear(d, d_ff) → GELU → Linear(d_ff, d) → dropout."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff)
        self.proj = nn.Linear(cfg.d_ff, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropped(self.drop, self.proj(nn.functional.gelu(self.fc(x))))


class Block(nn.Module):
    """x + drop(attn(LN(x))), then x + ffn(LN(x)); the attention kind is layer `layer`'s of the config
    (`cfg.layer_kinds()`: `cfg.attention`, or the kinds of a hybrid stack's `layers`), by registry name, built
    with that layer's settings (`cfg.layer_config(layer)`: the window, sinks and period its pattern item gives
    it, else the shared ones)."""

    def __init__(self, cfg: ModelConfig, *, causal: bool, layer: int = 0):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.kind = cfg.layer_kinds()[layer]
        self.attn = layer_attention(cfg, layer).from_config(cfg.layer_config(layer), causal=causal, layer=layer)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.ffn = FeedForward(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, d] -> [B, T, d]; with `cache`, x continues the text the layer's cache has seen; with
        `document_ids` [B, T], attention keeps to each packed document."""
        x = x + dropped(self.drop, self.attn(self.ln1(x), cache, document_ids))
        return x + self.ffn(self.ln2(x))


def init_weights(module: nn.Module, std: float) -> None:
    """Normal(0, std) for every linear and embedding weight, zero biases (std 0.02 in the paper).

    LayerNorms keep their ones/zeros; the π gate's last layer starts at zero weight like every other
    bias-free path, so α starts at σ(0) = 0.5 only through its zero bias.
    """
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
