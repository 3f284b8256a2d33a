"""Captioned images for image-text retrieval: one split, its caption ids, and the training batch loader.

A split holds N images and M captions (five per image in MSCOCO, Flickr30K and the generated shapes),
captions grouped by image: `caption_image[j]` is the image of caption j, non-decreasing. Sources (the
`--data` forms): `shapes` (generated, `piattn.data.shapes`), `coco:DIR` and `flickr30k:DIR` (the Karpathy
splits, `piattn.data.karpathy`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from .examples import _Indices
from .packing import SequenceLoader

SOURCES = ("shapes", "coco", "flickr30k")


class ImageSource(Protocol):
    """N images of one split, all uint8 [3, S, S] (`images.ImageFiles`, `images.ImageTensor`)."""

    def __len__(self) -> int: ...

    def batch(self, indices: torch.Tensor) -> torch.Tensor:
        """indices int64 [n] -> uint8 [n, 3, S, S]."""


@dataclass(frozen=True)
class CaptionedImages:
    """One split: `images` (N), `captions` (M strings) and `caption_image` int64 [M], non-decreasing, every
    image with at least one caption."""

    images: ImageSource
    captions: list[str]
    caption_image: torch.Tensor

    def __post_init__(self):
        counts = torch.bincount(self.caption_image, minlength=len(self.images))
        if len(self.captions) != len(self.caption_image) or len(counts) != len(self.images):
            raise ValueError(f"{len(self.captions)} captions, {len(self.caption_image)} caption images and "
                             f"{len(self.images)} images do not match")
        if len(self.caption_image) and (self.caption_image.diff() < 0).any():
            raise ValueError("captions must be grouped by image (caption_image non-decreasing)")
        if (counts == 0).any():
            raise ValueError(f"image {int((counts == 0).nonzero()[0])} has no caption")

    @property
    def first_caption(self) -> torch.Tensor:
        """int64 [N]: index of each image's first caption."""
        return torch.cumsum(self.captions_per_image, 0) - self.captions_per_image

    @property
    def captions_per_image(self) -> torch.Tensor:
        """int64 [N]."""
        return torch.bincount(self.caption_image, minlength=len(self.images))


def parse_source(data: str | None) -> tuple[str, Path | None]:
    """(kind, folder) of a --data value: None or "shapes" -> ("shapes", None); "coco:DIR" / "flickr30k:DIR"."""
    if data is None or data == "shapes":
        return "shapes", None
    kind, sep, folder = data.partition(":")
    if not sep or kind not in SOURCES[1:] or not folder:
        raise ValueError(f"vision-language data must be shapes, coco:DIR or flickr30k:DIR, got {data!r}")
    return kind, Path(folder)


def encode_captions(captions: list[str], length: int) -> torch.Tensor:
    """int16 [M, length]: each caption's first `length` UTF-8 bytes as ids b + 1, right-padded with 0 (the
    ids of `retrieval.encode_text`, written straight into int16: MSCOCO has 566,435 training captions)."""
    ids = np.zeros((len(captions), length), dtype=np.int16)
    for row, text in zip(ids, captions, strict=True):
        data = text.encode("utf-8")[:length]
        row[:len(data)] = np.frombuffer(data, dtype=np.uint8).astype(np.int16) + 1
    return torch.from_numpy(ids)


class CaptionLoader:
    """Training batches (images uint8 [B, 3, S, S], captions int64 [B, L]) of one split: one caption per image.

    Images come in `SequenceLoader`'s order (shuffled per epoch from `seed`, sharded over ranks,
    resumable); in epoch e image i is shown with its caption number (e + i) mod n_i, so every caption is
    used once in n_i epochs and a batch never holds two captions of one image (InfoNCE would count the
    second as a negative). The caption depends on (epoch, image) only, so the SequenceLoader state is the
    whole state.
    """

    def __init__(self, split: CaptionedImages, caption_ids: torch.Tensor, batch_size: int, seed: int = 0,
                 rank: int = 0, world_size: int = 1):
        self.split, self.caption_ids = split, caption_ids
        self.first, self.count = split.first_caption, split.captions_per_image
        self.order = SequenceLoader(_Indices(len(split.images)), batch_size, seed=seed, shuffle=True, rank=rank,
                                    world_size=world_size, drop_last=True)

    @property
    def batches_per_epoch(self) -> int:
        return self.order.batches_per_epoch

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        epoch = self.order.epoch  # next_batch may move the loader into the next epoch
        index = self.order.next_batch()
        caption = self.first[index] + (epoch + index) % self.count[index]
        return self.split.images.batch(index), self.caption_ids[caption].long()

    def state_dict(self) -> dict:
        return self.order.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.order.load_state_dict(state)
