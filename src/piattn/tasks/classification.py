"""Whole-sequence classification over fixed splits: the base of the LRA tasks and of the reach task.

One label per example, cross-entropy loss, accuracy. Splits are fixed sets of `Examples` held in memory:

- generated (ListOps, Pathfinder, reach): `--train-size` / `--eval-size` examples (default 10,000 / 1,000)
  drawn from the seed 3·`--data-seed` + (0 train, 1 validation, 2 test), so the splits never share a seed;
- read from `--data` (ListOps, Retrieval): a folder holding the LRA release's files of the task, the sizes
  then cap how many examples are read (default: all).

Every rank builds the same splits itself (generation is deterministic); training batches come from
`ExampleLoader`, resumable and sharded.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from ..config import EncoderConfig, ModelConfig, TrainConfig
from ..config.flags import flag
from ..data.examples import ExampleLoader, Examples
from ..data.text import normalize_split
from ..models import Encoder
from ..train.checkpoint import read_config
from ..train.distributed import DistContext
from ..train.task import Task, evaluation_sums, per_second

GENERATED_TRAIN_SIZE = 10_000
GENERATED_EVAL_SIZE = 1_000
SPLIT_INDEX = {"train": 0, "validation": 1, "test": 2}


@dataclass
class SplitFlags:
    """The flags of the tasks with fixed splits of examples, generated from --data-seed or read at most
    --train-size / --eval-size (every task here, and vl-retrieval)."""

    train_size: int | None = flag(None, "training examples: generated (default 10000) or read at most (default "
                                  "all)", low=1)
    eval_size: int | None = flag(None, "examples of the validation and of the test split: generated (default "
                                 "1000) or read at most (default all); vl-retrieval: images", low=1)
    data_seed: int = flag(0, "seed of generated splits (each split its own)", low=0)


@dataclass
class ImageFlags:
    """The flag of the tasks on images."""

    image_size: int | None = flag(None, "image side in pixels (default: pathfinder 32; vl-retrieval shapes 32, "
                                  "coco / flickr30k 224; pixels and image-class: of generated --data pathfinder "
                                  "or shapes, 32)", low=1)


def split_seed(data_seed: int, split: str) -> int:
    """The generator seed of `split`: distinct for every (data seed, split) pair."""
    return 3 * data_seed + SPLIT_INDEX[split]


def encoder_config(cfg: TrainConfig, *, vocab_size: int, num_classes: int, pool: str = "mean",
                   dual: bool = False) -> EncoderConfig:
    """The `--config` size with the model flags given (window, period, …) and the task's vocabulary and classes."""
    return EncoderConfig.from_name(cfg.model.config, vocab_size=vocab_size, num_classes=num_classes,
                                   block_size=cfg.data.seq_len, pool=pool, dual=dual, **cfg.model.model_fields())


def data_file(cfg: TrainConfig, names: dict[str, str], split: str, task: str) -> Path:
    """The file of `split` in the `--data` folder, ValueError naming the flag when it is missing."""
    folder = Path(cfg.data.data)
    if not folder.is_dir():
        raise ValueError(f"--data must be a folder holding the LRA {task} files ({', '.join(names.values())}), "
                         f"got {cfg.data.data!r}")
    path = folder / names[split]
    if not path.is_file():
        raise ValueError(f"--data: no {split} file {names[split]!r} in {folder}")
    return path


class ClassificationTask(Task):
    """A classifier over fixed splits: cross-entropy of one label per example; accuracy, loss, examples.

    Subclasses say how a split is built (`load_split`), which config (`make_config`), and, where it is not
    the Encoder's, which model and how logits [B, C] come from a batch of inputs (`build_model`, `logits`).
    """

    default_seq_len: ClassVar[int]  # --seq-len when it is not given
    flags = (SplitFlags,)
    validation_metrics = ("accuracy", "loss", "examples", "tokens_per_second")

    def __init__(self, cfg: TrainConfig, ctx: DistContext, config: ModelConfig):
        self.cfg, self.ctx, self.config = cfg, ctx, config
        self._splits: dict[str, Examples] = {}

    @classmethod
    def from_config(cls, cfg: TrainConfig, run_dir: Path, ctx: DistContext, checkpoint: Path | None = None):
        if checkpoint is not None:  # flags checked when the run started
            return cls(cfg, ctx, cls.config_class(cfg).from_dict(read_config(checkpoint)["model"]))
        cls.check_config(cfg)
        return cls(cfg, ctx, cls.make_config(cfg))

    @classmethod
    def resolve_seq_len(cls, cfg: TrainConfig) -> int:
        """The task's --seq-len when the flag is not given."""
        return cls.default_seq_len

    @classmethod
    def config_class(cls, cfg: TrainConfig) -> type[ModelConfig]:
        """The config class this task's model (trained with `cfg`) takes."""
        return EncoderConfig

    @classmethod
    def check_config(cls, cfg: TrainConfig) -> None:
        """ValueError naming the flag for task settings that need more than a range check (before any data)."""

    @classmethod
    @abstractmethod
    def make_config(cls, cfg: TrainConfig) -> ModelConfig: ...

    @abstractmethod
    def load_split(self, split: str) -> Examples:
        """The examples of `split` ("train", "validation" or "test")."""

    def logits(self, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        """inputs int64 [B, …] on the device -> logits [B, C]."""
        return model(inputs)

    @property
    def model_config(self) -> ModelConfig:
        return self.config

    def build_model(self) -> nn.Module:
        return Encoder(self.config)

    def save_assets(self, directory: Path) -> None:
        """Nothing: the ids are fixed by the task (no fitted tokenizer)."""

    def split_size(self, split: str) -> int | None:
        """How many examples `split` holds: generated ones default to 10,000 / 1,000; None reads a whole file."""
        size = self.cfg.task.train_size if split == "train" else self.cfg.task.eval_size
        if size is None and self.cfg.data.data is None:
            return GENERATED_TRAIN_SIZE if split == "train" else GENERATED_EVAL_SIZE
        return size

    def examples(self, split: str) -> Examples:
        """The examples of `split` (aliases "valid", "val"), built on first use."""
        split = normalize_split(split)
        if split not in self._splits:
            self._splits[split] = self.load_split(split)
        return self._splits[split]

    def train_loader(self) -> ExampleLoader:
        return ExampleLoader(self.examples("train"), self.cfg.optim.batch_size, seed=self.cfg.optim.seed,
                             shuffle=True, rank=self.ctx.rank, world_size=self.ctx.world_size)

    def loss(self, model, batch):
        inputs, labels = (t.to(self.ctx.device, non_blocking=True) for t in batch)
        return F.cross_entropy(self.logits(model, inputs).float(), labels), inputs.numel()

    def _score(self, model, batch) -> dict:
        inputs, labels = (t.to(self.ctx.device, non_blocking=True) for t in batch)
        logits = self.logits(model, inputs).float()
        return {"nats": F.cross_entropy(logits, labels, reduction="sum").double(),
                "correct": (logits.argmax(-1) == labels).sum(), "examples": len(labels), "tokens": inputs.numel()}

    def eval_loader(self, split: str) -> ExampleLoader:
        """The examples of `split` in order, this rank's share."""
        return ExampleLoader(self.examples(split), self.cfg.optim.batch_size, shuffle=False, rank=self.ctx.rank,
                             world_size=self.ctx.world_size, drop_last=False)

    def evaluate(self, model, split, max_batches):
        """{"accuracy", "loss" (mean nats per example), "examples", "tokens_per_second"} over `split`.

        Each rank scores its shard; with several ranks the split is trimmed to a multiple of world_size.
        """
        loader = self.eval_loader(split)
        sums, seconds = evaluation_sums(model, loader, max_batches, self.ctx,
                                        ("nats", "correct", "examples", "tokens"), self._score)
        return {"accuracy": sums["correct"] / sums["examples"], "loss": sums["nats"] / sums["examples"],
                "examples": int(sums["examples"]), "tokens_per_second": per_second(sums["tokens"], seconds)}
