"""Images for the vision-language task: decoding files with Pillow, square crops, normalisation.

Pillow is an optional dependency (`pip install piattn[vision]`), imported only when a file is decoded, so
importing piattn, and the generated `shapes` data, never need it. Images are kept as uint8 [3, S, S]
(a tenth of the memory of floats) and normalised per batch, on the device, by `normalize`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from .text import MissingPackageError

# CLIP's per-channel statistics of RGB in [0, 1] (Radford et al. 2021), used for every source.
MEAN = (0.48145466, 0.4578275, 0.40821073)
STD = (0.26862954, 0.26130258, 0.27577711)
# Pillow releases the GIL while decoding, so a few threads decode a batch in parallel.
DECODE_THREADS = min(8, os.cpu_count() or 1)


def pillow():
    """The `PIL.Image` module; MissingPackageError (a ValueError: one line at the CLI) when Pillow is absent."""
    try:
        from PIL import Image
    except ImportError:
        raise MissingPackageError("reading image files needs Pillow: pip install piattn[vision]") from None
    return Image


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())[:200] or type(err).__name__


def check_readable(paths: Sequence[Path]) -> None:
    """ValueError naming the first of `paths` (in order) that Pillow cannot identify as an image.

    Only headers are read (Pillow opens lazily), a few milliseconds per thousand warm files, so a split whose
    files are not all images is refused before training starts; damage past the header (a truncated JPEG)
    is still found by `load_image` when the file is decoded.
    """
    Image = pillow()

    def problem(path: Path) -> str | None:
        try:
            with Image.open(path):
                return None
        except (OSError, ValueError, Image.DecompressionBombError) as err:
            return f"{path}: not a readable image ({_one_line(err)})"

    with ThreadPoolExecutor(max_workers=DECODE_THREADS) as pool:
        message = next((m for m in pool.map(problem, paths) if m is not None), None)
    if message is not None:
        raise ValueError(message)


def load_image(path: str | Path, size: int) -> torch.Tensor:
    """uint8 [3, size, size]: the image file at `path` in RGB, its shorter side resized to `size` (bicubic),
    then the centre `size` × `size` square cropped (CLIP's preprocessing).

    ValueError naming the file when it does not exist or Pillow cannot decode it.
    """
    Image = pillow()
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such image file")
    try:
        with Image.open(path) as image:
            image.draft("RGB", (size, size))  # JPEG: decode at a reduced scale still >= size (much faster)
            image = image.convert("RGB")
            width, height = image.size
            scale = size / min(width, height)
            resized = (max(size, round(width * scale)), max(size, round(height * scale)))
            image = image.resize(resized, Image.Resampling.BICUBIC)
            left, top = (resized[0] - size) // 2, (resized[1] - size) // 2
            pixels = np.asarray(image.crop((left, top, left + size, top + size)), dtype=np.uint8)
    except (OSError, ValueError, Image.DecompressionBombError) as err:  # Pillow's "cannot identify", truncation
        raise ValueError(f"{path}: not a readable image ({_one_line(err)})") from None
    return torch.from_numpy(pixels.copy()).permute(2, 0, 1)


class ImageFiles:
    """A split's images as files, decoded on access: memory stays flat for MSCOCO-sized splits.

    batch(indices) -> uint8 [n, 3, size, size], decoded by `DECODE_THREADS` threads in index order.
    """

    def __init__(self, paths: Sequence[Path], size: int):
        self.paths, self.size = list(paths), size

    def __len__(self) -> int:
        return len(self.paths)

    def batch(self, indices: torch.Tensor) -> torch.Tensor:
        paths = [self.paths[int(i)] for i in indices]
        with ThreadPoolExecutor(max_workers=DECODE_THREADS) as pool:
            images = list(pool.map(lambda p: load_image(p, self.size), paths))
        return torch.stack(images) if images else torch.zeros(0, 3, self.size, self.size, dtype=torch.uint8)


class ImageTensor:
    """A split's images held in memory (generated ones): uint8 [n, 3, S, S]; batch(indices) selects rows."""

    def __init__(self, images: torch.Tensor):
        if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[1] != 3:
            raise ValueError(f"images must be uint8 [n, 3, S, S], got {images.dtype} {tuple(images.shape)}")
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def batch(self, indices: torch.Tensor) -> torch.Tensor:
        return self.images[indices]


def normalize(images: torch.Tensor) -> torch.Tensor:
    """uint8 [B, 3, H, W] -> float32 [B, 3, H, W]: pixels / 255, minus MEAN, over STD, per channel."""
    mean = torch.tensor(MEAN, device=images.device).view(1, 3, 1, 1)
    std = torch.tensor(STD, device=images.device).view(1, 3, 1, 1)
    return (images.float() / 255.0 - mean) / std
