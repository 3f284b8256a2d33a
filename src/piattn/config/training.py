"""The configuration of a training run: five sections of flags (model, data, task, optim, run).

Every `piattn train` flag is one field of a flags dataclass; `piattn.config.flags` turns the fields into the
argparse arguments, the range checks, the per-task and per-attention scope checks and the `--resume`
comparison. A checkpoint stores the flat field dict (`to_flat`); field names are unique across sections.

The fields below are the common flags, which every configuration has; a flag only some tasks read is
declared by those tasks (the `flags` of a `piattn.train.task.Task`: dataclasses of `flag` fields), and
`TrainConfig.of(tasks)` is the configuration with them, each scoped to the tasks that declare it. This
module names no task. A flag scoped to attention kinds names the capability they need (`Capability`), never
the kinds: the registry of attention kinds (`piattn.layers.registry`) answers which have it; a common flag
that only some tasks take (one the trainer reads: --cache-dir, --sequence-parallel) names a task
capability, which the tasks answer (their `capabilities`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import re
import textwrap
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .flags import (
    Capability,
    Notes,
    Registry,
    add_flags,
    applies,
    check_flags,
    flag,
    flag_fields,
    option_name,
    render_notes,
)
from .model import (
    GLOBAL_KIND,
    PERIOD_SCHEDULES,
    SIZES,
    ModelConfig,
    check_pattern_settings,
    global_every_pattern,
    is_geometry_period,
    pattern_kinds,
)
from .pi import PI_DEFAULTS, VARIANTS

PRECISIONS = ("auto", "fp32", "bf16")


@dataclass
class ModelFlags:
    config: str = flag("tiny", "model size preset (layers, width, heads; small/medium/large are the paper's)",
                       choices=tuple(SIZES), aliases=("--size",))
    attention: str = flag("pi", "attention kind", choices="attention")
    window: int | None = flag(None, "local window k (default: the config's, 4)", low=0,
                              applies={"attention": Capability("window")})
    period: str | None = flag(None, "π, the distance of the long-range key (default 16{notes}); or one per head, "
                              "'8,16,32,64'; or per layer, '5,6,7,8/9,14,19,24'; or a schedule: single[:N], "
                              "geometric[:N] (N, 2N, 4N, ...) or cover[:N] (every lag up to N, default seq-len "
                              "- 1)", applies={"attention": Capability("period")}, notes=Notes("; ", before="; "))
    variant: str | None = flag(None, "π-Attention fusion variant (default adaptive)", choices=VARIANTS,
                               applies={"attention": Capability("variant")})
    prior: float | None = flag(None, "the fixed local prior α of --variant fixed (default 0.5)", above=0, high=1,
                               applies={"attention": Capability("prior"), "variant": ("fixed",)})
    n_layer: int | None = flag(None, "number of layers (default: the --config's)", low=1)
    n_head: int | None = flag(None, "number of heads (default: the --config's)", low=1)
    n_kv_head: int | None = flag(None, "key/value heads, dividing the heads (grouped-query attention; default: as "
                                 "many as heads)", low=1, applies={"attention": Capability("grouped_query")})
    sinks: int | None = flag(None, "sink keys: the first N tokens of each document, seen by every later query "
                             "(default 0)", low=0, applies={"attention": Capability("sinks")})
    radius: int | None = flag(None, "neighbourhood attention's radius: rows and columns each side of a pixel "
                              "(default 1)", low=0, applies={"attention": Capability("radius")})
    stride: int | None = flag(None, "strided attention's stride l (default: the image width)", low=1,
                              applies={"attention": Capability("stride")})
    d_model: int | None = flag(None, "width (default: the --config's)", low=1)
    # The size's own d_ff, also under --d-model: 4 × d-model holds for the named sizes only.
    d_ff: int | None = flag(None, "feed-forward width (default: the --config's, 4 × its width, kept when "
                            "--d-model changes)", low=1)
    backend: str | None = flag(None, "π operator backend (default auto)", choices="backend",
                               applies={"attention": Capability("backend")})
    dropout: float = flag(0.1, "residual, attention and FFN dropout", low=0, below=1)
    layers: str | None = flag(None, "one attention kind per layer, a pattern repeated over depth: 'pi*3,dense' "
                              "(three pi layers, then a dense one; its length divides the layers); each layer takes "
                              "its kind's flags, or its own window, sinks or period in parentheses where its kind "
                              "takes them: 'local(window=1024)*5,dense', 'pi(window=64, period=128)*3,dense' "
                              "(default: --attention in every layer)")
    global_every: int | None = flag(None, "every Nth layer dense, the others --attention (a --layers pattern: "
                                    "'pi*3,dense' for 4; default: no dense layer)", low=1)
    nope_global: bool = flag(False, "no rotary embedding on the dense (global) layers (NoPE)")

    def __post_init__(self):
        if self.period is not None:  # a checkpoint written before --period took text stores an int
            self.period = str(self.period)

    def kinds(self) -> tuple[str, ...]:
        """The attention kinds of the model's layers, each once: --attention, or those of --layers or
        --global-every (ValueError when both are given, or for a malformed pattern)."""
        if self.layers is not None and self.global_every is not None:
            raise ValueError("--layers and --global-every both set the kind of each layer: give one")
        if self.global_every is not None:
            return tuple(dict.fromkeys((self.attention, GLOBAL_KIND)))
        if self.layers is not None:
            return tuple(dict.fromkeys(pattern_kinds(self.layers)))
        return (self.attention,)

    def model_fields(self) -> dict:
        """The `ModelConfig` fields these flags set (every flag named like a field, when given), for
        `ModelConfig.from_name(config, ...)`: a new model flag needs no code here."""
        fields = {f.name for f in dataclasses.fields(ModelConfig)}
        given = {k: v for k, v in dataclasses.asdict(self).items() if k in fields and v is not None}
        if not self.nope_global:  # off unless given, as the model's own default
            given.pop("nope_global", None)
        if self.global_every is not None:
            given["layers"] = global_every_pattern(self.global_every, self.attention)
        if "period" in given:
            given["period"] = parse_period(given["period"])
        return given


# The one message for the numeric syntax of periods, whichever flag reads it.
PERIOD_NUMBERS = "an int >= 1, per-head ints '8,16,32,64' or per-layer '5,6,7,8/9,14,19,24'"


def period_numbers(text: str, flag: str = "--period") -> int | list[int] | list[list[int]]:
    """The numeric syntax of periods, its one home: "16" -> 16, "8,16,32,64" -> one per head, "5,6/9,14" -> per
    layer ('/' between layers). One-line ValueError naming `flag` and the syntax (`PERIOD_NUMBERS`) otherwise."""
    try:
        layers = [[int(p) for p in layer.split(",")] for layer in text.strip().split("/")]
    except ValueError:
        layers = None
    if layers is None or any(p < 1 for layer in layers for p in layer):
        raise ValueError(f"{flag} must be {PERIOD_NUMBERS}, got {text!r}")
    if len(layers) > 1:
        return layers
    return layers[0][0] if len(layers[0]) == 1 else layers[0]


def parse_period(text: str) -> int | list | str:
    """--period's text -> a `ModelConfig.period`: the numeric syntax (`period_numbers`), a schedule name
    ("cover", "geometric:8") as is (`ModelConfig` resolves it, and checks the counts against the model), or a
    word of the image width ("width", "2width", "width-1", "neighbourhood": `geometry_periods`) as is.
    One-line ValueError otherwise."""
    text = text.strip()
    if text.split(":")[0] in PERIOD_SCHEDULES or is_geometry_period(text):
        return text
    try:
        return period_numbers(text)
    except ValueError:
        raise ValueError(f"--period must be {PERIOD_NUMBERS}, a schedule ({', '.join(PERIOD_SCHEDULES)}, "
                         f"optionally ':N'), or for images width, 2width, width-1, width+1, neighbourhood; "
                         f"got {text!r}") from None


def period_text(periods) -> str:
    """Periods in the syntax `piattn train --period` takes, `parse_period`'s inverse: an int (every head), a
    list of ints (one per head, every layer alike: '8,16,32,64') or per-layer lists ('5,6,7,8/9,14,19,24')."""
    layers = np.atleast_2d(np.asarray(periods)).tolist()  # every form as layers of heads: [[16]], [[8, 16]]
    return "/".join(",".join(map(str, heads)) for heads in layers)


@dataclass
class DataFlags:
    # each task says what it reads (its `flag_notes`)
    data: str | None = flag(None, "{notes}", notes=Notes("; "))
    seq_len: int | None = flag(None, "tokens per sequence{notes}", low=1,
                               notes=Notes(", ", before=" (default: ", after=")"))
    cache_dir: str | None = flag(None, "where tokenized corpora are cached (default: OUT/cache)",
                                 defines_run=False, applies={"task": Capability("cache")})


@dataclass
class TaskFlags:
    # the default: the first task of those the configuration is made with (`TrainConfig.of`)
    task: str | None = flag(None, "what to learn", choices="task")


@dataclass
class OptimFlags:
    batch_size: int = flag(8, "sequences per micro batch on each process", low=1)
    grad_accum: int = flag(1, "micro batches per optimiser step", low=1)
    # Not run-defining: --resume may extend a run (the schedule's rule is in the help).
    steps: int = flag(2000, "optimiser steps in the whole run; may change on --resume, which then continues on "
                      "the schedule of the new --steps: warmup, then the cosine from --lr at --warmup to --min-lr "
                      "at the new --steps, so extending a run raises the LR from where the old schedule had it "
                      "(a finished run: from --min-lr) to the new schedule's value at the step reached", low=1,
                      defines_run=False)
    lr: float = flag(3e-4, "peak learning rate", low=0)
    min_lr: float = flag(3e-5, "learning rate at the end of the cosine", low=0)
    warmup: int = flag(100, "linear warmup steps (the paper: 2000 of 200k)", low=0)
    weight_decay: float = flag(0.1, "AdamW decay of Linear weights", low=0)
    clip: float = flag(1.0, "global gradient-norm clip (0: none)", low=0)
    seed: int = flag(0, "seed of initialisation, dropout and data order", low=0)


STOP_AT_FORM = "METRIC>=VALUE or METRIC<=VALUE (accuracy>=0.99, loss<=1.2)"


@dataclass(frozen=True)
class StopAt:
    """A `--stop-at` condition: training stops after the first validation whose `metric` is >= or <= `value`."""

    metric: str  # a number of the task's validation record
    operator: str  # ">=" or "<="
    value: float

    @classmethod
    def parse(cls, text: str) -> StopAt:
        """'accuracy>=0.99' -> StopAt("accuracy", ">=", 0.99); a one-line ValueError naming the flag and the
        accepted form otherwise."""
        match = re.fullmatch(r"\s*([A-Za-z_]\w*)\s*(>=|<=)\s*(\S+)\s*", text)
        try:
            value = float(match[3]) if match else math.nan
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise ValueError(f"--stop-at must be {STOP_AT_FORM}, got {text!r}")
        return cls(match[1], match[2], value)

    def __str__(self) -> str:
        return f"{self.metric}{self.operator}{self.value}"

    def holds(self, value: float) -> bool:
        return value >= self.value if self.operator == ">=" else value <= self.value

    def met(self, value: float) -> str:
        """The condition as met by `value`: 'validation accuracy 0.9912 >= 0.99'."""
        return f"validation {self.metric} {value:.4f} {self.operator} {self.value}"

    def check_metric(self, metrics: Iterable[str], task: str) -> None:
        """ValueError naming the metric and those the validation of `task` reports, unless it is among them."""
        metrics = sorted(metrics)
        if self.metric not in metrics:
            raise ValueError(f"--stop-at {self}: the validation of --task {task} reports no {self.metric!r}; it "
                             f"reports {', '.join(metrics)}")


@dataclass
class RunFlags:
    out: str | None = flag(None, "run directory (checkpoints, metrics.jsonl, tokenizer, cache)", required=True,
                           defines_run=False)
    resume: bool = flag(False, "continue the run in --out from its latest checkpoint, with the settings stored "
                        "there: other flags need not be given; one given again must have its stored value, except "
                        "--steps, --cache-dir and the flags of this group, which may change; an --out without "
                        "checkpoints is an error", defines_run=False)
    eval_every: int = flag(500, "validate every N steps and at the end (0: never)", low=0, defines_run=False)
    eval_batches: int = flag(20, "validation batches per process (0: all)", low=0, defines_run=False)
    save_every: int = flag(1000, "checkpoint every N steps (0: at the end only)", low=0, defines_run=False)
    keep: int = flag(3, "checkpoints to keep", low=1, defines_run=False)
    log_every: int = flag(10, "write training metrics every N steps", low=1, defines_run=False)
    device: str = flag("auto", "auto, cpu, cuda or cuda:N", defines_run=False)
    sequence_parallel: int = flag(1, "ranks that share each sequence (under torchrun), each taking seq-len / N "
                                  "contiguous positions; the world size must be a multiple of N", low=1,
                                  defines_run=False, applies={"task": Capability("sequence_parallel"),
                                                              "attention": Capability("sequence_parallel")})
    fsdp: bool = flag(False, "shard weights, gradients and optimiser state over the processes (FSDP2) "
                      "instead of replicating them (DDP); checkpoints hold the full state as without it; "
                      "nothing to shard on one process", defines_run=False)
    precision: str = flag("auto", "auto (bf16 on capable GPUs), fp32 or bf16", choices=PRECISIONS,
                          defines_run=False)
    progress: bool = flag(True, "progress bar", defines_run=False)
    stop_at: str | None = flag(None, "stop after the first validation (on the --eval-every schedule) that meets "
                               "METRIC>=VALUE or METRIC<=VALUE, a number of the task's validation record "
                               "('accuracy>=0.99', 'loss<=1.2'): that step is checkpointed, summary.json gets "
                               "stopped_at and the run ends as at its last step; the LR schedule stays that of "
                               "--steps (nothing is rescaled); a stopped run resumed with the same condition trains "
                               "no further; needs --eval-every > 0 (default: none, train every step)",
                               defines_run=False)

    def stop_condition(self) -> StopAt | None:
        """--stop-at parsed (None when not given); ValueError for a malformed one, or one with no validation to
        check it on."""
        if self.stop_at is None:
            return None
        condition = StopAt.parse(self.stop_at)
        if not self.eval_every:
            raise ValueError(f"--stop-at {condition} needs --eval-every > 0: the condition is checked on the "
                             "validations, and with --eval-every 0 the run never validates")
        return condition


SECTIONS = {"model": ModelFlags, "data": DataFlags, "task": TaskFlags, "optim": OptimFlags, "run": RunFlags}
GROUP_TITLES = {"model": "model", "data": "data", "task": "tasks", "optim": "optimisation (paper defaults)",
                "run": "run (may change on --resume)"}


class DeclaresFlags(Protocol):
    """What `TrainConfig.of` reads of a task (a `piattn.train.task.Task` class).

    name: the --task value. flags: dataclasses of `flag` fields, the flags only the tasks that list the class
    read (a class variable `section` names the section they join, default "task"). flag_notes: {field: note}
    for the common flags that take notes (`Notes`), the note read after the task's name ("seq_len": " 64" ->
    "NAME 64"). capabilities: the names of the task capabilities it has, which scope common flags
    (`applies={"task": Capability(name)}`).
    """

    name: str
    flags: tuple[type, ...]
    flag_notes: Mapping[str, str]
    capabilities: Iterable[str]


@dataclass
class TrainConfig:
    """Every setting of a training run, by section. Build with `from_args`, `from_flat` or keywords.

    This class has the common flags only; `TrainConfig.of(tasks)` is the class with those the tasks declare
    too (what `piattn train` parses, `piattn.tasks.config_class()`).
    """

    model: ModelFlags = dataclasses.field(default_factory=ModelFlags)
    data: DataFlags = dataclasses.field(default_factory=DataFlags)
    task: TaskFlags = dataclasses.field(default_factory=TaskFlags)
    optim: OptimFlags = dataclasses.field(default_factory=OptimFlags)
    run: RunFlags = dataclasses.field(default_factory=RunFlags)

    # Class attributes, not fields: the flags dataclass of each section, the tasks whose flags they hold
    # (none here; `of`), the section of each field, the fields that define a run.
    sections = SECTIONS
    tasks = ()
    field_sections = {f.name: section for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    run_defining = tuple(f.name for cls in SECTIONS.values() for f, meta in flag_fields(cls) if meta.defines_run)

    @classmethod
    def of(cls, tasks: Iterable[DeclaresFlags]) -> type[TrainConfig]:
        """The configuration class with the flags these tasks declare, in their order: each flag a task lists
        applies to the tasks that list its class, the flags scoped by a task capability to the tasks that have
        it, the notes of the tasks fill the help of the flags that take notes, and the first task is --task's
        default. The same tasks give the same class. ValueError for a flag declared twice or over a common
        flag, a note no flag takes, or an unknown section."""
        return _configuration(tuple(tasks))

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, registries: Mapping[str, Iterable] | None = None
                      ) -> dict[str, argparse._ArgumentGroup]:
        """One argument group per section (returned by section name); `registries` as in `check`, for the
        choices --help lists. A flag not given is absent from the parsed namespace (`given`); the namespace
        records this class, whose flags `from_args` and `given` then read."""
        groups = {section: parser.add_argument_group(GROUP_TITLES[section]) for section in cls.sections}
        for section, flags in cls.sections.items():
            add_flags(groups[section], flags, registries)
        parser.set_defaults(**{_PARSED_BY: cls})
        return groups

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TrainConfig:
        """The parsed flags, the defaults for those not given: a configuration of the class that added the
        arguments (`add_arguments`) when it has this one's flags and more (the tasks' own, `of`)."""
        return cls._parsed_by(args).from_flat(cls.given(args))

    @classmethod
    def given(cls, args: argparse.Namespace) -> dict:
        """{field: value} of the flags given on the command line (those not given are absent from `args`),
        those of the class that added the arguments included."""
        return {k: v for k, v in vars(args).items() if k in cls._parsed_by(args).field_sections}

    @classmethod
    def _parsed_by(cls, args: argparse.Namespace) -> type[TrainConfig]:
        parser_class = getattr(args, _PARSED_BY, None)
        return parser_class if isinstance(parser_class, type) and issubclass(parser_class, cls) else cls

    @classmethod
    def from_flat(cls, values: Mapping) -> TrainConfig:
        """From a flat {field: value} dict (a checkpoint's `train_args`); missing fields take defaults,
        unknown ones are a ValueError naming them."""
        unknown = sorted(set(values) - set(cls.field_sections))
        if unknown:
            raise ValueError(f"unknown training settings {unknown}")
        parts = {section: {} for section in cls.sections}
        for name, value in values.items():
            parts[cls.field_sections[name]][name] = value
        return cls(**{section: cls.sections[section](**kw) for section, kw in parts.items()})

    def to_flat(self) -> dict:
        return {name: value for section in self.sections
                for name, value in dataclasses.asdict(getattr(self, section)).items()}

    def check(self, registries: Mapping[str, Iterable] | None = None) -> None:
        """ValueError naming the flag for any value out of range, not a choice, or given where it is ignored.

        registries: the allowed names of "attention", "task", "tokenizer" and "backend", known above here; the
        attention kinds as a `flags.Registry` that also says which kinds have a capability.
        """
        flat = self.to_flat()
        kinds = self.model.kinds()
        # A flag scoped to attention kinds applies to a hybrid stack when one of its kinds takes it.
        context = {**flat, "variant": flat["variant"] or PI_DEFAULTS.variant,
                   "attention": kinds[0] if len(kinds) == 1 else kinds}
        for section in self.sections:
            check_flags(getattr(self, section), registries, context)
        self.run.stop_condition()
        names = (registries or {}).get("attention")
        unknown = [kind for kind in kinds if names is not None and kind not in tuple(names)]
        if unknown:
            raise ValueError(f"--layers kinds must be among {sorted(names)}, got {unknown[0]!r}")
        if isinstance(names, Registry) and names.having is not None:  # the kinds that take each setting
            check_pattern_settings(self.model.layers, names.having)

    def differences(self, other: TrainConfig) -> list[tuple[str, object, object]]:
        """(flag, my value, other's value) for each run-defining flag whose values differ."""
        mine, theirs = self.to_flat(), other.to_flat()
        return [(option_name(name), mine[name], theirs[name]) for name in self.run_defining
                if mine[name] != theirs[name]]

    def resumed_with(self, given: Mapping) -> TrainConfig:
        """This stored configuration of a run, continued with the flags `given` ({field: value}) by `--resume`.

        A run-defining flag given again must have the stored value (ValueError naming each that differs,
        stored vs given); the others (`--steps`, `--cache-dir`, the run section) take the given value.
        """
        stored = self.to_flat()
        differing = [f"{option_name(name)}: stored {stored[name]!r}, given {value!r}"
                     for name, value in given.items() if name in self.run_defining and value != stored[name]]
        if differing:
            raise ValueError("--resume continues the run with its stored settings; these differ: "
                             + "; ".join(differing) + " (drop them, or start a new run in another --out)")
        return type(self).from_flat({**stored, **given, "resume": True})

    def warnings(self) -> list[str]:
        """Settings that are allowed but probably not meant, one line each."""
        o = self.optim
        if o.warmup >= o.steps:
            return [f"--warmup {o.warmup} >= --steps {o.steps}: the learning rate never reaches the end of its "
                    f"warmup ramp (peak --lr {o.lr:g}) and the cosine decay never starts; lower --warmup"]
        return []

    def describe(self, model: Mapping | None = None, width: int = 110, registries: Mapping | None = None) -> str:
        """The settings as one compact block, a line per section of `--flag value` pairs (flags left to the
        task or model config omitted; `model`: the built model's config, whose values fill in the model
        flags left to it that apply to this attention kind; `registries` as in `check`)."""
        context = {**self.to_flat(), **({"variant": model.get("variant")} if model else {})}
        lines = []
        for section, cls in self.sections.items():
            pairs = []
            for f, meta in flag_fields(cls):
                value = getattr(getattr(self, section), f.name)
                if value is None and model is not None and f.name in model and applies(meta, context, registries):
                    value = model[f.name]
                if (value is None or (value is False and f.default is False) or f.name == "resume"
                        or not applies(meta, context, registries)):
                    continue
                if isinstance(value, bool):
                    pairs.append(option_name(f.name) if value else f"--no-{f.name.replace('_', '-')}")
                else:
                    pairs.append(f"{option_name(f.name)} {value}")
            # no-break spaces inside a pair: lines break between pairs only
            text = textwrap.fill(", ".join(p.replace(" ", "\xa0") for p in pairs), width,
                                 initial_indent=f"  {section:<6} ", subsequent_indent=" " * 9, break_on_hyphens=False)
            lines.append(text.replace("\xa0", " "))
        return "\n".join(lines)


RUN_DEFINING = TrainConfig.run_defining
_PARSED_BY = "_train_config"  # the namespace attribute that holds the class that added the arguments


def _field(name: str, hint, default, meta) -> tuple:
    """A make_dataclass field spec of a flag."""
    return name, hint, dataclasses.field(default=default, metadata={"flag": meta})


@functools.cache
def _configuration(tasks: tuple[DeclaresFlags, ...]) -> type[TrainConfig]:
    """`TrainConfig.of`, one class per tuple of tasks."""
    common = TrainConfig.field_sections
    taking = {f.name for cls in SECTIONS.values() for f, meta in flag_fields(cls) if meta.notes is not None}
    declared: dict[str, dict[str, tuple]] = {section: {} for section in SECTIONS}  # name -> (class, field, flag, tasks)
    for task in tasks:
        for flags in task.flags:
            section = getattr(flags, "section", "task")
            if section not in SECTIONS:
                raise ValueError(f"{flags.__qualname__} of --task {task.name}: no section {section!r}, one of "
                                 f"{list(SECTIONS)}")
            for f, meta in flag_fields(flags):
                if f.name in common:
                    raise ValueError(f"{option_name(f.name)} of --task {task.name} is a common flag already")
                if "task" in (meta.applies or {}):
                    raise ValueError(f"{option_name(f.name)} of --task {task.name} names tasks: it applies to "
                                     "those that list its class")
                entry = declared[section].setdefault(f.name, (flags, f, meta, []))
                if entry[0] is not flags:
                    raise ValueError(f"{option_name(f.name)} is declared twice: in {entry[0].__qualname__} and in "
                                     f"{flags.__qualname__} (--task {task.name})")
                if task.name not in entry[3]:
                    entry[3].append(task.name)
        stray = sorted(set(task.flag_notes) - taking)
        if stray:
            raise ValueError(f"--task {task.name} has notes for {stray}, which take none (those that do: "
                             f"{sorted(taking)})")
    sections = {}
    for section, base in SECTIONS.items():
        hints = typing.get_type_hints(base)
        fields = []
        for f, meta in flag_fields(base):
            bound = meta
            if meta.notes is not None:
                given = [(t.name, t.flag_notes[f.name]) for t in tasks if f.name in t.flag_notes]
                notes = render_notes(meta.notes, given)
                bound = dataclasses.replace(bound, help=meta.help.replace("{notes}", notes))
            scope = (meta.applies or {}).get("task")
            if isinstance(scope, Capability):
                having = tuple(t.name for t in tasks if scope.name in t.capabilities)
                bound = dataclasses.replace(bound, applies={**meta.applies, "task": having})
            default = (tasks[0].name if tasks else None) if f.name == "task" else f.default
            if bound is not meta or default != f.default:  # in its place among the common flags
                fields.append(_field(f.name, hints[f.name], default, bound))
        for name, (flags, f, meta, owners) in declared[section].items():
            scoped = dataclasses.replace(meta, applies={"task": tuple(owners), **(meta.applies or {})})
            fields.append(_field(name, typing.get_type_hints(flags)[name], f.default, scoped))
        sections[section] = base
        if fields:
            sections[section] = dataclasses.make_dataclass(base.__name__, fields, bases=(base,))
            sections[section].__module__ = __name__
    names = {f.name: section for section, cls in sections.items() for f in dataclasses.fields(cls)}
    configuration = dataclasses.make_dataclass(
        "TrainConfig", [(section, cls, dataclasses.field(default_factory=cls)) for section, cls in sections.items()],
        bases=(TrainConfig,),
        namespace={"sections": sections, "tasks": tasks, "field_sections": names,
                   "run_defining": tuple(f.name for cls in sections.values() for f, meta in flag_fields(cls)
                                         if meta.defines_run),
                   "__doc__": TrainConfig.__doc__})
    configuration.__module__ = __name__
    return configuration
