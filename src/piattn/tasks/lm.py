"""Causal language modelling on packed text (`piattn.models.GPT`): loss, bits per byte, perplexity."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch.nn import functional as F

from ..checks import is_int
from ..config import GPTConfig, TrainConfig
from ..config.flags import Capability, flag
from ..data.packing import PackedSequences, SequenceLoader, load_corpus, tokenize_corpus
from ..data.text import is_auto_split, load_documents, source_fingerprint, split_plan
from ..data.tokenizers import load_tokenizer, make_tokenizer
from ..layers import sequence_parallel
from ..models import GPT
from ..train.checkpoint import check_weight_shapes, load_weights, read_config
from ..train.distributed import DistContext, all_reduce_sum, barrier
from ..train.task import Task, evaluation_sums, per_second

TOKENIZER_DIR = "tokenizer"
LM_SEQ_LEN = 1024  # --seq-len of --task lm when not given
IGNORE = -100  # target id the loss skips: with packed documents, the first token of each document


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
    raise ValueError(f"tokenizer kind must be byte, char or bpe, got {tokenizer.kind!r}")


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


def _files_digest(directory: Path) -> str:
    """A digest of the files of a folder (a saved tokenizer), read once."""
    digest = hashlib.sha256()
    for f in sorted(p for p in directory.rglob("*") if p.is_file()):
        digest.update(f.relative_to(directory).as_posix().encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()


@dataclass
class TextFlags:
    """--task lm's flags of the data section."""

    section: ClassVar[str] = "data"
    tokenizer: str = flag("byte", "tokenizer kind", choices="tokenizer")
    vocab_size: int | None = flag(None, "BPE vocabulary size (required with --tokenizer bpe)", low=256,
                                  applies={"tokenizer": ("bpe",)})
    cross_documents: bool = flag(False, "let sequences span document boundaries")
    pack_documents: bool = flag(False, "pack documents back to back into full sequences, attention kept inside "
                                "each document (document ids in the batch) and no target across a boundary",
                                applies={"attention": Capability("documents")})


class LanguageModelTask(Task):
    """Causal language modelling on packed text.

    Documents come from `--data` (see `piattn.data.text.load_documents`), split train / validation / test;
    the tokenizer (`--tokenizer byte|char|bpe`) is fitted on the train split. Tokenized splits are cached
    under `--cache-dir` (default `run_dir/cache`), keyed by the split's content (`source_fingerprint`) and
    the tokenizer's files, so an edited corpus is tokenized again.

    Under `--sequence-parallel N` the N ranks of a sequence group take the same batches (loaders shard
    over the data-parallel replicas, not the ranks) and each runs the model on its contiguous shard of
    every sequence inside `piattn.layers.sequence_parallel`; its loss is the mean over its shard's
    targets (see `piattn.train.distributed.wrap` for why that gives the unsharded gradient).
    """

    name = "lm"
    flags = (TextFlags,)
    flag_notes = {"data": " (required): a text file or a folder of text files (split 90/5/5 by contiguous "
                          "bytes), a folder with train/ validation/ test/ text files, books:<dir>, "
                          "wikitext:<dir>, hf:<name>", "seq_len": f" {LM_SEQ_LEN}"}
    capabilities = frozenset({"cache", "sequence_parallel"})
    by_position = True
    validation_metrics = ("loss", "bpb", "perplexity", "tokens", "bytes", "tokens_per_second")

    def __init__(self, cfg: TrainConfig, run_dir: Path, ctx: DistContext, tokenizer_dir: Path, config: GPTConfig):
        self.cfg, self.ctx, self.config = cfg, ctx, config
        self.tokenizer = load_tokenizer(tokenizer_dir)
        # Read now: a checkpoint's tokenizer folder may be rotated away while the run goes on.
        self.tokenizer_digest = _files_digest(tokenizer_dir)
        self.cache_dir = Path(cfg.data.cache_dir) if cfg.data.cache_dir else run_dir / "cache"
        self._byte_lengths = token_byte_lengths(self.tokenizer).to(ctx.device)
        self._sequences: dict[str, PackedSequences] = {}

    @staticmethod
    def resolve_seq_len(cfg: TrainConfig) -> int:
        return LM_SEQ_LEN

    @classmethod
    def from_config(cls, cfg: TrainConfig, run_dir: Path, ctx: DistContext, checkpoint: Path | None = None):
        if checkpoint is not None:
            config = GPTConfig.from_dict(read_config(checkpoint)["model"])
            return cls(cfg, run_dir, ctx, checkpoint / TOKENIZER_DIR, config)
        if cfg.data.data is None:
            raise ValueError("--data is required with --task lm")
        if cfg.data.pack_documents and cfg.data.cross_documents:
            raise ValueError("--pack-documents and --cross-documents exclude each other: packed sequences already "
                             "run across documents, keeping attention inside each")
        if cfg.data.tokenizer == "bpe" and cfg.data.vocab_size is None:
            raise ValueError("--vocab-size is required with --tokenizer bpe (e.g. 8192; at least 256)")
        # Check everything before the tokenizer is fitted and written, so a bad flag leaves no trace.
        _documents(cfg.data.data, "train")
        if ctx.is_main and is_auto_split(cfg.data.data):
            print(f"piattn train: {split_plan(cfg.data.data).note(cfg.data.data)}", file=sys.stderr)
        if cfg.run.eval_every:
            _documents(cfg.data.data, "validation", hint=" (or pass --eval-every 0)")
        config = GPTConfig.from_name(cfg.model.config, block_size=cfg.data.seq_len,
                                     **cfg.model.model_fields())
        tokenizer_dir = cls._fit_tokenizer(cfg, run_dir, ctx)
        config = dataclasses.replace(config, vocab_size=load_tokenizer(tokenizer_dir).vocab_size)
        return cls(cfg, run_dir, ctx, tokenizer_dir, config)

    @staticmethod
    def _fit_tokenizer(cfg: TrainConfig, run_dir: Path, ctx: DistContext) -> Path:
        """Rank 0 fits (char, bpe) and saves the tokenizer under run_dir; returns that folder."""
        directory = run_dir / TOKENIZER_DIR
        if ctx.is_main:
            texts = _documents(cfg.data.data, "train") if cfg.data.tokenizer != "byte" else None
            make_tokenizer(cfg.data.tokenizer, texts, cfg.data.vocab_size).save(directory)
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
        """Cache files of `split`: named by a digest of the split's content and of the tokenizer."""
        try:
            content = source_fingerprint(self.cfg.data.data, split)
        except (FileNotFoundError, ValueError) as err:
            raise ValueError(f"--data: {err}") from None
        digest = hashlib.sha256(f"{content}\0{self.tokenizer_digest}".encode())
        return self.cache_dir / f"{split}-{digest.hexdigest()[:16]}"

    def sequences(self, split: str) -> PackedSequences:
        """The packed sequences of `split`, tokenized once by rank 0 and cached; read once per task (a run
        evaluates the validation text it started with)."""
        if split not in self._sequences:
            self._sequences[split] = self._load_sequences(split)
        return self._sequences[split]

    def _load_sequences(self, split: str) -> PackedSequences:
        path = self._cache_path(split)
        if self.ctx.is_main:
            try:
                corpus = load_corpus(path)
            except (FileNotFoundError, ValueError, OSError):
                corpus = tokenize_corpus(_documents(self.cfg.data.data, split), self.tokenizer, path,
                                         progress=self.cfg.run.progress)
        barrier(self.ctx)
        if not self.ctx.is_main:
            corpus = load_corpus(path)
        try:
            return PackedSequences(corpus.tokens, corpus.doc_starts, self.cfg.data.seq_len,
                                   cross_documents=self.cfg.data.cross_documents,
                                   document_ids=self.cfg.data.pack_documents)
        except ValueError as err:
            raise ValueError(f"--seq-len {self.cfg.data.seq_len} is too long for the {split} split of "
                             f"{self.cfg.data.data}: {err}") from None

    def train_loader(self) -> SequenceLoader:
        return SequenceLoader(self.sequences("train"), self.cfg.optim.batch_size, seed=self.cfg.optim.seed,
                              shuffle=True, rank=self.ctx.data_rank, world_size=self.ctx.data_size)

    def _forward(self, model, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, targets) of this rank's positions of batch [B, T + 1]: all T of them, or with N ranks
        per sequence the contiguous S = T / N positions r·S … r·S + S − 1 and their next tokens. A shard's
        last target is the next shard's first input, read from the whole batch every rank holds.

        Packed documents (batch = (tokens, document index), both [B, T + 1]): the model keeps attention
        inside each document, and a target that starts a new document (nothing in its input's document
        predicts it) is IGNORE."""
        if isinstance(batch, tuple):
            tokens, docs = (t.to(self.ctx.device, non_blocking=True) for t in batch)
            targets = tokens[:, 1:].masked_fill(docs[:, 1:] != docs[:, :-1], IGNORE)
            return model(tokens[:, :-1], document_ids=docs[:, :-1]), targets
        batch = batch.to(self.ctx.device, non_blocking=True)
        n, r = self.ctx.sequence_parallel, self.ctx.sequence_rank
        T = batch.shape[1] - 1
        if T % n:
            raise ValueError(f"--seq-len {T} must be divisible by --sequence-parallel {n}")
        S = T // n
        inputs, targets = batch[:, r * S:(r + 1) * S], batch[:, r * S + 1:(r + 1) * S + 1]
        with sequence_parallel(self.ctx.sequence_group):
            return model(inputs), targets

    def loss(self, model, batch):
        logits, targets = self._forward(model, batch)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
        return loss, targets.numel()  # positions processed (throughput), not only those scored

    def evaluate(self, model, split, max_batches):
        return self._evaluate(model, split, max_batches, None)[0]

    def evaluate_by_position(self, model, split: str, max_batches: int, bins: int) -> tuple[dict, torch.Tensor]:
        """`evaluate`'s metrics with the loss by target position, and the loss of every window by bin.

        The T target positions 0 … T − 1 of a window fall into `bins` near-equal ranges (`position_ranges`);
        metrics["position_bins"] lists each range's start, end (exclusive), tokens and mean loss (nats per
        token). Also returns [W, bins] float64: the mean loss of each of the W evaluated windows in each
        bin, windows in split order, the same on every rank; two models scored here on the same split
        and batches see the same windows row by row.
        """
        ranges = position_ranges(self.cfg.data.seq_len, bins)
        metrics, windows = self._evaluate(model, split, max_batches, ranges)
        widths = torch.tensor([end - start for start, end in ranges], dtype=torch.float64)
        metrics["position_bins"] = [
            {"start": start, "end": end, "tokens": int(width) * len(windows), "loss": float(mean)}
            for (start, end), width, mean in zip(ranges, widths, windows.mean(0), strict=True)]
        return metrics, windows

    def evaluate_by_target(self, model, split: str, max_batches: int) -> tuple[dict, torch.Tensor, torch.Tensor]:
        """`evaluate`'s metrics, the loss of every target (nats) as float64 [W, T] and the windows scored as
        long [W, T + 1] (inputs [:, :-1], targets [:, 1:]), windows in split order, the same on every rank.

        Packed documents are refused: a window's targets would then span documents the model keeps apart,
        and a caller pairing a target with earlier tokens of its window (`piattn.analysis.copy_distance`)
        would pair it across them."""
        sequences = self.sequences(split)
        if sequences.document_ids:
            raise ValueError("per-target losses are not taken from packed documents (--pack-documents): a window "
                             "would mix documents the model keeps apart; evaluate a run trained without it")
        T = self.cfg.data.seq_len
        metrics, losses = self._evaluate(model, split, max_batches, position_ranges(T, T))
        windows = torch.stack([sequences[i] for i in range(len(losses))]) if len(losses) else \
            torch.zeros(0, T + 1, dtype=torch.long)
        return metrics, losses, windows

    def eval_loader(self, split: str) -> SequenceLoader:
        """The windows of `split` in order, this data-parallel replica's share (the ranks of a sequence group
        take the same ones)."""
        return SequenceLoader(self.sequences(split), self.cfg.optim.batch_size, shuffle=False,
                              rank=self.ctx.data_rank, world_size=self.ctx.data_size, drop_last=False)

    def _evaluate(self, model, split, max_batches, ranges: list[tuple[int, int]] | None):
        """(metrics, [W, len(ranges)] per-window mean loss by bin, or None without ranges)."""
        loader = self.eval_loader(split)
        rows: list[torch.Tensor] = []  # this rank's [B, bins] nats sums, batch by batch
        if ranges is not None:
            T = self.cfg.data.seq_len
            bin_of = torch.repeat_interleave(torch.arange(len(ranges)), torch.tensor([e - s for s, e in ranges]))
            shard = T // self.ctx.sequence_parallel
            bin_of = bin_of[self.ctx.sequence_rank * shard:(self.ctx.sequence_rank + 1) * shard].to(self.ctx.device)

        def score(model, batch) -> dict:
            logits, targets = self._forward(model, batch)
            nats = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none",
                                   ignore_index=IGNORE)
            nats = nats.view_as(targets).double()  # [B, S]; 0 at targets that start a packed document
            if ranges is not None:
                rows.append(nats.new_zeros(len(nats), len(ranges)).index_add_(1, bin_of, nats).cpu())
            scored = targets != IGNORE
            return {"nats": nats.sum(), "tokens": scored.sum(), "bytes": self._byte_lengths[targets[scored]].sum()}

        sums, seconds = evaluation_sums(model, loader, max_batches, self.ctx, ("nats", "tokens", "bytes"), score)
        metrics = {**lm_metrics(sums["nats"], int(sums["tokens"]), int(sums["bytes"])),
                   "tokens_per_second": per_second(sums["tokens"], seconds)}
        if ranges is None:
            return metrics, None
        # Every rank took the same number of windows; window p of rank r is window p·R + r of the split
        # (SequenceLoader's sharding). Each rank fills its rows (its positions, under sequence parallelism)
        # of the whole matrix and the sum over ranks assembles it.
        mine = torch.cat(rows) if rows else torch.zeros(0, len(ranges), dtype=torch.float64)
        world, rank = self.ctx.data_size, self.ctx.data_rank
        whole = torch.zeros(len(mine) * world, len(ranges), dtype=torch.float64)
        whole[rank::world] = mine
        whole = torch.tensor(all_reduce_sum(whole.flatten().tolist(), self.ctx), dtype=torch.float64)
        widths = torch.tensor([end - start for start, end in ranges], dtype=torch.float64)
        return metrics, whole.view(-1, len(ranges)) / widths


def position_ranges(seq_len: int, bins: int) -> list[tuple[int, int]]:
    """`bins` near-equal ranges [start, end) covering the target positions 0 … seq_len − 1, in order."""
    if not is_int(bins) or not 1 <= bins <= seq_len:
        raise ValueError(f"--position-bins must be an integer in [1, seq_len={seq_len}], got {bins!r}")
    return [(i * seq_len // bins, (i + 1) * seq_len // bins) for i in range(bins)]


def load_language_model(folder: Path, device: torch.device) -> tuple[GPT, object]:
    """The GPT of a `piattn train` checkpoint folder (eval mode, on `device`) and its tokenizer."""
    config = read_config(folder)
    if config.get("task") != "lm":
        raise ValueError(f"--checkpoint: {folder} holds a {config.get('task')!r} model, not a language model")
    build = functools.partial(GPT, GPTConfig.from_dict(config["model"]))
    check_weight_shapes(folder, build)  # before allocating what config.json asks for
    model = build()
    load_weights(model, folder)
    return model.to(device).eval(), load_tokenizer(folder / TOKENIZER_DIR)
