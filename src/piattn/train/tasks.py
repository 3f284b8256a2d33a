"""Training tasks: what a run learns, behind one small interface the training loop and `piattn eval` share.

A Task builds its model (config first), gives a resumable loader of training batches, computes the loss
of a batch and evaluates a split. `TASKS` maps `--task` names to Task classes: `lm` (causal language
modelling) here, and the classification tasks of `classification` (listops, pathfinder, retrieval, reach).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import ClassVar, Protocol

import torch
from torch import nn
from torch.nn import functional as F

from ..data.packing import PackedSequences, SequenceLoader, load_corpus, tokenize_corpus
from ..data.text import load_documents
from ..data.tokenizers import KINDS as TOKENIZER_KINDS
from ..data.tokenizers import load_tokenizer, make_tokenizer
from ..models import GPT, SIZES, GPTConfig, ModelConfig
from .checkpoint import read_config
from .distributed import DistContext, all_reduce_sum, barrier

TOKENIZER_DIR = "tokenizer"
# Training arguments that, when given, override the GPTConfig field of the same name.
MODEL_OVERRIDES = ("window", "period", "variant", "prior", "n_layer", "n_head", "d_model", "d_ff", "backend")


class BatchLoader(Protocol):
    """Batches forever, resumable: `state_dict()` after k batches + `load_state_dict` gives batch k + 1 next."""

    def next_batch(self): ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class Task(ABC):
    """One training objective.

    Built by `from_args(args, run_dir, ctx, checkpoint)`: `args` are the training arguments (the
    `piattn train` namespace, or the one saved in a checkpoint for `piattn eval`); with `checkpoint`, the
    model config and any fitted assets (a tokenizer) come from that checkpoint folder instead of being built.
    Files the task makes (caches, fitted assets) go under `run_dir`; only rank 0 writes them.
    """

    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def from_args(cls, args: argparse.Namespace, run_dir: Path, ctx: DistContext,
                  checkpoint: Path | None = None) -> Task: ...

    @property
    @abstractmethod
    def model_config(self) -> ModelConfig:
        """The configuration `build_model` builds (saved in every checkpoint's config.json)."""

    @abstractmethod
    def build_model(self) -> nn.Module:
        """A freshly initialised model of `model_config` (on the CPU)."""

    @abstractmethod
    def train_loader(self) -> BatchLoader:
        """This rank's shard of the training batches, shuffled from the run's seed."""

    @abstractmethod
    def loss(self, model: nn.Module, batch) -> tuple[torch.Tensor, int]:
        """(mean loss of the batch, a scalar tensor with grad; number of tokens the batch holds)."""

    @abstractmethod
    def evaluate(self, model: nn.Module, split: str, max_batches: int) -> dict:
        """Metrics of `model` on `split` (at most `max_batches` batches per rank; 0 = the whole split)."""

    @abstractmethod
    def save_assets(self, directory: Path) -> None:
        """Write what the model needs beside its weights (e.g. the tokenizer) into a checkpoint folder."""


def token_byte_lengths(tokenizer) -> torch.Tensor:
    """[vocab_size] int64: how many UTF-8 bytes of text each token id stands for.

    byte: 1 each. char: the character's UTF-8 length (the unknown id counts as U+FFFD, 3 bytes). bpe: the
    length of the token's byte string (byte-level BPE writes each byte as one symbol of its alphabet).
    """
    if tokenizer.kind == "byte":
        return torch.ones(tokenizer.vocab_size, dtype=torch.int64)
    if tokenizer.kind == "char":
        return torch.tensor([len(tokenizer.decode([i]).encode("utf-8")) for i in range(tokenizer.vocab_size)])
    if tokenizer.kind == "bpe":
        return torch.tensor([len(tokenizer.model.id_to_token(i)) for i in range(tokenizer.vocab_size)])
    raise ValueError(f"tokenizer kind must be one of {TOKENIZER_KINDS}, got {tokenizer.kind!r}")


def lm_metrics(nats: float, tokens: int, n_bytes: int) -> dict:
    """Loss (nats/token), bits per byte of the evaluated text, and perplexity per token, from summed counts."""
    loss = nats / tokens
    return {"loss": loss, "bpb": nats / (math.log(2) * n_bytes), "perplexity": math.exp(loss),
            "tokens": int(tokens), "bytes": int(n_bytes)}


def _documents(source: str, split: str, hint: str = ""):
    """The documents of `split`, the flag named in the error when the source or its split is missing."""
    try:
        return load_documents(source, split)
    except (FileNotFoundError, ValueError) as err:
        raise ValueError(f"--data: {err}{hint}") from None


class LanguageModelTask(Task):
    """Causal language modelling on packed text (`piattn.models.GPT`).

    Documents come from `--data` (see `piattn.data.text.load_documents`), split train / validation / test;
    the tokenizer (`--tokenizer byte|char|bpe`) is fitted on the train split. Tokenized splits are cached
    under `--cache-dir` (default `run_dir/cache`), keyed by source, split and tokenizer.
    """

    name = "lm"

    def __init__(self, args: argparse.Namespace, run_dir: Path, ctx: DistContext, tokenizer_dir: Path,
                 config: GPTConfig):
        self.args, self.ctx, self.config = args, ctx, config
        self.tokenizer_dir, self.tokenizer = tokenizer_dir, load_tokenizer(tokenizer_dir)
        self.cache_dir = Path(args.cache_dir) if args.cache_dir else run_dir / "cache"
        self._byte_lengths = token_byte_lengths(self.tokenizer).to(ctx.device)

    @classmethod
    def from_args(cls, args, run_dir, ctx, checkpoint=None):
        if checkpoint is not None:
            return cls(args, run_dir, ctx, checkpoint / TOKENIZER_DIR, GPTConfig(**read_config(checkpoint)["model"]))
        # Check everything before the tokenizer is fitted and written, so a bad flag leaves no trace.
        if args.config not in SIZES:
            raise ValueError(f"--config must be one of {sorted(SIZES)}, got {args.config!r}")
        if args.tokenizer not in TOKENIZER_KINDS:
            raise ValueError(f"--tokenizer must be one of {list(TOKENIZER_KINDS)}, got {args.tokenizer!r}")
        if args.tokenizer != "bpe" and args.vocab_size is not None:
            raise ValueError(f"--vocab-size applies to --tokenizer bpe only, got it with {args.tokenizer!r}")
        if args.tokenizer == "bpe" and args.vocab_size is None:
            raise ValueError("--vocab-size is required with --tokenizer bpe (e.g. 8192; at least 256)")
        _documents(args.data, "train")
        if args.eval_every:
            _documents(args.data, "validation", hint=" (or pass --eval-every 0)")
        overrides = {k: getattr(args, k) for k in MODEL_OVERRIDES if getattr(args, k) is not None}
        config = GPTConfig.from_name(args.config, attention=args.attention, block_size=args.seq_len,
                                     dropout=args.dropout, **overrides)
        tokenizer_dir = cls._fit_tokenizer(args, run_dir, ctx)
        config = dataclasses.replace(config, vocab_size=load_tokenizer(tokenizer_dir).vocab_size)
        return cls(args, run_dir, ctx, tokenizer_dir, config)

    @staticmethod
    def _fit_tokenizer(args, run_dir: Path, ctx: DistContext) -> Path:
        """Rank 0 fits (char, bpe) and saves the tokenizer under run_dir; returns that folder."""
        directory = run_dir / TOKENIZER_DIR
        if ctx.is_main:
            texts = _documents(args.data, "train") if args.tokenizer != "byte" else None
            make_tokenizer(args.tokenizer, texts, args.vocab_size).save(directory)
        barrier(ctx)
        return directory

    @property
    def model_config(self) -> GPTConfig:
        return self.config

    def build_model(self) -> GPT:
        return GPT(self.config)

    def save_assets(self, directory: Path) -> None:
        self.tokenizer.save(directory / TOKENIZER_DIR)

    def _cache_path(self, split: str) -> Path:
        """Cache files of `split`: named by a hash of the source, the split and the tokenizer's saved files."""
        digest = hashlib.sha256(f"{self.args.data}\0{split}".encode())
        for f in sorted(self.tokenizer_dir.iterdir()):
            digest.update(f.name.encode() + f.read_bytes())
        return self.cache_dir / f"{split}-{digest.hexdigest()[:16]}"

    def sequences(self, split: str) -> PackedSequences:
        """The packed sequences of `split`, tokenized once by rank 0 and cached."""
        path = self._cache_path(split)
        if self.ctx.is_main:
            try:
                corpus = load_corpus(path)
            except (FileNotFoundError, ValueError, OSError):
                corpus = tokenize_corpus(_documents(self.args.data, split), self.tokenizer, path,
                                         progress=self.args.progress)
        barrier(self.ctx)
        if not self.ctx.is_main:
            corpus = load_corpus(path)
        try:
            return PackedSequences(corpus.tokens, corpus.doc_starts, self.args.seq_len,
                                   cross_documents=self.args.cross_documents)
        except ValueError as err:
            raise ValueError(f"--seq-len {self.args.seq_len} is too long for the {split} split of "
                             f"{self.args.data}: {err}") from None

    def train_loader(self) -> SequenceLoader:
        return SequenceLoader(self.sequences("train"), self.args.batch_size, seed=self.args.seed, shuffle=True,
                              rank=self.ctx.rank, world_size=self.ctx.world_size)

    def loss(self, model, batch):
        batch = batch.to(self.ctx.device, non_blocking=True)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits = model(inputs)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()), targets.numel()

    @torch.no_grad()
    def evaluate(self, model, split, max_batches):
        loader = SequenceLoader(self.sequences(split), self.args.batch_size, shuffle=False, rank=self.ctx.rank,
                                world_size=self.ctx.world_size, drop_last=False)
        n_batches = loader.batches_per_epoch if max_batches <= 0 else min(max_batches, loader.batches_per_epoch)
        was_training = model.training
        model.eval()
        nats = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        n_tokens = n_bytes = 0
        start = time.perf_counter()
        for _ in range(n_batches):
            batch = loader.next_batch().to(self.ctx.device, non_blocking=True)
            targets = batch[:, 1:]
            logits = model(batch[:, :-1])
            nats += F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum").double()
            n_tokens += targets.numel()
            n_bytes += int(self._byte_lengths[targets].sum())
        model.train(was_training)
        nats_total, tokens_total, bytes_total = all_reduce_sum([float(nats), n_tokens, n_bytes], self.ctx)
        seconds = time.perf_counter() - start
        return {**lm_metrics(nats_total, int(tokens_total), int(bytes_total)),
                "tokens_per_second": tokens_total / seconds if seconds > 0 else float("inf")}


TASKS: dict[str, type[Task]] = {"lm": LanguageModelTask}


def task_class(name: str) -> type[Task]:
    """The Task class registered under `name` (the `--task` flag)."""
    if name in TASKS:
        return TASKS[name]
    raise ValueError(f"--task must be one of {sorted(TASKS)}, got {name!r}")


# Last: the classification tasks subclass Task and add themselves to TASKS when their module loads.
from . import classification  # noqa: E402, F401
