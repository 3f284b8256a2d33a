"""Classification tasks: the Long Range Arena's ListOps, Pathfinder and Retrieval, and the synthetic reach task.

Each task classifies whole sequences: one label per example, cross-entropy loss, accuracy. The LRA tasks
use the bidirectional `Encoder` (π-Attention then has skips at ±π); reach defaults to a causal `GPT` read
out at its last position. Splits are fixed sets of examples held in memory in a compact integer dtype:

- generated (ListOps, Pathfinder, reach): `--train-size` / `--eval-size` examples (default 10,000 / 1,000)
  drawn from the seed 3·`--data-seed` + (0 train, 1 validation, 2 test), so the splits never share a seed;
- read from `--data` (ListOps, Retrieval): a folder holding the LRA release's files of the task, the sizes
  then cap how many examples are read (default: all).

Every rank builds the same splits itself (generation is deterministic); training batches come from
`SequenceLoader`'s seeded permutation of example indices, so the loader state is (epoch, position) and a
resumed run sees the same batches.
"""

from __future__ import annotations

import argparse
import time
from abc import abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from ..data import listops, pathfinder, reach, retrieval
from ..data.packing import SequenceLoader
from ..data.text import normalize_split
from ..models import GPT, SIZES, Encoder, EncoderConfig, GPTConfig, ModelConfig
from .checkpoint import read_config
from .distributed import DistContext, all_reduce_sum
from .tasks import MODEL_OVERRIDES, TASKS, Task

GENERATED_TRAIN_SIZE = 10_000
GENERATED_EVAL_SIZE = 1_000
SPLIT_INDEX = {"train": 0, "validation": 1, "test": 2}


@dataclass(frozen=True)
class Examples:
    """One split: inputs [n, L] (or [n, 2, L] for pairs) of token ids in a compact integer dtype; labels int64 [n]."""

    inputs: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return len(self.labels)


def compact(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """ids in the smallest integer dtype holding 0 … vocab_size - 1: a split of LRA length stays a few bytes per id."""
    if vocab_size <= 256:
        return ids.to(torch.uint8)
    return ids.to(torch.int16 if vocab_size <= 2**15 else torch.int32)


class _Indices:
    """The dataset 0 … n-1, item i a 0-dim int64 tensor: lets SequenceLoader order the examples of a split."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(index)


class ExampleLoader:
    """Batches (inputs int64 [B, …], labels int64 [B]) of a split, in `SequenceLoader`'s order.

    Shuffled from `seed` per epoch, sharded over ranks, resumable: state_dict / load_state_dict are the
    SequenceLoader's (epoch, position and the configuration they depend on).
    """

    def __init__(self, examples: Examples, batch_size: int, seed: int = 0, shuffle: bool = True, rank: int = 0,
                 world_size: int = 1, drop_last: bool = True):
        self.examples = examples
        self.order = SequenceLoader(_Indices(len(examples)), batch_size, seed=seed, shuffle=shuffle, rank=rank,
                                    world_size=world_size, drop_last=drop_last)

    @property
    def batches_per_epoch(self) -> int:
        return self.order.batches_per_epoch

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        index = self.order.next_batch()
        return self.examples.inputs[index].long(), self.examples.labels[index]

    def state_dict(self) -> dict:
        return self.order.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.order.load_state_dict(state)


def split_seed(data_seed: int, split: str) -> int:
    """The generator seed of `split`: distinct for every (data seed, split) pair."""
    return 3 * data_seed + SPLIT_INDEX[split]


def _positive(flag: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise ValueError(f"{flag} must be >= 1, got {value}")


def encoder_config(args: argparse.Namespace, *, vocab_size: int, num_classes: int, block_size: int,
                   pool: str = "mean", dual: bool = False) -> EncoderConfig:
    """The `--config` size with the model flags given (window, period, …) and the task's vocabulary and classes."""
    overrides = {k: getattr(args, k) for k in MODEL_OVERRIDES if getattr(args, k) is not None}
    return EncoderConfig.from_name(args.config, attention=args.attention, dropout=args.dropout,
                                   vocab_size=vocab_size, num_classes=num_classes, block_size=block_size,
                                   pool=pool, dual=dual, **overrides)


class ClassificationTask(Task):
    """A classifier over fixed splits: cross-entropy of one label per example; accuracy, loss, examples.

    Subclasses say how a split is built (`load_split`), which config and model (`make_config`,
    `build_model`), and how logits [B, C] come from a batch of inputs (`logits`).
    """

    default_seq_len: ClassVar[int]  # --seq-len when it is not given

    def __init__(self, args: argparse.Namespace, ctx: DistContext, config: ModelConfig):
        self.args, self.ctx, self.config = args, ctx, config
        self._splits: dict[str, Examples] = {}

    @classmethod
    def from_args(cls, args, run_dir, ctx, checkpoint=None):
        if checkpoint is not None:  # arguments checked when the run started
            return cls(args, ctx, cls.checkpoint_config_class(args)(**read_config(checkpoint)["model"]))
        if args.seq_len is None:
            raise ValueError(f"--seq-len is required with --task {cls.name}")
        if args.config not in SIZES:
            raise ValueError(f"--config must be one of {sorted(SIZES)}, got {args.config!r}")
        cls.check_args(args)
        return cls(args, ctx, cls.make_config(args))

    @classmethod
    def resolve_seq_len(cls, args: argparse.Namespace) -> int:
        """--seq-len when given, else the task's default."""
        return args.seq_len if args.seq_len is not None else cls.default_seq_len

    @classmethod
    def checkpoint_config_class(cls, args: argparse.Namespace) -> type[ModelConfig]:
        """The config class a checkpoint of this task (trained with `args`) holds."""
        return EncoderConfig

    @classmethod
    def check_args(cls, args: argparse.Namespace) -> None:
        """ValueError naming the flag for task arguments out of range (before any data is built)."""
        _positive("--train-size", args.train_size)
        _positive("--eval-size", args.eval_size)
        if args.data_seed < 0:
            raise ValueError(f"--data-seed must be >= 0, got {args.data_seed}")

    @classmethod
    @abstractmethod
    def make_config(cls, args: argparse.Namespace) -> ModelConfig: ...

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
        size = self.args.train_size if split == "train" else self.args.eval_size
        if size is None and self.args.data is None:
            return GENERATED_TRAIN_SIZE if split == "train" else GENERATED_EVAL_SIZE
        return size

    def examples(self, split: str) -> Examples:
        """The examples of `split` (aliases "valid", "val"), built on first use."""
        split = normalize_split(split)
        if split not in self._splits:
            self._splits[split] = self.load_split(split)
        return self._splits[split]

    def train_loader(self) -> ExampleLoader:
        return ExampleLoader(self.examples("train"), self.args.batch_size, seed=self.args.seed, shuffle=True,
                             rank=self.ctx.rank, world_size=self.ctx.world_size)

    def loss(self, model, batch):
        inputs, labels = (t.to(self.ctx.device, non_blocking=True) for t in batch)
        return F.cross_entropy(self.logits(model, inputs).float(), labels), inputs.numel()

    @torch.no_grad()
    def evaluate(self, model, split, max_batches):
        """{"accuracy", "loss" (mean nats per example), "examples", "tokens_per_second"} over `split`.

        Each rank scores its shard; with several ranks the split is trimmed to a multiple of world_size.
        """
        loader = ExampleLoader(self.examples(split), self.args.batch_size, shuffle=False, rank=self.ctx.rank,
                               world_size=self.ctx.world_size, drop_last=False)
        n_batches = loader.batches_per_epoch if max_batches <= 0 else min(max_batches, loader.batches_per_epoch)
        was_training = model.training
        model.eval()
        nats = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        correct = torch.zeros((), dtype=torch.int64, device=self.ctx.device)
        n_examples = n_tokens = 0
        start = time.perf_counter()
        for _ in range(n_batches):
            inputs, labels = (t.to(self.ctx.device, non_blocking=True) for t in loader.next_batch())
            logits = self.logits(model, inputs).float()
            nats += F.cross_entropy(logits, labels, reduction="sum").double()
            correct += (logits.argmax(-1) == labels).sum()
            n_examples += len(labels)
            n_tokens += inputs.numel()
        model.train(was_training)
        nats_total, correct_total, examples_total, tokens_total = all_reduce_sum(
            [float(nats), int(correct), n_examples, n_tokens], self.ctx)
        seconds = time.perf_counter() - start
        return {"accuracy": correct_total / examples_total, "loss": nats_total / examples_total,
                "examples": int(examples_total),
                "tokens_per_second": tokens_total / seconds if seconds > 0 else float("inf")}


def _data_file(args: argparse.Namespace, names: dict[str, str], split: str, task: str) -> Path:
    """The file of `split` in the `--data` folder, ValueError naming the flag when it is missing."""
    folder = Path(args.data)
    if not folder.is_dir():
        raise ValueError(f"--data must be a folder holding the LRA {task} files ({', '.join(names.values())}), "
                         f"got {args.data!r}")
    path = folder / names[split]
    if not path.is_file():
        raise ValueError(f"--data: no {split} file {names[split]!r} in {folder}")
    return path


class ListOpsTask(ClassificationTask):
    """ListOps: the value 0–9 of a nested list expression; Encoder with mean pooling, ids padded to --seq-len.

    Generated: token counts in [--listops-min-len, --listops-max-len], by default [seq_len/4 + 1, seq_len - 1]
    (LRA: 501–1999 at 2000). From --data: LRA's basic_train.tsv, basic_val.tsv, basic_test.tsv (or ours,
    written with `listops.write_tsv` under those names).
    """

    name = "listops"
    default_seq_len = 2000
    FILES = {"train": "basic_train.tsv", "validation": "basic_val.tsv", "test": "basic_test.tsv"}

    @classmethod
    def check_args(cls, args):
        super().check_args(args)
        if args.data is not None:
            if args.listops_min_len is not None or args.listops_max_len is not None:
                raise ValueError("--listops-min-len / --listops-max-len apply to generated ListOps, not to --data")
            _data_file(args, cls.FILES, "train", cls.name)
            return
        low, high = cls.lengths(args)
        if not 1 <= low <= high <= args.seq_len:
            raise ValueError(f"ListOps lengths must satisfy 1 <= --listops-min-len ({low}) <= --listops-max-len "
                             f"({high}) <= --seq-len ({args.seq_len})")

    @staticmethod
    def lengths(args: argparse.Namespace) -> tuple[int, int]:
        """(fewest, most) tokens of a generated expression, both inclusive."""
        low = args.listops_min_len if args.listops_min_len is not None else args.seq_len // 4 + 1
        high = args.listops_max_len if args.listops_max_len is not None else args.seq_len - 1
        return low, high

    @classmethod
    def make_config(cls, args):
        return encoder_config(args, vocab_size=listops.VOCAB_SIZE, num_classes=10, block_size=args.seq_len)

    def load_split(self, split):
        size = self.split_size(split)
        if self.args.data is not None:
            examples = listops.read_tsv(_data_file(self.args, self.FILES, split, self.name))[:size]
        else:
            low, high = self.lengths(self.args)
            try:  # generate's bounds are exclusive
                examples = listops.generate(size, split_seed(self.args.data_seed, split), min_length=low - 1,
                                            max_length=high + 1)
            except ValueError as err:
                raise ValueError(f"--listops-min-len / --listops-max-len: {err}") from None
        try:
            inputs = listops.encode([source for source, _ in examples], self.args.seq_len)
        except ValueError as err:
            raise ValueError(f"--seq-len {self.args.seq_len} is too short for the {split} split: {err}") from None
        return Examples(compact(inputs, listops.VOCAB_SIZE), listops.targets(examples))


class PathfinderTask(ClassificationTask):
    """Pathfinder: are the two marked dots joined by a curve? Pixels row by row, Encoder with mean pooling.

    Images of --image-size² pixels (sequence length; --seq-len must be that or left out) with target curves
    of --contour-length paddles (LRA: 6, 9, 14) are generated. A pixel of value v is token v + 1, so no
    pixel, black ones included, is taken for padding (id 0) and left out of the pooled mean.
    """

    name = "pathfinder"
    VOCAB_SIZE = 257

    @classmethod
    def resolve_seq_len(cls, args):
        return args.seq_len if args.seq_len is not None else cls.image_size(args) ** 2

    @staticmethod
    def image_size(args: argparse.Namespace) -> int:
        return args.image_size if args.image_size is not None else 32

    @staticmethod
    def contour_length(args: argparse.Namespace) -> int:
        return args.contour_length if args.contour_length is not None else 14

    @classmethod
    def check_args(cls, args):
        super().check_args(args)
        if args.data is not None:
            raise ValueError("--data does not apply to --task pathfinder: its images are generated "
                             "(--image-size, --contour-length, --train-size, --eval-size)")
        size = cls.image_size(args)
        _positive("--image-size", size)
        _positive("--contour-length", cls.contour_length(args))
        if args.seq_len != size * size:
            raise ValueError(f"--seq-len must be --image-size² = {size * size} for --task pathfinder (or left out), "
                             f"got {args.seq_len}")

    @classmethod
    def make_config(cls, args):
        return encoder_config(args, vocab_size=cls.VOCAB_SIZE, num_classes=2, block_size=args.seq_len)

    def load_split(self, split):
        try:
            images, labels = pathfinder.generate(self.split_size(split), split_seed(self.args.data_seed, split),
                                                 self.image_size(self.args), self.contour_length(self.args))
        except ValueError as err:
            raise ValueError(f"--image-size / --contour-length: {err}") from None
        return Examples(compact(pathfinder.as_sequences(images) + 1, self.VOCAB_SIZE), labels)


class RetrievalTask(ClassificationTask):
    """Retrieval (AAN): does one paper cite the other? A dual Encoder over two byte sequences of --seq-len.

    --data is a folder with LRA's new_aan_pairs.train.tsv, .eval.tsv (validation) and .test.tsv; each text
    is cut to its first --seq-len bytes (LRA: 4000). Read whole by default: about 2.3 GB of ids in memory
    for LRA's 147,086 training pairs at 4000 (and four times that while reading), so --train-size helps.
    """

    name = "retrieval"
    default_seq_len = retrieval.MAX_LENGTH
    FILES = {"train": "new_aan_pairs.train.tsv", "validation": "new_aan_pairs.eval.tsv",
             "test": "new_aan_pairs.test.tsv"}

    @classmethod
    def check_args(cls, args):
        super().check_args(args)
        if args.data is None:
            raise ValueError(f"--task retrieval needs --data: a folder with {', '.join(cls.FILES.values())}")
        _data_file(args, cls.FILES, "train", cls.name)

    @classmethod
    def make_config(cls, args):
        return encoder_config(args, vocab_size=retrieval.VOCAB_SIZE, num_classes=2, block_size=args.seq_len,
                              dual=True)

    def load_split(self, split):
        ids, labels = retrieval.read_pairs(_data_file(self.args, self.FILES, split, self.name), self.args.seq_len,
                                           self.split_size(split))
        if len(labels) == 0:
            raise ValueError(f"--data: the {split} file {self.FILES[split]!r} holds no pairs")
        return Examples(compact(ids, retrieval.VOCAB_SIZE), labels)


class ReachTask(ClassificationTask):
    """Reach: recall the token --lag positions before the query, which ends the sequence (`piattn.data.reach`).

    --causal (default): a `GPT` over --reach-vocab + 1 ids; the prediction is its logits at the last
    position (the query), over all vocab + 1 ids, so the answer must reach the query through causal
    attention, as `reach.reachable(..., causal=True)` analyses. --no-causal: an `Encoder` with pool "cls"
    (its first position) over the REVERSED sequence, so the pooled position is the query; the attention
    patterns are symmetric, so reversing changes no reachability. Neither pools other positions, which
    would let the answer into the readout without attention.
    """

    name = "reach"
    default_seq_len = 64
    DEFAULT_VOCAB = 8

    @staticmethod
    def vocab(args: argparse.Namespace) -> int:
        return args.reach_vocab if args.reach_vocab is not None else ReachTask.DEFAULT_VOCAB

    @staticmethod
    def causal(args: argparse.Namespace) -> bool:
        return args.causal is not False

    @classmethod
    def check_args(cls, args):
        super().check_args(args)
        if args.data is not None:
            raise ValueError("--data does not apply to --task reach: its sequences are generated")
        if args.lag is None:
            raise ValueError("--lag is required with --task reach (the distance from the answer to the query)")
        if not 1 <= args.lag <= args.seq_len - 1:
            raise ValueError(f"--lag must be in [1, --seq-len - 1 = {args.seq_len - 1}], got {args.lag}")
        if not 2 <= cls.vocab(args) <= 2**15 - 1:
            raise ValueError(f"--reach-vocab must be in [2, {2**15 - 1}], got {cls.vocab(args)}")

    @classmethod
    def checkpoint_config_class(cls, args):
        return GPTConfig if cls.causal(args) else EncoderConfig

    @classmethod
    def make_config(cls, args):
        vocab = cls.vocab(args)
        if not cls.causal(args):
            return encoder_config(args, vocab_size=vocab + 1, num_classes=vocab, block_size=args.seq_len, pool="cls")
        overrides = {k: getattr(args, k) for k in MODEL_OVERRIDES if getattr(args, k) is not None}
        return GPTConfig.from_name(args.config, attention=args.attention, dropout=args.dropout, vocab_size=vocab + 1,
                                   block_size=args.seq_len, **overrides)

    def build_model(self):
        return GPT(self.config) if self.causal(self.args) else Encoder(self.config)

    def logits(self, model, inputs):
        """inputs [B, seq_len] (query last) -> [B, vocab + 1] (causal) or [B, vocab] (bidirectional)."""
        if self.causal(self.args):
            return model(inputs)[:, -1]
        return model(inputs.flip(1))

    def load_split(self, split):
        vocab = self.vocab(self.args)
        tokens, targets, _ = reach.generate(self.split_size(split), self.args.seq_len, self.args.lag, vocab,
                                            split_seed(self.args.data_seed, split))
        return Examples(compact(tokens, vocab + 1), targets)


CLASSIFICATION_TASKS: dict[str, type[ClassificationTask]] = {
    task.name: task for task in (ListOpsTask, PathfinderTask, RetrievalTask, ReachTask)}
# Registered from here: `tasks` imports this module at its end, and this one subclasses its Task.
TASKS.update(CLASSIFICATION_TASKS)
