"""What the trainer trains: the `Task` interface, and the evaluation loop every task shares.

The trainer (`train.loop`) knows nothing of language modelling or classification: it asks a Task for a
model, a resumable loader of training batches and the loss of a batch. Tasks implement this interface in
`piattn.tasks`, one file per family.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import ClassVar, Protocol

import torch
from torch import nn

from ..config import ModelConfig, TrainConfig
from .distributed import DistContext, all_reduce_sum


class BatchLoader(Protocol):
    """Batches forever, resumable: `state_dict()` after k batches + `load_state_dict` gives batch k + 1 next."""

    def next_batch(self): ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class EvalLoader(Protocol):
    """Batches of one pass over a split (`batches_per_epoch` of them)."""

    batches_per_epoch: int

    def next_batch(self): ...


class Task(ABC):
    """One training objective: a model, its training batches, the loss of a batch, metrics of a split.

    `name` is the task's registry name (the `--task` flag); `model_config` is saved in every checkpoint.

    The task declares its own flags (`TrainConfig.of` reads them): `flags`, dataclasses of
    `piattn.config.flags.flag` fields, each field one flag that applies to the tasks listing its class (a class
    variable `section` puts them in another section than "task": "data", "run", ...); `flag_notes`, what it
    adds to the help of a common flag that takes notes ({"seq_len": " 64"} reads "... mqar 64"; "data":
    what its --data takes); `capabilities`, the task capabilities that common flags are scoped by
    ("sequence_parallel": its batches can be split along the sequence; "cache": it caches what it derives
    from --data under --cache-dir; "raster": its sequences are raster-scanned images whose width its model
    config records, `image_width`, so `--period width` and the other words of the width resolve).

    The task declares its report too (what `piattn eval` shows, `commands.eval`, `commands.eval_report`, which
    name no task): `report_sections`, the tables after the main metrics; `by_position`, whether it scores
    by target position (--position-bins, --compare, --by-copy-distance); `planned_batches`, the model calls of an
    evaluation (the progress bar's total); and for a task scored by lag, what its reachability marks need
    (`reach_carries`, `lags_needed`, `sinks_note`).
    """

    name: ClassVar[str]
    flags: ClassVar[tuple[type, ...]] = ()
    flag_notes: ClassVar[Mapping[str, str]] = {}
    capabilities: ClassVar[frozenset[str]] = frozenset()
    # The tables `piattn eval` prints after the main metrics, by the names `commands.eval_report.SECTIONS` gives
    # them: "lags" (accuracy by lag), "distances" (MQAR: by key–query distance, then by number of pairs),
    # "row bands" (bits/dim by row band and by the pixel above), "classes" (accuracy by class).
    report_sections: ClassVar[tuple[str, ...]] = ()
    # `evaluate_by_position` and `evaluate_by_target` exist: --position-bins, --compare, --by-copy-distance apply.
    by_position: ClassVar[bool] = False
    # A task scored by lag: what the query must reach to answer, in the legend of the reachability marks.
    reach_carries: ClassVar[str] = "the answer"
    # The numbers every record of its `evaluate` holds, so that --stop-at's metric is checked before training;
    # empty: not declared, the metric is then checked against the first validation's record.
    validation_metrics: ClassVar[tuple[str, ...]] = ()

    @classmethod
    @abstractmethod
    def from_config(cls, cfg: TrainConfig, run_dir: Path, ctx: DistContext, checkpoint: Path | None = None) -> Task:
        """The task of a run: built fresh from `cfg` (checking its task flags; files it makes go under
        `run_dir`, written by rank 0 only), or, with `checkpoint`, with the model config and fitted assets
        (a tokenizer) of that checkpoint folder."""

    @classmethod
    @abstractmethod
    def resolve_seq_len(cls, cfg: TrainConfig) -> int:
        """The sequence length of a run that does not give --seq-len."""

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

    def eval_loader(self, split: str) -> EvalLoader | None:
        """The loader `evaluate` takes this rank's batches of `split` from, None for a task that has none."""
        return None

    def planned_batches(self, split: str, max_batches: int) -> int | None:
        """How many model calls (batches) this rank's `evaluate(model, split, max_batches)` makes, for a
        progress bar: those of `eval_loader`; None when not known (the bar then counts without a total)."""
        loader = self.eval_loader(split)
        if loader is None:
            return None
        n = loader.batches_per_epoch
        return n if max_batches <= 0 else min(max_batches, n)

    @classmethod
    def lags_needed(cls, cfg: TrainConfig, lags: list[int]) -> dict[int, tuple[int, ...]]:
        """A task scored by lag: {lag: the other lags the query must reach as well to answer at that lag} (the
        reach task: none)."""
        return {lag: () for lag in lags}

    @classmethod
    def sinks_note(cls, sinks: int) -> str | None:
        """A task scored by lag: None when the query is a sequence's last position, so that a lag reaching one
        of the first `sinks` positions is marked reachable; else what the legend says of the sinks instead."""
        return None


def evaluation_sums(model: nn.Module, loader: EvalLoader, max_batches: int, ctx: DistContext, keys: tuple[str, ...],
                    score: Callable[[nn.Module, object], dict[str, float]]) -> tuple[dict[str, float], float]:
    """Sum `score(model, batch)`, a dict of the numbers `keys`, over the batches of `loader`, on every rank.

    At most `max_batches` batches per rank (0: one whole pass); the model runs in eval mode without
    gradients and gets its mode back. Returns (the sums over all ranks, seconds taken). The keys are
    fixed up front so that every rank all-reduces the same list, even one left without a batch.
    """
    n_batches = loader.batches_per_epoch if max_batches <= 0 else min(max_batches, loader.batches_per_epoch)
    was_training = model.training
    model.eval()
    sums = dict.fromkeys(keys, 0.0)
    start = time.perf_counter()
    try:
        with torch.no_grad():
            for _ in range(n_batches):
                for key, value in score(model, loader.next_batch()).items():
                    sums[key] += float(value)
    finally:
        model.train(was_training)
    totals = dict(zip(keys, all_reduce_sum([sums[k] for k in keys], ctx), strict=True))
    return totals, time.perf_counter() - start


def per_second(count: float, seconds: float) -> float:
    return count / seconds if seconds > 0 else float("inf")
