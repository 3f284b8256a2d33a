"""experiments/learnability.py: what each arm trains, which lags it is judged on, and how steps-to-learn are
summarised (docs/results.md §7c)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from piattn.analysis import design_periods, reachable_lags
from piattn.commands.train import add_arguments
from piattn.config import TrainConfig
from piattn.config.training import parse_period
from utils import load_experiment

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def lrn():
    return load_experiment("learnability.py", "learnability_experiment")


def config(argv: list[str]) -> TrainConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return TrainConfig.from_args(parser.parse_args(argv[1:]))


@pytest.mark.parametrize("values,median", [
    ([1400, None, 3200], 3200),
    ([None, None, 1000], None),      # most runs never learned: no median
    ([1600, None], None),            # an even count: the upper middle value, which never learned
    ([1000, 2500, 300, 1300], 1300),
])
def test_the_median_counts_a_run_that_never_learned_as_after_the_budget(lrn, values, median):
    assert lrn.median_or_none(values, 4000) == median


@pytest.mark.parametrize("name", ["T64-L4", "T64-L3"])
def test_every_arm_reaches_the_common_lags_and_the_periods_are_the_designers(lrn, name):
    s = lrn.SETTINGS[name]
    common = set(lrn.common_lags(name))
    assert common and common <= set(range(2, s.seq_len))
    for arm in lrn.ARMS:
        assert common <= set(lrn.reachable_lags(name, arm)), arm
    assert lrn.schedule_of(name, "cover") == design_periods(s.window, s.layers, s.heads, s.seq_len - 1).periods
    # the value (lag) and its marker (lag - 1) both reachable: what `reachable_lags` of the analysis says
    lags = reachable_lags(s.window, lrn.schedule_of(name, "pi"), s.seq_len)
    assert sorted(common) == [d for d in range(2, s.seq_len) if lags[d] and lags[d - 1]]


def test_routes_of_the_tight_and_the_routed_design(lrn):
    tight, routed = lrn.routes("T64-L4", "cover"), lrn.routes("T64-L4", "cover-r2")
    assert tight[63] == 1 and min(tight[1:]) == 1
    assert min(routed[1:]) >= 2


def test_each_arm_trains_what_it_says(lrn, tmp_path):
    dense = config(lrn.train_argv("T64-L4", "dense", 3, tmp_path))
    assert dense.model.attention == "dense" and dense.optim.seed == 3 and dense.run.eval_every == lrn.EVERY
    cover = config(lrn.train_argv("T64-L4", "cover", 0, tmp_path))
    assert cover.model.attention == "pi" and cover.model.window == 4 and cover.model.variant == "adaptive"
    assert [tuple(p) for p in parse_period(cover.model.period)] == list(lrn.schedule_of("T64-L4", "cover"))
    assert cover.optim.warmup == lrn.WARMUP and cover.optim.lr == lrn.LR
    warm = config(lrn.train_argv("T64-L4", "cover-warmup", 0, tmp_path))
    slow = config(lrn.train_argv("T64-L4", "cover-lr1e-3", 0, tmp_path))
    assert warm.optim.warmup == 400 and slow.optim.lr == 1e-3 and slow.optim.min_lr == 1e-4
    union = config(lrn.train_argv("T64-L4", "cover-union", 0, tmp_path))
    assert union.model.variant == "union" and union.optim.lr == lrn.LR
    assert warm.model.period == cover.model.period == slow.model.period == union.model.period


def test_schedule_ablations_are_judged_against_single_pi_trained_alike(lrn, tmp_path):
    assert lrn.pi_reference("cover-warmup") == "pi-warmup" and lrn.pi_reference("cover-lr1e-3") == "pi-lr1e-3"
    assert lrn.pi_reference("cover-union") == "pi" and lrn.pi_reference("cover") == "pi"
    assert lrn.pi_reference("cover-paired-warmup") == "pi-warmup" and lrn.pi_reference("cover-paired") == "pi"
    assert lrn.pi_reference("cover-warmup100") == "pi-warmup100" and lrn.pi_reference("pi-warmup") == "pi-warmup"
    pi = config(lrn.train_argv("T64-L4-6400", "pi", 0, tmp_path))
    warm = config(lrn.train_argv("T64-L4-6400", "pi-warmup", 0, tmp_path))
    slow = config(lrn.train_argv("T64-L4-6400", "pi-lr1e-3", 0, tmp_path))
    assert warm.model.period == slow.model.period == pi.model.period
    assert warm.optim.warmup == 400 and warm.optim.lr == pi.optim.lr and slow.optim.lr == 1e-3
