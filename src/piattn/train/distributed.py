"""Process layout: one process on CPU or one GPU, or many under `torchrun` (DDP) with the same code.

torchrun sets RANK, WORLD_SIZE and LOCAL_RANK (and MASTER_ADDR/PORT); with WORLD_SIZE > 1 the process group
is started over NCCL on CUDA, Gloo on CPU, and each rank takes GPU LOCAL_RANK.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class DistContext:
    """Where this process runs: rank among world_size processes, and its device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Rank 0: the only rank that writes files and prints."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, str(default))
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {value!r}") from None


def parse_device(device: str) -> torch.device:
    """The device a `--device` flag names: "auto" (CUDA when available), "cpu", "cuda" or "cuda:N".

    ValueError naming the flag for anything else, and for CUDA on a machine that has none (or not N + 1).
    """
    index = None
    if isinstance(device, str) and device.startswith("cuda:") and device[5:].isdigit():
        index = int(device[5:])
    elif device not in DEVICES:
        raise ValueError(f"--device must be one of {list(DEVICES)} or cuda:N, got {device!r}")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {device} asked for CUDA, which this machine does not have; use cpu or auto")
    if index is not None and index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return torch.device("cuda", index)


def setup(device: str = "auto") -> DistContext:
    """Read the torchrun environment, start the process group if there are several ranks, pick the device.

    device: "auto" (CUDA when available), "cpu" or "cuda" (or "cuda:N" for a single process).
    """
    rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    dev = parse_device(device)
    use_cuda = dev.type == "cuda"
    if use_cuda:
        index = dev.index if dev.index is not None and world_size == 1 else local_rank
        torch.cuda.set_device(index)
        dev = torch.device("cuda", index)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world_size)
    return DistContext(rank, world_size, local_rank, dev)


def teardown(ctx: DistContext) -> None:
    """Leave the process group (if this process started one)."""
    if ctx.distributed and dist.is_initialized():
        dist.destroy_process_group()


def wrap(model: nn.Module, ctx: DistContext) -> nn.Module:
    """The model the training step calls: DDP over all ranks, or the model itself on one process."""
    if not ctx.distributed:
        return model
    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids)


def sync_gradients(model: nn.Module, sync: bool):
    """Context for one micro step's backward: DDP all-reduces gradients only when `sync` (the last micro step)."""
    if sync or not isinstance(model, nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext()
    return model.no_sync()


def all_reduce_sum(values: list[float], ctx: DistContext) -> list[float]:
    """Sum each value over all ranks (identity on one process); fp64 so token counts stay exact."""
    if not ctx.distributed:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t)
    return t.tolist()


def barrier(ctx: DistContext) -> None:
    """Wait for every rank (no-op on one process)."""
    if ctx.distributed:
        dist.barrier()
