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
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

import piattn

from ..config import PRECISIONS, TrainConfig
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
from .metrics import MetricsWriter, peak_memory_bytes
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


def run_config(cfg: TrainConfig, task: Task, ctx: DistContext) -> dict:
    """The config.json of a checkpoint: task, model config, training settings, world size, versions."""
    return {"task": task.name, "model": task.model_config.to_dict(), "train_args": cfg.to_flat(),
            "world_size": ctx.world_size, "versions": {"piattn": piattn.__version__, "torch": torch.__version__}}


def saved_train_config(checkpoint: Path) -> TrainConfig:
    """The training settings a checkpoint was written with, ValueError naming its config.json if unreadable."""
    try:
        return TrainConfig.from_flat(ckpt.read_config(checkpoint)["train_args"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{checkpoint / ckpt.CONFIG_FILE}: not a piattn training config ({err})") from None


def _check_resumable(cfg: TrainConfig, checkpoint: Path) -> None:
    differing = [f"{flag}: checkpoint {saved!r}, now {now!r}"
                 for flag, saved, now in saved_train_config(checkpoint).differences(cfg)]
    if differing:
        raise ValueError("--resume needs the settings the run started with; these differ: " + "; ".join(differing))


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
        self.run_dir = writable_folder(Path(cfg.run.out), "--out")
        if cfg.data.cache_dir is not None:
            writable_folder(Path(cfg.data.cache_dir), "--cache-dir")
        self.ckpt_root = self.run_dir / "checkpoints"
        if ctx.is_main:
            ckpt.clean_incomplete(self.ckpt_root)
        resume_from = self._resume_point()
        self.amp_dtype = autocast_dtype(cfg.run.precision, ctx.device)
        seed_everything(cfg.optim.seed)
        self.task = build_task(cfg, self.run_dir, ctx, resume_from)
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
        if resume_from is not None:
            self._load_state(ckpt.load_trainer_state(resume_from))
        self.config = run_config(cfg, self.task, ctx)
        self.interrupt = DeferredInterrupt()
        self._updating = False  # inside an optimiser update: the weights are not those of a step boundary

    def _resume_point(self) -> Path | None:
        latest = ckpt.read_latest(self.ckpt_root)
        if not self.cfg.run.resume:
            if latest is not None or ckpt.list_checkpoints(self.ckpt_root):
                raise ValueError(f"--out {self.run_dir} already holds checkpoints; pass --resume to continue "
                                 "that run, or choose another --out")
            return None
        if latest is None:
            return None
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
                "tokens_seen": self.tokens_seen, "wall_seconds": self.wall_seconds}

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
            # DDP all-reduces gradients only on the last micro step; the others accumulate locally.
            with sync_gradients(self.ddp_model, micro == accum - 1):
                with autocast(self.ctx.device, self.amp_dtype):
                    loss, n_tokens = self.task.loss(self.ddp_model, batch)
                (loss / accum).backward()
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

    def run(self) -> dict:
        """Train to `--steps`; returns the last training and validation metrics and the final checkpoint."""
        r, ctx, steps = self.cfg.run, self.ctx, self.cfg.optim.steps
        if ctx.is_main:
            start = f"resumed from {self.resumed_from} at step {self.step}" if self.resumed_from else "fresh start"
            if self.sharded:
                start += "; weights, gradients and optimiser state sharded (FSDP2)"
            elif self.cfg.run.fsdp:
                start += "; --fsdp: one process, nothing to shard"
            print(f"piattn train: {self.task.name}, {sum(p.numel() for p in self.model.parameters()):,} parameters, "
                  f"{ctx.world_size} × {ctx.device}, "
                  f"{self.amp_dtype or torch.float32}; {start}", file=sys.stderr)
        metrics = MetricsWriter(self.run_dir, enabled=ctx.is_main, after_step=self.step)
        bar = tqdm(total=steps, initial=self.step, unit="step", dynamic_ncols=True,
                   disable=not (ctx.is_main and r.progress))
        summary: dict = {}
        boundary = self._boundary()
        wall_start, wall_base = time.perf_counter(), self.wall_seconds
        # Throughput over each logging interval, the time spent evaluating and saving taken out.
        interval_start, interval_tokens, interval_paused = time.perf_counter(), 0, 0.0
        try:
            with self.interrupt:
                while self.step < steps:
                    logging = (self.step + 1) % r.log_every == 0 or self.step + 1 == steps
                    with self.gates.capture(enabled=logging and ctx.is_main):
                        loss, grad_norm, lr, tokens = self._train_step()
                    self.tokens_seen += tokens * ctx.world_size  # every rank takes batches of one shape
                    interval_tokens += tokens * ctx.world_size
                    self.wall_seconds = wall_base + time.perf_counter() - wall_start
                    boundary = self._boundary()
                    self._updating = False
                    bar.update(1)
                    if self.step % r.log_every == 0 or self.step == steps:
                        seconds = time.perf_counter() - interval_start - interval_paused
                        (loss_sum,) = all_reduce_sum([float(loss)], ctx)
                        record = {"loss": loss_sum / ctx.world_size, "grad_norm": float(grad_norm), "lr": lr,
                                  "tokens_per_second": interval_tokens / seconds,
                                  "tokens": self.tokens_seen, "wall_seconds": self.wall_seconds,
                                  "peak_memory_bytes": peak_memory_bytes(ctx.device), **self.gates.summary()}
                        metrics.log(self.step, "train", record)
                        bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_second']:,.0f}")
                        summary["train"] = record
                        interval_start, interval_tokens, interval_paused = time.perf_counter(), 0, 0.0
                    paused_from = time.perf_counter()
                    if r.eval_every and (self.step % r.eval_every == 0 or self.step == steps):
                        result = self.evaluate()
                        metrics.log(self.step, "validation", {**result, "wall_seconds": self.wall_seconds})
                        if ctx.is_main:
                            shown = ", ".join(f"{k} {v:.4f}" for k, v in result.items() if isinstance(v, float))
                            bar.write(f"step {self.step}: validation {shown}", file=sys.stderr)
                        summary["validation"] = result
                    if (r.save_every and self.step % r.save_every == 0) or self.step == steps:
                        summary["checkpoint"] = self._save(boundary, rng_of_all_ranks=True)
                    interval_paused += time.perf_counter() - paused_from
                    self.interrupt.check()
        except BaseException:
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
                except Exception as err:  # the original error matters more than the failed save
                    print(f"piattn train: could not save after the interruption: {err}", file=sys.stderr)
            raise
        finally:
            bar.close()
            metrics.close()
        summary["step"] = self.step
        return summary


def train(cfg: TrainConfig, build_task: TaskFactory, on_micro_step: MicroStepHook | None = None) -> dict:
    """Run a training configuration; `on_micro_step(step, micro)` is called before each micro batch."""
    ctx = setup(cfg.run.device, cfg.run.sequence_parallel)
    try:
        return Trainer(cfg, build_task, ctx, on_micro_step).run()
    finally:
        teardown(ctx)
