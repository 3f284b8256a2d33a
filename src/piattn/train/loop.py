"""The training loop: micro steps with gradient accumulation, clipping, AdamW, logging, evaluation, checkpoints.

One optimiser step takes `grad_accum` micro batches of `batch_size` sequences on each of `world_size`
ranks. Everything a step depends on (weights, optimiser and scheduler state, loader position, every random
generator) is in its checkpoint, so a resumed run repeats the uninterrupted one exactly on the same machine.
Ctrl-C is deferred to the next safe point (between micro batches, or once a step is complete) so that
what is saved is always the state of a step boundary; a second Ctrl-C stops at once. When the loop is left
by an exception or Ctrl-C, rank 0 first saves the state at the last completed step (unless the stop came
in the middle of an optimiser update, whose half-written weights must not be saved). With `--fsdp` saving
gathers the sharded state from every rank, so after an exception nothing is saved (a rank stuck in a
collective would make the save hang); the message names the latest checkpoint instead.
On logging steps the records also carry the gate statistics of gated π layers (`train/gates.py`),
captured from that step's own forward passes.

A diverging run stops (`Diverged`, a one-line error naming the step, the loss and what to lower) and never
saves non-finite state, so `--keep` cannot rotate the last finite checkpoint away. The losses and gradient
norms of the steps are checked together, without a device sync per step, on logging steps, before each
evaluation, and (with the weights) before each save; when the loop is left by an error or Ctrl-C the same
check decides whether the state may be saved (a NaN weight in a gated layer surfaces first as the gate
check's error, which is then reported as the divergence it is).

`--stop-at` ends a run early, as if its last step: at the first validation whose record meets the condition
the step is checkpointed, with the stop's summary in its trainer state, so that a resumed run with the same
condition trains no further and returns that summary. Rank 0's decision holds on every rank.
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from tqdm import tqdm

import piattn

from .. import safe_files
from ..config import PRECISIONS, TrainConfig
from ..layers import attention_registry
from ..progress import progress_bar
from ..safe_files import link_refusal
from . import checkpoint as ckpt
from .distributed import (
    DistContext,
    all_reduce_sum,
    full_model_state,
    full_optimizer_state,
    is_sharded,
    load_optimizer_state,
    setup,
    sync_gradients,
    teardown,
    wrap,
)
from .gates import GateMonitor
from .metrics import MetricsWriter, peak_memory_bytes, plot_metrics
from .optim import build_optimizer, clip_gradients, warmup_cosine
from .task import Task

MicroStepHook = Callable[[int, int], None]
# (config, run directory, process context, checkpoint to resume from or None) -> the run's Task
TaskFactory = Callable[[TrainConfig, Path, DistContext, "Path | None"], Task]


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of `--precision` on `device`: bf16, or None for plain fp32.

    auto: bf16 on a CUDA device that supports it, fp32 otherwise (CPU included).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"--precision must be one of {list(PRECISIONS)}, got {precision!r}")
    bf16_ok = device.type == "cpu" or torch.cuda.is_bf16_supported()
    if precision == "bf16" and not bf16_ok:
        raise ValueError(f"--precision bf16 is not supported on {torch.cuda.get_device_name(device)}; use fp32")
    if precision == "bf16" or (precision == "auto" and device.type == "cuda" and bf16_ok):
        return torch.bfloat16
    return None


def autocast(device: torch.device, dtype: torch.dtype | None):
    """Mixed-precision context for forward passes (nothing for fp32)."""
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's (CPU and every CUDA device) global generators."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter (the local shard of an FSDP2 DTensor, else the tensor itself)."""
    return p.to_local() if isinstance(p, DTensor) else p


def run_config(cfg: TrainConfig, task: Task, ctx: DistContext) -> dict:
    """The config.json of a checkpoint: task, model config, training settings, world size, versions."""
    return {"task": task.name, "model": task.model_config.to_dict(), "train_args": cfg.to_flat(),
            "world_size": ctx.world_size, "versions": {"piattn": piattn.__version__, "torch": torch.__version__}}


def saved_train_config(checkpoint: Path, config: type[TrainConfig]) -> TrainConfig:
    """The training settings a checkpoint was written with, read as a `config` (the configuration class with
    the flags of the tasks: `piattn.tasks.config_class()`, or a run's `type(cfg)`); ValueError naming its
    config.json if unreadable."""
    try:
        return config.from_flat(ckpt.read_config(checkpoint)["train_args"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{checkpoint / ckpt.CONFIG_FILE}: not a piattn training config ({err})") from None


def _check_resumable(cfg: TrainConfig, checkpoint: Path) -> None:
    differing = [f"{flag}: stored {saved!r}, given {now!r}"
                 for flag, saved, now in saved_train_config(checkpoint, type(cfg)).differences(cfg)]
    if differing:
        raise ValueError("--resume needs the settings the run started with; these differ: " + "; ".join(differing))


def _latest_to_resume(out: Path) -> Path:
    """The checkpoint `--resume` continues from in run directory `out`; ValueError when there is none."""
    latest = ckpt.read_latest(out / "checkpoints")
    if latest is None:
        raise ValueError(f"--resume: no run to continue in --out {out} (no checkpoints/latest there); drop "
                         "--resume to start a new run")
    return latest


def resumed_config(cfg: TrainConfig, given: Mapping) -> TrainConfig:
    """What `piattn train --resume` runs: the settings stored in the latest checkpoint of `cfg.run.out`, with
    the flags the user gave (`given`, {field: value}) where they may change (`TrainConfig.resumed_with`).

    ValueError when --out holds no checkpoint, or a flag that defines the run is given another value.
    """
    out = Path(cfg.run.out)
    return saved_train_config(_latest_to_resume(out), type(cfg)).resumed_with({**given, "out": cfg.run.out})


class Diverged(ValueError):
    """The loss, the gradient norm or the weights stopped being finite; nothing of that state was saved.

    A ValueError, so that `piattn` reports it as its one-line error with a non-zero exit status.
    """


def writable_folder(path: Path, flag: str) -> Path:
    """`path` if this process can write there: an existing folder, or one it can create (not created here,
    so that a run refused later leaves nothing behind); ValueError naming the flag otherwise."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path} is a file, not a folder")
    existing = next(p for p in (path, *path.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"{flag} {path}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: {existing} is not writable")
    return path


class DeferredInterrupt:
    """While active, the first Ctrl-C (SIGINT) only sets `requested`; the loop stops at its next safe point.

    A second Ctrl-C raises KeyboardInterrupt at once. Outside the main thread (where no handler can be
    set) it does nothing.
    """

    def __init__(self):
        self.requested = False
        self._previous = None

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\npiattn train: stopping after this step (Ctrl-C again to stop at once)", file=sys.stderr)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        return False

    def check(self) -> None:
        """Raise KeyboardInterrupt here if a stop was asked for: call only where the state is consistent."""
        if self.requested:
            raise KeyboardInterrupt


class Trainer:
    """One training run in `cfg.run.out`, fresh or resumed from its latest checkpoint."""

    def __init__(self, cfg: TrainConfig, build_task: TaskFactory, ctx: DistContext,
                 on_micro_step: MicroStepHook | None = None):
        self.cfg, self.ctx, self.on_micro_step = cfg, ctx, on_micro_step
        self.stop_at = cfg.run.stop_condition()  # --stop-at, parsed once (None without it)
        self.run_dir = writable_folder(Path(cfg.run.out), "--out")
        if cfg.data.cache_dir is not None:
            writable_folder(Path(cfg.data.cache_dir), "--cache-dir")
        elif (self.run_dir / "cache").is_symlink():  # a run folder made elsewhere would send the cache there
            raise link_refusal(self.run_dir / "cache", "training", "--cache-dir DIR")
        self.ckpt_root = ckpt.checkpoint_root(self.run_dir)
        if ctx.is_main:
            ckpt.clean_incomplete(self.ckpt_root)
        resume_from = self._resume_point()
        self.amp_dtype = autocast_dtype(cfg.run.precision, ctx.device)
        seed_everything(cfg.optim.seed)
        self.task = build_task(cfg, self.run_dir, ctx, resume_from)
        if self.stop_at is not None and self.task.validation_metrics:  # else checked at the first validation
            self.stop_at.check_metric(self.task.validation_metrics, self.task.name)
        self.model = self.task.build_model().to(ctx.device)
        if resume_from is not None:
            ckpt.load_weights(self.model, resume_from)
        if ctx.rank:  # the same initial weights everywhere (DDP broadcasts rank 0's), different dropout masks
            seed_everything(cfg.optim.seed + ctx.rank)
        # FSDP2 shards self.model in place (each rank keeps its shard of the weights every rank built alike).
        self.ddp_model = wrap(self.model, ctx, fsdp=cfg.run.fsdp)
        self.sharded = is_sharded(self.model)
        self.gates = GateMonitor(self.model)  # α statistics of the gated π layers, on logging steps only
        o = cfg.optim
        self.optimizer = build_optimizer(self.model, o.lr, o.weight_decay)
        self.scheduler = warmup_cosine(self.optimizer, peak=o.lr, minimum=o.min_lr, warmup=o.warmup, total=o.steps)
        self.loader = self.task.train_loader()
        self.step, self.tokens_seen, self.wall_seconds = 0, 0, 0.0
        self.resumed_from = resume_from
        self.schedule_note: str | None = None
        # the evaluation of the checkpoint's step was cut short (a second Ctrl-C): run it before training on
        self.evaluation_owed = False
        # the summary of the --stop-at stop at the checkpoint resumed from, when this run's condition is that one
        self.resumed_stop: dict | None = None
        # (step, loss, gradient norm, lr) of the steps since the last finiteness check (`_check_finite`)
        self._unchecked: list[tuple[int, torch.Tensor, torch.Tensor, float]] = []
        self._batch_in_flight = None
        if resume_from is not None:
            self._load_state(ckpt.load_trainer_state(resume_from))
        self.config = run_config(cfg, self.task, ctx)
        self.interrupt = DeferredInterrupt()
        self._updating = False  # inside an optimiser update: the weights are not those of a step boundary

    def _resume_point(self) -> Path | None:
        if not self.cfg.run.resume:
            if ckpt.read_latest(self.ckpt_root) is not None or ckpt.list_checkpoints(self.ckpt_root):
                raise ValueError(f"--out {self.run_dir} already holds checkpoints; pass --resume to continue "
                                 "that run, or choose another --out")
            return None
        latest = _latest_to_resume(self.run_dir)
        _check_resumable(self.cfg, latest)
        return latest

    def _load_state(self, state: dict) -> None:
        # The ranks of a sequence group share batches: only the data-parallel size shapes a step's batches.
        saved_replicas = state.get("data_parallel", state["world_size"])
        if saved_replicas != self.ctx.data_size:
            raise ValueError(f"--resume: the run was saved with {saved_replicas} data-parallel replica(s) (world "
                             f"size / --sequence-parallel), this one has {self.ctx.data_size}, so the batches of "
                             f"a step would differ; resume on {saved_replicas} × --sequence-parallel processes")
        if self.sharded:  # every rank read the full state; each keeps its shard
            load_optimizer_state(self.model, self.optimizer, state["optimizer"])
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        steps, stored_steps = self.cfg.optim.steps, saved_train_config(self.resumed_from, type(self.cfg)).optim.steps
        if state["step"] > steps:
            raise ValueError(f"--steps {steps}: the run is at step {state['step']} already; give --steps >= "
                             f"{state['step']} (a larger value extends the run)")
        if steps != stored_steps:
            # The schedule is a function of (step, --steps): the step's LR is that of the new schedule, not
            # the one the stored optimiser state carries from the old (see --steps in `piattn train --help`).
            for group, factor, base in zip(self.optimizer.param_groups, self.scheduler.lr_lambdas,
                                           self.scheduler.base_lrs, strict=True):
                group["lr"] = base * factor(state["step"])
            self.schedule_note = (f"--steps {stored_steps} -> {steps}: the LR of step {state['step'] + 1} is "
                                  f"{self.optimizer.param_groups[0]['lr']:.3g} on the new schedule")
        self.evaluation_owed = bool(state.get("evaluation_owed", False))
        stopped = state.get("stopped")
        # stopped there by --stop-at: with the same condition the run is over, with another it trains on
        if stopped is not None and self.stop_at is not None and stopped["stopped_at"]["condition"] == str(self.stop_at):
            self.resumed_stop = stopped
        try:
            self.loader.load_state_dict(state["loader"])
        except ValueError as err:
            raise ValueError(f"--resume: the data loader cannot continue ({err})") from None
        self.step, self.tokens_seen, self.wall_seconds = state["step"], state["tokens_seen"], state["wall_seconds"]
        rngs = state["rng"]
        if len(rngs) == self.ctx.world_size:
            ckpt.restore_rng(rngs[self.ctx.rank])
        elif self.ctx.is_main:  # a checkpoint written after a failure holds rank 0's generators only
            ckpt.restore_rng(rngs[0])
        else:  # fresh, still distinct per rank (not a bit-exact continuation)
            seed_everything(self.cfg.optim.seed + self.ctx.rank + self.ctx.world_size * self.step)

    def _boundary(self) -> dict:
        """What, beyond weights and optimiser, the state after the last completed step consists of."""
        return {"step": self.step, "loader": self.loader.state_dict(), "rng": ckpt.capture_rng(),
                "tokens_seen": self.tokens_seen, "wall_seconds": self.wall_seconds, "evaluation_owed": False}

    def _save(self, boundary: dict, rng_of_all_ranks: bool) -> Path | None:
        """Rank 0 writes the checkpoint of `boundary`; with `rng_of_all_ranks`, or a sharded model, every rank
        must call this (a sharded model's full weights and optimiser state are gathered onto rank 0)."""
        model_state = optimizer_state = None
        if self.sharded:
            model_state, optimizer_state = full_model_state(self.model), full_optimizer_state(self.model,
                                                                                               self.optimizer)
        rngs = [boundary["rng"]]
        if rng_of_all_ranks and self.ctx.distributed:
            # As bytes: all_gather_object cannot carry the tensors inside an RNG state (torch 2.13).
            buffer = io.BytesIO()
            torch.save(boundary["rng"], buffer)
            gathered = [None] * self.ctx.world_size
            dist.all_gather_object(gathered, buffer.getvalue())
            rngs = [torch.load(io.BytesIO(b), weights_only=True) for b in gathered]
        if not self.ctx.is_main:
            return None
        if optimizer_state is None:
            optimizer_state = self.optimizer.state_dict()
        state = {**boundary, "rng": rngs, "optimizer": optimizer_state,
                 "scheduler": self.scheduler.state_dict(), "world_size": self.ctx.world_size,
                 "data_parallel": self.ctx.data_size}
        return ckpt.save_checkpoint(self.ckpt_root, boundary["step"], model=self.model, model_state=model_state,
                                    trainer_state=state,
                                    config={**self.config, "step": boundary["step"]},
                                    save_assets=self.task.save_assets, keep=self.cfg.run.keep)

    def _train_step(self) -> tuple[torch.Tensor, torch.Tensor, float, int]:
        """One optimiser step over grad_accum micro batches.

        Returns (mean loss, grad norm before clipping, the LR used, tokens this rank processed).
        """
        accum = self.cfg.optim.grad_accum
        total, tokens = torch.zeros((), device=self.ctx.device), 0
        for micro in range(accum):
            self.interrupt.check()  # weights and optimiser are still those of the last boundary
            if self.on_micro_step is not None:
                self.on_micro_step(self.step, micro)
            batch = self.loader.next_batch()
            self._batch_in_flight = batch  # kept if the forward or backward fails: `_nonfinite_module` reruns it
            # DDP all-reduces gradients only on the last micro step; the others accumulate locally.
            with sync_gradients(self.ddp_model, micro == accum - 1):
                with autocast(self.ctx.device, self.amp_dtype):
                    loss, n_tokens = self.task.loss(self.ddp_model, batch)
                (loss / accum).backward()
            self._batch_in_flight = None
            total += loss.detach()
            tokens += n_tokens
        grad_norm = clip_gradients(self.model.parameters(), self.cfg.optim.clip)
        lr = self.optimizer.param_groups[0]["lr"]
        self._updating = True
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return total / accum, grad_norm, lr, tokens

    def evaluate(self, split: str = "validation") -> dict:
        """Metrics of the current model on `split` (`--eval-batches` batches per rank)."""
        with autocast(self.ctx.device, self.amp_dtype):
            return self.task.evaluate(self.model, split, self.cfg.run.eval_batches)

    def _nonfinite(self, weights: bool, collective: bool) -> str | None:
        """What went non-finite first: the loss or gradient norm of a step since the last check or, with
        `weights`, the weights now; as the message of `Diverged`, or None when all is finite. One host sync;
        the checked steps are forgotten.

        collective: decide together with the other ranks (one all-reduce: every rank must call it at the same
        point), so that they all stop; without it this rank's values only (where a rank may be stuck).
        """
        unchecked, self._unchecked = self._unchecked, []
        what = self._first_nonfinite(unchecked, weights, collective)
        return None if what is None else self._diverged(what)

    def _first_nonfinite(self, unchecked: list, weights: bool, collective: bool) -> str | None:
        """`_nonfinite`'s finding, as "the loss is not finite at step …" or the like."""
        device = self.ctx.device
        bad = torch.zeros(0, dtype=torch.bool, device=device)
        if unchecked:
            values = torch.stack([torch.stack([loss.float(), norm.float()]) for _, loss, norm, _ in unchecked])
            bad = (~torch.isfinite(values)).any(1)
        weights_bad = torch.zeros(1, dtype=torch.bool, device=device)
        if weights:
            weights_bad = ~torch.stack([torch.isfinite(_local(p)).all() for p in self.model.parameters()]).all()
        flags = torch.cat([bad, weights_bad.reshape(1)]).double()
        if collective and self.ctx.distributed:
            dist.all_reduce(flags)
        flags = flags.tolist()
        if not any(flags):
            return None
        first = next((i for i, flag in enumerate(flags[:-1]) if flag), None)
        if first is None:
            return f"the weights are not finite after step {self.step}"
        step, loss, norm, lr = unchecked[first]
        loss, norm = float(loss), float(norm)
        name = ("the loss" if not math.isfinite(loss) else "the gradient norm" if not math.isfinite(norm)
                else "the loss of another process")
        return f"{name} is not finite at step {step} (loss {loss:.4g}, gradient norm {norm:.4g}, lr {lr:.3g})"

    def _nonfinite_module(self, batch) -> str | None:
        """The first module whose output holds a NaN or ±inf when `batch` runs through the model again, or
        None: whether an error raised inside a training forward came from values that had diverged (a gate
        check meeting NaN gates, say) rather than from a defect. Only after a failure (a sync per module)."""
        found: list[str] = []

        def check(name, module, args, output):
            outputs = output if isinstance(output, (tuple, list)) else (output,)
            if not found and any(torch.is_tensor(t) and t.is_floating_point() and not bool(torch.isfinite(t).all())
                                 for t in outputs):
                found.append(name)

        handles = [m.register_forward_hook(functools.partial(check, name or "the model"))
                   for name, m in self.model.named_modules()]
        try:
            with torch.no_grad(), autocast(self.ctx.device, self.amp_dtype):
                self.task.loss(self.model, batch)
        except Exception:  # the failure being explained: what matters is what the modules gave before it
            pass
        finally:
            for handle in handles:
                handle.remove()
        return found[0] if found else None

    def _diverged(self, what: str) -> str:
        """The message of `Diverged`: what went non-finite, what is kept, what to change."""
        try:
            latest = ckpt.read_latest(self.ckpt_root)
        except ValueError:  # a damaged pointer has its own error at the next start; say what is known
            latest = None
        kept = (f"the latest checkpoint, {latest}, holds the last finite weights" if latest is not None
                else "no checkpoint had been saved")
        o = self.cfg.optim
        return (f"training diverged: {what}; stopped without saving that state ({kept}); lower --lr (now "
                f"{o.lr:g}) or raise --warmup (now {o.warmup}) and start a new run in another --out")

    def _check_finite(self, weights: bool = False) -> None:
        """Raise `Diverged` unless the steps since the last check (and, with `weights`, the weights) are
        finite; every rank calls it at the same points."""
        message = self._nonfinite(weights, collective=True)
        if message is not None:
            raise Diverged(message)

    def _validate(self, metrics: MetricsWriter, bar: tqdm, summary: dict) -> None:
        """Evaluate, log the record at the current step and show it."""
        result = self.evaluate()
        metrics.log(self.step, "validation", {**result, "wall_seconds": self.wall_seconds})
        if self.ctx.is_main:
            shown = ", ".join(f"{k} {v:.4f}" for k, v in result.items() if isinstance(v, float))
            bar.write(f"step {self.step}: validation {shown}", file=sys.stderr)
        summary["validation"] = result

    def _announce(self) -> None:
        """The start: what runs where, the settings as one block, warnings about them."""
        ctx = self.ctx
        start = f"resumed from {self.resumed_from} at step {self.step}" if self.resumed_from else "fresh start"
        if self.sharded:
            start += "; weights, gradients and optimiser state sharded (FSDP2)"
        elif self.cfg.run.fsdp:
            start += "; --fsdp: one process, nothing to shard"
        n = torch.get_num_threads()
        threads = (f" ({n} CPU thread{'s' if n > 1 else ''}{' each' if ctx.world_size > 1 else ''})"
                   if ctx.device.type == "cpu" else "")
        print(f"piattn train: {self.task.name}, {sum(p.numel() for p in self.model.parameters()):,} parameters, "
              f"{ctx.world_size} × {ctx.device}{threads}, {self.amp_dtype or torch.float32}; {start}\n"
              f"{self.cfg.describe(self.task.model_config.to_dict(), registries={'attention': attention_registry()})}",
              file=sys.stderr)
        for line in ([self.schedule_note] if self.schedule_note else []) + self.cfg.warnings():
            print(f"piattn train: {'note' if line is self.schedule_note else 'warning'}: {line}", file=sys.stderr)
        done = self._nothing_to_train()
        if done is not None:
            print(f"piattn train: {done}", file=sys.stderr)
        owner = safe_files.foreign_owner(self.run_dir) if self.resumed_from else None
        if owner is not None:
            print(f"piattn train: warning: the run folder {self.run_dir} belongs to {owner}, not to you; the "
                  "checkpoint and settings it resumes from are theirs", file=sys.stderr)

    def _nothing_to_train(self) -> str | None:
        """Why this run trains no further (--stop-at stopped it at the checkpoint resumed from, or it is at
        --steps already), or None."""
        if self.resumed_stop is not None:
            value = self.resumed_stop["stopped_at"]["value"]
            return (f"the run stopped at step {self.step} already: {self.stop_at.met(value)} (--stop-at); nothing "
                    "to train (another --stop-at trains on)")
        if self.step >= self.cfg.optim.steps:
            return (f"the run is at step {self.step} of --steps {self.cfg.optim.steps} already; nothing to train (a "
                    "larger --steps extends it)")
        return None

    def _plot(self) -> None:
        """RUN/metrics.png from metrics.jsonl (rank 0), or a line saying why there is none."""
        try:
            path = plot_metrics(self.run_dir)
        except ImportError:
            print("piattn train: no metrics.png: matplotlib is not installed (pip install matplotlib)",
                  file=sys.stderr)
        except Exception as err:  # the figure is a view of metrics.jsonl: never worth the run's own outcome
            print(f"piattn train: could not draw metrics.png: {type(err).__name__}: {err}", file=sys.stderr)
        else:
            if path is not None:
                print(f"piattn train: curves in {path}", file=sys.stderr)

    def run(self) -> dict:
        """Train to `--steps` (or to the validation that meets --stop-at); returns the last training and
        validation metrics, the final checkpoint and, stopped by --stop-at, `stopped_at`."""
        r, ctx, steps = self.cfg.run, self.ctx, self.cfg.optim.steps
        if ctx.is_main:
            self._announce()
        p = _Progress(metrics=MetricsWriter(self.run_dir, enabled=ctx.is_main, after_step=self.step),
                      bar=progress_bar(steps, desc="train", unit="step", initial=self.step,
                                       enabled=ctx.is_main and r.progress),
                      boundary=self._boundary(), wall_base=self.wall_seconds)
        try:
            with self.interrupt:
                self._continue_resumed(p)
                while self.step < steps and not p.stopped:
                    loss, grad_norm, lr = self._one_step(p)
                    if self.step % r.log_every == 0 or self.step == steps:
                        self._log_train(p, loss, grad_norm, lr)
                    self._evaluate_and_save(p)
                    self.interrupt.check()
        except Diverged:
            raise  # checked on every rank alike; nothing of that state may be saved
        except BaseException as err:
            self._on_stop(err, p.boundary)
            raise
        finally:
            p.bar.close()
            p.metrics.close()
            if ctx.is_main:
                self._plot()
        p.summary["step"] = self.step
        return p.summary

    def _continue_resumed(self, p: _Progress) -> None:
        """Before a resumed run's next step: the evaluation its checkpoint owes (and the --stop-at it may meet);
        with nothing left to train (at --steps, or stopped by --stop-at), that checkpoint is the run's result."""
        if self.resumed_from is None:
            return
        if self.resumed_stop is not None:
            p.summary.update(self.resumed_stop)  # the summary the run that stopped returned
        elif self.evaluation_owed and self.cfg.run.eval_every:
            self._validate_owed(p)
            # A stop met here is not written into the checkpoint (one of this step exists): the next resume
            # owes the evaluation again and stops again.
            self._check_stop(p)
        if p.stopped or self.step >= self.cfg.optim.steps:
            p.summary["checkpoint"] = self.resumed_from

    def _one_step(self, p: _Progress) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One optimiser step (the gates captured on a logging step), counted: tokens, wall time, the boundary
        saved if the loop is left before the next, the bar; (loss, gradient norm, lr) of the step."""
        ctx, steps = self.ctx, self.cfg.optim.steps
        logging = (self.step + 1) % self.cfg.run.log_every == 0 or self.step + 1 == steps
        with self.gates.capture(enabled=logging and ctx.is_main):
            loss, grad_norm, lr, tokens = self._train_step()
        self._unchecked.append((self.step, loss, grad_norm, lr))
        self.tokens_seen += tokens * ctx.world_size  # every rank takes batches of one shape
        p.interval_tokens += tokens * ctx.world_size
        self.wall_seconds = p.wall_base + time.perf_counter() - p.wall_start
        p.boundary = self._boundary()
        self._updating = False
        p.bar.update(1)
        return loss, grad_norm, lr

    def _log_train(self, p: _Progress, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float) -> None:
        """The training record of a logging step (after the finiteness check), with the throughput of the
        interval since the last one; the interval starts over."""
        ctx = self.ctx
        self._check_finite()  # before the record: metrics.jsonl holds finite numbers only
        seconds = time.perf_counter() - p.interval_start - p.interval_paused
        (loss_sum,) = all_reduce_sum([float(loss)], ctx)
        record = {"loss": loss_sum / ctx.world_size, "grad_norm": float(grad_norm), "lr": lr,
                  "tokens_per_second": p.interval_tokens / seconds,
                  "tokens": self.tokens_seen, "wall_seconds": self.wall_seconds,
                  "peak_memory_bytes": peak_memory_bytes(ctx.device), **self.gates.summary()}
        p.metrics.log(self.step, "train", record)
        p.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_second']:,.0f}")
        p.summary["train"] = record
        p.interval_start, p.interval_tokens, p.interval_paused = time.perf_counter(), 0, 0.0

    def _evaluate_and_save(self, p: _Progress) -> None:
        """The periodic evaluation and checkpoint of the step just done (each on its --eval-every /
        --save-every, and both on the last step; the checkpoint also where --stop-at stops the run), their time
        taken out of the interval's throughput."""
        r, steps = self.cfg.run, self.cfg.optim.steps
        paused_from = time.perf_counter()
        if r.eval_every and (self.step % r.eval_every == 0 or self.step == steps):
            self._check_finite()
            self._validate_owed(p)
            self._check_stop(p)
        if p.stopped or (r.save_every and self.step % r.save_every == 0) or self.step == steps:
            self._check_finite(weights=True)  # never a checkpoint of non-finite state
            p.summary["checkpoint"] = self._save(p.boundary, rng_of_all_ranks=True)
        p.interval_paused += time.perf_counter() - paused_from

    def _validate_owed(self, p: _Progress) -> None:
        """`_validate`, the boundary marked as owing it meanwhile: saved with the step if a second Ctrl-C cuts
        the evaluation short, so the resumed run evaluates first and the record of this step is not lost."""
        p.boundary["evaluation_owed"] = True
        self._validate(p.metrics, p.bar, p.summary)
        p.boundary["evaluation_owed"] = False

    def _check_stop(self, p: _Progress) -> None:
        """After a validation: when its record meets --stop-at, the run stops at this step (`p.stopped`): the
        summary gets `stopped_at`, the boundary the summary (a resumed run then knows it stopped), and rank 0
        says so in one line."""
        if self.stop_at is None:
            return
        value = self._stop_value(p.summary["validation"])
        # The tasks reduce their metrics over the ranks (or compute them alike on each), but one computed on
        # each rank could differ in its last bit: rank 0's decision, which its summary records, holds on all.
        (held,) = all_reduce_sum([float(self.ctx.is_main and self.stop_at.holds(value))], self.ctx)
        if not held:
            return
        p.summary["stopped_at"] = {"step": self.step, "metric": self.stop_at.metric, "value": value,
                                   "condition": str(self.stop_at)}
        p.boundary["stopped"] = {k: p.summary[k] for k in ("train", "validation", "stopped_at") if k in p.summary}
        if self.ctx.is_main:
            p.bar.write(f"stopped at step {self.step}: {self.stop_at.met(value)} (--stop-at)", file=sys.stderr)

    def _stop_value(self, record: dict) -> float:
        """--stop-at's metric in a validation record; ValueError naming the numbers the record has when none
        has that name (the same on every rank: the records have the same keys)."""
        numbers = [k for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
        self.stop_at.check_metric(numbers, self.task.name)
        return float(record[self.stop_at.metric])

    def _on_stop(self, err: BaseException, boundary: dict) -> None:
        """The loop was left by `err` (an error or Ctrl-C; not `Diverged`): `Diverged` instead if the state is
        not finite (nothing saved), else rank 0 saves `boundary`, the last completed step, where that is safe
        (or says why not). The caller raises `err` after."""
        ctx = self.ctx
        try:
            diverged = self._nonfinite(weights=True, collective=False)
            # never with sharded weights or sequences: that forward would wait for the other ranks
            if (diverged is None and isinstance(err, Exception) and self._batch_in_flight is not None
                    and not self.sharded and self.cfg.run.sequence_parallel == 1):
                module = self._nonfinite_module(self._batch_in_flight)
                if module is not None:
                    diverged = self._diverged(
                        f"the forward pass of step {self.step + 1} gave non-finite values (first in {module}) "
                        f"and then failed ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})")
        except Exception:  # the device itself failed: the save below, if tried, reports that
            diverged = None
        if diverged is not None:
            if isinstance(err, Exception):  # e.g. the gate check's error on NaN weights: say what it is
                raise Diverged(diverged) from err
            if ctx.is_main:
                print(f"piattn train: not saved: {diverged}", file=sys.stderr)
            return
        # Only rank 0 writes, from its own state: other ranks may be stuck in a collective by now.
        if ctx.is_main and self.sharded:
            print(f"piattn train: stopped; not saved (with --fsdp a save gathers from every rank, which "
                  f"could hang now); the latest checkpoint is {ckpt.read_latest(self.ckpt_root)}",
                  file=sys.stderr)
        elif ctx.is_main and self._updating:
            print(f"piattn train: stopped inside an optimiser update, not saved; the latest checkpoint "
                  f"is {ckpt.read_latest(self.ckpt_root)}", file=sys.stderr)
        elif ctx.is_main and boundary["step"] > 0:
            try:
                path = self._save(boundary, rng_of_all_ranks=False)
                print(f"piattn train: interrupted; saved step {boundary['step']} to {path}", file=sys.stderr)
            except Exception as save_err:  # the original error matters more than the failed save
                print(f"piattn train: could not save after the interruption: {save_err}", file=sys.stderr)


@dataclass
class _Progress:
    """What one call of `Trainer.run` carries from step to step."""

    metrics: MetricsWriter
    bar: tqdm
    boundary: dict  # the state of the last completed step: what an interruption saves (`Trainer._boundary`)
    wall_base: float  # the run's wall seconds before this call (a resumed run's), counted on from wall_start
    wall_start: float = field(default_factory=time.perf_counter)
    summary: dict = field(default_factory=dict)  # what `run` returns
    # Throughput over each logging interval, the time spent evaluating and saving taken out.
    interval_start: float = field(default_factory=time.perf_counter)
    interval_tokens: int = 0
    interval_paused: float = 0.0

    @property
    def stopped(self) -> bool:
        """Whether --stop-at stopped the run (at a validation of this call, or at the checkpoint resumed from)."""
        return "stopped_at" in self.summary


def train(cfg: TrainConfig, build_task: TaskFactory, on_micro_step: MicroStepHook | None = None) -> dict:
    """Run a training configuration; `on_micro_step(step, micro)` is called before each micro batch."""
    ctx = setup(cfg.run.device, cfg.run.sequence_parallel)
    try:
        return Trainer(cfg, build_task, ctx, on_micro_step).run()
    finally:
        teardown(ctx)
