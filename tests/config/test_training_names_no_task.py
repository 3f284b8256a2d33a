"""The training configuration names no task: a task's flags, its notes on the help of the common flags and its
capabilities live with the task (`piattn.train.task.Task.flags`), so a new task edits nothing here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import piattn.config.training as training
from piattn.config import TrainConfig
from piattn.tasks import TASKS

SOURCE = Path(training.__file__)


def test_the_training_configuration_names_no_task():
    """No scope tuple of task names, no task name in a string, a comment or a default: a task's flags, notes
    and capabilities live with the task."""
    text = SOURCE.read_text(encoding="utf-8")
    named = sorted({name for name in TASKS if re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text)})
    assert not named, f"{SOURCE.name} names the tasks {named}"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.keyword) and node.arg == "applies" and isinstance(node.value, ast.Dict):
            for key, value in zip(node.value.keys, node.value.values, strict=True):
                if isinstance(key, ast.Constant) and key.value == "task":
                    assert not isinstance(value, (ast.Tuple, ast.List)), \
                        f"line {node.lineno}: a flag scoped to named tasks"
    assert TrainConfig().task.task is None  # --task's default is the first task of a configuration
