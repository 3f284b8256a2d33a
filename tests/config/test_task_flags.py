"""A task declares its own flags (`Task.flags`): registered with them, it gets them parsed, checked, scoped to it
and in --help, with nothing else to edit (`piattn.tasks.config_class`, `TrainConfig.of`)."""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import ClassVar

import pytest

from piattn.config import TrainConfig
from piattn.config.flags import Notes, flag, render_notes
from piattn.layers import attention_registry
from piattn.tasks import TASKS, Task, config_class


def registries(tasks) -> dict:
    return {"attention": attention_registry(), "task": tuple(tasks), "tokenizer": ("byte", "bpe"),
            "backend": ("auto",)}


def test_every_task_flag_is_declared_by_the_tasks_that_read_it():
    """Each flag of the configuration with the registered tasks is either a common flag or one the tasks
    listing its class declare; it applies to exactly those tasks."""
    config = config_class()
    common = set(TrainConfig.field_sections)
    owners: dict[str, list[str]] = {}
    for name, task in TASKS.items():
        for flags in task.flags:
            for f in dataclasses.fields(flags):
                owners.setdefault(f.name, []).append(name)
    assert set(config.field_sections) == common | set(owners)
    assert not common & set(owners)
    for cls in config.sections.values():
        for f in dataclasses.fields(cls):
            if f.name in owners:
                assert f.metadata["flag"].applies["task"] == tuple(owners[f.name]), f.name
    assert config_class() is config  # the same tasks, the same class (configurations compare equal)
    assert config().task.task == next(iter(TASKS))


@dataclasses.dataclass
class ToyFlags:
    toy_depth: int | None = flag(None, "toy: nesting depth (default 2)", low=1)


@dataclasses.dataclass
class ToyDataFlags:
    section: ClassVar[str] = "data"
    toy_alphabet: str = flag("ab", "toy: the symbols", applies={"attention": ("pi",)})


class ToyTask(Task):
    """A task only this test registers: its flags, a note on --seq-len, and sequence parallelism."""

    name = "toy"
    flags = (ToyFlags, ToyDataFlags)
    flag_notes = {"seq_len": " 12"}
    capabilities = frozenset({"sequence_parallel"})


def test_a_task_brings_its_own_flags():
    """Registered with its flags in a fresh registry (TASKS untouched): parsed, range-checked, applied to it
    only, in its section's group of --help with its note on --seq-len, and the common flags scoped
    by a capability it has take it."""
    tasks = {**TASKS, "toy": ToyTask}
    config = config_class(tasks)
    parser = argparse.ArgumentParser()
    config.add_arguments(parser, registries(tasks))

    def parse(*argv):
        return config.from_args(parser.parse_args(["--out", "run", *argv]))

    cfg = parse("--task", "toy", "--toy-depth", "3", "--toy-alphabet", "xyz", "--sequence-parallel", "2")
    parsed = parser.parse_args(["--out", "run", "--task", "toy", "--toy-depth", "3"])
    assert TrainConfig.from_args(parsed) == config.from_args(parsed)  # read with the class that parsed them
    assert TrainConfig.given(parsed) == {"out": "run", "task": "toy", "toy_depth": 3}
    assert (cfg.task.toy_depth, cfg.data.toy_alphabet, cfg.run.sequence_parallel) == (3, "xyz", 2)
    cfg.check(registries(tasks))
    assert config.from_flat(cfg.to_flat()) == cfg and "toy_depth" in config.run_defining
    assert "--toy-depth 3" in cfg.describe(registries=registries(tasks))
    assert "--toy-alphabet" not in parse("--task", "lm").describe(registries=registries(tasks))
    for argv, message in (
            (["--toy-depth", "3"], "--toy-depth applies to --task toy only, not 'lm'"),
            (["--task", "reach", "--toy-alphabet", "x"], "--toy-alphabet applies to --task toy only, not 'reach'"),
            (["--task", "toy", "--attention", "dense", "--toy-alphabet", "x"],
             "--toy-alphabet applies to --attention pi only, not 'dense'"),
            (["--task", "toy", "--toy-depth", "0"], "--toy-depth must be >= 1, got 0"),
            (["--task", "toy", "--lag", "3"], "--lag applies to --task reach only, not 'toy'"),
            (["--task", "reach", "--sequence-parallel", "2"],
             "--sequence-parallel applies to --task lm / toy only, not 'reach'")):
        with pytest.raises(ValueError) as err:
            parse(*argv).check(registries(tasks))
        assert str(err.value) == message
    groups = {g.title: {a.dest for a in g._group_actions} for g in parser._action_groups}
    assert "toy_depth" in groups["tasks"] and "toy_alphabet" in groups["data"]
    assert ("reach, recall and mqar 64, vl-retrieval (image-size / patch-size)², the image's patches, pixels and "
            "image-class H × W of the (downsampled) images, toy 12)") in \
        re.sub(r"- (?=[a-z])", "-", " ".join(parser.format_help().split()))  # argparse may wrap at a hyphen
    # the registered tasks and their configuration are untouched
    assert "toy" not in TASKS and not {"toy_depth", "toy_alphabet"} & set(config_class().field_sections)


def test_flags_declared_twice_over_a_common_flag_or_naming_tasks_are_refused():
    @dataclasses.dataclass
    class Twice:
        toy_depth: int | None = flag(None, "again")

    @dataclasses.dataclass
    class Over:
        seq_len: int | None = flag(None, "mine")

    @dataclasses.dataclass
    class Naming:
        toy_width: int | None = flag(None, "scoped by hand", applies={"task": ("lm",)})

    for flags, message in ((Twice, "--toy-depth is declared twice"),
                           (Over, "--seq-len of --task other is a common flag already"),
                           (Naming, "--toy-width of --task other names tasks")):
        other = type("Other", (ToyTask,), {"name": "other", "flags": (flags,)})
        with pytest.raises(ValueError, match=message):
            TrainConfig.of((ToyTask, other))
    stray = type("Stray", (ToyTask,), {"name": "stray", "flag_notes": {"lag": " 3"}})
    with pytest.raises(ValueError, match=r"--task stray has notes for \['lag'\], which take none"):
        TrainConfig.of((stray,))


def test_notes_group_the_tasks_that_give_the_same_one():
    notes = Notes(", ", before=" (default: ", after=")")
    given = [("a", " 1"), ("b", " 64"), ("c", " 2"), ("d", " 64"), ("e", " 64")]
    assert render_notes(notes, given) == " (default: a 1, b, d and e 64, c 2)"
    assert render_notes(notes, []) == ""
