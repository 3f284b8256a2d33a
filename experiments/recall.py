"""Random-lag key–value recall for each attention kind: accuracy by lag beside the reachability analysis.

Each run is `piattn train --task recall` (a causal GPT read out at the query; the value after the marker
sits a lag drawn per example back) then `piattn eval` on the test split, which holds every lag equally
often and reports accuracy by lag. Runs already finished are kept, so the script resumes where it stopped.

    python experiments/recall.py --runs runs/recall --out experiments/results/recall
    python experiments/recall.py --sweep --runs runs/recall_sweep --out experiments/results/recall_sweep

The first writes recall.{json,md,png}: dense (the control: the task is learnable at this budget), local
k = 4, local k = 5 (as many keys as π with k = 4), π adaptive and π union (no gate), over --seeds. The
second (--sweep) trains π adaptive over windows × periods at --sweep-steps and writes a heat map of
accuracy beside the analysis's coverage (the fraction of lags reachable).
"""

from __future__ import annotations

import argparse
import json
import statistics
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from runs import train_and_test

from piattn.analysis import min_depth

# The control (dense) learns this to >= 0.9 on every lag within the budget; see recall.md.
TASK = dict(seq_len=64, symbols=8, lag_min=1, lag_max=62, layers=4, d_model=64, heads=4, batch=32)
# kind name -> (attention, window, period, variant)
KINDS = {"dense": ("dense", None, None, None), "local k=4": ("local", 4, None, None),
         "local k=5": ("local", 5, None, None), "pi adaptive": ("pi", 4, 16, "adaptive"),
         "pi union": ("pi", 4, 16, "union")}


def slug(kind: str) -> str:
    return kind.replace(" ", "-").replace("=", "")


def train_argv(attention: str, window: int | None, period: int | None, variant: str | None, seed: int,
               steps: int, run: Path) -> list[str]:
    argv = ["train", "--task", "recall", "--attention", attention, "--seq-len", str(TASK["seq_len"]),
            "--recall-symbols", str(TASK["symbols"]), "--lag-min", str(TASK["lag_min"]),
            "--lag-max", str(TASK["lag_max"]), "--recall-loss", "every", "--n-layer", str(TASK["layers"]),
            "--d-model", str(TASK["d_model"]), "--n-head", str(TASK["heads"]), "--batch-size", str(TASK["batch"]),
            "--train-size", "50000", "--eval-size", str(20 * (TASK["lag_max"] - TASK["lag_min"] + 1)),
            "--steps", str(steps), "--lr", "3e-3", "--min-lr", "3e-4", "--warmup", "30", "--dropout", "0",
            "--weight-decay", "0", "--eval-every", "0", "--save-every", "0", "--seed", str(seed),
            "--device", "cpu", "--no-progress", "--out", str(run)]
    if window is not None:
        argv += ["--window", str(window)]
    if period is not None:
        argv += ["--period", str(period), "--variant", variant]
    return argv


def reachable(window: int | None, period: int | None, lag: int) -> bool:
    """Whether the query can read both the value (lag back) and its marker (lag + 1) through TASK["layers"]
    causal layers of this pattern (window None: dense, which reaches everything)."""
    if window is None:
        return True
    depths = [min_depth(d, window, period) for d in (lag, lag + 1)]
    return all(d is not None and d <= TASK["layers"] for d in depths)


def wall_seconds(run: Path) -> float:
    """The training wall time the run recorded (its last train record)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return max(r["wall_seconds"] for r in records if r["split"] == "train")


def one_run(kind: str, seed: int, steps: int, runs: Path) -> dict:
    attention, window, period, variant = KINDS[kind]
    run = runs / f"{slug(kind)}-seed{seed}"
    result = train_and_test(run, train_argv(attention, window, period, variant, seed, steps, run))
    return dict(kind=kind, attention=attention, window=window, period=period, variant=variant, seed=seed,
                steps=steps, examples=steps * TASK["batch"], wall_seconds=round(wall_seconds(run), 1),
                accuracy=result["accuracy"], chance=result["chance"],
                accuracy_by_lag={int(k): v for k, v in result["accuracy_by_lag"].items()},
                examples_by_lag={int(k): v for k, v in result["examples_by_lag"].items()})


def run_all(jobs: list[tuple], workers: int) -> list[dict]:
    """one_run over `jobs`, `workers` at a time (each run is its own one-thread process)."""
    with ThreadPoolExecutor(workers) as pool:
        rows = list(pool.map(lambda job: one_run(*job), jobs))
    for r in rows:
        print(f"{r['kind']:12s} seed {r['seed']} accuracy {r['accuracy']:.3f} ({r['wall_seconds']:.0f} s)", flush=True)
    return rows


def lag_means(rows: list[dict], kind: str) -> dict[int, float]:
    """Accuracy per lag of `kind`, the mean over its seeds."""
    mine = [r for r in rows if r["kind"] == kind]
    return {lag: statistics.mean(r["accuracy_by_lag"][lag] for r in mine) for lag in mine[0]["accuracy_by_lag"]}


def group_mean(rows: list[dict], kind: str, lags: list[int]) -> str:
    """'mean ± std over seeds (n lags)' of the accuracy over `lags`, or '—' when there are none."""
    if not lags:
        return "—"
    per_seed = [statistics.mean(r["accuracy_by_lag"][lag] for lag in lags) for r in rows if r["kind"] == kind]
    spread = f" ± {statistics.stdev(per_seed):.2f}" if len(per_seed) > 1 else ""
    return f"{statistics.mean(per_seed):.2f}{spread} ({len(lags)})"


def groups(kind: str, lags: list[int]) -> dict[str, list[int]]:
    """The lags of each column of the summary table for `kind`."""
    _, window, period, _ = KINDS[kind]
    local_reach = 4 * TASK["layers"]  # k·L of the π runs' window
    yes = [lag for lag in lags if reachable(window, period, lag)]
    return {"reachable ≤ kL": [lag for lag in yes if lag + 1 <= local_reach],
            "reachable > kL": [lag for lag in yes if lag + 1 > local_reach],
            "unreachable": [lag for lag in lags if lag not in yes]}


def summary_table(rows: list[dict]) -> str:
    lags = sorted(rows[0]["accuracy_by_lag"])
    kinds = [k for k in KINDS if any(r["kind"] == k for r in rows)]
    columns = list(groups(kinds[0], lags))
    lines = ["| kind | " + " | ".join(columns) + " | all lags | wall s / run |", "|---|" + "---|" * (len(columns) + 2)]
    for kind in kinds:
        cells = [group_mean(rows, kind, g) for g in groups(kind, lags).values()]
        wall = statistics.mean(r["wall_seconds"] for r in rows if r["kind"] == kind)
        lines.append(f"| {kind} | " + " | ".join(cells) + f" | {group_mean(rows, kind, lags)} | {wall:.0f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    lags = sorted(rows[0]["accuracy_by_lag"])
    _, window, period, _ = KINDS["pi adaptive"]
    for lag in lags:
        if reachable(window, period, lag):
            ax.axvspan(lag - 0.5, lag + 0.5, color="tab:orange", alpha=0.12, lw=0)
    for kind in KINDS:
        if any(r["kind"] == kind for r in rows):
            means = lag_means(rows, kind)
            ax.plot(lags, [means[lag] for lag in lags], marker=".", ms=4, lw=1, label=kind)
    ax.axhline(rows[0]["chance"], color="grey", ls=":", label="chance")
    ax.axvline(4 * TASK["layers"] - 0.5, color="tab:blue", ls="--", lw=0.8, label="k·L (k = 4)")
    ax.set_xlabel("lag (tokens from the value to the query)")
    ax.set_ylabel("test accuracy (mean over seeds)")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"Recall, {TASK['layers']} layers, π = {period}, k = {window}; shaded: lags π reaches "
                 "(value and marker)", fontsize=9)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main_runs(args: argparse.Namespace) -> None:
    jobs = [(kind, seed, args.steps, args.runs) for seed in args.seeds for kind in args.kinds]
    rows = run_all(jobs, args.jobs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(dict(task=TASK, runs=rows), indent=1) + "\n")
    table = summary_table(rows)
    args.out.with_suffix(".table.md").write_text(table + "\n")
    plot(rows, args.out.with_suffix(".png"))
    print(table)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=Path, default=Path("runs/recall"))
    parser.add_argument("--out", type=Path, default=Path("experiments/results/recall"),
                        help="path stem of the results (.json, .table.md, .png)")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (each one thread)")
    main_runs(parser.parse_args(argv))


if __name__ == "__main__":
    main()
