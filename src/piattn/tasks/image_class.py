"""Whole-image classification of raster-scanned grayscale images (sequential MNIST and the other sources).

The image row by row is one sequence for a bidirectional `Encoder` with mean pooling; pixel value v is token
v + 1 (vocabulary 257) so that no pixel, black ones included, is the padding id 0, as in --task pathfinder.
With π = W (`--period width`) the skip keys of a pixel are the pixels above and below it. Accuracy overall
and by class (`accuracy_by_class`, `examples_by_class`).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from ..config import EncoderConfig
from ..data import raster as images
from ..data.examples import Examples, compact
from ..train.task import evaluation_sums, per_second
from . import raster
from .classification import ClassificationTask

VOCAB_SIZE = 257


class ImageClassTask(raster.RasterTaskTraits, ClassificationTask):
    """Classify an image read pixel by pixel (module docstring)."""

    name = "image-class"
    report_sections = ("classes",)

    @classmethod
    def resolve_seq_len(cls, cfg):
        h, w = raster.shape(cfg)
        return h * w

    @classmethod
    def check_config(cls, cfg):
        raster.check(cfg, cls.name)

    @classmethod
    def make_config(cls, cfg):
        h, w = raster.shape(cfg)
        return EncoderConfig.from_name(cfg.model.config, vocab_size=VOCAB_SIZE,
                                       num_classes=images.num_classes(raster.source(cfg)), block_size=h * w,
                                       pool="mean", image_width=w, **cfg.model.model_fields())

    def load_split(self, split):
        data = raster.load(self.cfg, split)
        if data.width != self.config.image_width or data.height * data.width != self.config.block_size:
            raise ValueError(f"--data: the {split} images are {data.height} × {data.width}; the model takes "
                             f"{self.config.block_size} pixels {self.config.image_width} wide")
        return Examples(compact(data.sequences().long() + 1, VOCAB_SIZE), data.labels)

    def _score(self, model, batch) -> dict:
        inputs, labels = (t.to(self.ctx.device, non_blocking=True) for t in batch)
        logits = self.logits(model, inputs).float()
        correct = logits.argmax(-1) == labels
        classes = torch.arange(self.config.num_classes, device=labels.device)
        at = labels[:, None] == classes[None, :]  # [B, C]
        return {"nats": F.cross_entropy(logits, labels, reduction="sum").double(), "correct": correct.sum(),
                "examples": len(labels), "tokens": inputs.numel(),
                **{f"examples_{c}": at[:, c].sum() for c in range(len(classes))},
                **{f"correct_{c}": (at[:, c] & correct).sum() for c in range(len(classes))}}

    def evaluate(self, model, split, max_batches):
        """{"accuracy", "loss", "examples", "tokens_per_second", "accuracy_by_class", "examples_by_class"}:
        by class, {str(label): value} for the labels the scored batches hold."""
        n = self.config.num_classes
        keys = ("nats", "correct", "examples", "tokens",
                *(f"{k}_{c}" for c in range(n) for k in ("examples", "correct")))
        loader = self.eval_loader(split)
        sums, seconds = evaluation_sums(model, loader, max_batches, self.ctx, keys, self._score)
        held = [c for c in range(n) if sums[f"examples_{c}"] > 0]
        return {"accuracy": sums["correct"] / sums["examples"], "loss": sums["nats"] / sums["examples"],
                "examples": int(sums["examples"]), "tokens_per_second": per_second(sums["tokens"], seconds),
                "accuracy_by_class": {str(c): sums[f"correct_{c}"] / sums[f"examples_{c}"] for c in held},
                "examples_by_class": {str(c): int(sums[f"examples_{c}"]) for c in held}}
