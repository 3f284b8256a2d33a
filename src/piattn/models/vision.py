"""Image-text dual encoder (CLIP): a ViT over patches, the text `Encoder`, a shared space, symmetric InfoNCE.

The image tower stacks the same `Block` as the other models, with any attention kind of
`piattn.layers.ATTENTION` (`cfg.attention`), over the patches in raster order. With π-Attention and π
equal to the patches per row (the default of `VisionLanguageConfig`), each patch's skip keys are the
patches directly above and below it: 2D locality from the 1D pattern.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from ..config.vision import VisionLanguageConfig
from .block import Block, init_weights
from .encoder import Encoder

MAX_LOGIT_SCALE = 100.0  # CLIP's cap on the learned inverse temperature


class PatchEmbedding(nn.Module):
    """images [B, C, H, W] -> tokens [B, grid², d_model]: each patch_size² patch flattened and projected
    (the ViT patch embedding), raster order, plus a 2D position: row embedding + column embedding.

    The attention layers add RoPE over the raster index as well; the row and column terms are what tell two
    patches in one column apart from two in one row.
    """

    def __init__(self, cfg: VisionLanguageConfig):
        super().__init__()
        self.patch, self.grid, self.image_size = cfg.patch_size, cfg.grid, cfg.image_size
        self.proj = nn.Linear(cfg.channels * cfg.patch_size ** 2, cfg.d_model)
        self.row = nn.Embedding(cfg.grid, cfg.d_model)
        self.col = nn.Embedding(cfg.grid, cfg.d_model)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        b, c, *side = images.shape
        if side != [self.image_size] * 2:
            raise ValueError(f"images must be [B, C, {self.image_size}, {self.image_size}], got {tuple(images.shape)}")
        p, g = self.patch, self.grid
        patches = images.reshape(b, c, g, p, g, p).permute(0, 2, 4, 1, 3, 5).reshape(b, g * g, c * p * p)
        index = torch.arange(g, device=images.device)
        position = (self.row(index)[:, None] + self.col(index)[None, :]).reshape(g * g, -1)  # [grid², d]
        return self.proj(patches) + position


class ImageEncoder(nn.Module):
    """images [B, C, H, W] (normalised) -> [B, embed_dim]: patches → n_layer bidirectional Pre-LN blocks of
    `cfg.attention` → LN → mean over patches → Linear → GELU → Linear (the text Encoder's head)."""

    def __init__(self, cfg: VisionLanguageConfig):
        super().__init__()
        self.embed = PatchEmbedding(cfg)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, causal=False, layer=i) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_model), nn.GELU(), nn.Linear(cfg.d_model, cfg.embed_dim))
        init_weights(self, cfg.init_std)

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """images [B, C, H, W] -> per-patch features [B, grid², d_model], raster order, after the final LN."""
        x = self.drop(self.embed(images))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images).mean(1))


class DualEncoder(nn.Module):
    """CLIP: image and text towers into one space of `embed_dim`, compared by a learned-temperature cosine.

    forward(images [B, 3, H, W] float, normalised; captions int64 [B', L]) -> logits [B, B'] =
    exp(s)·cos(image_i, caption_j), s = log(1/τ) learned from log(1/`init_temperature`), the scale capped
    at 100. The text tower is the bidirectional `Encoder` over byte ids (mean over non-padding ids).
    """

    def __init__(self, cfg: VisionLanguageConfig):
        super().__init__()
        self.config = cfg
        self.image = ImageEncoder(cfg)
        self.text = Encoder(cfg.text_config())
        self.log_scale = nn.Parameter(torch.tensor(math.log(1.0 / cfg.init_temperature)))

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """images [B, 3, H, W] -> unit vectors [B, embed_dim]."""
        return F.normalize(self.image(images).float(), dim=-1)

    def encode_texts(self, captions: torch.Tensor) -> torch.Tensor:
        """captions int64 [B, L] -> unit vectors [B, embed_dim]."""
        return F.normalize(self.text(captions).float(), dim=-1)

    @property
    def logit_scale(self) -> torch.Tensor:
        """exp(s), capped at MAX_LOGIT_SCALE (a 0-dim tensor)."""
        return self.log_scale.exp().clamp(max=MAX_LOGIT_SCALE)

    def forward(self, images: torch.Tensor, captions: torch.Tensor) -> torch.Tensor:
        return self.logit_scale * self.encode_images(images) @ self.encode_texts(captions).T


def clip_loss(logits: torch.Tensor) -> torch.Tensor:
    """Symmetric InfoNCE of logits [B, B] whose diagonal holds the matching pairs: the mean of the image→text
    and text→image cross-entropies."""
    target = torch.arange(len(logits), device=logits.device)
    return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2
