"""What a run learns: one file per task family, one registry of `--task` names.

    lm            language modelling on packed text (lm.py)
    listops, pathfinder, retrieval
                  the Long Range Arena classifiers (lra.py, on classification.py)
    reach         recall the token a fixed lag back (reach.py)
    vl-retrieval  image-text retrieval with a CLIP dual encoder, Recall@K (vl_retrieval.py, ranking.py)

Every task implements `piattn.train.task.Task`, the interface the trainer uses.
"""

from __future__ import annotations

from ..train.task import Task
from .lm import LanguageModelTask
from .lra import ListOpsTask, PathfinderTask, RetrievalTask
from .reach import ReachTask
from .vl_retrieval import VisionLanguageTask

TASKS: dict[str, type[Task]] = {
    task.name: task for task in (LanguageModelTask, ListOpsTask, PathfinderTask, RetrievalTask, ReachTask,
                                 VisionLanguageTask)}


def task_class(name: str) -> type[Task]:
    """The Task class registered under `name` (the `--task` flag)."""
    if name not in TASKS:
        raise ValueError(f"--task must be one of {sorted(TASKS)}, got {name!r}")
    return TASKS[name]


__all__ = ["TASKS", "LanguageModelTask", "ListOpsTask", "PathfinderTask", "ReachTask", "RetrievalTask", "Task",
           "VisionLanguageTask", "task_class"]
