"""Steps-to-learn of random-lag recall, over many seeds: does multi-scale π learn as reliably as one period?
(issue 39, item 3)

Each run is `piattn train --task recall` validated every EVERY steps on a split that holds every lag equally
often. Steps-to-learn is the first validation step at which the accuracy over a set of lags is >= LEARNED:
over the lags every arm of the setting reaches ("common": single π's, since dense and the designed periods
reach all of them) and over the arm's own reachable lags ("own"). A run stops once both are learned, or at the
setting's step budget (then its steps-to-learn is None: not learned). No test split is scored: the curve is
the result.

Two caveats (issue 59): training uses --recall-loss every, so lag ℓ gets signal in proportion to T - ℓ and the
longest lags are the least trained (say so where a verdict rests on them); and "own" averages over the arm's own
reachable lags, which favours arms with more of them (one lag at chance costs an arm of 24 lags 3.6 points, one
of 78 lags 1.1): the verdicts read "common".

    python experiments/learnability.py --plan                      # the runs, done or not
    python experiments/learnability.py --settings T64-L4 --arms dense pi cover --seeds 0 1 2 3 4 5 6 7
    python experiments/learnability.py --report                    # tables and figure of the finished runs

Resumable: OUT/runs.json holds every finished run and is rewritten after each; an unfinished run folder is
started again. Writes OUT/learnability.{json,md,png}, OUT defaulting to experiments/results/learnability/.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from runs import write_json
from tqdm import tqdm

from piattn.analysis import design_periods, min_depth_multi, periods_per_layer
from piattn.analysis.multiscale import lag_routes
from piattn.config.training import period_text


@dataclasses.dataclass(frozen=True)
class Setting:
    """A recall task and model: the single-π pattern (window, period) and the step budget."""

    seq_len: int
    layers: int
    window: int = 4
    period: int = 16
    steps: int = 4000
    d_model: int = 64
    heads: int = 4
    symbols: int = 8
    batch: int = 32


# 64 tokens at 4 and at 3 layers: the designer can give every lag 2 routes in both (at 96 tokens and 3 layers
# of 4 heads it cannot: some lag keeps 1 route at every ratio).
SETTINGS = {"T64-L4": Setting(seq_len=64, layers=4), "T64-L3": Setting(seq_len=64, layers=3),
            # T64-L4 with a budget of twice single π's median there (3,200): its rule's second clause asks whether
            # a seed learns within 6,400 steps, which the 4,000-step schedule cannot tell for the seeds it missed.
            "T64-L4-6400": Setting(seq_len=64, layers=4, steps=6400)}
EVERY = 100  # validation interval, in steps
PER_LAG = 10  # validation examples per lag
LEARNED = 0.9
# recall.md's schedule. A 30-step warm-up at this rate leaves some seeds of every arm on the plateau for
# thousands of steps (docs/results.md §7c); the -warmup arms take 400.
LR, MIN_LR, WARMUP = 3e-3, 3e-4, 30


def cover(s: Setting, target: int | None = None, routes: int = 1) -> tuple[tuple[int, ...], ...]:
    """The designer's periods reaching every lag up to `target` (default seq_len - 1) with at least `routes`
    routes each (`design_periods`)."""
    return design_periods(s.window, s.layers, s.heads, target or s.seq_len - 1, routes=routes).periods


def single_pi(s: Setting) -> tuple[tuple[int, ...], ...]:
    """The setting's one period on every head of every layer."""
    return periods_per_layer(s.period, s.layers, s.heads)


def paired_cover(s: Setting) -> tuple[tuple[int, ...], ...]:
    """Each designed period on two heads: the design for H/2 heads, every period repeated."""
    half = design_periods(s.window, s.layers, s.heads // 2, s.seq_len - 1).periods
    return tuple(tuple(p for p in layer for _ in range(2)) for layer in half)


# Arm -> the schedule builder (None: dense). Ablation arms vary one thing of "cover": its periods, or a
# training flag (ARM_FLAGS).
ARMS = {
    "dense": None,
    "pi": single_pi,
    "cover": cover,
    "cover-r2": lambda s: cover(s, routes=2),  # every lag at least 2 routes
    "cover-x2": lambda s: cover(s, 2 * (s.seq_len - 1)),  # designed for twice the longest lag: more routes
    "cover-paired": paired_cover,
    "cover-warmup": cover,
    "cover-lr1e-3": cover,
    "cover-union": cover,
    # the schedule ablations on single π: a schedule that speeds up every arm says nothing about multi-scale π
    "pi-warmup": single_pi,
    "pi-lr1e-3": single_pi,
    # the library's own default warm-up (`piattn train --warmup`, 100 steps)
    "cover-warmup100": cover,
    "pi-warmup100": single_pi,
    "cover-paired-warmup": paired_cover,
}
# Flags an arm sets beside the common ones, placed last (later flags win in argparse). cover-union drops the
# gate (one softmax over local and skip keys): is the gate's learned prior what holds some seeds back?
WARMUP_100, WARMUP_400, LR_1E3 = ["--warmup", "100"], ["--warmup", "400"], ["--lr", "1e-3", "--min-lr", "1e-4"]
ARM_FLAGS = {"cover-warmup": WARMUP_400, "cover-lr1e-3": LR_1E3, "cover-union": ["--variant", "union"],
             "pi-warmup": WARMUP_400, "pi-lr1e-3": LR_1E3, "cover-warmup100": WARMUP_100,
             "pi-warmup100": WARMUP_100, "cover-paired-warmup": WARMUP_400}


def schedule_of(name: str, arm: str):
    """The arm's Schedule in the setting (None for dense)."""
    build = ARMS[arm]
    return None if build is None else build(SETTINGS[name])


def reachable_lags(name: str, arm: str) -> list[int]:
    """Lags whose value (lag back) and marker (lag - 1 back, value-marker order) the arm's layers reach."""
    s, periods = SETTINGS[name], schedule_of(name, arm)
    lags = range(2, s.seq_len)
    if periods is None:
        return list(lags)
    ok = {d for d in range(1, s.seq_len) if (m := min_depth_multi(d, s.window, periods)) is not None
          and m <= s.layers}
    return [lag for lag in lags if lag in ok and lag - 1 in ok]


def routes(name: str, arm: str) -> list[int]:
    """[lag]: its routes through the arm's layers (`lag_routes`): the fewer, the fewer ways to learn it."""
    s = SETTINGS[name]
    return lag_routes(s.window, schedule_of(name, arm), s.seq_len - 1).tolist()


def common_lags(name: str) -> list[int]:
    """The lags every arm reaches: single π's (a subset of every other arm's)."""
    return reachable_lags(name, "pi")


def pi_reference(arm: str) -> str:
    """The single-π arm an arm is judged against: the one trained with the same flags ("cover-warmup" and
    "cover-paired-warmup" against "pi-warmup"), "pi" where there is none."""
    flags = ARM_FLAGS.get(arm)
    return next((a for a in ARMS if a.startswith("pi") and flags and ARM_FLAGS.get(a) == flags), "pi")


def train_argv(name: str, arm: str, seed: int, folder: Path) -> list[str]:
    s = SETTINGS[name]
    lags = s.seq_len - 2
    argv = ["train", "--task", "recall", "--seq-len", str(s.seq_len), "--recall-symbols", str(s.symbols),
            "--lag-min", "2", "--lag-max", str(s.seq_len - 1), "--recall-order", "value-marker",
            "--recall-loss", "every", "--n-layer", str(s.layers), "--d-model", str(s.d_model), "--n-head",
            str(s.heads), "--batch-size", str(s.batch), "--train-size", "50000", "--eval-size", str(PER_LAG * lags),
            "--eval-batches", "0", "--steps", str(s.steps), "--lr", f"{LR:g}", "--min-lr", f"{MIN_LR:g}",
            "--warmup", str(WARMUP), "--dropout", "0", "--weight-decay", "0", "--eval-every", str(EVERY),
            "--save-every", "0", "--log-every", str(EVERY), "--seed", str(seed), "--device", "cpu", "--no-progress",
            "--out", str(folder)]
    periods = schedule_of(name, arm)
    if periods is None:
        argv += ["--attention", "dense"]
    else:
        argv += ["--attention", "pi", "--window", str(s.window), "--period",
                 period_text([list(p) for p in periods]), "--variant", "adaptive"]
    return argv + ARM_FLAGS.get(arm, [])


def accuracy_over(record: dict, lags: list[int]) -> float:
    by_lag = record["accuracy_by_lag"]
    return statistics.mean(by_lag[str(lag)] for lag in lags)


def validations(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # the line being written
            break
    return [r for r in records if r.get("split") == "validation"]


def one_run(name: str, arm: str, seed: int, runs_dir: Path) -> dict:
    """Train until both lag sets are learned or the budget ends; the run's record."""
    folder = runs_dir / name / f"{arm}-seed{seed}"
    shutil.rmtree(folder, ignore_errors=True)  # an unfinished run starts again
    folder.parent.mkdir(parents=True, exist_ok=True)
    sets = {"common": common_lags(name), "own": reachable_lags(name, arm)}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    with open(folder.parent / f"{arm}-seed{seed}.log", "w") as log:
        process = subprocess.Popen([sys.executable, "-m", "piattn.cli", *train_argv(name, arm, seed, folder)],
                                   stdout=subprocess.DEVNULL, stderr=log, env=env)
        learned: dict[str, int | None] = dict.fromkeys(sets)
        curve = []
        while True:
            done = process.poll() is not None
            records = validations(folder)
            curve = [(r["step"], r["accuracy"], *(accuracy_over(r, lags) for lags in sets.values())) for r in records]
            for step, _, *on in curve:
                for key, value in zip(sets, on, strict=True):
                    if learned[key] is None and value >= LEARNED:
                        learned[key] = step
            if all(v is not None for v in learned.values()):
                process.terminate()
                process.wait()
                break
            if done:
                if process.returncode:
                    raise RuntimeError(f"{folder}: piattn train exited {process.returncode}; see {log.name}")
                break
            time.sleep(1.0)
    return dict(key=f"{name}/{arm}/seed{seed}", setting=name, arm=arm, seed=seed, steps=SETTINGS[name].steps,
                steps_to_learn=learned, curve=curve, curve_columns=["step", "all", *sets],
                wall_seconds=round(time.perf_counter() - start, 1), periods=schedule_of(name, arm))


class Results:
    """OUT/runs.json: {"settings", "runs": [record]}, rewritten atomically after every finished run."""

    def __init__(self, path: Path):
        self.path = path
        self.settings = {n: dataclasses.asdict(s) for n, s in SETTINGS.items()}
        stored = json.loads(path.read_text()) if path.exists() else {"settings": self.settings, "runs": []}
        for n, s in stored["settings"].items():
            if n in self.settings and self.settings[n] != s:
                raise SystemExit(f"{path}: setting {n} was run as {s}, now {self.settings[n]}; move it or use --out")
        self.done = {r["key"]: r for r in stored["runs"]}

    def add(self, record: dict) -> None:
        self.done[record["key"]] = record
        write_json(self.path, {"settings": self.settings, "runs": list(self.done.values())})


# --- report ------------------------------------------------------------------------------------------

def median_or_none(values: list[int | None], budget: int) -> int | None:
    """The upper median (of an even count, the larger middle value: a run that never learned has no value to
    average), with a run that never learned counted as after the budget; None if that is the median."""
    m = statistics.median_high(budget + 1 if v is None else v for v in values)
    return None if m > budget else m


def table(results: Results) -> str:
    lines = [f"Steps-to-learn: first validation step (every {EVERY}) with accuracy ≥ {LEARNED} over the lags; "
             "'common' = the lags single π reaches (every arm reaches them), 'own' = the arm's reachable lags; "
             "— = not within the budget. Median: the upper median, a run that never learned counted as after the "
             "budget.", ""]
    for name, s in SETTINGS.items():
        rows = [r for r in results.done.values() if r["setting"] == name]
        if not rows:
            continue
        lines += [f"### {name}: {s.seq_len} tokens, {s.layers} layers, d_model {s.d_model}, {s.heads} heads, "
                  f"k {s.window}, single π {s.period}; budget {s.steps} steps, batch {s.batch}, lr {LR:g}", "",
                  "| arm | periods | fewest routes (common / own lags) | seeds | common: steps per seed | "
                  "median | π arm | / π's | learned ≤ 2× π's median | own: median |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        medians = {arm: median_or_none([r["steps_to_learn"]["common"] for r in rows if r["arm"] == arm], s.steps)
                   for arm in {r["arm"] for r in rows}}
        for arm in ARMS:
            mine = sorted((r for r in rows if r["arm"] == arm), key=lambda r: r["seed"])
            if not mine:
                continue
            reference = pi_reference(arm)
            if reference not in medians:  # its single-π arm not run in this setting
                reference = "pi"
            pi_median = medians.get(reference)
            common = [r["steps_to_learn"]["common"] for r in mine]
            own = [r["steps_to_learn"]["own"] for r in mine]
            med = median_or_none(common, s.steps)
            ratio = "—" if med is None or not pi_median else f"{med / pi_median:.2f}"
            within = "—" if not pi_median else \
                f"{sum(v is not None and v <= 2 * pi_median for v in common)}/{len(common)}"
            periods = "—" if mine[0]["periods"] is None else period_text([list(p) for p in mine[0]["periods"]])
            fewest = "—"
            if ARMS[arm] is not None:
                count = routes(name, arm)
                fewest = " / ".join(str(min(min(count[lag], count[lag - 1]) for lag in lags))
                                    for lags in (common_lags(name), reachable_lags(name, arm)))
            own_med = median_or_none(own, s.steps)
            lines.append(f"| {arm} | {periods} | {fewest} | {len(mine)} | "
                         f"{', '.join('—' if v is None else str(v) for v in common)} | "
                         f"{'—' if med is None else f'{med:g}'} | {reference} | {ratio} | {within} | "
                         f"{'—' if own_med is None else f'{own_med:g}'} |")
        lines.append("")
    return "\n".join(lines)


def plot(results: Results, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in SETTINGS if any(r["setting"] == n for r in results.done.values())]
    if not names:
        return
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 3.8), squeeze=False)
    colours = dict(zip(ARMS, ("black", "tab:blue", "tab:orange", "tab:purple", "tab:green", "tab:red", "tab:brown",
                              "tab:pink", "tab:olive", "tab:cyan", "tab:gray",
                              "gold", "navy", "lime"), strict=True))
    for ax, name in zip(axes[0], names, strict=True):
        for r in results.done.values():
            if r["setting"] != name:
                continue
            column = r["curve_columns"].index("common")
            ax.plot([c[0] for c in r["curve"]], [c[column] for c in r["curve"]], color=colours[r["arm"]], lw=0.8,
                    alpha=0.7, label=r["arm"])
        handles = {h.get_label(): h for h in ax.get_lines()}
        ax.legend(handles.values(), handles.keys(), fontsize=7)
        ax.axhline(LEARNED, color="grey", ls=":", lw=0.8)
        ax.set_title(f"{name}: validation accuracy on single π's lags", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylim(0, 1.02)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(results: Results, out: Path) -> None:
    text = table(results)
    (out / "learnability.md").write_text("## Steps-to-learn of random-lag recall (experiments/learnability.py)\n\n"
                                         + text + "\n")
    (out / "learnability.json").write_text(json.dumps({"settings": results.settings,
                                                       "runs": list(results.done.values())}, indent=1) + "\n")
    plot(results, out / "learnability.png")
    print(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--arms", nargs="+", default=["pi", "cover", "cover-r2", "dense"], choices=list(ARMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=list(range(8)))
    parser.add_argument("--workers", type=int, default=1, help="runs at a time, one thread each (default 1)")
    parser.add_argument("--out", type=Path, default=Path("experiments/results/learnability"))
    parser.add_argument("--runs", type=Path, default=Path("runs/learnability"))
    parser.add_argument("--plan", action="store_true", help="list the runs, done or not, and stop")
    parser.add_argument("--report", action="store_true", help="write the tables and figure of finished runs only")
    args = parser.parse_args()
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    results = Results(args.out / "runs.json")
    todo = [(n, a, seed) for n in args.settings for seed in args.seeds for a in args.arms]
    if args.plan:
        for n, a, seed in todo:
            done = results.done.get(f"{n}/{a}/seed{seed}")
            print(f"{n}/{a}/seed{seed}: " + ("not run" if done is None else f"learned {done['steps_to_learn']}"))
        return
    if not args.report:
        todo = [job for job in todo if f"{job[0]}/{job[1]}/seed{job[2]}" not in results.done]
        with tqdm(total=len(todo), desc="learnability", unit="run") as bar, ThreadPoolExecutor(args.workers) as pool:
            def job(spec):
                record = one_run(*spec, args.runs)
                results.add(record)
                bar.write(f"{record['key']}: learned {record['steps_to_learn']} ({record['wall_seconds']:.0f} s)")
                bar.update()
            list(pool.map(job, todo))
    report(results, args.out)


if __name__ == "__main__":
    main()
