"""Image-text retrieval (the paper's MSCOCO / Flickr30K experiment): a CLIP dual encoder, Recall@K.

    piattn train --task vl-retrieval --data shapes --attention pi --out runs/vl-pi
    piattn train --task vl-retrieval --data coco:DIR --attention pi --out runs/coco-pi
    piattn eval --checkpoint runs/vl-pi --split test    # {"i2t_r1": …, …, "t2i_r10": …}

Training minimises the symmetric InfoNCE of each batch (one caption per image, `data.vl.CaptionLoader`);
evaluation encodes every image and caption of the split and ranks them (`tasks.ranking`). The image tower
reads --image-size² pixels as (--image-size / --patch-size)² patches (the sequence length, --seq-len);
with --attention pi, π defaults to the patches per row, so the skip keys are the patches above and below.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import TrainConfig
from ..config.flags import flag
from ..config.vision import VisionLanguageConfig
from ..data import karpathy, shapes
from ..data.images import normalize, pillow
from ..data.text import normalize_split
from ..data.vl import CaptionedImages, CaptionLoader, encode_captions, parse_source
from ..models.vision import DualEncoder, clip_loss
from ..train.checkpoint import read_config
from ..train.distributed import DistContext
from ..train.task import Task, per_second
from .classification import GENERATED_EVAL_SIZE, GENERATED_TRAIN_SIZE, ImageFlags, SplitFlags, split_seed
from .ranking import KS, retrieval_recalls

# (image size, patch size) when not given: small for the generated shapes, ViT-B/16's for the datasets.
DEFAULT_SIZES = {"shapes": (32, 4), "files": (224, 16)}


def source(cfg: TrainConfig) -> tuple[str, Path | None]:
    """(kind, folder) of --data: ("shapes", None), ("coco", DIR) or ("flickr30k", DIR)."""
    try:
        return parse_source(cfg.data.data)
    except ValueError as err:
        raise ValueError(f"--data: {err}") from None


def image_sizes(cfg: TrainConfig) -> tuple[int, int]:
    """(--image-size, --patch-size) with the defaults of the source; ValueError unless the patch divides the image."""
    defaults = DEFAULT_SIZES["shapes" if source(cfg)[0] == "shapes" else "files"]
    size = cfg.task.image_size if cfg.task.image_size is not None else defaults[0]
    patch = cfg.task.patch_size if cfg.task.patch_size is not None else defaults[1]
    if size % patch:
        raise ValueError(f"--image-size ({size}) must be a multiple of --patch-size ({patch})")
    return size, patch


@dataclass
class VisionLanguageFlags:
    patch_size: int | None = flag(None, "vl-retrieval: side of an image patch in pixels, dividing --image-size "
                                  "(default: shapes 4, coco / flickr30k 16)", low=1)
    caption_len: int | None = flag(None, "vl-retrieval: UTF-8 bytes kept of a caption (default 64)", low=1)
    embed_dim: int | None = flag(None, "vl-retrieval: width of the shared image-text space (default d-model)",
                                 low=2)
    text_attention: str | None = flag(None, "vl-retrieval: attention kind of the text tower (default dense; "
                                      "--attention is the image tower's)", choices="attention")


class VisionLanguageTask(Task):
    """A `DualEncoder` trained by batch InfoNCE on captioned images; metrics i2t_r1 … t2i_r10.

    Splits: `shapes` generated from --data-seed (3·seed + 0 / 1 / 2 for train / validation / test), 10,000
    and 1,000 images by default (--train-size, --eval-size); coco:DIR / flickr30k:DIR read from the Karpathy
    JSON, all images of a split unless the sizes cap them. Validation during training (--eval-batches B)
    ranks the split's first B × batch-size images and their captions; `piattn eval` ranks the whole split.
    """

    name = "vl-retrieval"
    flags = (SplitFlags, ImageFlags, VisionLanguageFlags)
    flag_notes = {"data": ": shapes (default, generated), coco:DIR or flickr30k:DIR (Karpathy splits: "
                          "DIR/dataset_coco.json or DIR/dataset_flickr30k.json and the images)",
                  "seq_len": " (image-size / patch-size)², the image's patches",
                  "period": ": the image's patches per row, so the skip key is the patch above / below"}
    capabilities = frozenset({"raster"})  # its patches are raster-scanned: --period width counts patches per row
    validation_metrics = (*(f"{way}_r{k}" for way in ("i2t", "t2i") for k in KS), "images", "captions",
                          "images_per_second")

    def __init__(self, cfg: TrainConfig, ctx: DistContext, config: VisionLanguageConfig):
        self.cfg, self.ctx, self.config = cfg, ctx, config
        self.kind, self.root = source(cfg)
        self._splits: dict[str, tuple[CaptionedImages, torch.Tensor]] = {}

    @classmethod
    def from_config(cls, cfg, run_dir, ctx, checkpoint=None):
        if checkpoint is not None:  # flags checked when the run started
            return cls(cfg, ctx, VisionLanguageConfig.from_dict(read_config(checkpoint)["model"]))
        cls.check_config(cfg)
        return cls(cfg, ctx, cls.make_config(cfg))

    @classmethod
    def resolve_seq_len(cls, cfg):
        size, patch = image_sizes(cfg)
        return (size // patch) ** 2

    @classmethod
    def check_config(cls, cfg: TrainConfig) -> None:
        """ValueError naming the flag or file, before any data is read: --seq-len, the source, Pillow."""
        patches = cls.resolve_seq_len(cfg)
        if cfg.data.seq_len != patches:
            raise ValueError(f"--seq-len must be (--image-size / --patch-size)² = {patches} for --task "
                             f"vl-retrieval (or left out), got {cfg.data.seq_len}")
        kind, root = source(cfg)
        if kind != "shapes":
            karpathy.split_file(kind, root)
            pillow()

    @classmethod
    def make_config(cls, cfg: TrainConfig) -> VisionLanguageConfig:
        """The --config size with the model flags given, the image and patch sizes, and the text tower's flags;
        π is the patches per row unless --period is given."""
        size, patch = image_sizes(cfg)
        t = cfg.task
        extra = {name: value for name, value in (("caption_len", t.caption_len), ("embed_dim", t.embed_dim),
                                                 ("text_attention", t.text_attention)) if value is not None}
        return VisionLanguageConfig.from_name(cfg.model.config, image_size=size, patch_size=patch, **extra,
                                              **cfg.model.model_fields())

    @property
    def model_config(self):
        return self.config

    def build_model(self):
        return DualEncoder(self.config)

    def save_assets(self, directory):
        """Nothing: captions are byte ids (no fitted tokenizer)."""

    def split_size(self, split: str) -> int | None:
        size = self.cfg.task.train_size if split == "train" else self.cfg.task.eval_size
        if size is None and self.kind == "shapes":
            return GENERATED_TRAIN_SIZE if split == "train" else GENERATED_EVAL_SIZE
        return size

    def split(self, split: str) -> tuple[CaptionedImages, torch.Tensor]:
        """(the split "train", "validation" or "test" (aliases valid, val), its caption ids int16 [M, caption_len]),
        built on first use."""
        split = normalize_split(split)
        if split not in self._splits:
            size = self.config.image_size
            if self.kind == "shapes":
                data = shapes.generate(self.split_size(split), split_seed(self.cfg.task.data_seed, split), size)
            else:
                data = karpathy.read_split(self.kind, self.root, split, size, self.split_size(split))
            self._splits[split] = data, encode_captions(data.captions, self.config.caption_len)
        return self._splits[split]

    def train_loader(self):
        data, ids = self.split("train")
        return CaptionLoader(data, ids, self.cfg.optim.batch_size, seed=self.cfg.optim.seed, rank=self.ctx.rank,
                             world_size=self.ctx.world_size)

    def loss(self, model, batch):
        images, captions = batch
        images = normalize(images.to(self.ctx.device, non_blocking=True))
        logits = model(images, captions.to(self.ctx.device, non_blocking=True))
        return clip_loss(logits.float()), len(images) * (self.config.n_patches + self.config.caption_len)

    def embeddings(self, model, split: str, n_images: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(image embeddings [n, E], caption embeddings [m, E], caption_image int64 [m]) of the first n images of
        `split` and their m captions, --batch-size at a time, in eval mode without gradients (the model's
        mode is given back)."""
        data, ids = self.split(split)
        ids = ids[:int((data.caption_image < n_images).sum())]  # captions are grouped by image
        batch, device, was_training = self.cfg.optim.batch_size, self.ctx.device, model.training
        model.eval()
        try:
            with torch.no_grad():
                images = [model.encode_images(normalize(data.images.batch(torch.arange(s, min(s + batch, n_images)))
                                                        .to(device))) for s in range(0, n_images, batch)]
                captions = [model.encode_texts(ids[s:s + batch].to(device).long())
                            for s in range(0, len(ids), batch)]
        finally:
            model.train(was_training)
        return torch.cat(images), torch.cat(captions), data.caption_image[:len(ids)]

    def planned_batches(self, split: str, max_batches: int) -> int:
        """The encoder calls of `evaluate`: the images, then their captions, --batch-size at a time."""
        data, size = self.split(split)[0], self.cfg.optim.batch_size
        images = len(data.images) if max_batches <= 0 else min(len(data.images), max_batches * size)
        captions = int((data.caption_image < images).sum())
        return -(-images // size) + -(-captions // size)

    def evaluate(self, model, split, max_batches):
        """{"i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10", "images", "captions",
        "images_per_second"}: Recall@K (fractions) over the split's first max_batches × batch-size images
        (0: all) and all their captions.

        Ranking needs every embedding, so with several ranks each rank encodes and ranks the same images
        (same result everywhere; the work is repeated, not shared).
        """
        total = len(self.split(split)[0].images)
        n_images = total if max_batches <= 0 else min(total, max_batches * self.cfg.optim.batch_size)
        start = time.perf_counter()
        image_emb, caption_emb, caption_image = self.embeddings(model, split, n_images)
        recalls = retrieval_recalls(image_emb, caption_emb, caption_image)
        return {**recalls, "images": n_images, "captions": len(caption_image),
                "images_per_second": per_second(n_images, time.perf_counter() - start)}
