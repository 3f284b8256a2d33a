"""Next-pixel modelling of raster-scanned grayscale images with the causal `GPT`; bits per pixel (bits/dim).

An image of H × W pixels x_0 … x_{N−1} (N = H·W, row by row, values 0–255) is one sequence. The first
pixel is predicted from a start token: the model reads [START, x_0, …, x_{N−2}] (N positions, vocabulary
257, START = 256) and position t predicts x_t, so every pixel is scored, x_0 from the start token alone.
The prediction is a softmax over the 256 pixel values only (START's logit is left out), so the loss is the
negative log-likelihood of the image in nats; bits/dim = total nats / (ln 2 · pixels scored), for
grayscale the same as bits per pixel.

The query that predicts x_t sits at x_{t−1}: the pixel above the target, x_{t−W}, is W − 1 tokens back
from it, the pixel above-left W back (π = W gives every pixel its own vertical neighbour, which is the
target's above-left one). `evaluate` reports bits/dim overall, by row band (ROW_BANDS near-equal bands of
rows), for the first row (no pixel above) against the rest, and whether the model's attention reaches the
target's neighbours (`neighbour_lags`, the lags of `AttentionLayer.lag_reach`).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch.nn import functional as F

from ..config import GPTConfig, TrainConfig
from ..data.examples import ExampleLoader, Examples
from ..data.raster import RasterImages
from ..data.text import normalize_split
from ..decoding.sampling import sample_next
from ..layers import kinds_with, model_reach
from ..models import GPT
from ..train.checkpoint import read_config
from ..train.distributed import DistContext
from ..train.task import Task, evaluation_sums, per_second
from . import raster

PIXEL_VALUES = 256
START = 256  # the token before the first pixel
VOCAB_SIZE = 257
ROW_BANDS = 4


def row_bands(height: int, bands: int = ROW_BANDS) -> list[tuple[int, int]]:
    """min(bands, height) near-equal ranges [start, end) of the rows 0 … height − 1, in order."""
    n = min(bands, height)
    return [(i * height // n, (i + 1) * height // n) for i in range(n)]


def neighbour_lags(width: int) -> dict[str, int]:
    """{neighbour of the target pixel: its lag back from the query that predicts the target} for images
    `width` pixels wide (the query holds the pixel left of the target)."""
    lags = {"left": 0, "above-right": width - 2, "above": width - 1, "above-left": width, "two above": 2 * width - 1}
    return {name: lag for name, lag in lags.items() if lag >= 0}


def neighbour_reach(model: dict, width: int, height: int) -> dict[str, bool] | None:
    """{neighbour: whether the model's attention reaches its lag} (`neighbour_lags`), None for a kind that
    declares no fixed reach (longformer, bigbird, reformer).

    Asked of the query that predicts the bottom row's middle pixel: the 2D kinds' reach depends on the column
    (their neighbourhood is clipped at the image's sides), and an interior pixel is the typical one."""
    lags = neighbour_lags(width)
    try:
        reach = model_reach(model, max((height - 1) * width + width // 2, max(lags.values())))
    except ValueError:
        return None
    return {name: bool(reach.reachable[lag]) for name, lag in lags.items()}


def bits(nats: float, count: float) -> float:
    return nats / (math.log(2) * count) if count else float("nan")


class PixelsTask(raster.RasterTaskTraits, Task):
    """Next-pixel modelling (module docstring): a causal GPT over START + pixels, bits/dim."""

    name = "pixels"
    report_sections = ("row bands",)
    validation_metrics = ("loss", "bits_per_dim", "pixels", "images", "pixels_per_second", "width", "height")

    def __init__(self, cfg: TrainConfig, ctx: DistContext, config: GPTConfig):
        self.cfg, self.ctx, self.config = cfg, ctx, config
        self._splits: dict[str, RasterImages] = {}

    @classmethod
    def from_config(cls, cfg, run_dir: Path, ctx: DistContext, checkpoint: Path | None = None):
        if checkpoint is not None:
            return cls(cfg, ctx, GPTConfig.from_dict(read_config(checkpoint)["model"]))
        h, w = raster.check(cfg, cls.name)
        config = GPTConfig.from_name(cfg.model.config, vocab_size=VOCAB_SIZE, block_size=h * w, image_width=w,
                                     **cfg.model.model_fields())
        return cls(cfg, ctx, config)

    @classmethod
    def resolve_seq_len(cls, cfg: TrainConfig) -> int:
        h, w = raster.shape(cfg)
        return h * w

    @property
    def model_config(self) -> GPTConfig:
        return self.config

    def build_model(self) -> GPT:
        return GPT(self.config)

    def save_assets(self, directory: Path) -> None:
        """Nothing: pixel values are the ids."""

    def images(self, split: str) -> RasterImages:
        """The images of `split` (aliases "valid", "val"), read or generated on first use."""
        split = normalize_split(split)
        if split not in self._splits:
            images = raster.load(self.cfg, split)
            if images.width != self.config.image_width or images.height * images.width != self.config.block_size:
                raise ValueError(f"--data: the {split} images are {images.height} × {images.width}; the model takes "
                                 f"{self.config.block_size} pixels {self.config.image_width} wide")
            self._splits[split] = images
        return self._splits[split]

    def examples(self, split: str) -> Examples:
        images = self.images(split)
        return Examples(images.sequences(), images.labels)

    def train_loader(self) -> ExampleLoader:
        return ExampleLoader(self.examples("train"), self.cfg.optim.batch_size, seed=self.cfg.optim.seed,
                             shuffle=True, rank=self.ctx.rank, world_size=self.ctx.world_size)

    def nats(self, model, pixels: torch.Tensor) -> torch.Tensor:
        """pixels int64 [B, N] -> the nats of every pixel, float [B, N] (START + pixels in, one softmax over
        the 256 values out)."""
        start = torch.full_like(pixels[:, :1], START)
        logits = model(torch.cat([start, pixels[:, :-1]], 1))[..., :PIXEL_VALUES].float()
        return F.cross_entropy(logits.flatten(0, 1), pixels.flatten(), reduction="none").view_as(pixels)

    def loss(self, model, batch):
        pixels = batch[0].to(self.ctx.device, non_blocking=True)
        return self.nats(model, pixels).mean(), pixels.numel()

    def eval_loader(self, split: str) -> ExampleLoader:
        """The images of `split` in order, this rank's share."""
        return ExampleLoader(self.examples(split), self.cfg.optim.batch_size, shuffle=False, rank=self.ctx.rank,
                             world_size=self.ctx.world_size, drop_last=False)

    def evaluate(self, model, split, max_batches):
        """{"loss" (nats/pixel), "bits_per_dim", "pixels", "images", "pixels_per_second", "width", "height",
        "row_bands": [{"start", "end" (rows, end exclusive), "pixels", "bits_per_dim"}], "first_row" and
        "rows_below": {"pixels", "bits_per_dim"}, "neighbour_lags", "neighbour_reach"} over `split`."""
        h, w = self.images(split).height, self.images(split).width
        bands = row_bands(h)
        band_of = torch.repeat_interleave(torch.arange(len(bands)), torch.tensor([e - s for s, e in bands]) * w)
        band_of = band_of.to(self.ctx.device)

        def score(model, batch) -> dict:
            nats = self.nats(model, batch[0].to(self.ctx.device, non_blocking=True)).double()
            by_band = nats.sum(0).new_zeros(len(bands)).index_add_(0, band_of, nats.sum(0))
            return {"nats": nats.sum(), "images": len(nats), "first": nats[:, :w].sum(),
                    **{f"band_{i}": by_band[i] for i in range(len(bands))}}

        loader = self.eval_loader(split)
        keys = ("nats", "images", "first", *(f"band_{i}" for i in range(len(bands))))
        sums, seconds = evaluation_sums(model, loader, max_batches, self.ctx, keys, score)
        images = int(sums["images"])
        pixels = images * h * w
        first = {"pixels": images * w, "bits_per_dim": bits(sums["first"], images * w)}
        below = {"pixels": pixels - images * w, "bits_per_dim": bits(sums["nats"] - sums["first"], pixels - images * w)}
        return {"loss": sums["nats"] / pixels if pixels else float("nan"), "bits_per_dim": bits(sums["nats"], pixels),
                "pixels": pixels, "images": images, "pixels_per_second": per_second(pixels, seconds),
                "width": w, "height": h,
                "row_bands": [{"start": s, "end": e, "pixels": images * (e - s) * w,
                               "bits_per_dim": bits(sums[f"band_{i}"], images * (e - s) * w)}
                              for i, (s, e) in enumerate(bands)],
                "first_row": first, "rows_below": below, "neighbour_lags": neighbour_lags(w),
                "neighbour_reach": neighbour_reach(self.config.to_dict(), w, h)}


@torch.no_grad()
def complete(model: GPT, pixels: torch.Tensor, given: int, *, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, seed: int | None = None) -> torch.Tensor:
    """pixels int64 [B, N] (whole images row by row) -> [B, N]: the first `given` pixels kept, the rest drawn
    one at a time from the model over the 256 pixel values, at `temperature` (0: argmax) with `top_k` / `top_p`,
    from `seed`. The model's mode is left as it is (call in eval mode).

    Through the decoding cache where every layer's kind has one; otherwise (the 2D neighbourhood, strided:
    masked kinds without incremental decoding) each pixel's logits come from the whole prefix run again, the
    same numbers at O(N²) work, which images of a few hundred pixels afford."""
    b, n = pixels.shape
    if not 0 <= given < n:
        raise ValueError(f"given must be in [0, {n}) pixels, got {given}")
    generator = None if seed is None else torch.Generator(pixels.device).manual_seed(seed)
    incremental = set(model.config.layer_kinds()) <= set(kinds_with("decoding"))
    cache = model.init_cache(b, max_positions=n) if incremental else None
    sequence = torch.cat([torch.full_like(pixels[:, :1], START), pixels[:, :given]], 1)
    logits = model(sequence, cache)[:, -1, :PIXEL_VALUES]
    drawn = []
    for step in range(n - given):
        token = sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        drawn.append(token)
        if given + step + 1 < n:  # the last pixel is never fed back
            if incremental:
                logits = model(token[:, None], cache)[:, -1, :PIXEL_VALUES]
            else:
                sequence = torch.cat([sequence, token[:, None]], 1)
                logits = model(sequence)[:, -1, :PIXEL_VALUES]
    return torch.cat([pixels[:, :given], torch.stack(drawn, 1)], 1)
