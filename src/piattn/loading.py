"""`piattn.load`: the model of a `piattn train` run or checkpoint folder, ready to call from Python."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn


class Loaded(NamedTuple):
    """What `load` returns: the model (eval mode), its configuration (a `GPTConfig` for language models,
    the task's model configuration otherwise), the tokenizer (None for tasks without one), the task's
    name and the checkpoint folder read."""

    model: nn.Module
    config: object
    tokenizer: object | None
    task: str
    checkpoint: Path


def load(path: str | Path, device: str | torch.device = "cpu") -> Loaded:
    """The model of a run folder (its latest checkpoint), a `checkpoints/` folder or one checkpoint folder.

    Returns `Loaded(model, config, tokenizer, task, checkpoint)`, a named tuple: the model has its weights,
    is in eval mode and on `device` (default CPU). Unpack it as `model, config, tokenizer, *_ = load(path)`.
    Nothing is written and no data is read. A folder that is not a piattn run or checkpoint, or whose
    files are damaged, raises ValueError in one line naming the path or the file.
    """
    from .tasks import restore  # the tasks import most of piattn: only when something is loaded
    from .train import checkpoint as ckpt
    from .train.distributed import DistContext

    path = Path(path)
    if not path.exists():
        raise ValueError(f"piattn.load: {path} does not exist")
    folder = ckpt.resolve_checkpoint(path, flag="piattn.load")
    task_name = ckpt.read_config(folder).get("task")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"piattn.load: device must be e.g. 'cpu' or 'cuda:0', got {device!r} ({err})") from None
    ctx = DistContext(rank=0, world_size=1, local_rank=0, device=device)
    try:
        task, model, _ = restore(folder, ctx)
    except (KeyError, TypeError) as err:
        raise ValueError(f"piattn.load: {folder} is not a readable piattn checkpoint ({type(err).__name__}: "
                         f"{err})") from None
    return Loaded(model.eval(), task.model_config, getattr(task, "tokenizer", None), str(task_name), folder)
