"""What a run learns: one file per task family, one registry of `--task` names, `TASKS`.

    lm            language modelling on packed text (lm.py)
    listops, pathfinder, retrieval
                  the Long Range Arena classifiers (lra.py, on classification.py)
    reach         recall the token a fixed lag back (reach.py; reach_setting.py: the demo's small size)
    recall        recall the value after a marker, at a lag drawn per example (recall.py)
    mqar          multi-query associative recall, scored by key–query distance and pairs (mqar.py)
    vl-retrieval  image-text retrieval with a CLIP dual encoder, Recall@K (vl_retrieval.py, ranking.py)
    pixels        next-pixel modelling of raster-scanned grayscale images, bits/dim (pixels.py, raster.py)
    image-class   whole-image classification of raster-scanned images, sequential MNIST (image_class.py)

Every task implements `piattn.train.task.Task`, the interface the trainer uses, and declares the flags only
it reads (`Task.flags`): `config_class()` is the training configuration with the flags of every task
registered here. A new task is its module and its line in `TASKS`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

from torch import nn

from ..config import TrainConfig
from ..train import checkpoint as ckpt
from ..train.distributed import DistContext
from ..train.loop import saved_train_config, writable_folder
from ..train.task import Task
from .image_class import ImageClassTask
from .lm import LanguageModelTask
from .lra import ListOpsTask, PathfinderTask, RetrievalTask
from .mqar import MQARTask
from .pixels import PixelsTask
from .reach import ReachTask
from .recall import RecallTask
from .vl_retrieval import VisionLanguageTask

# In this order the flags of several tasks list them ("--train-size applies to --task listops / pathfinder / …")
# and the help their notes; the first is --task's default.
TASKS: dict[str, type[Task]] = {
    task.name: task for task in (LanguageModelTask, ListOpsTask, PathfinderTask, RetrievalTask, ReachTask,
                                 VisionLanguageTask, RecallTask, MQARTask, PixelsTask, ImageClassTask)}


def config_class(tasks: Mapping[str, type[Task]] | None = None) -> type[TrainConfig]:
    """The training configuration with the flags `tasks` declare (default: the registered ones, `TASKS`):
    `TrainConfig.of`, what `piattn train` parses and a checkpoint's settings are read with."""
    return TrainConfig.of((TASKS if tasks is None else tasks).values())


def task_class(name: str) -> type[Task]:
    """The Task class registered under `name` (the `--task` flag)."""
    if name not in TASKS:
        raise ValueError(f"--task must be one of {sorted(TASKS)}, got {name!r}")
    return TASKS[name]


def restore(folder: Path, ctx: DistContext, *, data: str | None = None, batch_size: int | None = None,
            cache_dir: str | None = None) -> tuple[Task, nn.Module, TrainConfig]:
    """The task, model (weights loaded, on ctx.device) and training settings of a checkpoint folder, for
    scoring or inspecting it: `data` and `batch_size` replace the recorded ones when given.

    Files go only where the user says: tokenized text to `cache_dir` or the run directory's cache/,
    never to a folder the checkpoint's config names.
    """
    cfg = saved_train_config(folder, config_class())
    if cache_dir is not None:
        writable_folder(Path(cache_dir), "--cache-dir")
    cfg = dataclasses.replace(
        cfg, run=dataclasses.replace(cfg.run, progress=False),
        data=dataclasses.replace(cfg.data, data=data or cfg.data.data, cache_dir=cache_dir),
        optim=dataclasses.replace(cfg.optim, batch_size=batch_size or cfg.optim.batch_size))
    task = task_class(ckpt.read_config(folder).get("task")).from_config(cfg, ckpt.run_dir_of(folder), ctx,
                                                                         checkpoint=folder)
    # config.json is checked against the weights' header first: an edited config cannot allocate more
    ckpt.check_weight_shapes(folder, task.build_model)
    model = task.build_model()
    ckpt.load_weights(model, folder)
    return task, model.to(ctx.device), cfg


__all__ = ["TASKS", "ImageClassTask", "LanguageModelTask", "ListOpsTask", "MQARTask", "PathfinderTask", "PixelsTask",
           "ReachTask", "RecallTask", "RetrievalTask", "Task", "VisionLanguageTask", "config_class", "restore",
           "task_class"]
