"""Command-line flags generated from dataclass fields: one field declares a flag, its range and its scope.

A field of a flags dataclass carries a `Flag` in its metadata (made with `flag(...)`). From it come the
argparse argument (name, type, help, boolean style), the range and choice checks, the rule that a flag
given to a task or attention kind that ignores it is an error, and whether the flag defines a run (so
that `--resume` with another value is refused). Adding a flag is adding one field.

A flag's scope may name a capability instead of listing values: `applies={"attention": Capability("documents")}`.
The registry of that field's values lives above the configuration: the caller passes it in `registries`, as a
`Registry` whose `having` answers which values have a capability (asked at each check, so a kind registered
later is covered). Nothing is lent to this module at import.

A flag's help may take notes from the values of another field (`Notes`): `--seq-len`'s default, say, is each
task's own, and each task says it; whoever knows those values renders them into the help (`render_notes`).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Flag:
    """What a field means on the command line.

    help: the help text. low / high: inclusive bounds of a number (checked when the value is not None).
    above / below: exclusive bounds. choices: the allowed values, or the name of a registry the caller passes
    to `check` (its keys are only known above the config, e.g. the attention kinds). applies: field name ->
    values of that field under which this flag means something ({"tokenizer": ("bpe",)}), or a `Capability`
    those values must have ({"attention": Capability("documents")}); given elsewhere it is an error.
    defines_run: a resumed run must have the same value. required: no default. notes: how the help takes the
    notes others add to it (`Notes`), in place of `{notes}` in `help`. aliases: more option names for the same
    flag (the field's own name stays the one stored and reported).
    """

    help: str
    low: float | None = None
    high: float | None = None
    above: float | None = None
    below: float | None = None
    choices: tuple | str | None = None
    applies: Mapping[str, tuple | Capability] | None = None
    defines_run: bool = True
    required: bool = False
    notes: Notes | None = None
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class Notes:
    """Where a flag's help takes the notes of others (the tasks' own defaults of `--seq-len`, say): `{notes}` in
    its help becomes `before`, the notes joined by `between`, then `after`, or nothing when there are none."""

    between: str
    before: str = ""
    after: str = ""


def render_notes(notes: Notes, given: Iterable[tuple[str, str]]) -> str:
    """The notes of (name, note) pairs as `Notes` places them: each note after the names that gave it, names
    giving the same note together ("a, b and c 64") where the first of them stands."""
    names_of: dict[str, list[str]] = {}
    for name, note in given:
        names_of.setdefault(note, []).append(name)
    if not names_of:
        return ""
    parts = [(", ".join(names[:-1]) + " and " if len(names) > 1 else "") + names[-1] + note
             for note, names in names_of.items()]
    return notes.before + notes.between.join(parts) + notes.after


def flag(default=None, help: str = "", **kwargs):
    """A dataclass field with a `Flag` (keyword arguments as in `Flag`)."""
    return dataclasses.field(default=default, metadata={"flag": Flag(help, **kwargs)})


def option_name(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class Capability:
    """The values of a field that can do `name` (e.g. the attention kinds with "documents"), as the registry
    answering for that field says when a flag is checked (`answer_capabilities`)."""

    name: str


@dataclass(frozen=True)
class Registry:
    """What the code above the configuration knows of a field's values: their names and, for flags scoped by a
    `Capability`, which of them have one (`having(capability)` -> names). A plain tuple of names stands for a
    registry without capabilities wherever `registries` is taken."""

    names: tuple
    having: Callable[[str], Iterable] | None = None

    def __iter__(self):
        return iter(self.names)


def allowed_values(field: str, allowed: tuple | Capability, registries: Mapping | None) -> tuple:
    """The values of `field` a flag scoped by `allowed` applies to: the tuple itself, or for a `Capability` the
    answer of the field's `Registry` in `registries` (LookupError when none is given: nothing is assumed)."""
    if not isinstance(allowed, Capability):
        return allowed
    registry = (registries or {}).get(field)
    if not isinstance(registry, Registry) or registry.having is None:
        raise LookupError(f"no registry says which {option_name(field)} values have {allowed.name!r}: pass "
                          f"registries={{{field!r}: Registry(names, having)}} (for attention kinds: "
                          "piattn.layers.attention_registry())")
    return tuple(registry.having(allowed.name))


def _base_type(cls, name: str):
    """The type of field `name` without `| None` (int, float, str or bool)."""
    hint = typing.get_type_hints(cls)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def flag_fields(cls) -> list[tuple[dataclasses.Field, Flag]]:
    return [(f, f.metadata["flag"]) for f in dataclasses.fields(cls) if "flag" in f.metadata]


def _choices(meta: Flag, registries: Mapping[str, Iterable] | None) -> list | None:
    """The allowed values of a flag, in the order its errors list them (registries sorted), or None when it
    has no fixed set or its registry is not known here."""
    if isinstance(meta.choices, str):
        names = (registries or {}).get(meta.choices)
        return None if names is None else sorted(names)
    return None if meta.choices is None else list(meta.choices)


def help_text(field: dataclasses.Field, meta: Flag) -> str:
    """The flag's help with its default appended, unless the text already says it, the flag is required, off
    unless given (False), or left to the task or model config (None, which the text explains)."""
    text = meta.help.replace("{notes}", "")  # notes not rendered (`render_notes`): none
    if meta.required or field.default is None or field.default is False or "default" in text.lower():
        return text
    return f"{text} (default: {'on' if field.default is True else field.default})"


def add_flags(parser: argparse._ActionsContainer, cls, registries: Mapping[str, Iterable] | None = None) -> None:
    """One argparse argument per flag field of dataclass `cls`; its help states the default and the choices
    (those of a registry when `registries` has it).

    A flag not given is absent from the parsed namespace (default `argparse.SUPPRESS`), so that what the user
    typed can be told from the defaults (`--resume` takes the run's own settings for everything else);
    `from_args`-style readers fill in the field defaults.
    """
    for field, meta in flag_fields(cls):
        kind = _base_type(cls, field.name)
        options = dict(dest=field.name, help=help_text(field, meta).replace("%", "%%"), default=argparse.SUPPRESS)
        if kind is bool:
            if field.default is False:
                options.update(action="store_true")
            else:  # True by default, or None for "the task decides"
                options.update(action=argparse.BooleanOptionalAction)
        else:
            options.update(type=kind)
            choices = _choices(meta, registries)
            if choices is not None:  # shown as argparse shows choices; checked by `check_flags` (one-line error)
                options.update(metavar="{" + ",".join(map(str, choices)) + "}")
        if meta.required:
            options.update(required=True)
        parser.add_argument(option_name(field.name), *meta.aliases, **options)


def check_flags(obj, registries: Mapping[str, Iterable] | None = None, context: Mapping | None = None) -> None:
    """ValueError naming the flag for the first value out of range, not among its choices, or given where
    it does not apply. `context`: the values of other fields that `applies` refers to."""
    registries = registries or {}
    context = context or {}
    for field, meta in flag_fields(type(obj)):
        value, name = getattr(obj, field.name), option_name(field.name)
        if _base_type(type(obj), field.name) is bool and field.default is not False:
            name = f"{name} / --no-{name[2:]}"
        if value is None:
            continue
        if meta.low is not None and not value >= meta.low:
            raise ValueError(f"{name} must be >= {meta.low:g}, got {value!r}")
        if meta.high is not None and not value <= meta.high:
            raise ValueError(f"{name} must be <= {meta.high:g}, got {value!r}")
        if meta.above is not None and not value > meta.above:
            raise ValueError(f"{name} must be > {meta.above:g}, got {value!r}")
        if meta.below is not None and not value < meta.below:
            raise ValueError(f"{name} must be < {meta.below:g}, got {value!r}")
        # registries are listed sorted, fixed choices in the order written
        choices = sorted(registries.get(meta.choices, ())) if isinstance(meta.choices, str) else meta.choices
        if choices is not None and value not in choices:
            raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
        if meta.applies is None or value == field.default:
            continue
        for other, scope in meta.applies.items():
            allowed = allowed_values(other, scope, registries)
            if not _within(context.get(other), allowed):
                shown = " / ".join(map(str, allowed))
                raise ValueError(f"{name} applies to {option_name(other)} {shown} only, "
                                 f"not {context.get(other)!r}")


def applies(meta: Flag, context: Mapping, registries: Mapping | None = None) -> bool:
    """Whether a flag means something under the values of other fields in `context` (its `applies`)."""
    return meta.applies is None or all(_within(context.get(other), allowed_values(other, scope, registries))
                                       for other, scope in meta.applies.items())


def _within(value, allowed: tuple) -> bool:
    """Whether `value` is among `allowed`; a tuple of values (the kinds of a hybrid stack's layers) is when one
    of them is."""
    if isinstance(value, tuple):
        return any(v in allowed for v in value)
    return value in allowed
