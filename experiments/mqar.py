"""Multi-query associative recall (MQAR) by key–query distance for each attention kind: issue 39, item 2.

MQAR is the recall test of the Zoology study (`piattn.data.mqar`, docs/design.md §7): key–value pairs open the
sequence, every key is asked once later, loss and accuracy only at the queries. Each run is `piattn train
--task mqar` then `piattn eval` on the test split (experiments/runs.py), which reports accuracy by key–query
distance, by number of pairs and by both. Beside each arm's accuracy stands what the reach analysis predicts:
the distances d whose key (d back) and value (d - 1 back) the arm's layers reach (`served`).

    python experiments/mqar.py --plan                  # the runs in order, done or not, and the wall time left
    python experiments/mqar.py                         # every run (resumable), then the tables and the figure
    python experiments/mqar.py --only main --limit 6   # a subset: settings, arms or setting/arm, at most 6 runs
    python experiments/mqar.py --report                # the tables and the figure of the finished runs only
    python experiments/mqar.py --predictions           # the served distances of every arm in every setting

Design (not a full grid). Arms: dense; local k = 4; local k = 4 + 4 sinks; π (k 4, π 16); multi-scale π (k 4,
`--period cover`: the designer's head periods for the setting's depth and heads); local k = 16, as wide as π's
decode ring (max(k, π) + 1 = 17 positions: the equal-memory control). Settings: `main` (SETTINGS), then one
factor at a time around it (deeper, more pairs, longer sequences). In `main`, each arm trains at every rate of LRS
(seed 0) and the rate with the best final validation accuracy trains seeds 1 and 2; the other settings take
each arm's rate from `main` and train every seed. Steps-to-learn: the first validation step at which the
accuracy over the arm's served distances is >= LEARNED.

The within-reach control (issue 59): the setting `reach` is `main` with every query drawn only at the distances
the arm serves (`--mqar-lags`, the scattered layout of `piattn.data.mqar`), so that training asks nothing an arm
cannot reach; its tables stand beside the others'. Its short distances open the shortcut "answer with the latest
value before the query" (no key match): the tables give its share of the test queries per arm ("latest value"),
the floor an arm's accuracy must clear.

Beside the average over the arm's own served distances, which favours arms with more of them (one distance at
chance costs an arm of 7 served distances about 13 points, one of 47 about 2), the verdicts read two judgements
that do not (issue 59): over the distances every arm serves ("common": steps-to-learn on validation, accuracy on
test), and per distance (on test, each served distance with at least MIN_LAG_QUERIES queries: how many are >=
LEARNED, and the worst). Old records lack the validation-side fields ("n/r"); the test-side ones are computed
from them. The old fields and their verdicts are unchanged.

Resumable: OUT/runs.json holds every finished run and is rewritten after each one; a rerun skips them (and
`runs.train_and_test` skips a run folder already scored). Writes OUT/mqar.json (settings, predictions, runs,
summary), OUT/mqar.md (tables) and OUT/mqar.png (accuracy by distance per arm, one panel per setting), OUT
defaulting to experiments/results/mqar/.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from runs import timed_or_exit, train_and_test, write_json
from tqdm import tqdm

from piattn.analysis.report import lag_runs
from piattn.data.mqar import distance_spread, mqar_mix
from piattn.data.mqar import spans as lags_text
from piattn.data.mqar import vocab_size as mqar_vocab_size
from piattn.layers import model_reach
from piattn.models import GPTConfig
from piattn.tasks.classification import split_seed
from piattn.tasks.mqar import pairs_view, parse_pairs


@dataclasses.dataclass(frozen=True)
class Setting:
    """The model and sequence of a group of runs; `steps` its training budget."""

    seq_len: int
    layers: int
    d_model: int
    steps: int
    heads: int = 4
    pairs: str = "4"  # --mqar-pairs
    distances: str = "uniform"  # "uniform": packed, anywhere after the pairs; "reach": only the arm's served ones


@dataclasses.dataclass(frozen=True)
class Arm:
    """An attention kind and its pattern (`piattn train` flags)."""

    attention: str
    window: int | None = None
    period: int | str | None = None
    sinks: int = 0
    layers: str | None = None  # a hybrid stack's pattern (--layers "pi*3,dense"); None: every layer `attention`

    def flags(self) -> list[str]:
        flags = ["--attention", self.attention]
        if self.window is not None:
            flags += ["--window", str(self.window)]
        if self.period is not None:
            flags += ["--period", str(self.period)]
        if self.layers is not None:
            flags += ["--layers", self.layers]
        return flags + (["--sinks", str(self.sinks)] if self.sinks else [])


# The task of every setting: queries anywhere after the pairs (uniform), keys and values from their own
# vocabularies of 16, the training recipe with which dense solved MQAR on this machine (docs/results.md §7b:
# 64 tokens, 4 pairs, 0.96 at 1,250 steps and 1.000 on test at 4,000; at lr 3e-3 it stayed on the plateau).
# Binned distances (--mqar-distance 1-8,9-16,17-32,33-56) looked like the fairer design, since windowed arms
# would get queries they can serve in training, but dense did not learn them at this budget: 0.63 at 4,000
# steps with 2 and 4 pairs (lr 1e-3, seed 0), so the study keeps uniform placement and reads accuracy by
# distance from the test split.
TASK = dict(keys=16, values=16, batch=64, train_size=20_000, eval_size=1_000, warmup=100, min_lr_ratio=0.1)
# Steps: a main-setting run took 500–670 s on one thread, three runs sharing the 2 cores (see --plan).
SETTINGS = {
    "main": Setting(seq_len=64, layers=2, d_model=64, steps=4000),
    "layers4": Setting(seq_len=64, layers=4, d_model=64, steps=4000),
    "pairs8": Setting(seq_len=64, layers=2, d_model=64, steps=4000, pairs="8"),
    "T128": Setting(seq_len=128, layers=2, d_model=64, steps=4000),
    # the within-reach control: main with every query at a distance the arm serves (issue 59)
    "reach": Setting(seq_len=64, layers=2, d_model=64, steps=4000, distances="reach"),
}
MAIN = "main"
ARMS = {
    "dense": Arm("dense"),
    "local-k4": Arm("local", 4),
    "local-k4-s4": Arm("local", 4, sinks=4),
    "pi-k4-p16": Arm("pi", 4, 16),
    "pi-k4-cover": Arm("pi", 4, "cover"),
    "local-k16": Arm("local", 16),  # π's decode ring holds max(k, π) + 1 = 17 positions, local k = 16 as many
}
LRS = (1e-3, 3e-3)
SEEDS = (0, 1, 2)
VALIDATIONS = 10  # validation points per run, for steps-to-learn
LEARNED = 0.9
MIN_LAG_QUERIES = 20  # a distance is judged on its own only with at least this many queries
# One-thread seconds per training step (forward, backward, AdamW) of the main setting at batch 64 on the 2-core
# machine, three runs sharing it, per attention kind (alike at 64 tokens); the other settings scale (`cost`).
SECONDS_PER_STEP = {"dense": 0.14, "local": 0.125, "pi": 0.125}
# Seconds per run beside the steps: two processes starting, the splits generated, ten validations and the test
# evaluation.
OVERHEAD = 30.0


@dataclasses.dataclass(frozen=True)
class Run:
    """One planned run: its lr is None until the sweep of its arm (in `main`) has chosen one."""

    setting: str
    arm: str
    seed: int
    lr: float | None
    phase: str  # "sweep" (main, seed 0, every rate) or "seeds" (the chosen rate)

    def key(self, lr: float | None = None) -> str:
        lr = self.lr if lr is None else lr
        return f"{self.setting}/{self.arm}/lr{lr:g}/seed{self.seed}/steps{SETTINGS[self.setting].steps}"


def plan() -> list[Run]:
    """Every run, in the order they go: the main setting's sweep, its other seeds, then the factors."""
    runs = [Run(MAIN, arm, 0, lr, "sweep") for arm in ARMS for lr in LRS]
    runs += [Run(MAIN, arm, seed, None, "seeds") for seed in SEEDS[1:] for arm in ARMS]
    runs += [Run(name, arm, seed, None, "seeds") for name in SETTINGS if name != MAIN for seed in SEEDS
             for arm in ARMS]
    return runs


def selected(runs: list[Run], only: list[str] | None) -> list[Run]:
    """The runs `--only` names: a setting, an arm, a phase or SETTING/ARM, any of them (all when None)."""
    if not only:
        return runs
    known = {*SETTINGS, *ARMS, "sweep", "seeds", *(f"{s}/{a}" for s in SETTINGS for a in ARMS)}
    unknown = [name for name in only if name not in known]
    if unknown:
        raise SystemExit(f"--only: unknown {unknown}; use settings {list(SETTINGS)}, arms {list(ARMS)}, "
                         "'sweep', 'seeds' or SETTING/ARM")
    return [r for r in runs if {r.setting, r.arm, r.phase, f"{r.setting}/{r.arm}"} & set(only)]


# --- what the reach analysis predicts ------------------------------------------------------------------

def model_config(name: str, arm: Arm) -> GPTConfig:
    """The model `piattn train` builds for this arm in this setting (the designer's periods for "cover")."""
    s = SETTINGS[name]
    fields = {k: v for k, v in dict(window=arm.window, period=arm.period, layers=arm.layers).items()
              if v is not None}
    return GPTConfig(vocab_size=mqar_vocab_size(TASK["keys"], TASK["values"]), block_size=s.seq_len, n_layer=s.layers,
                     n_head=s.heads, d_model=s.d_model, attention=arm.attention, sinks=arm.sinks, **fields)


def served(name: str, arm: str) -> list[int]:
    """The key–query distances the arm serves in the setting: d with the key (d back) and its value (d - 1
    back) both reachable within its layers (the reach its attention kind declares, `lag_reach`, or a hybrid
    stack's, `model_reach`). Sinks add pairs, not distances (`sink_pairs`)."""
    s, cfg = SETTINGS[name], model_config(name, ARMS[arm])
    reach = model_reach(cfg.to_dict(), s.seq_len - 1).reachable
    return [d for d in range(2, s.seq_len - 1) if reach[d] and reach[d - 1]]


def common_served(name: str) -> list[int]:
    """The distances every arm serves in the setting (sinks aside): where all arms are judged alike."""
    return sorted(set.intersection(*(set(served(name, arm)) for arm in ARMS)))


def sink_pairs(arm: str) -> int:
    """Pairs whose key and value sit among the arm's sinks: served at every distance."""
    return ARMS[arm].sinks // 2


def spans(distances: list[int]) -> str:
    """[2, 3, 4, 9] -> '2–4, 9' ('none' for none)."""
    return lag_runs(distances) or "none"


def predictions() -> dict:
    """{setting: {arm: {"served": [d], "spans": text, "periods": resolved periods or None, "sink_pairs": n}}}."""
    out = {}
    for name, s in SETTINGS.items():
        out[name] = {}
        for arm in ARMS:
            cfg = model_config(name, ARMS[arm])
            d = served(name, arm)
            out[name][arm] = dict(served=d, spans=spans(d), distances=s.seq_len - 3,
                                  periods=cfg.period if cfg.attention == "pi" else None, sink_pairs=sink_pairs(arm))
    return out


def predictions_text() -> str:
    lines = ["| setting | arm | periods | distances served (key and value reachable) | of |", "|---|---|---|---|---|"]
    for name, arms in predictions().items():
        s = SETTINGS[name]
        for arm, p in arms.items():
            extra = f" + pairs 0–{p['sink_pairs'] - 1} at any distance" if p["sink_pairs"] else ""
            periods = "—" if p["periods"] is None else str(p["periods"]).replace(" ", "")
            lines.append(f"| {name} (T {s.seq_len}, {s.layers} layers) | {arm} | {periods} | {p['spans']}{extra} | "
                         f"{len(p['served'])}/{p['distances']} |")
    return "\n".join(lines)


# --- runs --------------------------------------------------------------------------------------------

def distance_flags(name: str, arm: str) -> list[str]:
    """The setting's --mqar-lags for the arm: its served distances in `reach`, none (uniform, packed) else."""
    return ["--mqar-lags", lags_text(served(name, arm))] if SETTINGS[name].distances == "reach" else []


def train_argv(run: Run, lr: float, folder: Path) -> list[str]:
    s, t = SETTINGS[run.setting], TASK
    every = max(1, s.steps // VALIDATIONS)
    return ["train", "--task", "mqar", *ARMS[run.arm].flags(), *distance_flags(run.setting, run.arm),
            "--seq-len", str(s.seq_len),
            "--mqar-pairs", s.pairs, "--mqar-keys", str(t["keys"]), "--mqar-values", str(t["values"]),
            "--n-layer", str(s.layers), "--d-model", str(s.d_model), "--n-head", str(s.heads),
            "--batch-size", str(t["batch"]), "--train-size", str(t["train_size"]), "--eval-size", str(t["eval_size"]),
            "--steps", str(s.steps), "--lr", f"{lr:g}", "--min-lr", f"{lr * t['min_lr_ratio']:g}",
            "--warmup", str(t["warmup"]), "--dropout", "0", "--weight-decay", "0", "--eval-every", str(every),
            "--eval-batches", "4", "--save-every", "0", "--seed", str(run.seed), "--device", "cpu", "--no-progress",
            "--out", str(folder)]


def accuracy_over(result: dict, distances: set[int]) -> float | None:
    """Accuracy over the queries at `distances` (None: no such query), from an evaluation's by-distance counts."""
    counts = {int(d): q for d, q in result["queries_by_distance"].items() if int(d) in distances}
    if not counts:
        return None
    return sum(result["accuracy_by_distance"][str(d)] * q for d, q in counts.items()) / sum(counts.values())


def per_lag(result: dict, distances: list[int], min_queries: int = MIN_LAG_QUERIES) -> dict[int, float]:
    """{d: accuracy} over the distances with at least `min_queries` queries in the evaluation (the others
    too few to judge alone)."""
    queries = result["queries_by_distance"]
    return {d: result["accuracy_by_distance"][str(d)] for d in distances if queries.get(str(d), 0) >= min_queries}


def lag_verdict(result: dict, distances: list[int], min_queries: int = MIN_LAG_QUERIES) -> dict:
    """The per-distance judgement of one evaluation over `distances`: {"judged": distances with enough queries,
    "learned": those >= LEARNED, "worst": [d, accuracy] of the lowest (None: none judged), "every": all judged
    ones learned (None: none judged)}. Unlike the mean, one distance at chance fails it whatever their number."""
    accuracy = per_lag(result, distances, min_queries)
    worst = min(accuracy.items(), key=lambda item: (item[1], item[0])) if accuracy else None
    learned = sum(a >= LEARNED for a in accuracy.values())
    return dict(judged=len(accuracy), learned=learned, worst=list(worst) if worst else None,
                every=learned == len(accuracy) if accuracy else None)


def one_run(run: Run, lr: float, runs_dir: Path) -> dict:
    """Train and test one run; its record for runs.json."""
    folder = runs_dir / run.setting / f"{run.arm}-lr{lr:g}-seed{run.seed}-steps{SETTINGS[run.setting].steps}"
    result = train_and_test(folder, train_argv(run, lr, folder))
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    reach = set(served(run.setting, run.arm))
    validations = [r for r in records if r["split"] == "validation"]
    curve = [(r["step"], r["accuracy"], accuracy_over(r, reach)) for r in validations]
    learned = next((step for step, _, on_reach in curve if on_reach is not None and on_reach >= LEARNED), None)
    common = set(common_served(run.setting))
    curve_common = [(r["step"], accuracy_over(r, common)) for r in validations]
    every_lag = next((r["step"] for r in validations if lag_verdict(r, sorted(reach))["every"]), None)
    keep = ("accuracy", "loss", "chance", "queries", "accuracy_by_distance", "queries_by_distance",
            "accuracy_by_pairs", "queries_by_pairs", "by_pairs_distance")
    return dict(key=run.key(lr), setting=run.setting, arm=run.arm, seed=run.seed, lr=lr, phase=run.phase,
                steps=SETTINGS[run.setting].steps, steps_to_learn=learned, validation=curve,
                validation_common=curve_common,
                steps_to_learn_common=next((step for step, a in curve_common if a is not None and a >= LEARNED),
                                           None),
                steps_to_learn_every_lag=every_lag,
                validation_accuracy=curve[-1][1] if curve else None,
                wall_seconds=round(max(r["wall_seconds"] for r in records if r["split"] == "train"), 1),
                **{k: result[k] for k in keep})


def chosen_lr(done: dict[str, dict], arm: str) -> float | None:
    """The rate of the main setting's sweep with the best final validation accuracy (ties: the lower rate);
    None until every rate of the sweep has finished."""
    sweep = [done.get(Run(MAIN, arm, 0, lr, "sweep").key()) for lr in LRS]
    if any(r is None for r in sweep):
        return None
    return max(sweep, key=lambda r: (r["validation_accuracy"], -r["lr"]))["lr"]


def cost(run: Run) -> float:
    """Estimated one-thread seconds of a run: SECONDS_PER_STEP scaled by tokens, layers and width."""
    s, main = SETTINGS[run.setting], SETTINGS[MAIN]
    scale = (s.seq_len / main.seq_len) * (s.layers / main.layers) * (s.d_model / main.d_model) ** 1.5
    if ARMS[run.arm].attention == "dense":
        scale *= s.seq_len / main.seq_len  # its attention grows with the square of the length
    return OVERHEAD * s.seq_len / main.seq_len + s.steps * SECONDS_PER_STEP[ARMS[run.arm].attention] * scale


class Results:
    """OUT/runs.json: {"task", "runs": [record]}, rewritten (atomically) after every finished run."""

    def __init__(self, path: Path):
        self.path = path
        stored = json.loads(path.read_text()) if path.exists() else {"task": TASK, "runs": []}
        if stored["task"] != TASK:
            raise SystemExit(f"{path} holds runs of another task setting {stored['task']}; move it or use --out")
        self.done = {r["key"]: r for r in stored["runs"]}

    def add(self, record: dict) -> None:
        self.done[record["key"]] = record
        write_json(self.path, {"task": TASK, "runs": list(self.done.values())})


def resolved(run: Run, done: dict[str, dict]) -> float | None:
    """The run's learning rate: its own (sweep), else its arm's chosen rate (None: not chosen yet)."""
    return run.lr if run.lr is not None else chosen_lr(done, run.arm)


@contextlib.contextmanager
def children_quiet(log: Path):
    """While inside, every process's stderr (the trainer's validation lines, warnings) goes to the end of `log`;
    yields a stream on the terminal's stderr for the bar and the results."""
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    terminal = os.dup(2)
    stream = os.fdopen(os.dup(terminal), "w", buffering=1)
    with open(log, "a") as file:
        os.dup2(file.fileno(), 2)
        try:
            yield stream
        finally:
            sys.stderr.flush()
            os.dup2(terminal, 2)
            os.close(terminal)
            stream.close()


def execute(runs: list[Run], results: Results, runs_dir: Path, jobs: int, limit: int | None) -> None:
    """Run what is not done, sweep first (the other runs' rates come from it), `jobs` at a time, at most
    `limit` runs. A bar counts the runs' estimated seconds (`cost`), so its time left follows the measured
    pace; the trainers' own lines go to OUT/train.log."""
    todo = [r for r in runs if r.key(resolved(r, results.done) or 0.0) not in results.done]
    todo = todo[:limit] if limit is not None else todo
    log = results.path.parent / "train.log"
    with children_quiet(log) as terminal:
        bar = tqdm(total=sum(cost(r) for r in todo), file=terminal, dynamic_ncols=True,
                   bar_format="mqar {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} estimated s "
                   "[{elapsed} < {remaining}]")
        for phase in ("sweep", "seeds"):
            ready, waiting = [], []
            for r in (r for r in todo if r.phase == phase):
                lr = resolved(r, results.done)
                if lr is not None and r.key(lr) in results.done:  # its rate, chosen by the sweep just run, was done
                    bar.update(cost(r))
                else:
                    (ready if lr is not None else waiting).append((r, lr))
            for r, _ in waiting:
                bar.write(f"skipped {r.setting}/{r.arm} seed {r.seed}: the main sweep of {r.arm} is not finished "
                          "(run --only sweep first)", file=terminal)
                bar.update(cost(r))

            def go(job):
                run, lr = job
                return run, *timed_or_exit(run.key(lr), log, lambda: one_run(run, lr, runs_dir))

            with ThreadPoolExecutor(jobs) as pool:
                for run, record, seconds in pool.map(go, ready):
                    results.add(record)
                    bar.update(cost(run))
                    bar.write(f"{run.setting:8s} {run.arm:12s} lr {record['lr']:g} seed {run.seed}: accuracy "
                              f"{record['accuracy']:.3f}, learned at {record['steps_to_learn']} ({seconds:.0f} s)",
                              file=terminal)
        bar.close()


def print_plan(runs: list[Run], results: Results, jobs: int, limit: int | None) -> None:
    todo = 0.0
    print(f"{'#':>3}  {'setting':8s} {'arm':12s} {'phase':6s} {'lr':>8} {'seed':>4} {'steps':>6} {'est. s':>7}  status")
    left = limit
    for i, r in enumerate(runs, 1):
        lr = resolved(r, results.done)
        done = lr is not None and r.key(lr) in results.done
        status = "done" if done else "to run"
        if not done and left is not None:
            status, left = ("to run" if left > 0 else "beyond --limit"), left - 1
        if status == "to run":
            todo += cost(r)
        shown = f"{lr:g}" if lr is not None else "best"
        print(f"{i:>3}  {r.setting:8s} {r.arm:12s} {r.phase:6s} {shown:>8} {r.seed:>4} "
              f"{SETTINGS[r.setting].steps:>6} {cost(r):>7.0f}  {status}")
    by_setting = {name: sum(cost(r) for r in runs if r.setting == name) for name in SETTINGS}
    print("\nestimated one-thread hours per setting (all its runs): "
          + ", ".join(f"{n} {s / 3600:.1f}" for n, s in by_setting.items() if s))
    print(f"left to run: {todo / 3600:.1f} h on one thread; with --jobs {jobs}: about {todo / jobs / 3600:.1f} h wall "
          f"(SECONDS_PER_STEP {SECONDS_PER_STEP}, {OVERHEAD:.0f} s per run beside the steps)")


# --- tables and figure -------------------------------------------------------------------------------

def mean_sd(values: list[float | None], digits: int = 2) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "—"
    spread = f" ± {statistics.stdev(values):.{digits}f}" if len(values) > 1 else ""
    return f"{statistics.mean(values):.{digits}f}{spread}"


def seeds_text(values: list[int | None], recorded: list[bool]) -> str:
    """Steps per seed ("—": not learned, "n/r": a run recorded before the field was)."""
    return ", ".join("n/r" if not r else "—" if v is None else str(v) for v, r in zip(values, recorded, strict=True))


def final_runs(done: dict[str, dict], name: str, arm: str) -> list[dict]:
    """The runs of (setting, arm) at the arm's chosen rate (the main sweep's best), one per seed."""
    lr = chosen_lr(done, arm)
    return sorted((r for r in done.values() if r["setting"] == name and r["arm"] == arm and r["lr"] == lr
                   and r["steps"] == SETTINGS[name].steps), key=lambda r: r["seed"])


def summary(done: dict[str, dict]) -> dict:
    """{setting: {arm: numbers over its seeds}}: what the tables show and the verdicts read."""
    out = {}
    for name, s in SETTINGS.items():
        for arm in ARMS:
            rows = final_runs(done, name, arm)
            if not rows:
                continue
            reach = set(served(name, arm))
            beyond = set(range(2, s.seq_len - 1)) - reach
            pairs = parse_pairs(s.pairs)
            common = set(common_served(name))
            out.setdefault(name, {})[arm] = dict(
                lr=rows[0]["lr"], seeds=[r["seed"] for r in rows], accuracy=[r["accuracy"] for r in rows],
                served=[accuracy_over(r, reach) for r in rows], beyond=[accuracy_over(r, beyond) for r in rows],
                served_by_pairs={n: [accuracy_over(pairs_view(r, n), reach) for r in rows] for n in pairs},
                by_pairs={n: [r["accuracy_by_pairs"].get(str(n)) for r in rows] for n in pairs},
                steps_to_learn=[r["steps_to_learn"] for r in rows], wall_seconds=[r["wall_seconds"] for r in rows],
                # issue 59: judgements that do not favour arms serving more distances (new fields only)
                common=[accuracy_over(r, common) for r in rows],
                steps_to_learn_common=[r.get("steps_to_learn_common") for r in rows],
                served_lags=[lag_verdict(r, sorted(reach)) for r in rows],
                steps_to_learn_every_lag=[r.get("steps_to_learn_every_lag") for r in rows],
                validation_recorded=["steps_to_learn_common" in r for r in rows],
                latest_value=latest_value_share(name, arm))
    return out


def latest_value_share(name: str, arm: str) -> float:
    """The share of the setting's test queries (for this arm) whose nearest earlier value is their own: what
    "answer with the latest value" scores without matching a key (`distance_spread`); 1/pairs when packed."""
    return _latest_value(name, tuple(served(name, arm)) if SETTINGS[name].distances == "reach" else None)


@functools.cache
def _latest_value(name: str, lags: tuple[int, ...] | None) -> float:
    s = SETTINGS[name]
    data = mqar_mix(TASK["eval_size"], s.seq_len, parse_pairs(s.pairs), key_vocab=TASK["keys"],
                    value_vocab=TASK["values"], stratified=True, layout="scattered" if lags else "packed", lags=lags,
                    generator=torch.Generator().manual_seed(split_seed(0, "test")))
    return distance_spread(data)["latest_value_share"]


def tables(done: dict[str, dict]) -> str:
    numbers = summary(done)
    lines = []
    for name, arms in numbers.items():
        s = SETTINGS[name]
        pairs = parse_pairs(s.pairs)
        dense = arms.get("dense")
        counts = dense is not None and statistics.mean(dense["accuracy"]) >= 0.95
        lines += [f"### {name}: T = {s.seq_len}, {s.layers} layers, d_model {s.d_model}, {s.heads} heads, "
                  f"{s.pairs} pairs, {s.steps} steps of {TASK['batch']}",
                  "", f"Dense test accuracy {mean_sd(dense['accuracy']) if dense else 'not run'}: the setting "
                  f"{'counts' if counts else 'does not count'} (dense >= 0.95). Mean ± sd over seeds; served: the "
                  f"distances the reach analysis says the arm serves (key and value reachable), beyond: the others; "
                  f"learned: steps to >= {LEARNED} on served distances (validation), per seed."
                  + (" Every query is drawn at the arm's served distances (--mqar-lags, scattered layout): the "
                     "within-reach control." if s.distances == "reach" else ""), "",
                  "| arm | lr | served | accuracy | on served | beyond | " + " | ".join(f"served, {n} pairs"
                                                                                   for n in pairs)
                  + " | learned at | s / run |", "|---|---|---|---|---|---|" + "---|" * len(pairs) + "---|---|"]
        for arm, a in arms.items():
            learned = ", ".join("—" if v is None else str(v) for v in a["steps_to_learn"])
            per_pairs = " | ".join(mean_sd(a["served_by_pairs"][n]) for n in pairs)
            lines.append(f"| {arm} | {a['lr']:g} | {spans(served(name, arm))} | {mean_sd(a['accuracy'])} | "
                         f"{mean_sd(a['served'])} | {mean_sd(a['beyond'])} | {per_pairs} | {learned} | "
                         f"{statistics.mean(a['wall_seconds']):.0f} |")
        common = spans(common_served(name))
        lines += ["", f"Judgements that do not favour arms serving more distances: on the distances every arm serves "
                  f"({common}), and per served distance with >= {MIN_LAG_QUERIES} test queries (how many of those "
                  f"judged are >= {LEARNED}, per seed; the worst one's accuracy). Latest value: the share of test "
                  f"queries \"answer with the latest value\" gets right without matching a key (1/pairs when "
                  f"packed). n/r: a run recorded before these fields were.", "",
                  f"| arm | on common ({common}) | learned on common at | served distances >= {LEARNED} | worst "
                  f"distance | every served distance at | latest value |", "|---|---|---|---|---|---|---|"]
        for arm, a in arms.items():
            per_seed = " · ".join(f"{v['learned']}/{v['judged']}" for v in a["served_lags"])
            worst = mean_sd([v["worst"][1] if v["worst"] else None for v in a["served_lags"]])
            recorded = a["validation_recorded"]
            lines.append(f"| {arm} | {mean_sd(a['common'])} | {seeds_text(a['steps_to_learn_common'], recorded)} | "
                         f"{per_seed} | {worst} | {seeds_text(a['steps_to_learn_every_lag'], recorded)} | "
                         f"{a['latest_value']:.2f} |")
        lines.append("")
    sweep = [r for r in done.values() if r["phase"] == "sweep"]
    if sweep:
        lines += ["### Learning-rate sweep (main, seed 0): final validation accuracy", "",
                  "| arm | " + " | ".join(f"lr {lr:g}" for lr in LRS) + " | chosen |",
                  "|---|" + "---|" * (len(LRS) + 1)]
        for arm in ARMS:
            cells = [done.get(Run(MAIN, arm, 0, lr, "sweep").key()) for lr in LRS]
            chosen = chosen_lr(done, arm)
            shown = ["—" if c is None else f"{c['validation_accuracy']:.3f}" for c in cells]
            lines.append(f"| {arm} | " + " | ".join(shown) + f" | {'—' if chosen is None else f'{chosen:g}'} |")
    return "\n".join(lines)


def plot(done: dict[str, dict], path: Path) -> None:
    """Accuracy by key–query distance (bins of T / 16, pooled over seeds) per arm, one panel per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    names = [n for n in SETTINGS if any(final_runs(done, n, arm) for arm in ARMS)]
    if not names:
        return
    chance = next(iter(done.values()))["chance"]
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 3.8), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        s = SETTINGS[name]
        width = max(2, s.seq_len // 16)
        edges = list(range(2, s.seq_len - 1, width))
        for arm in ARMS:
            rows = final_runs(done, name, arm)
            if not rows:
                continue
            xs, ys = [], []
            for lo in edges:
                inside = set(range(lo, lo + width))
                values = [accuracy_over(r, inside) for r in rows]
                if any(v is not None for v in values):
                    xs.append(lo + (width - 1) / 2)
                    ys.append(statistics.mean(v for v in values if v is not None))
            line, = ax.plot(xs, ys, marker=".", ms=3, lw=1, label=arm)
            reach = served(name, arm)
            if len(reach) < s.seq_len - 3:  # a windowed arm: where its served distances end
                ax.axvline(max(reach) + 0.5, color=line.get_color(), ls=":", lw=0.8)
        ax.axhline(chance, color="grey", ls="--", lw=0.8, label="chance")
        ax.set_xscale("log")
        ax.set_xticks([t for t in (2, 4, 8, 16, 32, 64, 128, 256, 512) if t < s.seq_len])
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(plt.NullFormatter())
        ax.set_ylim(0, 1.05)
        ax.set_xlabel(f"key–query distance (bins of {width})")
        ax.set_title(f"{name}: T {s.seq_len}, {s.layers} layers, d {s.d_model}", fontsize=9)
    axes[0][0].set_ylabel("test accuracy (mean over seeds)")
    axes[0][-1].legend(fontsize=7, loc="upper right")
    fig.suptitle("MQAR accuracy by key–query distance\ndotted: the last distance each windowed arm serves", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(results: Results, out: Path) -> None:
    text = tables(results.done)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mqar.json").write_text(json.dumps(dict(task=TASK, settings={n: dataclasses.asdict(s) for n, s in
                                                                       SETTINGS.items()},
                                                   arms={n: dataclasses.asdict(a) for n, a in ARMS.items()},
                                                   lrs=LRS, seeds=SEEDS, predictions=predictions(),
                                                   common_served={n: common_served(n) for n in SETTINGS},
                                                   summary=summary(results.done),
                                                   runs=list(results.done.values())), indent=1) + "\n")
    (out / "mqar.md").write_text("# MQAR by key–query distance (experiments/mqar.py)\n\n## Predictions\n\n"
                                 + predictions_text() + "\n\n## Results\n\n" + text + "\n")
    plot(results.done, out / "mqar.png")
    print(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=Path, default=Path("runs/mqar"), help="where the run folders go")
    parser.add_argument("--out", type=Path, default=Path("experiments/results/mqar"),
                        help="results folder: runs.json (finished runs), mqar.json, mqar.md, mqar.png")
    parser.add_argument("--plan", action="store_true", help="print the runs and the estimated time; run nothing")
    parser.add_argument("--predictions", action="store_true", help="print what the reach analysis predicts")
    parser.add_argument("--report", action="store_true", help="tables and figure of the finished runs; run nothing")
    parser.add_argument("--only", nargs="+", metavar="NAME",
                        help=f"run only these: settings {list(SETTINGS)}, arms {list(ARMS)}, 'sweep', 'seeds' or "
                        "SETTING/ARM (a run named by any of them)")
    parser.add_argument("--limit", type=int, help="run at most this many of the runs not yet done")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time, each on one thread (default 1)")
    args = parser.parse_args(argv)
    if args.limit is not None and args.limit < 0:
        parser.error(f"--limit must be >= 0, got {args.limit}")
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    results = Results(args.out / "runs.json")
    runs = selected(plan(), args.only)
    if args.predictions:
        print(predictions_text())
    elif args.plan:
        print_plan(runs, results, args.jobs, args.limit)
    else:
        if not args.report:
            execute(runs, results, args.runs, args.jobs, args.limit)
        report(results, args.out)


if __name__ == "__main__":
    main()
