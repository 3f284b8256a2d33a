"""experiments/mqar.py: the judgements that do not favour arms serving more distances (per distance, over the
distances every arm serves) and the within-reach control (issue 59), the committed records' verdicts unchanged."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from piattn.commands.train import add_arguments, checked_config
from piattn.config import TrainConfig
from piattn.data.mqar import spans
from piattn.tasks import MQARTask
from utils import load_experiment

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results" / "mqar"


@pytest.fixture(scope="module")
def mq():
    return load_experiment("mqar.py", "mqar_experiment")


def test_the_committed_predictions_are_unchanged(mq):
    committed = json.loads((RESULTS / "mqar.json").read_text())["predictions"]
    now = json.loads(json.dumps(mq.predictions()))
    assert {name: now[name] for name in committed} == committed


def test_the_committed_summary_keeps_every_old_field_and_verdict(mq):
    committed = json.loads((RESULTS / "mqar.json").read_text())["summary"]
    now = json.loads(json.dumps(mq.summary(mq.Results(RESULTS / "runs.json").done)))
    for name, arms in committed.items():
        for arm, fields in arms.items():
            assert {k: now[name][arm][k] for k in fields} == fields, (name, arm)
            assert {"common", "served_lags", "steps_to_learn_common", "latest_value"} <= set(now[name][arm])
    # the old records carry no validation-side field of the new judgements
    assert now["main"]["dense"]["validation_recorded"] == [False] * 3
    assert now["main"]["dense"]["latest_value"] == 0.25  # packed: the last pair's value, 1 of 4


def result(accuracy: dict[int, float], queries: dict[int, int]) -> dict:
    return {"accuracy_by_distance": {str(d): a for d, a in accuracy.items()},
            "queries_by_distance": {str(d): q for d, q in queries.items()}}


def test_one_distance_at_chance_fails_the_per_distance_judgement_whatever_the_count(mq):
    # 24 distances all at 1.00 but one at chance: the mean over them is 0.96 >= 0.9, the per-distance verdict fails
    many = result({d: 1.0 for d in range(2, 26)} | {25: 0.0625}, dict.fromkeys(range(2, 26), 40))
    assert mq.accuracy_over(many, set(range(2, 26))) >= mq.LEARNED
    assert mq.lag_verdict(many, list(range(2, 26))) == dict(judged=24, learned=23, worst=[25, 0.0625], every=False)
    # a distance with too few queries is not judged alone
    thin = result({2: 1.0, 3: 0.0}, {2: 40, 3: 5})
    assert mq.lag_verdict(thin, [2, 3]) == dict(judged=1, learned=1, worst=[2, 1.0], every=True)
    assert mq.lag_verdict(thin, [3])["every"] is None


def test_common_distances_are_what_every_arm_serves(mq):
    assert mq.common_served("main") == list(range(2, 9))  # local k = 4's, the narrowest
    assert mq.common_served("layers4") == list(range(2, 17))
    assert all(set(mq.common_served("main")) <= set(mq.served("main", arm)) for arm in mq.ARMS)


def test_the_reach_control_trains_each_arm_on_its_served_distances_only(mq):
    for arm in mq.ARMS:
        run = mq.Run("reach", arm, 1, None, "seeds")
        argv = mq.train_argv(run, 1e-3, Path("unused"))
        assert argv[argv.index("--mqar-lags") + 1] == spans(mq.served("reach", arm))
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        cfg = checked_config(TrainConfig.from_args(parser.parse_args(argv[1:])))
        settings = MQARTask.settings(cfg)
        assert settings["layout"] == "scattered" and list(settings["lags"]) == mq.served("reach", arm)
    assert "--mqar-lags" not in mq.train_argv(mq.Run("main", "dense", 0, 1e-3, "sweep"), 1e-3, Path("unused"))
    # its short distances: "answer with the latest value" gets more than when packed, and the tables say so
    assert mq.latest_value_share("reach", "local-k4") > 0.5 > mq.latest_value_share("main", "local-k4")


def test_a_hybrid_arm_is_served_by_its_stack(mq, monkeypatch):
    monkeypatch.setitem(mq.ARMS, "hybrid", mq.Arm("pi", 4, 16, layers="pi,dense"))
    assert mq.ARMS["hybrid"].flags()[-2:] == ["--layers", "pi,dense"]
    assert mq.served("main", "hybrid") == list(range(2, 63))  # a dense layer reaches every distance
