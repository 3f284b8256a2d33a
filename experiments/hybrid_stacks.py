"""MQAR in hybrid stacks: windowed layers (local, local + sinks, π, multi-scale π, a wide window, π + sinks) with
one dense layer, against an all-dense stack; steps-to-learn, the windowed:dense ratio at which each still learns,
accuracy by distance (issue 59, part (a); the rule in docs/results.md §11).

The MQAR study's task and recipe (experiments/mqar.py's TASK, its arms' windowed patterns, each arm at the rate
its main-setting sweep chose, read from that study's runs.json), with the pattern of the windowed arm in every
layer but the dense one (`--layers`, e.g. "pi*3,dense"). Every run validates each VALIDATE_EVERY steps on
VALIDATION_BATCHES batches and stops at the first validation whose accuracy reaches TARGET (`--stop-at`): that
step is its steps-to-learn; a run that does not get there in STEPS steps is "not learned" (NOT_LEARNED in
medians). The test split is scored at the last checkpoint, by distance.

    python experiments/hybrid_stacks.py --plan           # the phases' runs in order, done or not
    python experiments/hybrid_stacks.py                  # every phase in order (resumable), then the tables
    python experiments/hybrid_stacks.py --only h4-last   # one setting (or an arm, or SETTING/ARM); --limit N
    python experiments/hybrid_stacks.py --jobs 2         # two runs of a phase at a time (one thread each)
    python experiments/hybrid_stacks.py --report         # tables and figure of the finished runs only

Phase 2 of the rule, the within-reach control, is experiments/mqar.py's setting `reach`
(`python experiments/mqar.py --only reach --limit 6`: seed 0 of its six arms); its table is in
experiments/results/mqar/mqar.md and is quoted beside these.

Resumable: OUT/runs.json holds every finished run, rewritten after each; `runs.train_and_test` continues a run
cut short from its latest checkpoint. Writes OUT/stacks.json, OUT/stacks.md and OUT/stacks.png, OUT defaulting
to experiments/results/hybrids/.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import mqar
from runs import timed_or_exit, train_and_test, write_json
from tqdm import tqdm

STEPS = 4000
VALIDATE_EVERY = 200
VALIDATION_BATCHES = 8  # 8 × 64 sequences × 4 queries = 2,048 validation queries
TARGET = 0.99
NOT_LEARNED = STEPS + VALIDATE_EVERY  # a run that never learned, in medians
SEQ_LEN, D_MODEL, HEADS = 64, 64, 4
DENSE = "dense"


@dataclasses.dataclass(frozen=True)
class Stack:
    """A hybrid setting: `layers` layers, the dense one at index `dense_at`, `pairs` key–value pairs."""

    layers: int
    dense_at: int
    pairs: str = "4"

    def pattern(self, kind: str) -> str:
        """The --layers pattern: `kind` in every layer but the dense one ("pi*3,dense", "pi,dense,pi*2")."""
        parts = []
        if self.dense_at:
            parts.append(kind if self.dense_at == 1 else f"{kind}*{self.dense_at}")
        parts.append(DENSE)
        after = self.layers - self.dense_at - 1
        if after:
            parts.append(kind if after == 1 else f"{kind}*{after}")
        return ",".join(parts)

    @property
    def ratio(self) -> str:
        return f"{self.layers - 1}:1"


SETTINGS = {
    "h4-last": Stack(4, 3),
    "h8-last": Stack(8, 7),
    "h4-pairs8": Stack(4, 3, "8"),
    "h8-pairs8": Stack(8, 7, "8"),
    "h4-second": Stack(4, 1),
}
WINDOWED = tuple(a for a in mqar.ARMS if a != DENSE)
# The rule's amendment (docs/results.md §11, set before its runs): π with local + sinks' 4 sinks, so that the
# skip key is the only difference from the field's window. Not an arm of the MQAR study: it trains at the rate
# of the arm named here, whose sweep chose it (π's, 3e-3, which local + sinks' sweep chose too).
HYBRID_ONLY = {"pi-k4-p16-s4": (mqar.Arm("pi", 4, 16, sinks=4), "pi-k4-p16")}
ARMS = {**mqar.ARMS, **{name: arm for name, (arm, _) in HYBRID_ONLY.items()}}
PI_ARMS = ("pi-k4-p16", "pi-k4-cover", *HYBRID_ONLY)  # the arms clause 1 sets against the windows
# The rule's phases, in order: (setting, seeds, arms). Phase 2, the within-reach control, runs in mqar.py. The
# amendment's two settings run after phase 4, before the dense layer moves (h4-second) and the extra seeds.
PHASES = (
    ("h4-last", (0, 1, 2), (*WINDOWED, DENSE)),
    ("h8-last", (0, 1), WINDOWED),
    ("h4-pairs8", (0, 1), WINDOWED),
    ("h8-pairs8", (0, 1), WINDOWED),
    ("h4-last", (0, 1, 2), tuple(HYBRID_ONLY)),
    ("h8-last", (0, 1), tuple(HYBRID_ONLY)),
    ("h4-second", (0, 1, 2), WINDOWED),
    ("h4-last", (3, 4), WINDOWED),
)
# Measured before the rule (100 steps, one thread, the other core busy): seconds a step by depth.
SECONDS_PER_STEP = {4: 0.20, 8: 0.39}


@dataclasses.dataclass(frozen=True)
class Run:
    setting: str
    arm: str
    seed: int
    phase: int  # the index of its phase in PHASES (not part of the key)

    @property
    def key(self) -> str:
        return f"{self.setting}/{self.arm}/seed{self.seed}"


def plan() -> list[Run]:
    return [Run(name, arm, seed, phase) for phase, (name, seeds, arms) in enumerate(PHASES) for seed in seeds
            for arm in arms]


def selected(runs: list[Run], only: list[str] | None) -> list[Run]:
    if not only:
        return runs
    known = {*SETTINGS, *ARMS, *(f"{s}/{a}" for s in SETTINGS for a in ARMS)}
    unknown = [n for n in only if n not in known]
    if unknown:
        raise SystemExit(f"--only: unknown {unknown}; use settings {list(SETTINGS)}, arms {list(ARMS)} or "
                         "SETTING/ARM")
    return [r for r in runs if {r.setting, r.arm, f"{r.setting}/{r.arm}"} & set(only)]


def chosen_rates() -> dict[str, float]:
    """Each arm's rate from the MQAR study's main-setting sweep (its runs.json): one home for the fact."""
    done = mqar.Results(Path(mqar.__file__).parent / "results" / "mqar" / "runs.json").done
    rates = {arm: mqar.chosen_lr(done, arm) for arm in mqar.ARMS}
    rates.update({arm: rates[source] for arm, (_, source) in HYBRID_ONLY.items()})
    missing = [arm for arm, lr in rates.items() if lr is None]
    if missing:
        raise SystemExit(f"the MQAR study's sweep has not chosen a rate for {missing}: run experiments/mqar.py "
                         "--only sweep first")
    return rates


def arm_flags(run: Run) -> list[str]:
    """The arm's `piattn train` flags in the setting: the windowed pattern around the dense layer, or dense."""
    arm = ARMS[run.arm]
    if run.arm == DENSE:
        return arm.flags()
    return dataclasses.replace(arm, layers=SETTINGS[run.setting].pattern(arm.attention)).flags()


def train_argv(run: Run, lr: float, folder: Path) -> list[str]:
    s, t = SETTINGS[run.setting], mqar.TASK
    return ["train", "--task", "mqar", *arm_flags(run), "--seq-len", str(SEQ_LEN), "--mqar-pairs", s.pairs,
            "--mqar-keys", str(t["keys"]), "--mqar-values", str(t["values"]), "--n-layer", str(s.layers),
            "--d-model", str(D_MODEL), "--n-head", str(HEADS), "--batch-size", str(t["batch"]),
            "--train-size", str(t["train_size"]), "--eval-size", str(t["eval_size"]), "--steps", str(STEPS),
            "--lr", f"{lr:g}", "--min-lr", f"{lr * t['min_lr_ratio']:g}", "--warmup", str(t["warmup"]),
            "--dropout", "0", "--weight-decay", "0", "--eval-every", str(VALIDATE_EVERY),
            "--eval-batches", str(VALIDATION_BATCHES), "--stop-at", f"accuracy>={TARGET}", "--save-every", "1000",
            "--seed", str(run.seed), "--device", "cpu", "--no-progress", "--out", str(folder)]


def one_run(run: Run, lr: float, runs_dir: Path) -> dict:
    folder = runs_dir / run.setting / f"{run.arm}-seed{run.seed}"
    result = train_and_test(folder, train_argv(run, lr, folder))
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    stopped = json.loads((folder / "summary.json").read_text()).get("stopped_at")
    validations = [(r["step"], r["accuracy"]) for r in records if r["split"] == "validation"]
    distances = list(range(2, SEQ_LEN - 1))  # a dense layer reaches every one
    keep = ("accuracy", "loss", "chance", "queries", "accuracy_by_distance", "queries_by_distance")
    return dict(key=run.key, setting=run.setting, arm=run.arm, seed=run.seed, lr=lr, pattern=arm_flags(run),
                steps_to_learn=stopped["step"] if stopped else None, validation=validations,
                per_distance=mqar.lag_verdict(result, distances), last_step=result.get("step"),
                wall_seconds=round(max(r["wall_seconds"] for r in records if r["split"] == "train"), 1),
                **{k: result[k] for k in keep})


def cost(run: Run) -> float:
    """Estimated one-thread seconds of a run if it never stops early."""
    return 30 + STEPS * SECONDS_PER_STEP[SETTINGS[run.setting].layers]


def execute(runs: list[Run], results: mqar.Results, runs_dir: Path, limit: int | None, jobs: int = 1) -> None:
    """Run what is not done, at most `limit` runs, phase by phase (the rule's order: a phase finishes before the
    next starts), `jobs` runs of a phase at a time (each one thread). Each run's record is kept (OUT/runs.json
    rewritten) as soon as it ends."""
    todo = [r for r in runs if r.key not in results.done]
    todo = todo[:limit] if limit is not None else todo
    if not todo:
        return
    rates = chosen_rates()
    log = results.path.parent / "train.log"

    def go(run: Run) -> tuple[Run, dict, float]:
        return run, *timed_or_exit(run.key, log, lambda: one_run(run, rates[run.arm], runs_dir))

    with mqar.children_quiet(log) as terminal:
        bar = tqdm(total=sum(cost(r) for r in todo), file=terminal, dynamic_ncols=True,
                   bar_format="hybrid MQAR {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} estimated s at most "
                   "[{elapsed} < {remaining}]")
        for phase in sorted({r.phase for r in todo}):
            with ThreadPoolExecutor(jobs) as pool:
                futures = [pool.submit(go, r) for r in todo if r.phase == phase]
                for future in as_completed(futures):  # each record kept as soon as its run ends
                    run, record, seconds = future.result()
                    results.add(record)
                    bar.update(cost(run))
                    bar.write(f"{run.key}: test accuracy {record['accuracy']:.3f}, learned at "
                              f"{record['steps_to_learn']} ({seconds:.0f} s)", file=terminal)
        bar.close()


# --- tables and figure -------------------------------------------------------------------------------

def runs_of(done: dict[str, dict], setting: str, arm: str) -> list[dict]:
    return sorted((r for r in done.values() if r["setting"] == setting and r["arm"] == arm), key=lambda r: r["seed"])


def median_steps(rows: list[dict]) -> float:
    return statistics.median(NOT_LEARNED if r["steps_to_learn"] is None else r["steps_to_learn"] for r in rows)


def summary(done: dict[str, dict]) -> dict:
    """{setting: {arm: its seeds' numbers}} and the rule's clauses 1–2 where they can be read."""
    out: dict = {"settings": {}, "clauses": {}}
    for name in SETTINGS:
        arms = {}
        for arm in ARMS:
            rows = runs_of(done, name, arm)
            if rows:
                arms[arm] = dict(seeds=[r["seed"] for r in rows], steps_to_learn=[r["steps_to_learn"] for r in rows],
                                 median_steps=median_steps(rows), learns=all(r["steps_to_learn"] for r in rows),
                                 accuracy=[r["accuracy"] for r in rows],
                                 worst_distance=[r["per_distance"]["worst"] for r in rows],
                                 wall_seconds=[r["wall_seconds"] for r in rows], lr=rows[0]["lr"])
        if arms:
            out["settings"][name] = arms
            out["clauses"][name] = steps_clause(arms, first_phase_seeds(name))
    out["ratio"] = ratio_clause(out["settings"])
    return out


def first_phase_seeds(setting: str) -> int:
    """How many seeds the phase that introduces `setting` runs (3 for h4-last, 2 for h8-last): fewer is a
    provisional verdict; a later phase's extra seeds (h4-last's 3 and 4) only add to a judged one."""
    return next(len(seeds) for name, seeds, _ in PHASES if name == setting)


def steps_clause(arms: dict, planned_seeds: int) -> dict:
    """Clause 1: each π arm's (PI_ARMS) median steps-to-learn against the better of local-k4 and local-k4-s4;
    provisional while any of the three has fewer than `planned_seeds` seeds."""
    windows = [arms[a]["median_steps"] for a in ("local-k4", "local-k4-s4") if a in arms]
    if len(windows) < 2:
        return {}
    best_window, worst_window = min(windows), max(windows)
    out = {}
    for arm in PI_ARMS:
        if arm not in arms:
            continue
        steps = arms[arm]["median_steps"]
        # at most 0.75× the better window is at most 0.75× both
        text = "π helps" if steps <= 0.75 * best_window else "worse" if steps > 1.33 * best_window else "no difference"
        seeds = min(len(arms[a]["seeds"]) for a in (arm, "local-k4", "local-k4-s4"))
        out[arm] = dict(verdict=text, ratio_to_best_window=round(steps / best_window, 3),
                        windows=[best_window, worst_window], provisional=seeds < planned_seeds)
    return out


def ratio_clause(settings: dict) -> dict:
    """Clause 2: per number of pairs, the largest ratio at which each arm learns (every seed run)."""
    out = {}
    for pairs in ("4", "8"):
        names = [n for n, s in SETTINGS.items() if s.pairs == pairs and s.dense_at == s.layers - 1 and n in settings]
        for arm in ARMS:
            learned = [SETTINGS[n].ratio for n in names if arm in settings[n] and settings[n][arm]["learns"]]
            tried = [SETTINGS[n].ratio for n in names if arm in settings[n]]
            if tried:
                out.setdefault(pairs, {})[arm] = dict(tried=tried, learned=learned)
    return out


def tables(done: dict[str, dict]) -> str:
    s = summary(done)
    lines = []
    for name, arms in s["settings"].items():
        st = SETTINGS[name]
        lines += [f"### {name}: {st.layers} layers, the dense one at index {st.dense_at} ({st.ratio}), "
                  f"{st.pairs} pairs",
                  "", f"Steps to the first validation with accuracy ≥ {TARGET} (every {VALIDATE_EVERY} steps, at most "
                  f"{STEPS}; — not learned, counted as {NOT_LEARNED} in the median); test accuracy at the last "
                  "checkpoint; the worst distance with ≥ 20 test queries.", "",
                  "| arm | lr | learned at (per seed) | median | test accuracy | worst distance | s / run |",
                  "|---|---|---|---|---|---|---|"]
        for arm, a in arms.items():
            steps = ", ".join("—" if v is None else str(v) for v in a["steps_to_learn"])
            worst = ", ".join("—" if w is None else f"{w[0]}: {w[1]:.2f}" for w in a["worst_distance"])
            lines.append(f"| {arm} | {a['lr']:g} | {steps} | {a['median_steps']:.0f} | "
                         f"{mqar.mean_sd(a['accuracy'], 3)} | {worst} | {statistics.mean(a['wall_seconds']):.0f} |")
        clause = s["clauses"].get(name)
        if clause:
            lines += ["", "Clause 1 (median steps against the better of local-k4 and local-k4-s4): "
                      + "; ".join(f"{arm} {c['verdict']} ({c['ratio_to_best_window']}×"
                                  + (", provisional: not every planned seed)" if c["provisional"] else ")")
                                  for arm, c in clause.items())]
        lines.append("")
    if s["ratio"]:
        lines += ["### Clause 2: the ratios at which each arm learns (dense layer last)", "",
                  "| pairs | arm | ratios tried | learned at |", "|---|---|---|---|"]
        for pairs, arms in s["ratio"].items():
            for arm, r in arms.items():
                lines.append(f"| {pairs} | {arm} | {', '.join(r['tried'])} | {', '.join(r['learned']) or 'none'} |")
    return "\n".join(lines)


def pooled_by_distance(rows: list[dict], least: int = 20) -> tuple[list[int], list[float]]:
    """Test accuracy by key–query distance over the runs `rows` (their queries pooled), at the distances with at
    least `least` pooled queries."""
    right: dict[int, float] = {}
    asked: dict[int, int] = {}
    for r in rows:
        for d, n in r["queries_by_distance"].items():
            asked[int(d)] = asked.get(int(d), 0) + n
            right[int(d)] = right.get(int(d), 0.0) + n * r["accuracy_by_distance"][d]
    distances = sorted(d for d, n in asked.items() if n >= least)
    return distances, [right[d] / asked[d] for d in distances]


def plot(done: dict[str, dict], path: Path) -> None:
    """Per setting (a column): validation accuracy against steps, a line per run; below, test accuracy by
    key–query distance, each arm's seeds pooled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in SETTINGS if any(r["setting"] == n for r in done.values())]
    if not names:
        return
    fig, axes = plt.subplots(2, len(names), figsize=(max(6.4, 4.6 * len(names)), 7.2), squeeze=False)
    colors = dict(zip(ARMS, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    handles = {}  # arm -> its first curve: one legend for the whole figure, every arm that ran somewhere
    for column, name in enumerate(names):
        curves, by_distance = axes[0][column], axes[1][column]
        for arm in ARMS:
            rows = runs_of(done, name, arm)
            for r in rows:
                steps, accuracy = zip(*r["validation"], strict=True) if r["validation"] else ((), ())
                handles.setdefault(arm, curves.plot(steps, accuracy, color=colors[arm], lw=1, alpha=0.8)[0])
            if rows:
                by_distance.plot(*pooled_by_distance(rows), color=colors[arm], lw=1, marker=".", ms=3,
                                 label=f"{arm} ({len(rows)} seeds)")
        curves.axhline(TARGET, color="grey", ls=":", lw=0.8)
        curves.set_ylim(0, 1.02)
        curves.set_xlabel("step")
        st = SETTINGS[name]
        curves.set_title(f"{name}: {st.layers} layers ({st.ratio}), {st.pairs} pairs", fontsize=9)
        by_distance.set_ylim(0, 1.02)
        by_distance.set_xlabel("key–query distance (tokens)")
    axes[0][0].set_ylabel("validation accuracy")
    axes[1][0].set_ylabel("test accuracy (seeds pooled)")
    for row in axes[1]:  # each setting's own seed counts
        row.legend(fontsize=6, loc="lower left")
    fig.legend(handles.values(), handles.keys(), loc="upper right", ncol=len(handles), fontsize=7)
    fig.suptitle(f"MQAR in hybrid stacks: windowed layers + one dense layer (dotted: {TARGET})", fontsize=9, x=0.3)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(results: mqar.Results, out: Path) -> None:
    text = tables(results.done)
    settings = {n: dataclasses.asdict(s) for n, s in SETTINGS.items()}
    write_json(out / "stacks.json", dict(task=mqar.TASK, settings=settings, phases=PHASES, steps=STEPS, target=TARGET,
                                         summary=summary(results.done), runs=list(results.done.values())))
    (out / "stacks.md").write_text("# MQAR in hybrid stacks (experiments/hybrid_stacks.py)\n\n" + text + "\n")
    plot(results.done, out / "stacks.png")
    print(text)


def print_plan(runs: list[Run], results: mqar.Results) -> None:
    left = 0.0
    for i, r in enumerate(runs, 1):
        done = r.key in results.done
        left += 0 if done else cost(r)
        print(f"{i:>3}  {r.key:28s} {' '.join(arm_flags(r)):48s} {'done' if done else 'to run'}")
    print(f"\nleft to run: at most {left / 3600:.1f} h on one thread (less where runs learn early)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=Path, default=Path("runs/hybrids"), help="where the run folders go")
    parser.add_argument("--out", type=Path, default=Path("experiments/results/hybrids"),
                        help="results folder: runs.json (finished runs), stacks.json, stacks.md, stacks.png")
    parser.add_argument("--plan", action="store_true", help="print the runs in order; run nothing")
    parser.add_argument("--report", action="store_true", help="tables and figure of the finished runs; run nothing")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="settings, arms or SETTING/ARM")
    parser.add_argument("--limit", type=int, help="run at most this many of the runs not yet done")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs of one phase at a time, each on one thread (phases still run in order)")
    args = parser.parse_args(argv)
    if args.limit is not None and args.limit < 0:
        parser.error(f"--limit must be >= 0, got {args.limit}")
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    results = mqar.Results(args.out / "runs.json")
    runs = selected(plan(), args.only)
    if args.plan:
        print_plan(runs, results)
        return 0
    if not args.report:
        execute(runs, results, args.runs, args.limit, args.jobs)
    report(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
