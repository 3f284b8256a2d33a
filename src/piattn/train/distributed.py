"""Process layout: one process on CPU or one GPU, or many under `torchrun` (DDP) with the same code.

torchrun sets RANK, WORLD_SIZE and LOCAL_RANK (and MASTER_ADDR/PORT); with WORLD_SIZE > 1 the process group
is started over NCCL on CUDA, Gloo on CPU, and each rank takes GPU LOCAL_RANK.

With sequence parallelism (`--sequence-parallel N`) the world is a 2-D grid, data parallel × sequence
parallel: global rank g is rank g % N of sequence group g // N (N consecutive ranks, on one node when N
divides the GPUs per node), which is data-parallel replica g // N. The ranks of a sequence group take the
same batches, each its contiguous shard of every sequence; the replicas take different batches.

With `--fsdp` the model is not replicated but sharded with FSDP2 (`fully_shard`) over the whole world; the
helpers at the end gather full (unsharded) weights and optimiser state for checkpoints and load them back.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from ..checks import is_int
from ..models.block import Block

DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class DistContext:
    """Where this process runs: rank among world_size processes, and its device.

    sequence_parallel: N, the ranks that share each sequence; sequence_group: their ProcessGroup (None
    when N = 1). See the module docstring for the layout.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    sequence_parallel: int = 1
    sequence_group: object = None

    @property
    def sequence_rank(self) -> int:
        """This rank's place in its sequence group: it holds shard `sequence_rank` of every sequence."""
        return self.rank % self.sequence_parallel

    @property
    def data_rank(self) -> int:
        """This rank's data-parallel replica (its sequence group): what shards the batches."""
        return self.rank // self.sequence_parallel

    @property
    def data_size(self) -> int:
        """How many data-parallel replicas take different batches: world_size / sequence_parallel."""
        return self.world_size // self.sequence_parallel

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


def check_layout(world_size: int, sequence_parallel: int) -> None:
    """ValueError naming --sequence-parallel unless it is a positive divisor of the world size."""
    if not is_int(sequence_parallel) or sequence_parallel < 1:
        raise ValueError(f"--sequence-parallel must be an integer >= 1, got {sequence_parallel!r}")
    if world_size % sequence_parallel:
        raise ValueError(f"--sequence-parallel {sequence_parallel} must divide the number of processes, "
                         f"{world_size} (start a multiple of {sequence_parallel} with torchrun --nproc_per_node)")


def setup(device: str = "auto", sequence_parallel: int = 1) -> DistContext:
    """Read the torchrun environment, start the process group if there are several ranks, pick the device.

    device: "auto" (CUDA when available), "cpu" or "cuda" (or "cuda:N" for a single process).
    sequence_parallel: N ranks per sequence group (must divide the world size; checked before any process
    group starts, so every rank refuses alike).
    """
    rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    check_layout(world_size, sequence_parallel)
    dev = parse_device(device)
    use_cuda = dev.type == "cuda"
    if use_cuda:
        index = dev.index if dev.index is not None and world_size == 1 else local_rank
        torch.cuda.set_device(index)
        dev = torch.device("cuda", index)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world_size)
    group = None
    if sequence_parallel > 1:
        # Every rank creates every group, in the same order (torch.distributed.new_group requires it).
        for first in range(0, world_size, sequence_parallel):
            new = dist.new_group(list(range(first, first + sequence_parallel)))
            if first <= rank < first + sequence_parallel:
                group = new
    return DistContext(rank, world_size, local_rank, dev, sequence_parallel, group)


def teardown(ctx: DistContext) -> None:
    """Leave the process group (if this process started one)."""
    if ctx.distributed and dist.is_initialized():
        dist.destroy_process_group()


def wrap(model: nn.Module, ctx: DistContext, fsdp: bool = False) -> nn.Module:
    """The model the training step calls: DDP over all ranks, or the model itself on one process.

    fsdp: shard it instead with FSDP2 (`shard`), in place; the returned module is `model` itself.
    Ignored on one process, where there is nothing to shard over.

    With sequence parallelism DDP still spans the whole world, and that gives the unsharded gradient.
    Each rank's loss L_r is the mean over its shard's B·S targets. The weights are replicated, and after
    backward (in which the halo exchange sends the gradients of borrowed keys and values back to the
    ranks that own them) the parameter gradients of the N ranks of a sequence group sum to ∇ Σ_r L_r.
    The shards hold equal token counts, so the loss of the whole sequences is (1/N) Σ_r L_r: the group's
    gradient is the sum over the group divided by N. The data-parallel average then divides by the number
    of replicas, so the optimiser needs the mean over all N × replicas ranks: DDP's own all-reduce (mean
    over the world) is exactly that, with no second all-reduce over the sequence group.
    """
    if not ctx.distributed:
        return model
    if fsdp:
        return shard(model, ctx)
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


def shard(model: nn.Module, ctx: DistContext) -> nn.Module:
    """Shard `model` in place with FSDP2 over all world ranks: each transformer `Block`, then the root (which
    takes the rest: embeddings, final norm, the tied head, and so on). Every rank must hold the same weights.

    Over the whole world, with sequence parallelism too, not only over the data-parallel replicas: as for
    DDP (see `wrap`), the gradient the optimiser needs is the mean of the rank gradients over all world
    ranks, and FSDP2's reduce-scatter averages over its mesh, so a mesh of the world gives exactly that
    mean, each rank receiving its shard of it. The sequence groups' halo exchange runs on its own groups
    beside FSDP's all-gathers, in the same order on every rank. Gradients are reduce-scattered after each
    micro batch's backward (a sum of means over grad_accum, as with DDP up to float rounding), so no
    unsharded gradient outlives its backward.
    """
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    for block in [m for m in model.modules() if isinstance(m, Block)]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def is_sharded(model: nn.Module) -> bool:
    """Whether `model` was sharded by `shard` (FSDP2)."""
    return isinstance(model, FSDPModule)


_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict of a sharded model, on the CPU of rank 0 ({} on the others); collective.

    Tied parameters (the LM head's weight is the embedding's) come back as separate copies: they are made
    one tensor again, so that a checkpoint stores them once, as `model.state_dict()` of the plain model.
    """
    state = get_model_state_dict(model, options=_GATHER)
    if state:
        first: dict[int, str] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            kept = first.setdefault(id(param), name)
            if kept != name and name in state:
                state[name] = state[kept]
    return state


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The unsharded state of the optimiser of a sharded model, on the CPU of rank 0 ({} on the others),
    in the format of a plain optimiser's `state_dict()` (parameters numbered in group order), so that a
    process without FSDP loads it; collective."""
    state = get_optimizer_state_dict(model, optimizer, options=_GATHER)
    if not state:
        return {}
    by_index, groups, index = {}, [], 0
    for group in state["param_groups"]:  # parameters named by FQN, in the optimiser's group order
        numbers = []
        for name in group["params"]:
            if name in state["state"]:
                by_index[index] = state["state"][name]
            numbers.append(index)
            index += 1
        groups.append({**group, "params": numbers})
    return {"state": by_index, "param_groups": groups}


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a plain optimiser `state_dict()` (every rank holds the whole of it) into the optimiser of a
    sharded model: each rank keeps its shard of every state tensor."""
    names = {id(p): name for name, p in model.named_parameters()}  # a tied parameter under its first name
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    if len(order) != sum(len(g["params"]) for g in state["param_groups"]):
        raise ValueError("the saved optimiser state holds another number of parameters than the model")
    full = {"state": {order[i]: s for i, s in state["state"].items()},
            "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, full, options=StateDictOptions(full_state_dict=True))
