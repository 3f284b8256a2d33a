"""TrainConfig: every flag declared once, as a dataclass field, with its parser argument, checks and resume
comparison generated from it (with the flags the tasks declare: `piattn.tasks.config_class()`)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from piattn.config import PI_DEFAULTS, PiSettings, TrainConfig
from piattn.config.flags import Capability, Registry, add_flags, check_flags, flag, flag_fields
from piattn.config.training import RUN_DEFINING, SECTIONS, ModelFlags
from piattn.layers import kinds_with
from piattn.tasks import config_class

CONFIG = config_class()  # the flags of every task and those the registered tasks declare

REGISTRIES = {"attention": Registry(("dense", "local", "pi"), kinds_with), "task": ("lm", "reach"),
              "tokenizer": ("byte",), "backend": ("auto", "torch")}


def parse(*argv) -> TrainConfig:
    parser = argparse.ArgumentParser()
    CONFIG.add_arguments(parser)
    return CONFIG.from_args(parser.parse_args(["--out", "run", *argv]))


@pytest.mark.parametrize("config", [TrainConfig, CONFIG], ids=["every task", "with the tasks' own"])
def test_every_field_is_one_flag_in_its_section_group(config):
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    groups = {g.title: {a.dest for a in g._group_actions} for g in parser._action_groups}
    assert config is TrainConfig or config.sections["data"] is not SECTIONS["data"]
    for section, cls in config.sections.items():
        names = {f.name for f in dataclasses.fields(cls)}
        assert any(names == dests for dests in groups.values()), section


def test_flat_round_trip_and_unknown_keys():
    cfg = parse("--task", "reach", "--lag", "3", "--no-causal", "--lr", "0.01")
    assert cfg.task.causal is False and cfg.optim.lr == 0.01
    assert CONFIG.from_flat(cfg.to_flat()) == cfg
    with pytest.raises(ValueError, match=r"unknown training settings \['colour'\]"):
        CONFIG.from_flat({**cfg.to_flat(), "colour": "red"})


def test_resume_comparison_covers_what_defines_a_run_only():
    a, b = parse("--lr", "0.01"), parse("--lr", "0.02", "--eval-every", "7", "--progress")
    assert a.differences(b) == [("--lr", 0.01, 0.02)]
    assert "eval_every" not in RUN_DEFINING and "seq_len" in RUN_DEFINING


@pytest.mark.parametrize(("argv", "message"), [
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--dropout", "1.0"], "--dropout must be < 1, got 1.0"),
    (["--prior", "1.5", "--variant", "fixed"], "--prior must be <= 1, got 1.5"),
    (["--attention", "sparse"], "--attention must be one of ['dense', 'local', 'pi'], got 'sparse'"),
    (["--precision", "fp8"], "--precision must be one of ['auto', 'fp32', 'bf16'], got 'fp8'"),
    (["--lag", "3"], "--lag applies to --task reach only, not 'lm'"),
    (["--no-causal"], "--causal / --no-causal applies to --task reach only, not 'lm'"),
    (["--prior", "0.3"], "--prior applies to --variant fixed only, not 'adaptive'"),
    (["--attention", "dense", "--backend", "torch"], "--backend applies to --attention local / pi only, not 'dense'"),
])
def test_checks_name_the_flag(argv, message):
    with pytest.raises(ValueError) as err:
        parse(*argv).check(REGISTRIES)
    assert str(err.value) == message


def test_a_new_flag_is_one_field():
    """A flags dataclass with one more field: parser argument, range check and scope check all follow."""
    Extra = dataclasses.make_dataclass(
        "Extra", [("ring", int | None, flag(None, "ring size", low=2, applies={"attention": ("pi",)}))])
    parser = argparse.ArgumentParser()
    add_flags(parser, Extra)
    extra = Extra(**vars(parser.parse_args(["--ring", "1"])))
    with pytest.raises(ValueError, match="--ring must be >= 2, got 1"):
        check_flags(extra, context={"attention": "pi"})
    with pytest.raises(ValueError, match="--ring applies to --attention pi only, not 'dense'"):
        check_flags(Extra(ring=4), context={"attention": "dense"})
    check_flags(Extra(ring=4), context={"attention": "pi"})


def test_a_capability_scope_needs_the_registry_passed_in():
    """The configuration imports nothing above it and is lent nothing: without the kinds' registry a flag scoped
    by a capability cannot be checked, and says what to pass; with it, the registry answers."""
    cfg = parse("--attention", "dense", "--window", "3")
    with pytest.raises(LookupError, match=r"pass registries=\{'attention': Registry\(names, having\)\}"):
        cfg.check({**REGISTRIES, "attention": ("dense", "local", "pi")})
    with pytest.raises(ValueError, match="--window applies to --attention"):
        cfg.check(REGISTRIES)
    parse("--attention", "local", "--window", "3").check(REGISTRIES)


def test_flags_scoped_by_a_capability_name_one_some_registered_kind_has():
    """A misspelt capability would be refused by the registry; one no kind has would refuse the flag always."""
    scoped = {f.name: scope.name for cls in CONFIG.sections.values() for f, meta in flag_fields(cls)
              for scope in (meta.applies or {}).values() if isinstance(scope, Capability)}
    assert {"window", "n_kv_head", "sinks", "backend", "pack_documents", "sequence_parallel"} <= set(scoped)
    for name, capability in scoped.items():
        assert kinds_with(capability), name


def test_model_flags_reach_the_model_config_by_name():
    fields = ModelFlags(window=3, period=None, n_layer=2).model_fields()
    assert fields == {"attention": "pi", "window": 3, "n_layer": 2, "dropout": 0.1}


def test_pi_defaults_are_the_papers_and_ranges_are_checked():
    assert PiSettings(window=4, period=16, variant="adaptive", prior=0.5, logit_clamp=20.0, eps=1e-4) == PI_DEFAULTS
    for bad, name in ((dict(window=-1), "window"), (dict(period=0), "period"), (dict(variant="x"), "variant"),
                      (dict(prior=0.0), "prior"), (dict(logit_clamp=0), "logit_clamp"), (dict(eps=0.5), "eps"),
                      (dict(window=True), "window")):
        with pytest.raises(ValueError, match=name):
            PiSettings(**bad)
