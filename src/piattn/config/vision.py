"""The configuration of the image-text dual encoder (`piattn.models.vision.DualEncoder`, CLIP-style).

The `ModelConfig` fields describe the image tower, a ViT over a raster of patches whose attention kind is
`attention`; the text tower is a bidirectional `Encoder` of the same width and depth over byte ids, with
its own attention kind (`text_attention`). Both project to a shared space of `embed_dim` dimensions.

π on an image: patches are laid out row by row, so with π equal to the number of patches per row the skip
key of a patch is the patch directly above it (and, bidirectionally, below it). `period` defaults to that
(`grid`) when it is not given, which turns π-Attention's 1D pattern into 2D locality: a local window
along the row plus the vertical neighbours.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..checks import is_int
from .model import EncoderConfig, ModelConfig
from .pi import PI_DEFAULTS

# Byte ids as LRA's char tokenizer: byte b is id b + 1, 0 is padding (`piattn.data.retrieval.encode_text`).
BYTE_VOCAB = 257


@dataclass
class VisionLanguageConfig(ModelConfig):
    """Image tower fields of `ModelConfig` plus:

    image_size: side of the square input images in pixels; patch_size: side of a patch (must divide
    image_size); grid = image_size / patch_size patches per row, n_patches = grid² tokens per image.
    period: the π of the image tower, default `grid` (the patch above / below); image_width: default `grid`,
    so `--period width` (and the other words of `geometry_periods`) count patches. block_size: default and
    only allowed value n_patches. vocab_size: the text tower's, 257 byte ids. channels: 3 (RGB).
    embed_dim: width of the shared embedding space (default d_model). caption_len: byte ids per caption
    (the text tower's sequence length). text_attention: the text tower's attention kind (default dense:
    captions are short). init_temperature: the CLIP temperature τ at initialisation (0.07); logits are
    exp(log 1/τ)·cos, with the learned scale capped at 100 as in CLIP.
    """

    period: int | None = None
    block_size: int | None = None
    vocab_size: int = BYTE_VOCAB
    image_size: int = 32
    patch_size: int = 4
    channels: int = 3
    embed_dim: int | None = None
    caption_len: int = 64
    text_attention: str = "dense"
    init_temperature: float = 0.07

    def __post_init__(self):
        for name in ("image_size", "patch_size", "channels", "caption_len"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size ({self.image_size}) must be a multiple of patch_size ({self.patch_size})")
        if self.period is None:
            self.period = self.grid
        if self.image_width is None:  # the raster of patches: `--period width` is the patches per row
            self.image_width = self.grid
        if self.block_size is None:
            self.block_size = self.n_patches
        if self.block_size != self.n_patches:
            raise ValueError(f"block_size must be the number of patches, (image_size / patch_size)² = "
                             f"{self.n_patches}, got {self.block_size!r}")
        if self.embed_dim is None:
            self.embed_dim = self.d_model
        if not is_int(self.embed_dim) or self.embed_dim < 2:
            raise ValueError(f"embed_dim must be an integer >= 2, got {self.embed_dim!r}")
        if not isinstance(self.init_temperature, (int, float)) or not self.init_temperature > 0:
            raise ValueError(f"init_temperature must be > 0, got {self.init_temperature!r}")
        super().__post_init__()

    @property
    def grid(self) -> int:
        """Patches per row (and per column)."""
        return self.image_size // self.patch_size

    @property
    def n_patches(self) -> int:
        """Tokens of an image: grid², in raster order (row by row)."""
        return self.grid * self.grid

    def text_config(self) -> EncoderConfig:
        """The text tower: this config's sizes, dropout and window with `text_attention`, `caption_len`
        positions, the operator's default π and no image width (a caption has no rows) and `embed_dim` outputs,
        mean pooled."""
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(ModelConfig)}
        return EncoderConfig(**{**shared, "attention": self.text_attention, "block_size": self.caption_len,
                                "period": PI_DEFAULTS.period, "image_width": None},
                             num_classes=self.embed_dim, pool="mean")
