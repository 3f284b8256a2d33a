"""Which bytes of real text does each kind predict better than local attention? Loss by copy-distance class.

Six arms of the `tiny` GPT (byte level, context 256, dropout 0, the budget of `books_context.py`'s 4M study:
1,024 steps of 16 windows = 4,194,304 training bytes per run) on the Gutenberg book splits: dense; local
k = 5 (the reference: as many keys per query as π k = 4); local k = 5 + 4 sinks; π (k 4, π 16, adaptive);
π + 4 sinks; multi-scale π (k 4, `--period cover`: the designer's per-layer head periods, every lag of the
window reachable). Each arm's learning rate comes from the three-rate check of `books_context.py` (256 steps,
seed 0, validation bpb); the check's committed results are reused for the arms it covered (dense, local
k = 5, π), and run here for the others. Every arm trains for each seed; each trained model is then scored
on the test split against local k = 5 of the same seed with `piattn eval --by-copy-distance`, on the
classes of π (π, π + sinks, local + sinks, dense) and of multi-scale π (multi-scale π, dense). The rule
that turns the classes into verdicts is in docs/results.md, written before the runs, and applied here.

    python experiments/copy_distance.py --books ../shared/data/books                 # everything, resumable
    python experiments/copy_distance.py --summary-only                                 # tables from what exists

Resumable across machines: every finished step writes a small file under --results (the learning-rate
check, each run's final validation record, each evaluation's JSON), committed with the results; a step whose
file exists is skipped, and a run is trained only while one of its evaluations is missing. Writes
<out>.json, <out>.md and <out>.png (default experiments/results/copy_distance.*).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from books_context import evaluate, train, train_argv

from piattn.analysis.copy_distance import CLASSES

PI_FLAGS = ["--attention", "pi", "--window", "4", "--variant", "adaptive"]
ARMS: dict[str, list[str]] = {
    "local-k5": ["--attention", "local", "--window", "5"],
    "pi-k4-p16": [*PI_FLAGS, "--period", "16"],
    "dense": ["--attention", "dense"],
    "pi-k4-cover": [*PI_FLAGS, "--period", "cover"],
    "pi-k4-p16-s4": [*PI_FLAGS, "--period", "16", "--sinks", "4"],
    "local-k5-s4": ["--attention", "local", "--window", "5", "--sinks", "4"],
}
REFERENCE = "local-k5"
# The classes of each kind (its reach against the reference's), and the arms scored on them.
SCHEMES: dict[str, tuple[str, ...]] = {"pi-k4-p16": ("pi-k4-p16", "pi-k4-p16-s4", "local-k5-s4", "dense"),
                                       "pi-k4-cover": ("pi-k4-cover", "dense")}
JUDGED = {"pi-k4-p16": "pi-k4-p16", "pi-k4-p16-s4": "pi-k4-p16", "pi-k4-cover": "pi-k4-cover"}
"""Arms the rule gives a verdict, and the scheme whose class B is their reachable-only class."""
EARLIER_CHECK = Path(__file__).parent / "results" / "books_context_4m.json"


def read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def write(path: Path, value: dict) -> dict:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".partial").write_text(json.dumps(value, indent=1) + "\n")
    path.with_suffix(".partial").replace(path)
    return value


_LR_LOCKS = {arm: threading.Lock() for arm in ARMS}


def learning_rate(args: argparse.Namespace, arm: str) -> float:
    """The arm's chosen rate: from the committed check (this study's or the earlier one), else checked now
    (once: a second worker asking for the same arm waits for the first)."""
    path = args.results / "lr_check" / f"{arm}.json"
    with _LR_LOCKS[arm]:
        return (read(path) or _check(args, arm, path))["chosen"]


def _check(args: argparse.Namespace, arm: str, path: Path) -> dict:
    """Run (or take from the earlier study) the three-rate check of `arm` and record it at `path`."""
    earlier = (read(EARLIER_CHECK) or {}).get("lr_check", {}).get(arm)
    if earlier is not None and args.lr_steps == 256 and args.lrs == [1e-3, 2e-3, 4e-3]:
        return write(path, {**earlier, "source": f"{EARLIER_CHECK.name} (the same check, run for that study)"})
    bpb = {}
    for lr in args.lrs:
        run = args.runs / "lr" / f"{arm}-lr{lr:g}"
        bpb[f"{lr:g}"] = train(run, train_argv(args, run, ARMS[arm], lr, args.lr_steps, 0), args.lr_steps)["bpb"]
    return write(path, {"val_bpb": bpb, "chosen": float(min(bpb, key=bpb.get)), "source": "this study"})


def evaluation_path(args: argparse.Namespace, arm: str, seed: int, scheme: str) -> Path:
    return args.results / "evals" / f"{arm}-s{seed}.classes-{scheme}.json"


def schemes_of(arm: str) -> list[str]:
    return [scheme for scheme, arms in SCHEMES.items() if arm in arms]


def used_by(args: argparse.Namespace, arm: str, seed: int) -> list[Path]:
    """The evaluations that read `arm`'s checkpoint besides its own: all of the seed's for the reference,
    those on its classes for a scheme's arm."""
    if arm == REFERENCE:
        return [evaluation_path(args, a, seed, s) for s, arms in SCHEMES.items() for a in arms]
    return [evaluation_path(args, a, seed, arm) for a in SCHEMES.get(arm, ())]


def run_arm(args: argparse.Namespace, arm: str, seed: int, reference: Future | None) -> Path:
    """Train `arm` for `seed` unless every file it owes or another evaluation needs from it exists; score
    it against the reference. Returns its run folder."""
    run = args.runs / f"{arm}-s{seed}"
    record = args.results / "train" / f"{arm}-s{seed}.json"
    owed = [evaluation_path(args, arm, seed, s) for s in schemes_of(arm)] + used_by(args, arm, seed)
    if record.exists() and all(p.exists() for p in owed):
        return run
    rate = learning_rate(args, arm)
    start = time.perf_counter()
    validation = train(run, train_argv(args, run, ARMS[arm], rate, args.steps, seed), args.steps)
    if not record.exists():
        write(record, {"arm": arm, "seed": seed, "lr": rate, "steps": args.steps, "validation": validation,
                       "train_seconds": round(time.perf_counter() - start)})
    if reference is not None:
        reference_run = reference.result()
        for scheme in schemes_of(arm):
            evaluate(evaluation_path(args, arm, seed, scheme),
                     ["--checkpoint", str(run), "--compare", str(reference_run), "--by-copy-distance",
                      "--classes-of", str(args.runs / f"{scheme}-s{seed}") if scheme != arm else str(run),
                      "--split", "test", "--batches", str(args.test_batches), "--cache-dir", str(args.runs / "cache"),
                      "--threads", "1"])
    return run


def after(needs: list[Future], function, *arguments):
    """function(*arguments) once every future in `needs` is done (submitted earlier to the same pool, so
    none waits on a job queued behind it)."""
    for need in needs:
        need.result()
    return function(*arguments)


def run_all(args: argparse.Namespace) -> None:
    """Every arm and seed, the reference of a seed first, a scheme's arm before the arms scored on its
    classes (the classes are read from its checkpoint), in this order so that a seed completes early."""
    order = [REFERENCE, *SCHEMES, *(a for a in ARMS if a != REFERENCE and a not in SCHEMES)]
    with ThreadPoolExecutor(args.jobs) as pool:
        jobs = []
        for seed in args.seeds:
            runs: dict[str, Future] = {}
            for arm in order:
                # an arm is scored on the classes of its schemes: those arms' checkpoints must exist first
                needs = [runs[s] for s in schemes_of(arm) if s != arm and s in runs]
                runs[arm] = pool.submit(after, needs, run_arm, args, arm, seed, runs.get(REFERENCE))
                jobs.append(runs[arm])
        for job in jobs:
            job.result()


# --- the summary --------------------------------------------------------------------------------------

def bits(nats: float) -> float:
    return nats / math.log(2)


def pooled(classes: dict, names: str) -> tuple[int, float]:
    """(bytes, paired mean difference in bits/byte) over the union of the named classes."""
    present = [c for c in names if classes[c]["count"]]  # an empty class has a nan mean
    count = sum(classes[c]["count"] for c in present)
    return count, bits(sum(classes[c]["diff"] * classes[c]["count"] for c in present) / count) if count else math.nan


def summarise(args: argparse.Namespace) -> dict:
    evals: dict[str, dict[str, dict[int, dict]]] = {}
    for scheme, arms in SCHEMES.items():
        for arm in arms:
            for seed in args.seeds:
                if (e := read(evaluation_path(args, arm, seed, scheme))) is not None:
                    evals.setdefault(scheme, {}).setdefault(arm, {})[seed] = e
    training = {p.stem: read(p) for p in sorted((args.results / "train").glob("*.json"))}
    lrs = {p.stem: read(p) for p in sorted((args.results / "lr_check").glob("*.json"))}
    schemes = {}
    for scheme, by_arm in evals.items():
        some = next(iter(next(iter(by_arm.values())).values()))["copy_distance"]
        rows = {}
        for arm, by_seed in by_arm.items():
            seeds = sorted(by_seed)
            rows[arm] = {
                "seeds": seeds,
                "test_bpb": [by_seed[s]["bpb"] for s in seeds],
                "reference_test_bpb": [by_seed[s]["compare"]["bpb"] for s in seeds],
                "classes": {c: {"diff_bits": [bits(by_seed[s]["copy_distance"]["classes"][c]["diff"]) for s in seeds],
                                "low_bits": [bits(by_seed[s]["copy_distance"]["classes"][c]["low"]) for s in seeds],
                                "high_bits": [bits(by_seed[s]["copy_distance"]["classes"][c]["high"]) for s in seeds],
                                "loss_bits": [bits(by_seed[s]["copy_distance"]["classes"][c]["loss"]) for s in seeds]}
                            for c in CLASSES},
                "bcd_diff_bits": [pooled(by_seed[s]["copy_distance"]["classes"], "BCD")[1] for s in seeds]}
        schemes[scheme] = {"classes": {c: {"lags": some["classes"][c]["lags"], "bytes": some["classes"][c]["count"]}
                                       for c in CLASSES},
                           "windows": some["windows"], "classes_of": some["classes_of"], "arms": rows}
    return {"budget": budget(args), "lr_check": lrs, "training": training, "schemes": schemes,
            "verdicts": verdicts(schemes, len(args.seeds))}


def budget(args: argparse.Namespace) -> dict:
    return {"config": args.config, "seq_len": args.seq_len, "batch_size": args.batch_size, "steps": args.steps,
            "training_bytes": args.steps * args.batch_size * args.seq_len, "lr_check_steps": args.lr_steps,
            "lrs": args.lrs, "seeds": args.seeds, "dropout": 0.0, "test_windows": args.test_batches * args.batch_size,
            "copy_n": 4, "bootstrap": "1000 resamples of the test windows, 95% percentile interval"}


def sample_sd(values: list[float]) -> float:
    """The sample standard deviation (n − 1), nan for fewer than two values or a nan among them."""
    if len(values) < 2:
        return math.nan
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def verdicts(schemes: dict, seeds_wanted: int) -> dict:
    """The rule of docs/results.md §3b, as written there before the runs."""
    out = {}
    for arm, scheme in JUDGED.items():
        rows = schemes.get(scheme, {}).get("arms", {})
        if arm not in rows or "dense" not in rows or len(rows[arm]["seeds"]) < seeds_wanted \
                or len(rows["dense"]["seeds"]) < seeds_wanted:
            out[arm] = {"verdict": "not yet", "why": "not every seed of this arm and of dense has been scored"}
            continue
        gain_bcd = [-d for d in rows["dense"]["bcd_diff_bits"]]  # dense's gain over local on B ∪ C ∪ D
        spread = sample_sd(gain_bcd)
        valid = statistics.mean(gain_bcd) >= 3 * spread
        b = rows[arm]["classes"]["B"]
        dense_gain = -statistics.mean(rows["dense"]["classes"]["B"]["diff_bits"])
        gain = -statistics.mean(b["diff_bits"])
        recovered = gain / dense_gain if dense_gain > 0 else math.nan
        below = [h < 0 for h in b["high_bits"]]  # interval of kind − local entirely below zero: kind better
        spans_zero = [lo <= 0 <= h for lo, h in zip(b["low_bits"], b["high_bits"], strict=True)]
        if not valid:
            verdict = "invalid"
        elif recovered >= 0.25 and all(below):
            verdict = "supported"
        elif all(spans_zero):
            verdict = "refuted"
        else:
            verdict = "inconclusive"
        out[arm] = {"verdict": verdict, "valid": valid, "dense_gain_bcd_bits": gain_bcd, "seed_sd_bits": spread,
                    "dense_gain_b_bits": dense_gain, "gain_b_bits": gain, "recovered": recovered,
                    "b_interval_below_zero": below, "b_interval_spans_zero": spans_zero}
    return out


def markdown(s: dict) -> str:
    b = s["budget"]
    out = [f"GPT `{b['config']}`, byte level, context {b['seq_len']}, batch {b['batch_size']}, dropout 0, "
           f"{b['steps']} steps = {b['training_bytes']:,} training bytes per run, seeds {b['seeds']}; learning "
           f"rate per arm from a three-rate check ({b['lrs']}) at {b['lr_check_steps']} steps, seed 0. Test: the "
           f"first {b['test_windows']:,} windows of the test split. Copy context n = {b['copy_n']}; intervals: "
           f"{b['bootstrap']}. Differences are arm − local k = 5 on the same bytes, bits per byte "
           "(negative: the arm predicts them better).", "",
           "| arm | learning rate (val bpb per checked rate) | source |", "|---|---|---|"]
    for arm, lr in s["lr_check"].items():
        rates = ", ".join(f"{r}: {v:.3f}" for r, v in lr["val_bpb"].items())
        out.append(f"| {arm} | {lr['chosen']:g} ({rates}) | {lr['source']} |")
    for scheme, sc in s["schemes"].items():
        out += ["", f"### Classes of {scheme}", "",
                "| class | lags | bytes | " + " | ".join(sc["arms"]) + " |",
                "|---|---|---|" + "---|" * len(sc["arms"])]
        for c in CLASSES:
            cells = []
            for row in sc["arms"].values():
                k = row["classes"][c]
                per_seed = "; ".join(f"s{seed} {d:+.4f} [{lo:+.4f}, {h:+.4f}]"
                                     for seed, d, lo, h in zip(row["seeds"], k["diff_bits"], k["low_bits"],
                                                               k["high_bits"], strict=True))
                cells.append(per_seed or "—")
            lags = sc["classes"][c]["lags"] or "—"
            lags = lags if len(lags) <= 40 else lags[:39] + "…"
            out.append(f"| {c} | {lags} | {sc['classes'][c]['bytes']:,} | " + " | ".join(cells) + " |")
        out.append("| test bpb | | | " + " | ".join(
            "; ".join(f"s{seed} {v:.4f}" for seed, v in zip(row["seeds"], row["test_bpb"], strict=True))
            for row in sc["arms"].values()) + " |")
    out += ["", "| arm | verdict | why |", "|---|---|---|"]
    for arm, v in s["verdicts"].items():
        if v["verdict"] == "not yet":
            out.append(f"| {arm} | not yet | {v['why']} |")
            continue
        out.append(f"| {arm} | {v['verdict']} | dense's gain on B∪C∪D {statistics.mean(v['dense_gain_bcd_bits']):+.4f} "
                   f"(seed sd {v['seed_sd_bits']:.4f}, valid: {v['valid']}); on B dense gains "
                   f"{v['dense_gain_b_bits']:+.4f}, the arm {v['gain_b_bits']:+.4f} ({v['recovered']:.0%}); "
                   f"B interval below zero per seed {v['b_interval_below_zero']} |")
    return "\n".join(out) + "\n"


def figure(s: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    schemes = s["schemes"]
    if not schemes:
        return
    fig, axes = plt.subplots(1, len(schemes), figsize=(6 * len(schemes), 4), squeeze=False)
    for ax, (scheme, sc) in zip(axes[0], schemes.items(), strict=True):
        arms = list(sc["arms"])
        for i, arm in enumerate(arms):
            for j, c in enumerate(CLASSES):
                k = sc["arms"][arm]["classes"][c]
                for n, (d, lo, h) in enumerate(zip(k["diff_bits"], k["low_bits"], k["high_bits"], strict=True)):
                    x = j + (i - (len(arms) - 1) / 2) * 0.18 + (n - 1) * 0.04
                    ax.errorbar(x, d, yerr=[[d - lo], [h - d]], fmt="o", ms=3, color=f"C{i}",
                                label=arm if j == 0 and n == 0 else None)
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xticks(range(len(CLASSES)))
        ax.set_xticklabels([f"{c}\n{sc['classes'][c]['bytes']:,} B" for c in CLASSES], fontsize=8)
        ax.set_ylabel("arm − local k=5 (bits/byte)")
        ax.set_title(f"classes of {scheme}", fontsize=10)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--books", type=Path, default=Path(os.environ.get("PIATTN_BOOKS", "../shared/data/books")))
    parser.add_argument("--runs", type=Path, default=Path("runs/copy_distance"), help="checkpoints (not committed)")
    parser.add_argument("--results", type=Path, default=Path("experiments/results/copy_distance"),
                        help="the small per-step files that make the study resumable (committed)")
    parser.add_argument("--out", type=Path, default=Path("experiments/results/copy_distance"))
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=1024)
    parser.add_argument("--lr-steps", type=int, default=256)
    parser.add_argument("--lrs", type=float, nargs=3, default=[1e-3, 2e-3, 4e-3])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--eval-batches", type=int, default=32, help="validation batches at the end of training")
    parser.add_argument("--test-batches", type=int, default=64, help="test batches scored (64 × 16 = 1,024 windows)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (one thread each)")
    parser.add_argument("--summary-only", action="store_true", help="write the tables from the files that exist")
    args = parser.parse_args(argv)
    if not args.summary_only:
        if not args.books.is_dir():
            raise SystemExit(f"--books: no folder {args.books}")
        run_all(args)
    summary = summarise(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(summary))
    figure(summary, args.out.with_suffix(".png"))
    print(markdown(summary), file=sys.stderr)


if __name__ == "__main__":
    main()
