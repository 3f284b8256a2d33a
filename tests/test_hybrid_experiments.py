"""experiments/hybrid_stacks.py and hybrid_heads.py (issue 59): the stacks each run trains, every argv a valid
`piattn train`, and the rule's clauses read from made records as docs/results.md §11 words them."""

from __future__ import annotations

import argparse
import subprocess
import threading
import time
from pathlib import Path

import pytest

from piattn.commands.train import add_arguments, checked_config
from piattn.config import TrainConfig
from utils import load_experiment


@pytest.fixture(scope="module")
def stacks():
    return load_experiment("hybrid_stacks.py", "hybrid_stacks_experiment")


@pytest.fixture(scope="module")
def heads():
    pytest.importorskip("transformers")
    return load_experiment("hybrid_heads.py", "hybrid_heads_experiment")


def checked(argv: list[str]) -> TrainConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return checked_config(TrainConfig.from_args(parser.parse_args(argv[1:])))


@pytest.mark.parametrize("layers, dense_at, pattern", [
    (4, 3, "pi*3,dense"), (4, 1, "pi,dense,pi*2"), (4, 0, "dense,pi*3"), (8, 7, "pi*7,dense"), (3, 1, "pi,dense,pi")])
def test_the_stack_puts_one_dense_layer_where_the_setting_says(stacks, layers, dense_at, pattern):
    stack = stacks.Stack(layers, dense_at)
    assert stack.pattern("pi") == pattern
    assert stack.ratio == f"{layers - 1}:1"


def test_every_planned_run_is_a_valid_train_command_with_its_dense_layer(stacks):
    runs = stacks.plan()
    assert len(runs) == len({r.key for r in runs})  # no run twice
    for run in runs:
        cfg = checked(stacks.train_argv(run, 1e-3, Path("unused")))
        model = cfg.model
        setting = stacks.SETTINGS[run.setting]
        assert model.n_layer == setting.layers and cfg.run.stop_at == "accuracy>=0.99"
        if run.arm == "dense":
            assert model.attention == "dense" and model.layers is None
        else:
            expected = stacks.Stack(setting.layers, setting.dense_at).pattern(stacks.ARMS[run.arm].attention)
            assert model.layers == expected


def test_the_amendments_pi_with_sinks_runs_after_the_eight_pair_phases_at_its_borrowed_rate(stacks, monkeypatch):
    """π + sinks differs from local + sinks by the skip key alone; it trains at π's chosen rate, and its
    settings run after h8-pairs8 and before h4-second."""
    runs = [r for r in stacks.plan() if r.arm == "pi-k4-p16-s4"]
    assert [(r.setting, r.seed) for r in runs] == [("h4-last", 0), ("h4-last", 1), ("h4-last", 2), ("h8-last", 0),
                                                   ("h8-last", 1)]
    phase_of = {r.setting: r.phase for r in stacks.plan() if r.arm == "local-k4"}
    assert phase_of["h8-pairs8"] < min(r.phase for r in runs) <= max(r.phase for r in runs) < phase_of["h4-second"]
    argv = stacks.train_argv(runs[0], 3e-3, Path("unused"))
    assert " ".join(stacks.arm_flags(runs[0])) == "--attention pi --window 4 --period 16 --layers pi*3,dense --sinks 4"
    assert checked(argv).model.sinks == 4
    monkeypatch.setattr(stacks.mqar, "chosen_lr", lambda done, arm: {"pi-k4-p16": 3e-3}.get(arm, 1e-3))
    assert stacks.chosen_rates()["pi-k4-p16-s4"] == 3e-3


def test_jobs_run_a_phase_together_and_the_phases_in_the_rules_order(stacks, monkeypatch, tmp_path):
    events, running, lock = [], [0], threading.Lock()
    most = [0]

    def fake_run(run, lr, runs_dir):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            events.append(("start", run.phase, run.key))
        time.sleep(0.1)  # long enough that three start before the first ends, on a loaded machine too
        with lock:
            running[0] -= 1
            events.append(("end", run.phase, run.key))
        return record(run.setting, run.arm, run.seed, 1000)

    monkeypatch.setattr(stacks, "one_run", fake_run)
    monkeypatch.setattr(stacks, "chosen_rates", lambda: dict.fromkeys(stacks.ARMS, 1e-3))
    results = stacks.mqar.Results(tmp_path / "runs.json")
    runs = [r for r in stacks.plan() if r.phase in (1, 2)]
    stacks.execute(runs, results, tmp_path, limit=None, jobs=3)
    assert set(results.done) == {r.key for r in runs}
    assert most[0] == 3  # three at a time within a phase
    last_end_of_phase_1 = max(i for i, (what, phase, _) in enumerate(events) if what == "end" and phase == 1)
    first_start_of_phase_2 = min(i for i, (what, phase, _) in enumerate(events) if what == "start" and phase == 2)
    assert last_end_of_phase_1 < first_start_of_phase_2


def test_a_failed_run_stops_the_script_naming_the_run_and_its_log(stacks, monkeypatch, tmp_path):
    def failing_run(run, lr, runs_dir):
        raise subprocess.CalledProcessError(3, ["piattn", "train"])

    monkeypatch.setattr(stacks, "one_run", failing_run)
    monkeypatch.setattr(stacks, "chosen_rates", lambda: dict.fromkeys(stacks.ARMS, 1e-3))
    results = stacks.mqar.Results(tmp_path / "runs.json")
    run = stacks.plan()[0]
    with pytest.raises(SystemExit) as stopped:
        stacks.execute([run], results, tmp_path, limit=None)
    assert str(stopped.value) == f"{run.key} failed (exit 3); its messages are in {tmp_path / 'train.log'}"
    assert not results.done


def record(setting: str, arm: str, seed: int, steps: int | None) -> dict:
    return dict(key=f"{setting}/{arm}/seed{seed}", setting=setting, arm=arm, seed=seed, lr=1e-3,
                steps_to_learn=steps, accuracy=0.99 if steps else 0.5, per_distance=dict(worst=[2, 0.9]),
                wall_seconds=1.0, validation=[])


def test_clause_one_compares_pi_with_the_better_window_and_counts_a_run_not_learned_past_the_budget(stacks):
    done = {}
    for seed, (local, sinks, pi, cover) in enumerate([(2000, 1400, 1000, None), (2400, 1600, 1000, 3000),
                                                      (None, 1800, 1200, 2000)]):
        for arm, steps in (("local-k4", local), ("local-k4-s4", sinks), ("pi-k4-p16", pi), ("pi-k4-cover", cover)):
            r = record("h4-last", arm, seed, steps)
            done[r["key"]] = r
    s = stacks.summary(done)
    arms = s["settings"]["h4-last"]
    assert arms["local-k4"]["median_steps"] == 2400 and not arms["local-k4"]["learns"]
    assert arms["local-k4-s4"]["median_steps"] == 1600 and arms["local-k4-s4"]["learns"]
    clause = s["clauses"]["h4-last"]
    assert clause["pi-k4-p16"]["verdict"] == "π helps"  # 1000 <= 0.75 × 1600
    assert clause["pi-k4-p16"]["ratio_to_best_window"] == 0.625
    assert clause["pi-k4-cover"]["verdict"] == "worse"  # median 3000 (one seed past the budget: 4200) > 1.33 × 1600


def made(setting: str, seeds, steps_by_arm: dict[str, int | None]) -> dict[str, dict]:
    """Records of every arm of `steps_by_arm` in `setting`, each seed learning at the same step (None: not)."""
    rows = (record(setting, arm, seed, steps) for seed in seeds for arm, steps in steps_by_arm.items())
    return {r["key"]: r for r in rows}


def test_clause_one_says_no_difference_within_the_band(stacks):
    done = made("h4-last", (0,), {"local-k4": 2000, "local-k4-s4": 1600, "pi-k4-p16": 1400})
    assert stacks.summary(done)["clauses"]["h4-last"]["pi-k4-p16"]["verdict"] == "no difference"


def test_clause_one_is_provisional_until_the_seeds_its_phase_planned_are_in(stacks):
    """h8-last's phase runs seeds 0 and 1: two seeds judge it; h4-last's runs 0–2: two seeds do not."""
    for setting, provisional in (("h8-last", False), ("h4-last", True)):
        done = made(setting, (0, 1), {"local-k4": None, "local-k4-s4": 2000, "pi-k4-p16": None})
        clause = stacks.summary(done)["clauses"][setting]["pi-k4-p16"]
        assert clause["verdict"] == "worse" and clause["provisional"] is provisional, setting


def test_clause_one_judges_pi_with_sinks_as_it_judges_pi(stacks):
    done = made("h8-last", (0,), {"local-k4": 2000, "local-k4-s4": 1600, "pi-k4-p16-s4": 1000})
    assert stacks.summary(done)["clauses"]["h8-last"]["pi-k4-p16-s4"]["verdict"] == "π helps"


def test_clause_two_reads_the_largest_ratio_each_arm_learns(stacks):
    done = {**made("h4-last", (0,), {"pi-k4-p16": 1000}), **made("h8-last", (0,), {"pi-k4-p16": None}),
            **made("h4-pairs8", (0,), {"pi-k4-p16": 3000})}
    ratio = stacks.summary(done)["ratio"]
    assert ratio["4"]["pi-k4-p16"] == dict(tried=["3:1", "7:1"], learned=["3:1"])
    assert ratio["8"]["pi-k4-p16"] == dict(tried=["3:1"], learned=["3:1"])


def heads_row(arm: str, heads: int, beyond: float) -> dict:
    return dict(arm=arm, heads=heads, fraction=str(heads), beyond=beyond)


@pytest.mark.parametrize("local, pi, separated, verdict", [
    ([0.0, 0.5, 0.96], [0.0, 0.96, 0.99], False, "π helps (a smaller f*)"),
    ([0.0, 0.5, 0.96], [0.0, 0.5, 0.97], False, "no difference"),
    ([0.0, 0.5, 0.96], [0.0, 0.6, 0.97], True, "π helps (a smaller f separates them)"),
    ([0.0, 0.96, 0.99], [0.0, 0.5, 0.96], False, "worse (a larger f*)"),
    ([0.0, 0.5, 0.6], [0.0, 0.5, 0.7], False, "not reached"),
])
def test_rule_one_of_the_conversion_reads_f_star(heads, local, pi, separated, verdict):
    by_arm = {"local": [heads_row("local", k, b) for k, b in zip((0, 6, 45), local, strict=True)],
              "pi": [heads_row("pi", k, b) for k, b in zip((0, 6, 45), pi, strict=True)]}
    comparisons = {"0": dict(low=0.0), "6": dict(low=0.05 if separated else -0.02), "45": dict(low=-0.01)}
    assert heads.verdict(by_arm, comparisons)["verdict"] == verdict


def test_the_duo_choice_keeps_its_own_records_and_leaves_the_retrieval_records_valid(heads):
    retrieval = heads.parse_args([])
    duo = heads.parse_args(["--choose", "duo", "--duo-steps", "7"])
    assert retrieval.records.name == "heads_runs" and retrieval.out.name == "heads"
    assert duo.records.name == "heads_duo_runs" and duo.out.name == "heads_duo"
    control = heads.parse_args(["--choose", "duo", "--duo-gates-of", "pi"])
    assert control.records.name == "heads_duo_pi_gates_runs" and control.out.name == "heads_duo_pi_gates"
    # the retrieval study's records were written with exactly these probe settings: adding keys would refuse them
    assert heads.probe_settings(retrieval) == dict(length=256, batch=4, seed=0, vocab=[1000, 20000])
    assert heads.probe_settings(duo) == dict(heads.probe_settings(retrieval), choose="duo", duo_steps=7,
                                             duo_lr=heads.DUO_LR, duo_l1=heads.DUO_L1)
    with pytest.raises(SystemExit):
        heads.parse_args(["--choose", "attention-mass"])


def test_the_duo_choice_ranks_each_arms_gates_and_orders_equal_gates_by_retrieval_score(heads):
    import torch

    study = heads.HeadStudy.__new__(heads.HeadStudy)  # no model: the ranking reads only the scores and gates
    study.args = heads.parse_args(["--choose", "duo"])
    study.scores = torch.tensor([[0.1, 0.3], [0.7, 0.9]])
    study._gates = {"local": torch.tensor([[1.0, 1.0], [1.0, 0.0]]), "pi": torch.tensor([[0.0, 1.0], [0.5, 0.2]])}
    assert study.dense_heads("local", "1/4") == {1: [0]}
    assert study.dense_heads("pi", "1/2") == {0: [1], 1: [0]}
    study.args = heads.parse_args(["--choose", "duo", "--duo-gates-of", "pi"])  # the control: π's heads for both
    assert study.dense_heads("local", "1/2") == study.dense_heads("pi", "1/2") == {0: [1], 1: [0]}
    assert heads.probe_settings(study.args)["gates_of"] == "pi"  # its records are not the own-gates runs'
    study.args = heads.parse_args([])
    assert study.dense_heads("pi", "1/4") == {1: [1]}  # the retrieval choice ignores the gates
    with pytest.raises(SystemExit):
        heads.parse_args(["--duo-gates-of", "pi"])  # without --choose duo there are no gates to take
