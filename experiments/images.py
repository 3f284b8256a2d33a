"""Raster images: π with the period set by the geometry, against local, 2D neighbourhood, strided and dense
attention (docs/results.md §10, whose rules were committed before these runs). Three studies:

    main     next-pixel bits/dim of 14×14 MNIST digits (the rule's main setting; 8 arms × 3 seeds)
    28x28    the same at full size, W = 28 (a factor: 5 arms, 1 000 steps, seeds 0–1 for local-4 and pi-w1)
    smnist   whole-image classification of 14×14 digits, sMNIST (a factor: 7 arms × 2 seeds, ±π)
    pathfinder  Pathfinder-32 classification (a factor: a dense probe first, the other arms only if it learns)

    python experiments/images.py --plan                        # the main study's runs in order, done or not
    python experiments/images.py --jobs 2                      # every run (resumable), then tables and figure
    python experiments/images.py --study smnist --jobs 1       # a factor
    python experiments/images.py --only pi-w1 local-4 --limit 2
    python experiments/images.py --report                      # tables, verdicts, figure of the finished runs
    python experiments/images.py --completions                 # the completion grid of each arm's seed-0 run
    python experiments/images.py --cost                        # clause 5: step times side by side, one process

Each run is `piattn train` then `piattn eval` on the test split (experiments/runs.py), one intra-op thread
each; `--jobs` runs that many at once. Resumable: OUT/runs.json holds every finished run and is rewritten after
each one, and a run folder already scored is not trained again. Writes OUT/images.json (setting, arms, runs,
summary, verdicts), OUT/images.md and OUT/images.png (the test metric per arm and seed; validation against
steps); OUT is experiments/results/images/ for the main study and a subfolder named after a factor.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from runs import train_and_test, write_json
from tqdm import tqdm

RESULTS = Path(__file__).parent / "results" / "images"


@dataclass(frozen=True)
class Study:
    """One setting of docs/results.md §10 and the arms run in it."""

    name: str
    title: str
    setting: dict  # `piattn train` flags shared by every arm (as field=value)
    width: int  # the image width W after downsampling
    arms: dict[str, list[str]]  # arm -> the `piattn train` flags of its attention
    seeds: dict[str, tuple[int, ...]]  # arm -> its seeds
    metric: str  # "bits_per_dim" (lower is better) or "accuracy" (higher is better)
    pi_arms: tuple[str, ...]  # the π arms clause 1 tests against local-4 (the first is the rule's π)
    margins: dict  # the rule's margins, in the metric's unit: beats, at_least_as_good, close, ceiling
    learns: float | None = None  # the metric some arm must reach for the setting to count
    flags: tuple[str, ...] = ()  # more `piattn train` flags of every arm

    @property
    def out(self) -> Path:
        return RESULTS if self.name == "main" else RESULTS / self.name

    @property
    def lower_is_better(self) -> bool:
        return self.metric == "bits_per_dim"

    def better(self, a: float, b: float) -> float:
        """How much value a is better than value b (positive: a better), in the metric's unit."""
        return b - a if self.lower_is_better else a - b


PIXEL_SETTING = dict(task="pixels", data="mnist5k", downsample=2, n_layer=2, d_model=64, n_head=4, d_ff=256,
                     batch_size=32, lr=3e-3, warmup=100, steps=2000, eval_every=100, dropout=0.0)


def _arms(width: int, *names: str) -> dict[str, list[str]]:
    every = {
        "dense": ["--attention", "dense"],
        "local-4": ["--attention", "local", "--window", "4"],
        f"local-{width + 1}": ["--attention", "local", "--window", str(width + 1)],
        "pi-w1": ["--attention", "pi", "--window", "4", "--period", "width-1"],
        "pi-w": ["--attention", "pi", "--window", "4", "--period", "width"],
        "pi-nbhd": ["--attention", "pi", "--window", "4", "--period", "neighbourhood"],
        "nbhd-2d": ["--attention", "neighbourhood", "--radius", "1"],
        "strided": ["--attention", "strided"],
    }
    return {name: every[name] for name in names}


BITS_MARGINS = dict(beats=0.05, at_least_as_good=0.01, close=0.05, ceiling=0.01)
ACCURACY_MARGINS = dict(beats=0.02, at_least_as_good=0.01, close=0.02, ceiling=0.01)
STUDIES = {study.name: study for study in (
    Study("main", "next-pixel bits/dim, 14×14 MNIST", PIXEL_SETTING, 14,
          _arms(14, "dense", "local-4", "local-15", "pi-w1", "pi-w", "pi-nbhd", "nbhd-2d", "strided"),
          dict.fromkeys(("dense", "local-4", "local-15", "pi-w1", "pi-w", "pi-nbhd", "nbhd-2d", "strided"),
                        (0, 1, 2)),
          "bits_per_dim", ("pi-w1", "pi-w"), BITS_MARGINS),
    # factor: full size (W = 28); local/π steps cost 4× the main setting's, the 2D kinds and dense 7–11×
    Study("28x28", "next-pixel bits/dim, 28×28 MNIST", {**PIXEL_SETTING, "downsample": 1, "steps": 1000}, 28,
          _arms(28, "local-4", "pi-w1", "pi-nbhd", "nbhd-2d", "dense"),
          {"local-4": (0, 1), "pi-w1": (0, 1), "pi-nbhd": (0,), "nbhd-2d": (0,), "dense": (0,)},
          "bits_per_dim", ("pi-w1",), BITS_MARGINS),
    # factor: sMNIST, a bidirectional encoder with mean pooling: ±π = W holds the pixels above and below exactly
    Study("smnist", "sMNIST accuracy, 14×14 digits", {**PIXEL_SETTING, "task": "image-class"}, 14,
          _arms(14, "dense", "local-4", "local-15", "pi-w", "pi-nbhd", "nbhd-2d", "strided"),
          dict.fromkeys(("dense", "local-4", "local-15", "pi-w", "pi-nbhd", "nbhd-2d", "strided"), (0, 1)),
          "accuracy", ("pi-w",), ACCURACY_MARGINS, learns=0.80),
    # factor: Pathfinder-32 (contour length 6), whose dense probe runs first (`--only dense`): the other arms
    # run only if it learns; dense steps cost 1.6 s here, π's 0.7 s, the 2D neighbourhood's 1.9 s
    Study("pathfinder", "Pathfinder-32 accuracy (contour length 6)",
          {**PIXEL_SETTING, "task": "image-class", "data": "pathfinder", "downsample": 1, "steps": 1000}, 32,
          _arms(32, "dense", "local-4", "pi-w", "pi-nbhd", "nbhd-2d"), dict.fromkeys(
              ("dense", "local-4", "pi-w", "pi-nbhd", "nbhd-2d"), (0,)),
          "accuracy", ("pi-w",), ACCURACY_MARGINS, learns=0.60, flags=("--contour-length", "6")),
)}


def arm_config(study: Study, arm: str):
    """The GPTConfig of `arm` in a next-pixel study (its flags read as config fields; period words resolve
    from the image width)."""
    from piattn.models import GPTConfig

    flags = study.arms[arm]
    fields = {flag[2:].replace("-", "_"): value for flag, value in zip(flags[::2], flags[1::2], strict=True)}
    for name in ("window", "radius"):
        if name in fields:
            fields[name] = int(fields[name])
    s = study.setting
    return GPTConfig.from_name("tiny", **fields, image_width=study.width, n_layer=s["n_layer"],
                               d_model=s["d_model"], n_head=s["n_head"], d_ff=s["d_ff"], dropout=s["dropout"],
                               vocab_size=257, block_size=study.width * study.width)


def step_costs(study: Study, rounds: int = 41) -> dict:
    """Clause 5: one training step (forward, backward, AdamW) of every arm on one batch of the study's shape
    (random pixels), one thread, in one process, the arms in a rotated order each round; per arm the median ms
    and the median of its per-round ratio to local-4."""
    import time

    import torch

    from piattn.models import GPT

    torch.set_num_threads(1)
    torch.manual_seed(0)
    models = {arm: GPT(arm_config(study, arm)) for arm in study.arms}
    optimizers = {arm: torch.optim.AdamW(m.parameters(), study.setting["lr"]) for arm, m in models.items()}
    batch = torch.randint(0, 256, (study.setting["batch_size"], study.width * study.width + 1))

    def step(arm: str) -> float:
        start = time.perf_counter()
        logits = models[arm](batch[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
        optimizers[arm].step()
        optimizers[arm].zero_grad(set_to_none=True)
        return (time.perf_counter() - start) * 1e3

    arms = list(study.arms)
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


def run_dir(study: Study, arm: str, seed: int) -> Path:
    return study.out / "runs" / f"{arm}-seed{seed}"


def train_argv(study: Study, arm: str, seed: int) -> list[str]:
    s = study.setting
    return ["train", "--task", s["task"], "--data", s["data"], "--downsample", str(s["downsample"]),
            "--n-layer", str(s["n_layer"]), "--d-model", str(s["d_model"]), "--n-head", str(s["n_head"]),
            "--d-ff", str(s["d_ff"]), "--dropout", str(s["dropout"]), "--batch-size", str(s["batch_size"]),
            "--lr", str(s["lr"]), "--warmup", str(s["warmup"]), "--steps", str(s["steps"]),
            "--eval-every", str(s["eval_every"]), "--save-every", "200", "--seed", str(seed), "--device", "cpu",
            "--no-progress",
            "--out", str(run_dir(study, arm, seed)), *study.flags, *study.arms[arm]]


def validation_curve(run: Path, metric: str) -> list[tuple[int, float]]:
    """(step, validation metric) of a finished run, from its metrics.jsonl."""
    curve = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("split") == "validation" and metric in record:
            curve.append((record["step"], record[metric]))
    return curve


def one_run(study: Study, arm: str, seed: int) -> dict:
    run = run_dir(study, arm, seed)
    test = train_and_test(run, train_argv(study, arm, seed))
    return dict(arm=arm, seed=seed, test=test, curve=validation_curve(run, study.metric))


def planned(study: Study, only: list[str] | None) -> list[tuple[str, int]]:
    """(arm, seed) in the order they go: seed by seed, every arm, so that a cut-short study has whole seeds."""
    arms = [a for a in study.arms if not only or a in only]
    seeds = sorted({s for arm in arms for s in study.seeds[arm]})
    return [(arm, seed) for seed in seeds for arm in arms if seed in study.seeds[arm]]


def load_runs(out: Path) -> dict[str, dict]:
    path = out / "runs.json"
    return json.loads(path.read_text()) if path.exists() else {}


def summarize(study: Study, runs: dict[str, dict]) -> dict:
    """Per arm: the test metric by seed, its mean, and the steps to reach local-4's final mean (validation);
    for next-pixel studies also bits/dim by row band and which neighbours the arm reaches."""
    by_arm: dict[str, dict] = {}
    for r in runs.values():
        by_arm.setdefault(r["arm"], {"seeds": {}})["seeds"][r["seed"]] = r["test"][study.metric]
    local = by_arm.get("local-4")
    target = statistics.mean(local["seeds"].values()) if local else None
    for arm, entry in by_arm.items():
        mine = [r for r in runs.values() if r["arm"] == arm]
        entry["mean"] = statistics.mean(entry["seeds"].values())
        if study.metric == "bits_per_dim":
            entry["reach"] = mine[0]["test"].get("neighbour_reach") or {}
            bands = [r["test"]["row_bands"] for r in mine]
            entry["row_bands"] = [statistics.mean(b[i]["bits_per_dim"] for b in bands) for i in range(len(bands[0]))]
        if target is not None:
            entry["steps_to_local4_final"] = [
                next((step for step, value in r["curve"] if study.better(value, target) >= 0), None) for r in mine]
    return by_arm


def verdicts(study: Study, summary: dict) -> list[tuple[str, str]]:
    """(clause, verdict with its numbers) for the rule's clauses whose arms have all their seeds; two arms are
    compared by their means over the seeds both have."""
    whole = {arm: e for arm, e in summary.items() if set(e["seeds"]) == set(study.seeds[arm])}
    m, unit = study.margins, "bits/dim" if study.lower_is_better else "accuracy"
    out = []

    def gap(a: str, b: str) -> tuple[float, list[int]]:
        """How much arm a is better than arm b (mean over their common seeds), and those seeds."""
        common = sorted(set(whole[a]["seeds"]) & set(whole[b]["seeds"]))
        mean = {arm: statistics.mean(whole[arm]["seeds"][s] for s in common) for arm in (a, b)}
        return study.better(mean[a], mean[b]), common

    def compared(a: str, g: float) -> str:
        return f"{a} {'better' if g >= 0 else 'worse'} by {abs(g):.3f}"

    if study.learns is not None and whole:
        best = max(whole, key=lambda arm: study.better(whole[arm]["mean"], 0))
        learned = study.better(whole[best]["mean"], study.learns) >= 0
        out.append((f"0. some arm reaches {study.learns} (else the setting does not count)",
                    f"{'yes' if learned else 'no'}: best {best} {whole[best]['mean']:.3f}"))
        if not learned:
            return out
    for pi in study.pi_arms:
        if {pi, "local-4"} <= set(whole):
            g, seeds = gap(pi, "local-4")
            paired = all(study.better(whole[pi]["seeds"][s], whole["local-4"]["seeds"][s]) > 0 for s in seeds)
            word = ("supported" if g >= m["beats"] and paired else
                    "no difference" if abs(g) < m["beats"] else "not supported")
            out.append((f"1. {pi} beats local-4 by ≥ {m['beats']}, every seed",
                        f"{word}: {compared(pi, g)} {unit} (seeds {seeds}); better in every seed: {paired}"))
    pi = study.pi_arms[0]
    if {"pi-nbhd", pi} <= set(whole):
        g, seeds = gap("pi-nbhd", pi)
        out.append((f"2. pi-nbhd at least as good as {pi} (within {m['at_least_as_good']})",
                    f"{'supported' if g >= -m['at_least_as_good'] else 'not supported'}: {compared('pi-nbhd', g)} "
                    f"(seeds {seeds})"))
    if {pi, "nbhd-2d"} <= set(whole):
        g, seeds = gap(pi, "nbhd-2d")
        out.append((f"3. {pi} within {m['close']} of nbhd-2d (or better)",
                    f"{'supported' if g >= -m['close'] else 'not supported'}: {compared(pi, g)} "
                    f"(seeds {seeds})"))
    if "dense" in whole and len(whole) > 1:
        worse = [a for a in whole if a != "dense" and gap(a, "dense")[0] > m["ceiling"]]
        out.append((f"4. dense at least as good as every arm (within {m['ceiling']})",
                    "holds" if not worse else f"violated by {', '.join(worse)}: the budget limits dense"))
    return out


def markdown(study: Study, summary: dict, verdict_lines: list[tuple[str, str]], cost: dict | None) -> str:
    s = study.setting
    seeds = sorted({k for arm in study.arms for k in study.seeds[arm]})
    command = "python experiments/images.py" + ("" if study.name == "main" else f" --study {study.name}")
    pixels = study.metric == "bits_per_dim"
    model = "GPT" if pixels else "bidirectional encoder (mean pooling),"
    test = "the generated test split" if s["data"] == "pathfinder" else "the 500 test digits"
    lines = [f"# Raster images: {study.title} (docs/results.md §10)", "",
             f"{model} {s['n_layer']} layers, d_model {s['d_model']}, {s['n_head']} heads, d_ff {s['d_ff']}; batch "
             f"{s['batch_size']} images, lr {s['lr']}, {s['warmup']} warm-up, {s['steps']} steps; test: "
             f"{test}. Command: `{command} --jobs 2`.", "",
             "| arm | " + " | ".join(f"seed {k}" for k in seeds) + " | mean | "
             + ("rows by band, top to bottom (mean) | reaches above | " if pixels else "")
             + "steps to local-4's final |",
             "|---|" + "---:|" * (len(seeds) + 1) + ("---|---|" if pixels else "") + "---|"]
    for arm in study.arms:
        if arm not in summary:
            continue
        e = summary[arm]
        values = " | ".join(f"{e['seeds'][k]:.3f}" if k in e["seeds"] else "–" for k in seeds)
        extra = (" / ".join(f"{b:.3f}" for b in e["row_bands"]) + f" | {e['reach'].get('above', '?')} | "
                 if pixels else "")
        steps = ", ".join("–" if x is None else str(x) for x in e.get("steps_to_local4_final", []))
        lines.append(f"| {arm} | {values} | {e['mean']:.3f} | {extra}{steps} |")
    lines += ["", "## Verdicts (the rule's clauses)", ""]
    lines += [f"- **{clause}**: {verdict}" for clause, verdict in verdict_lines]
    if cost:
        ratio = cost["x_local4"][study.pi_arms[0]]
        lines += [f"- **5. pi's step ≤ 1.1× local-4's**: {'supported' if ratio <= 1.1 else 'not supported'}: "
                  f"{study.pi_arms[0]} {ratio:.2f}× local-4 (median of {cost['rounds']} interleaved rounds, one "
                  f"thread, one process; load average {cost['load']:.1f})", "", "| arm | step ms | × local-4 |",
                  "|---|---:|---:|"]
        lines += [f"| {arm} | {cost['ms'][arm]:.0f} | {cost['x_local4'][arm]:.2f} |" for arm in study.arms]
    return "\n".join(lines) + "\n"


def plot(study: Study, runs: dict[str, dict], summary: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    from piattn.safe_files import save_figure

    label = "bits/dim" if study.lower_is_better else "accuracy"
    fig = Figure(figsize=(12, 4.5), layout="constrained")
    left, right = fig.subplots(1, 2)
    arms = [a for a in study.arms if a in summary]
    for i, arm in enumerate(arms):
        values = list(summary[arm]["seeds"].values())
        left.scatter([i] * len(values), values, s=18)
        left.hlines(summary[arm]["mean"], i - 0.3, i + 0.3, color="black")
    left.set_xticks(range(len(arms)), arms, rotation=30)
    left.set_ylabel(f"test {label} (dots: seeds, bar: mean)")
    left.set_title(study.title)
    for arm in arms:
        curves = [r["curve"] for r in runs.values() if r["arm"] == arm and r["curve"]]
        if curves:
            steps = [s for s, _ in curves[0]]
            mean = [statistics.mean(c[i][1] for c in curves if len(c) > i) for i in range(len(steps))]
            right.plot(steps, mean, label=arm)
    right.set_xlabel("step")
    right.set_ylabel(f"validation {label} (mean over seeds)")
    if study.lower_is_better:
        right.set_ylim(top=min(3.0, right.get_ylim()[1]))
    right.legend(fontsize=8)
    save_figure(fig, path)


def report(study: Study) -> None:
    out = study.out
    runs = load_runs(out)
    cost_path = out / "cost.json"
    cost = json.loads(cost_path.read_text()) if cost_path.exists() else None
    if not runs:
        print("no finished runs yet", file=sys.stderr)
        return
    summary = summarize(study, runs)
    verdict_lines = verdicts(study, summary)
    write_json(out / "images.json", dict(setting=study.setting, arms=study.arms, seeds=study.seeds, runs=runs,
                                         summary=summary, verdicts=verdict_lines, cost=cost))
    (out / "images.md").write_text(markdown(study, summary, verdict_lines, cost))
    plot(study, runs, summary, out / "images.png")
    print((out / "images.md").read_text())


def completions(study: Study) -> None:
    """The completion grids: each arm's seed-0 checkpoint completes the bottom half of 8 test digits (sampled,
    and argmax); the kinds without incremental decoding (2D neighbourhood, strided) run the whole prefix again
    for each pixel (`piattn.tasks.pixels.complete`)."""
    checkpoints = [str(run_dir(study, arm, 0)) for arm in study.arms
                   if (run_dir(study, arm, 0) / "checkpoints").is_dir()]
    flags = [flag for c in checkpoints for flag in ("--checkpoint", c)]
    # sampled (temperature 1, one seed for every model) and argmax, which collapses to runs of one value
    for name, sampling in (("completions_sampled.png", ["--temperature", "1", "--seed", "0"]),
                           ("completions.png", ["--temperature", "0"])):
        subprocess.run([sys.executable, "-m", "piattn.cli", "generate", *flags, "--images", "8", *sampling,
                        "--overwrite", "--output", str(study.out / name)], check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--study", choices=list(STUDIES), default="main", help="which setting (module docstring)")
    parser.add_argument("--only", nargs="+", help="these arms only")
    parser.add_argument("--limit", type=int, help="at most this many runs now")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (one thread each)")
    parser.add_argument("--plan", action="store_true", help="list the runs, done or not, and stop")
    parser.add_argument("--report", action="store_true", help="tables, verdicts and figure of the finished runs")
    parser.add_argument("--completions", action="store_true", help="the completion grid of the seed-0 runs")
    parser.add_argument("--cost", action="store_true", help="clause 5: step times side by side (OUT/cost.json)")
    args = parser.parse_args()
    study = STUDIES[args.study]
    unknown = set(args.only or ()) - set(study.arms)
    if unknown:
        parser.error(f"--only: {', '.join(sorted(unknown))} not an arm of --study {study.name}; its arms: "
                     f"{', '.join(study.arms)}")
    pixels = study.metric == "bits_per_dim"
    if (args.completions or args.cost) and not pixels:
        parser.error(f"--completions and --cost are for the next-pixel studies, not --study {study.name}")
    runs = load_runs(study.out)
    todo = [(a, s) for a, s in planned(study, args.only) if f"{a}/seed{s}" not in runs]
    if args.plan:
        for arm, seed in planned(study, args.only):
            print(f"{arm}/seed{seed}: {'done' if f'{arm}/seed{seed}' in runs else 'to run'}")
        return 0
    if args.completions:
        completions(study)
        return 0
    if args.cost:
        write_json(study.out / "cost.json", step_costs(study))
        report(study)
        return 0
    if not args.report:
        todo = todo[: args.limit] if args.limit is not None else todo
        with ThreadPoolExecutor(args.jobs) as pool, tqdm(total=len(todo), desc="image runs", unit="run") as bar:
            for result in pool.map(lambda job: one_run(study, *job), todo):
                runs = {**load_runs(study.out), f"{result['arm']}/seed{result['seed']}": result}
                write_json(study.out / "runs.json", runs)
                bar.update()
    report(study)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
