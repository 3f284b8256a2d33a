"""Random-lag key–value recall for each attention kind: accuracy by lag beside the reachability analysis.

Each run is `piattn train --task recall` (a causal GPT read out at the query; the value sits a lag drawn
per example back, its marker beside it) then `piattn eval` on the test split, which holds every lag
equally often and reports accuracy by lag. Finished runs are kept, so the script resumes where it stopped.

    python experiments/recall.py --runs runs/recall --out experiments/results/recall
    python experiments/recall.py --sweep --steps 500 --seeds 0 --runs runs/recall_sweep \
        --out experiments/results/recall_sweep
    python experiments/recall.py --seq-len 64 --seeds 0 1 --steps 4000 --runs runs/recall64 \
        --out experiments/results/recall64                                 # the issue's k = 4, π = 16
    python experiments/recall.py --kinds "pi adaptive" "local k=3" --seeds 1 2 --steps 1600 \
        --runs runs/recall_long --out experiments/results/recall_long       # the longer budget

The first writes recall.{json,png} and the tables of recall.md: dense (the control: the task is learnable
at this budget), local k, local k + 1 (as many keys per query as π with k), π adaptive and π union (no
gate), over --seeds. The second (--sweep) trains π adaptive over windows × periods and writes
recall_sweep.{json,md,png}: accuracy beside the analysis's coverage (the fraction of lags reachable).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from runs import train_and_test

from piattn.analysis import min_depth, min_depth_multi, schedule

# Per sequence length: the π pattern and the k × π sweep grid. 64 is the setting (k = 4, π = 16; grid
# k ∈ {2, 4, 8, 16} × π ∈ {8, 16, 32, 64}); 32 halves it with the sequence. The control (dense) learns both
# to >= 0.9 on every lag within the budgets of recall.md (value-marker order, every position supervised).
LENGTHS = {32: dict(window=2, period=8, sweep=((1, 2, 4, 8), (4, 8, 16, 32))),
           64: dict(window=4, period=16, sweep=((2, 4, 8, 16), (8, 16, 32, 64)))}
@dataclasses.dataclass(frozen=True)
class Setup:
    """What a sequence length fixes: the task's flags, the π runs' pattern, the kinds and the sweep grid."""

    task: dict
    window: int
    period: int
    kinds: dict[str, tuple]  # kind name -> (attention, window, period: int or "cover", variant)
    sweep_windows: tuple[int, ...]
    sweep_periods: tuple[int, ...]


def setup_for(seq_len: int) -> Setup:
    """The `Setup` of sequences of `seq_len` tokens (a key of LENGTHS)."""
    window, period = LENGTHS[seq_len]["window"], LENGTHS[seq_len]["period"]
    task = dict(seq_len=seq_len, symbols=8, order="value-marker", loss="every", layers=4, d_model=64, heads=4,
                batch=32, lag_min=2, lag_max=seq_len - 1)
    # local k + 1 has as many keys per query as π with k
    kinds = {"dense": ("dense", None, None, None), f"local k={window}": ("local", window, None, None),
             f"local k={window + 1}": ("local", window + 1, None, None),
             "pi adaptive": ("pi", window, period, "adaptive"), "pi union": ("pi", window, period, "union"),
             # multi-scale π: the designer's per-layer head periods reaching every lag of the sequence
             "pi cover": ("pi", window, "cover", "adaptive")}
    return Setup(task, window, period, kinds, *LENGTHS[seq_len]["sweep"])


def slug(kind: str) -> str:
    return kind.replace(" ", "-").replace("=", "")


def train_argv(cfg: Setup, attention: str, window: int | None, period: int | None, variant: str | None, seed: int,
               steps: int, run: Path) -> list[str]:
    task = cfg.task
    argv = ["train", "--task", "recall", "--attention", attention, "--seq-len", str(task["seq_len"]),
            "--recall-symbols", str(task["symbols"]), "--lag-min", str(task["lag_min"]),
            "--lag-max", str(task["lag_max"]), "--recall-order", task["order"], "--recall-loss", task["loss"],
            "--n-layer", str(task["layers"]),
            "--d-model", str(task["d_model"]), "--n-head", str(task["heads"]), "--batch-size", str(task["batch"]),
            "--train-size", "50000", "--eval-size", str(40 * (task["lag_max"] - task["lag_min"] + 1)),
            "--steps", str(steps), "--lr", "3e-3", "--min-lr", "3e-4", "--warmup", "30", "--dropout", "0",
            "--weight-decay", "0", "--eval-every", "0", "--save-every", "0", "--seed", str(seed),
            "--device", "cpu", "--no-progress", "--out", str(run)]
    if window is not None:
        argv += ["--window", str(window)]
    if period is not None:
        argv += ["--period", str(period), "--variant", variant]
    return argv


def marker_lag(cfg: Setup, lag: int) -> int:
    """Where the marker of a value `lag` back sits, as a lag from the query."""
    return lag - 1 if cfg.task["order"] == "value-marker" else lag + 1


def min_depth_of(cfg: Setup, d: int, window: int, period: int | str | None) -> int | None:
    """The layers lag d needs: `min_depth` for one period (or none), `min_depth_multi` for "cover", whose
    periods are those `piattn train --period cover` gives the model (every lag up to seq_len − 1)."""
    if period != "cover":
        return min_depth(d, window, period)
    task = cfg.task
    periods = schedule("cover", window, task["layers"], task["heads"], target=task["seq_len"] - 1)
    return min_depth_multi(d, window, periods)


def reachable(cfg: Setup, window: int | None, period: int | str | None, lag: int) -> bool:
    """Whether the query can read both the value (lag back) and its marker through cfg.task["layers"] causal
    layers of this pattern (`min_depth_of`; window None: dense, which reaches everything)."""
    if window is None:
        return True
    depths = [min_depth_of(cfg, d, window, period) for d in (lag, marker_lag(cfg, lag))]
    return all(d is not None and d <= cfg.task["layers"] for d in depths)


def wall_seconds(run: Path) -> float:
    """The training wall time the run recorded (its last train record)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return max(r["wall_seconds"] for r in records if r["split"] == "train")


def one_run(cfg: Setup, kind: str, spec: tuple, seed: int, steps: int, runs: Path) -> dict:
    """Train and test one run of spec = (attention, window, period, variant); its record for the JSON."""
    attention, window, period, variant = spec
    run = runs / f"{slug(kind)}-seed{seed}"
    result = train_and_test(run, train_argv(cfg, attention, window, period, variant, seed, steps, run))
    return dict(kind=kind, attention=attention, window=window, period=period, variant=variant, seed=seed,
                steps=steps, examples=steps * cfg.task["batch"], wall_seconds=round(wall_seconds(run), 1),
                accuracy=result["accuracy"], chance=result["chance"],
                accuracy_by_lag={int(k): v for k, v in result["accuracy_by_lag"].items()},
                examples_by_lag={int(k): v for k, v in result["examples_by_lag"].items()})


def run_all(jobs: list[tuple], workers: int) -> list[dict]:
    """one_run over `jobs`, `workers` at a time (each run is its own one-thread process)."""
    with ThreadPoolExecutor(workers) as pool:
        rows = list(pool.map(lambda job: one_run(*job), jobs))
    for r in rows:
        print(f"{r['kind']:14s} seed {r['seed']} accuracy {r['accuracy']:.3f} ({r['wall_seconds']:.0f} s)", flush=True)
    return rows


def lag_means(rows: list[dict], kind: str) -> dict[int, float]:
    """Accuracy per lag of `kind`, the mean over its seeds."""
    mine = [r for r in rows if r["kind"] == kind]
    return {lag: statistics.mean(r["accuracy_by_lag"][lag] for r in mine) for lag in mine[0]["accuracy_by_lag"]}


def seed_means(rows: list[dict], kind: str, lags: list[int]) -> list[float]:
    """The accuracy of each seed of `kind`, averaged over `lags`."""
    return [statistics.mean(r["accuracy_by_lag"][lag] for lag in lags) for r in rows if r["kind"] == kind]


def group_mean(rows: list[dict], kind: str, lags: list[int]) -> str:
    """'mean ± std over seeds (n lags)' of the accuracy over `lags`, or '—' when there are none."""
    if not lags:
        return "—"
    per_seed = seed_means(rows, kind, lags)
    spread = f" ± {statistics.stdev(per_seed):.2f}" if len(per_seed) > 1 else ""
    return f"{statistics.mean(per_seed):.2f}{spread} ({len(lags)})"


def own_groups(cfg: Setup, spec: tuple, lags: list[int]) -> dict[str, list[int]]:
    """The lags a kind reaches within k·L of the π runs' window, those it reaches beyond, those it does not."""
    _, window, period, _ = spec
    near = cfg.window * cfg.task["layers"]
    yes = [lag for lag in lags if reachable(cfg, window, period, lag)]
    return {"reachable ≤ kL": [lag for lag in yes if max(lag, marker_lag(cfg, lag)) <= near],
            "reachable > kL": [lag for lag in yes if max(lag, marker_lag(cfg, lag)) > near],
            "unreachable": [lag for lag in lags if lag not in yes]}


def beyond_local(cfg: Setup, lags: list[int]) -> dict[str, list[int]]:
    """Lags beyond the reach of local k + 1 (so of every local run), split by whether π reaches them."""
    far = [lag for lag in lags if not reachable(cfg, cfg.window + 1, None, lag)]
    return {"π reaches": [lag for lag in far if reachable(cfg, cfg.window, cfg.period, lag)],
            "π's gaps": [lag for lag in far if not reachable(cfg, cfg.window, cfg.period, lag)]}


def summary_tables(cfg: Setup, rows: list[dict]) -> str:
    lags = sorted(rows[0]["accuracy_by_lag"])
    kinds = [k for k in cfg.kinds if any(r["kind"] == k for r in rows)]
    columns = list(own_groups(cfg, cfg.kinds[kinds[0]], lags))
    lines = [f"Mean test accuracy over the lags of each group, each kind by its own reachability (k·L = "
             f"{cfg.window * cfg.task['layers']}: the π runs' window k = {cfg.window} times {cfg.task['layers']} "
             "layers); mean ± "
             f"std over seeds, (number of lags); chance {rows[0]['chance']:.3f}.", "",
             "| kind | " + " | ".join(columns) + " | all lags | train wall s / run |",
             "|---|" + "---|" * (len(columns) + 2)]
    for kind in kinds:
        cells = [group_mean(rows, kind, g) for g in own_groups(cfg, cfg.kinds[kind], lags).values()]
        wall = statistics.mean(r["wall_seconds"] for r in rows if r["kind"] == kind)
        lines.append(f"| {kind} | " + " | ".join(cells) + f" | {group_mean(rows, kind, lags)} | {wall:.0f} |")
    far = beyond_local(cfg, lags)
    lines += ["", f"Lags beyond local k = {cfg.window + 1}'s reach, split by π's: π reaches {far['π reaches']}, "
              f"its gaps are {far['π' + chr(39) + 's gaps']}.", "",
              "| kind | " + " | ".join(far) + " |", "|---|" + "---|" * len(far)]
    for kind in kinds:
        lines.append(f"| {kind} | " + " | ".join(group_mean(rows, kind, g) for g in far.values()) + " |")
    return "\n".join(lines)


def depth(cfg: Setup, window: int, period: int | None, lag: int) -> int | None:
    """The layers the query needs to read both the value and its marker (None: never)."""
    depths = [min_depth_of(cfg, d, window, period) for d in (lag, marker_lag(cfg, lag))]
    return None if None in depths else max(depths)


def depth_table(cfg: Setup, rows: list[dict]) -> str:
    """Accuracy of the windowed kinds by the depth their pattern needs for a lag (1 … layers, or never)."""
    lags = sorted(rows[0]["accuracy_by_lag"])
    kinds = [k for k in cfg.kinds if cfg.kinds[k][1] is not None and any(r["kind"] == k for r in rows)]
    levels = [*range(1, cfg.task["layers"] + 1), None]
    names = [f"depth {level}" if level else f"> {cfg.task['layers']} (unreachable)" for level in levels]
    lines = ["Accuracy by the layers a lag needs (the larger `min_depth` of value and marker); mean ± std "
             "over seeds, (number of lags):", "", "| kind | " + " | ".join(names) + " |",
             "|---|" + "---|" * len(names)]
    for kind in kinds:
        _, window, period, _ = cfg.kinds[kind]
        need = {lag: depth(cfg, window, period, lag) for lag in lags}
        cells = [group_mean(rows, kind, [lag for lag in lags if (need[lag] if need[lag] is None or need[lag] <=
                                                                  cfg.task["layers"] else None) == level])
                 for level in levels]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_tables(path: Path, text: str) -> None:
    """Put `text` between the <!-- tables --> markers of `path`, keeping the prose around them."""
    start, end = "<!-- tables -->", "<!-- /tables -->"
    old = path.read_text() if path.exists() else ""
    if start in old and end in old:
        path.write_text(old[:old.index(start)] + f"{start}\n{text}\n{end}" + old[old.index(end) + len(end):])
    else:
        path.write_text(f"{old}{start}\n{text}\n{end}\n")


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(cfg: Setup, rows: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    lags = sorted(rows[0]["accuracy_by_lag"])
    for lag in lags:
        if reachable(cfg, cfg.window, cfg.period, lag):
            ax.axvspan(lag - 0.5, lag + 0.5, color="tab:orange", alpha=0.12, lw=0)
    for kind in cfg.kinds:
        if any(r["kind"] == kind for r in rows):
            means = lag_means(rows, kind)
            ax.plot(lags, [means[lag] for lag in lags], marker=".", ms=4, lw=1, label=kind)
    ax.axhline(rows[0]["chance"], color="grey", ls=":", label="chance")
    for window, style in ((cfg.window, "--"), (cfg.window + 1, "-.")):
        ax.axvline(window * cfg.task["layers"] + 0.5, color="grey", ls=style, lw=0.8, label=f"k·L, k = {window}")
    ax.set_xlabel("lag (tokens from the value to the query)")
    ax.set_ylabel("test accuracy (mean over seeds)")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"Recall, {cfg.task['seq_len']} tokens, {cfg.task['layers']} layers, k = {cfg.window}, "
                 f"π = {cfg.period}; "
                 "shaded: lags π reaches (value and marker)", fontsize=9)
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.15))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main_runs(cfg: Setup, args: argparse.Namespace) -> None:
    # most telling first
    order = ["dense", "pi adaptive", "pi cover", f"local k={cfg.window + 1}", "pi union", f"local k={cfg.window}"]
    jobs = [(cfg, kind, cfg.kinds[kind], seed, args.steps, args.runs) for seed in args.seeds for kind in order
            if kind in args.kinds]
    rows = run_all(jobs, args.jobs)
    if args.include is not None:  # an earlier result's runs of the kinds not run now, at the same budget
        earlier = json.loads(args.include.read_text())
        if earlier["task"] != cfg.task:
            raise SystemExit(f"--include: {args.include} is of another task setting: {earlier['task']}")
        rows += [{**r, **{key: {int(lag): v for lag, v in r[key].items()}  # JSON keys are strings
                          for key in ("accuracy_by_lag", "examples_by_lag")}}
                 for r in earlier["runs"] if r["kind"] not in args.kinds and r["steps"] == args.steps
                 and r["seed"] in args.seeds]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(dict(task=cfg.task, runs=rows), indent=1) + "\n")
    tables = summary_tables(cfg, rows) + "\n\n" + depth_table(cfg, rows)
    write_tables(args.out.with_suffix(".md"), tables)
    plot(cfg, rows, args.out.with_suffix(".png"))
    print(tables)


def sweep_kind(window: int, period: int) -> str:
    return f"pi adaptive k={window} p={period}"


def coverage(cfg: Setup, window: int, period: int, lags: list[int]) -> float:
    """The fraction of `lags` the pattern reaches (value and marker) in cfg.task["layers"] layers."""
    return sum(reachable(cfg, window, period, lag) for lag in lags) / len(lags)


def sweep_table(cfg: Setup, rows: list[dict]) -> str:
    lags = sorted(rows[0]["accuracy_by_lag"])
    lines = [f"π adaptive, {rows[0]['steps']} steps, seed(s) {sorted({r['seed'] for r in rows})}; each cell: mean "
             "test accuracy over all lags / over the lags the pattern reaches / over those it does not / "
             f"coverage (fraction of the {len(lags)} lags reached). Chance {rows[0]['chance']:.3f}.", "",
             "| k \\ π | " + " | ".join(str(p) for p in cfg.sweep_periods) + " |",
             "|---|" + "---|" * len(cfg.sweep_periods)]
    for window in cfg.sweep_windows:
        cells = []
        for period in cfg.sweep_periods:
            kind = sweep_kind(window, period)
            if not any(r["kind"] == kind for r in rows):
                cells.append(f"not run / {coverage(cfg, window, period, lags):.2f}")
                continue
            yes = [lag for lag in lags if reachable(cfg, window, period, lag)]
            no = [lag for lag in lags if lag not in yes]
            parts = [statistics.mean(seed_means(rows, kind, group)) if group else None for group in (lags, yes, no)]
            cells.append(" / ".join("—" if v is None else f"{v:.2f}" for v in parts)
                         + f" / {coverage(cfg, window, period, lags):.2f}")
        lines.append(f"| {window} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_sweep(cfg: Setup, rows: list[dict], path: Path) -> None:
    plt = pyplot()
    lags = sorted(rows[0]["accuracy_by_lag"])
    ran = {r["kind"] for r in rows}
    accuracy = [[statistics.mean(seed_means(rows, sweep_kind(w, p), lags)) if sweep_kind(w, p) in ran
                 else float("nan") for p in cfg.sweep_periods] for w in cfg.sweep_windows]
    covered = [[coverage(cfg, w, p, lags) for p in cfg.sweep_periods] for w in cfg.sweep_windows]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.6))
    for ax, grid, title in ((axes[0], accuracy, "test accuracy (all lags)"),
                            (axes[1], covered, "coverage: fraction of lags reachable")):
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", origin="lower")
        for i, row in enumerate(grid):
            for j, value in enumerate(row):
                ax.text(j, i, "not run" if value != value else f"{value:.2f}", ha="center", va="center",
                        fontsize=8, color="white" if value <= 0.6 else "black")
        ax.set_xticks(range(len(cfg.sweep_periods)), [str(p) for p in cfg.sweep_periods])
        ax.set_yticks(range(len(cfg.sweep_windows)), [str(w) for w in cfg.sweep_windows])
        ax.set_xlabel("π")
        ax.set_ylabel("window k")
        ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=axes, shrink=0.8)
    fig.suptitle(f"Recall sweep, π adaptive, {cfg.task['seq_len']} tokens, {cfg.task['layers']} layers, "
                 f"{rows[0]['steps']} steps", fontsize=9)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main_sweep(cfg: Setup, args: argparse.Namespace) -> None:
    jobs = [(cfg, sweep_kind(w, p), ("pi", w, p, "adaptive"), seed, args.steps, args.runs)
            for seed in args.seeds for w in args.windows for p in cfg.sweep_periods]
    if args.report:  # only the runs already finished: cells of the others stay empty
        jobs = [job for job in jobs if list((args.runs / f"{slug(job[1])}-seed{job[3]}").glob("eval/*_test.json"))]
    rows = run_all(jobs, args.jobs)
    if not args.report and set(args.windows) != set(cfg.sweep_windows):
        return  # part of the grid: the runs are kept, the tables wait for the whole grid (or --report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(dict(task=cfg.task, runs=rows), indent=1) + "\n")
    table = sweep_table(cfg, rows)
    write_tables(args.out.with_suffix(".md"), table)
    plot_sweep(cfg, rows, args.out.with_suffix(".png"))
    print(table)


def main(argv: list[str] | None = None) -> None:
    length = argparse.ArgumentParser(add_help=False)
    length.add_argument("--seq-len", type=int, default=32, choices=sorted(LENGTHS),
                        help="sequence length: sets the π pattern, the kinds and the sweep grid")
    cfg = setup_for(length.parse_known_args(argv)[0].seq_len)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     parents=[length])
    parser.add_argument("--runs", type=Path, default=Path("runs/recall"))
    parser.add_argument("--out", type=Path, default=Path("experiments/results/recall"),
                        help="path stem of the results (.json, .md, .png)")
    parser.add_argument("--sweep", action="store_true", help="π adaptive over windows × periods instead")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--kinds", nargs="+", default=list(cfg.kinds), choices=list(cfg.kinds), metavar="KIND",
                        help=f"the kinds to run (default all: {', '.join(cfg.kinds)})")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (each one thread)")
    parser.add_argument("--include", type=Path, help="an earlier result JSON whose runs of other kinds (same task, "
                        "steps and seeds) join the tables and figure")
    parser.add_argument("--windows", type=int, nargs="+", default=list(cfg.sweep_windows), choices=cfg.sweep_windows,
                        help="--sweep: the rows of the grid to train (e.g. to split it over processes)")
    parser.add_argument("--report", action="store_true", help="--sweep: tables and figure of the finished runs only")
    args = parser.parse_args(argv)
    (main_sweep if args.sweep else main_runs)(cfg, args)


if __name__ == "__main__":
    main()
