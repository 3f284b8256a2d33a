"""Raster images: next-pixel bits/dim of 14×14 MNIST digits for π with the period set by the geometry, against
local, 2D neighbourhood, strided and dense attention (docs/results.md §10, whose rule was committed before
these runs).

    python experiments/images.py --plan             # the runs in order, done or not
    python experiments/images.py --jobs 2           # every run (resumable), then the tables and the figure
    python experiments/images.py --only pi-w1 local-4 --limit 2
    python experiments/images.py --report           # the tables, verdicts and figure of the finished runs only
    python experiments/images.py --completions      # the completion grid of each arm's seed-0 run
    python experiments/images.py --cost             # clause 5: step times side by side, one process

Each run is `piattn train --task pixels` then `piattn eval` on the test split (experiments/runs.py), one
intra-op thread each; `--jobs` runs that many at once. Resumable: OUT/runs.json holds every finished run and is
rewritten after each one, and a run folder already scored is not trained again. Writes OUT/images.json
(setting, arms, runs, summary, verdicts), OUT/images.md and OUT/images.png (test bits/dim per arm and seed;
validation bits/dim against steps), OUT defaulting to experiments/results/images/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from runs import train_and_test, write_json
from tqdm import tqdm

# The main setting of the rule (docs/results.md §10).
SETTING = dict(task="pixels", data="mnist5k", downsample=2, n_layer=2, d_model=64, n_head=4, d_ff=256,
               batch_size=32, lr=3e-3, warmup=100, steps=2000, eval_every=100, dropout=0.0)
WIDTH = 14  # 28 / downsample 2
# arm -> `piattn train` flags of its attention (docs/results.md §10's table).
ARMS = {
    "dense": ["--attention", "dense"],
    "local-4": ["--attention", "local", "--window", "4"],
    "local-15": ["--attention", "local", "--window", str(WIDTH + 1)],
    "pi-w1": ["--attention", "pi", "--window", "4", "--period", "width-1"],
    "pi-w": ["--attention", "pi", "--window", "4", "--period", "width"],
    "pi-nbhd": ["--attention", "pi", "--window", "4", "--period", "neighbourhood"],
    "nbhd-2d": ["--attention", "neighbourhood", "--radius", "1"],
    "strided": ["--attention", "strided"],
}
SEEDS = (0, 1, 2)
# The rule's margins, in bits/dim.
BEATS = 0.05
AT_LEAST_AS_GOOD = 0.01
CLOSE = 0.05
CEILING = 0.01


def arm_config(arm: str):
    """The GPTConfig of `arm` in the main setting (its flags read as config fields; period words resolve
    from the image width)."""
    from piattn.models import GPTConfig

    flags = ARMS[arm]
    fields = {flag[2:].replace("-", "_"): value for flag, value in zip(flags[::2], flags[1::2], strict=True)}
    for name in ("window", "radius"):
        if name in fields:
            fields[name] = int(fields[name])
    s = SETTING
    return GPTConfig.from_name("tiny", **fields, image_width=WIDTH, n_layer=s["n_layer"], d_model=s["d_model"],
                               n_head=s["n_head"], d_ff=s["d_ff"], dropout=s["dropout"], vocab_size=257,
                               block_size=WIDTH * WIDTH)


def step_costs(rounds: int = 41) -> dict:
    """Clause 5: one training step (forward, backward, AdamW) of every arm on one batch of the main setting's
    shape (random pixels), one thread, in one process, the arms in a rotated order each round; per arm the
    median ms and the median of its per-round ratio to local-4."""
    import time

    import torch

    from piattn.models import GPT

    torch.set_num_threads(1)
    torch.manual_seed(0)
    models = {arm: GPT(arm_config(arm)) for arm in ARMS}
    optimizers = {arm: torch.optim.AdamW(m.parameters(), SETTING["lr"]) for arm, m in models.items()}
    batch = torch.randint(0, 256, (SETTING["batch_size"], WIDTH * WIDTH + 1))

    def step(arm: str) -> float:
        start = time.perf_counter()
        logits = models[arm](batch[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
        optimizers[arm].step()
        optimizers[arm].zero_grad(set_to_none=True)
        return (time.perf_counter() - start) * 1e3

    arms = list(ARMS)
    for arm in arms:  # warm-up
        step(arm)
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    for r in tqdm(range(rounds), desc="step costs", unit="round"):
        for arm in arms[r % len(arms):] + arms[:r % len(arms)]:
            times[arm].append(step(arm))
    ratios = {arm: statistics.median(t / b for t, b in zip(times[arm], times["local-4"], strict=True))
              for arm in arms}
    return dict(rounds=rounds, ms={arm: statistics.median(t) for arm, t in times.items()}, x_local4=ratios,
                load=os.getloadavg()[0])


def run_dir(out: Path, arm: str, seed: int) -> Path:
    return out / "runs" / f"{arm}-seed{seed}"


def train_argv(out: Path, arm: str, seed: int) -> list[str]:
    s = SETTING
    return ["train", "--task", s["task"], "--data", s["data"], "--downsample", str(s["downsample"]),
            "--n-layer", str(s["n_layer"]), "--d-model", str(s["d_model"]), "--n-head", str(s["n_head"]),
            "--d-ff", str(s["d_ff"]), "--dropout", str(s["dropout"]), "--batch-size", str(s["batch_size"]),
            "--lr", str(s["lr"]), "--warmup", str(s["warmup"]), "--steps", str(s["steps"]),
            "--eval-every", str(s["eval_every"]), "--seed", str(seed), "--device", "cpu", "--no-progress",
            "--out", str(run_dir(out, arm, seed)), *ARMS[arm]]


def validation_curve(run: Path) -> list[tuple[int, float]]:
    """(step, validation bits/dim) of a finished run, from its metrics.jsonl."""
    curve = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("split") == "validation" and "bits_per_dim" in record:
            curve.append((record["step"], record["bits_per_dim"]))
    return curve


def one_run(out: Path, arm: str, seed: int) -> dict:
    run = run_dir(out, arm, seed)
    test = train_and_test(run, train_argv(out, arm, seed))
    return dict(arm=arm, seed=seed, test=test, curve=validation_curve(run))


def planned(only: list[str] | None) -> list[tuple[str, int]]:
    """(arm, seed) in the order they go: seed by seed, every arm, so that a cut-short study has whole seeds."""
    arms = [a for a in ARMS if not only or a in only]
    return [(arm, seed) for seed in SEEDS for arm in arms]


def load_runs(out: Path) -> dict[str, dict]:
    path = out / "runs.json"
    return json.loads(path.read_text()) if path.exists() else {}


def summarize(runs: dict[str, dict]) -> dict:
    """Per arm: test bits/dim by seed, mean, and the steps to reach local-4's final mean (validation)."""
    by_arm: dict[str, dict] = {}
    for r in runs.values():
        by_arm.setdefault(r["arm"], {"seeds": {}})["seeds"][r["seed"]] = r["test"]["bits_per_dim"]
    local = by_arm.get("local-4")
    target = statistics.mean(local["seeds"].values()) if local else None
    for arm, entry in by_arm.items():
        entry["mean"] = statistics.mean(entry["seeds"].values())
        entry["reach"] = next(iter(r["test"].get("neighbour_reach") or {} for r in runs.values() if r["arm"] == arm))
        bands = [r["test"]["row_bands"] for r in runs.values() if r["arm"] == arm]
        entry["row_bands"] = [statistics.mean(b[i]["bits_per_dim"] for b in bands) for i in range(len(bands[0]))]
        if target is not None:
            reached = [next((step for step, bpd in r["curve"] if bpd <= target), None)
                       for r in runs.values() if r["arm"] == arm]
            entry["steps_to_local4_final"] = reached
    return by_arm


def verdicts(summary: dict) -> list[tuple[str, str]]:
    """(clause, verdict with its numbers) for the rule's clauses whose arms have all their seeds."""
    whole = {arm: e for arm, e in summary.items() if len(e["seeds"]) == len(SEEDS)}
    out = []

    def mean(arm):
        return whole[arm]["mean"]

    for pi in ("pi-w1", "pi-w"):
        if {pi, "local-4"} <= set(whole):
            gap = mean("local-4") - mean(pi)
            paired = all(whole[pi]["seeds"][s] < whole["local-4"]["seeds"][s] for s in SEEDS)
            word = ("supported" if gap >= BEATS and paired else
                    "no difference" if abs(gap) < BEATS else "not supported")
            out.append((f"1. {pi} beats local-4 by ≥ {BEATS}, every seed",
                        f"{word}: local-4 − {pi} = {gap:+.3f} bits/dim; below in every seed: {paired}"))
    if {"pi-nbhd", "pi-w1"} <= set(whole):
        d = mean("pi-nbhd") - mean("pi-w1")
        out.append((f"2. pi-nbhd ≤ pi-w1 + {AT_LEAST_AS_GOOD}",
                    f"{'supported' if d <= AT_LEAST_AS_GOOD else 'not supported'}: pi-nbhd − pi-w1 = {d:+.3f}"))
    if {"pi-w1", "nbhd-2d"} <= set(whole):
        d = mean("pi-w1") - mean("nbhd-2d")
        out.append((f"3. |pi-w1 − nbhd-2d| ≤ {CLOSE} (or pi-w1 better)",
                    f"{'supported' if d <= CLOSE else 'not supported'}: pi-w1 − nbhd-2d = {d:+.3f}"))
    if "dense" in whole and len(whole) > 1:
        worse = [a for a in whole if a != "dense" and mean("dense") > mean(a) + CEILING]
        out.append((f"4. dense ≤ every arm + {CEILING}",
                    "holds" if not worse else f"violated by {', '.join(worse)}: the budget limits dense"))
    return out


def markdown(summary: dict, verdict_lines: list[tuple[str, str]], cost: dict | None) -> str:
    s = SETTING
    lines = ["# Raster images: next-pixel bits/dim, 14×14 MNIST (docs/results.md §10)", "",
             f"GPT {s['n_layer']} layers, d_model {s['d_model']}, {s['n_head']} heads, d_ff {s['d_ff']}; batch "
             f"{s['batch_size']} images, lr {s['lr']}, {s['warmup']} warm-up, {s['steps']} steps; test: the 500 "
             "test digits. Command: `python experiments/images.py --jobs 2`.", "",
             "| arm | seed 0 | seed 1 | seed 2 | mean | rows 0–2 / 3–6 / 7–9 / 10–13 (mean) | reaches above "
             "| steps to local-4's final |", "|---|---:|---:|---:|---:|---|---|---|"]
    for arm in ARMS:
        if arm not in summary:
            continue
        e = summary[arm]
        seeds = " | ".join(f"{e['seeds'][k]:.3f}" if k in e["seeds"] else "–" for k in SEEDS)
        bands = " / ".join(f"{b:.3f}" for b in e["row_bands"])
        steps = ", ".join("–" if x is None else str(x) for x in e.get("steps_to_local4_final", []))
        lines.append(f"| {arm} | {seeds} | {e['mean']:.3f} | {bands} | {e['reach'].get('above', '?')} | {steps} |")
    lines += ["", "## Verdicts (the rule's clauses)", ""]
    lines += [f"- **{clause}**: {verdict}" for clause, verdict in verdict_lines]
    if cost:
        ratio = cost["x_local4"]["pi-w1"]
        lines += [f"- **5. pi's step ≤ 1.1× local-4's**: {'supported' if ratio <= 1.1 else 'not supported'}: "
                  f"pi-w1 {ratio:.2f}× local-4 (median of {cost['rounds']} interleaved rounds, one thread, one "
                  f"process; load average {cost['load']:.1f})", "", "| arm | step ms | × local-4 |", "|---|---:|---:|"]
        lines += [f"| {arm} | {cost['ms'][arm]:.0f} | {cost['x_local4'][arm]:.2f} |" for arm in ARMS]
    return "\n".join(lines) + "\n"


def plot(runs: dict[str, dict], summary: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    from piattn.safe_files import save_figure

    fig = Figure(figsize=(12, 4.5), layout="constrained")
    left, right = fig.subplots(1, 2)
    arms = [a for a in ARMS if a in summary]
    for i, arm in enumerate(arms):
        values = list(summary[arm]["seeds"].values())
        left.scatter([i] * len(values), values, s=18)
        left.hlines(summary[arm]["mean"], i - 0.3, i + 0.3, color="black")
    left.set_xticks(range(len(arms)), arms, rotation=30)
    left.set_ylabel("test bits/dim (dots: seeds, bar: mean)")
    left.set_title("next-pixel bits/dim, 14×14 MNIST")
    for arm in arms:
        curves = [r["curve"] for r in runs.values() if r["arm"] == arm and r["curve"]]
        if curves:
            steps = [s for s, _ in curves[0]]
            mean = [statistics.mean(c[i][1] for c in curves if len(c) > i) for i in range(len(steps))]
            right.plot(steps, mean, label=arm)
    right.set_xlabel("step")
    right.set_ylabel("validation bits/dim (mean over seeds)")
    right.set_ylim(top=min(3.0, right.get_ylim()[1]))
    right.legend(fontsize=8)
    save_figure(fig, path)


def report(out: Path) -> None:
    runs = load_runs(out)
    cost_path = out / "cost.json"
    cost = json.loads(cost_path.read_text()) if cost_path.exists() else None
    if not runs:
        print("no finished runs yet", file=sys.stderr)
        return
    summary = summarize(runs)
    verdict_lines = verdicts(summary)
    write_json(out / "images.json", dict(setting=SETTING, arms=ARMS, seeds=SEEDS, runs=runs, summary=summary,
                                         verdicts=verdict_lines, cost=cost))
    (out / "images.md").write_text(markdown(summary, verdict_lines, cost))
    plot(runs, summary, out / "images.png")
    print((out / "images.md").read_text())


def completions(out: Path) -> None:
    """The completion grids: each arm's seed-0 checkpoint completes the bottom half of 8 test digits (sampled,
    and argmax).
    Arms whose kind has no incremental decoding (the 2D neighbourhood, strided) are left out, said on stderr."""
    from piattn.layers import kinds_with

    decoding = set(kinds_with("decoding"))
    left_out = [arm for arm in ARMS if arm_config(arm).attention not in decoding]
    if left_out:
        print(f"completions: {', '.join(left_out)} left out (no incremental decoding)", file=sys.stderr)
    checkpoints = [str(run_dir(out, arm, 0)) for arm in ARMS
                   if arm not in left_out and (run_dir(out, arm, 0) / "checkpoints").is_dir()]
    flags = [flag for c in checkpoints for flag in ("--checkpoint", c)]
    # sampled (temperature 1, one seed for every model) and argmax, which collapses to runs of one value
    for name, sampling in (("completions_sampled.png", ["--temperature", "1", "--seed", "0"]),
                           ("completions.png", ["--temperature", "0"])):
        subprocess.run([sys.executable, "-m", "piattn.cli", "generate", *flags, "--images", "8", *sampling,
                        "--output", str(out / name)], check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "images")
    parser.add_argument("--only", nargs="+", choices=list(ARMS), help="these arms only")
    parser.add_argument("--limit", type=int, help="at most this many runs now")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (one thread each)")
    parser.add_argument("--plan", action="store_true", help="list the runs, done or not, and stop")
    parser.add_argument("--report", action="store_true", help="tables, verdicts and figure of the finished runs")
    parser.add_argument("--completions", action="store_true", help="the completion grid of the seed-0 runs")
    parser.add_argument("--cost", action="store_true", help="clause 5: step times side by side (OUT/cost.json)")
    args = parser.parse_args()
    runs = load_runs(args.out)
    todo = [(a, s) for a, s in planned(args.only) if f"{a}/seed{s}" not in runs]
    if args.plan:
        for arm, seed in planned(args.only):
            print(f"{arm}/seed{seed}: {'done' if f'{arm}/seed{seed}' in runs else 'to run'}")
        return 0
    if args.completions:
        completions(args.out)
        return 0
    if args.cost:
        write_json(args.out / "cost.json", step_costs())
        report(args.out)
        return 0
    if not args.report:
        todo = todo[: args.limit] if args.limit is not None else todo
        with ThreadPoolExecutor(args.jobs) as pool, tqdm(total=len(todo), desc="image runs", unit="run") as bar:
            for result in pool.map(lambda job: one_run(args.out, *job), todo):
                runs = {**load_runs(args.out), f"{result['arm']}/seed{result['seed']}": result}
                write_json(args.out / "runs.json", runs)
                bar.update()
    report(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
