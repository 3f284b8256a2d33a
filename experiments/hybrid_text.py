"""Byte-level books in hybrid stacks: local, π or multi-scale π in the windowed layers beside one dense layer,
bits per byte at equal steps, and the training step's cost side by side (issue 59, part (b); the rule in
docs/results.md §11).

    python experiments/hybrid_text.py --plan      # the runs in order, done or not
    python experiments/hybrid_text.py             # every run (resumable), then the table
    python experiments/hybrid_text.py --limit 1   # at most one run this call
    python experiments/hybrid_text.py --timing    # the arms' training steps interleaved in one process
    python experiments/hybrid_text.py --report    # the table of the finished runs only

Resumable: OUT/text_runs.json holds every finished run, rewritten after each; `runs.train_and_test` continues
a run cut short from its latest checkpoint. Writes OUT/text.{json,md,png} and OUT/text_timing.{json,md}, OUT
defaulting to experiments/results/hybrids/.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from mqar import Arm
from runs import train_and_test, write_json
from tqdm import tqdm

from piattn.benchmarking import command_line, cpu_model, machine_info, save_results, timed_step
from piattn.config.training import parse_period
from piattn.models import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]
BUDGET = dict(config="tiny", seq_len=1024, batch=8, steps=1000, lr=2e-3, min_lr=2e-4, warmup=100, eval_every=250,
              eval_batches=16, test_batches=64)
WINDOW, PERIOD = 64, 128


# mqar.Arm: the same `piattn train` attention flags (the all-dense stack takes no window)
ARMS = {
    "local": Arm("local", WINDOW, layers="local*3,dense"),
    "pi": Arm("pi", WINDOW, str(PERIOD), layers="pi*3,dense"),
    "cover": Arm("pi", WINDOW, "cover", layers="pi*3,dense"),
    "all-local": Arm("local", WINDOW),
    "all-dense": Arm("dense"),
}
HYBRIDS = ("local", "pi", "cover")
# The rule's order: seed 0 of every arm, then seeds 1 and 2 of the hybrids.
PLAN = [(arm, 0) for arm in ARMS] + [(arm, seed) for seed in (1, 2) for arm in HYBRIDS]


def key(arm: str, seed: int) -> str:
    return f"{arm}/seed{seed}"


def train_argv(args, arm: str, seed: int, folder: Path) -> list[str]:
    b = BUDGET
    return ["train", "--data", f"books:{args.books}", "--tokenizer", "byte", "--config", b["config"],
            *ARMS[arm].flags(), "--seq-len", str(b["seq_len"]), "--batch-size", str(b["batch"]),
            "--steps", str(b["steps"]), "--lr", f"{b['lr']:g}", "--min-lr", f"{b['min_lr']:g}",
            "--warmup", str(b["warmup"]), "--dropout", "0", "--seed", str(seed), "--eval-every", str(b["eval_every"]),
            "--eval-batches", str(b["eval_batches"]), "--save-every", "250", "--log-every", "25", "--device", "cpu",
            "--no-progress", "--cache-dir", str(args.runs / "cache"), "--out", str(folder)]


def one_run(args, arm: str, seed: int) -> dict:
    folder = args.runs / f"{arm}-seed{seed}"
    result = train_and_test(folder, train_argv(args, arm, seed, folder), ["--batches", str(BUDGET["test_batches"])])
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    validation = [(r["step"], r["bpb"]) for r in records if r["split"] == "validation"]
    return dict(key=key(arm, seed), arm=arm, seed=seed, flags=ARMS[arm].flags(), test_bpb=result["bpb"],
                test_tokens=result.get("tokens"), validation=validation,
                wall_seconds=round(max(r["wall_seconds"] for r in records if r["split"] == "train"), 1))


def load(path: Path) -> dict[str, dict]:
    if not path.exists():
        return {}
    stored = json.loads(path.read_text())
    if stored["budget"] != BUDGET:
        raise SystemExit(f"{path} holds runs of another budget {stored['budget']}; move it or use --out")
    return {r["key"]: r for r in stored["runs"]}


# --- the rule ----------------------------------------------------------------------------------------

def clause_one(done: dict[str, dict]) -> dict:
    """π and cover against local, on the seeds both have: mean difference and the sign of every seed pair."""
    out = {}
    for arm in ("pi", "cover"):
        seeds = [s for s in (0, 1, 2) if key(arm, s) in done and key("local", s) in done]
        if not seeds:
            continue
        diffs = [done[key(arm, s)]["test_bpb"] - done[key("local", s)]["test_bpb"] for s in seeds]
        mean = statistics.mean(diffs)
        if mean <= -0.01 and all(d < 0 for d in diffs):
            verdict = "helps"
        elif mean >= 0.01 and all(d > 0 for d in diffs):
            verdict = "worse"
        else:
            verdict = "no difference"
        out[arm] = dict(seeds=seeds, differences=diffs, mean=mean, verdict=verdict,
                        provisional=len(seeds) < 3)
    return out


def table(done: dict[str, dict]) -> str:
    b = BUDGET
    lines = [f"GPT `{b['config']}` (4 layers), byte-level books, context {b['seq_len']}, batch {b['batch']}, "
             f"{b['steps']} steps ({b['steps'] * b['batch'] * b['seq_len']:,} training bytes), lr {b['lr']:g} → "
             f"{b['min_lr']:g}, dropout 0; test bits per byte on the first {b['test_batches']} batches of the test "
             "split. Windowed layers: k = 64; π = 128; cover designed over the π layers.", "",
             "| arm | flags | test bpb per seed | mean | s / run |", "|---|---|---|---|---|"]
    for arm in ARMS:
        rows = [done[key(arm, s)] for s in (0, 1, 2) if key(arm, s) in done]
        if rows:
            per_seed = " / ".join(f"{r['test_bpb']:.4f}" for r in rows)
            lines.append(f"| {arm} | `{' '.join(ARMS[arm].flags())}` | {per_seed} | "
                         f"{statistics.mean(r['test_bpb'] for r in rows):.4f} | "
                         f"{statistics.mean(r['wall_seconds'] for r in rows):.0f} |")
    for arm, c in clause_one(done).items():
        lines += ["", f"Clause 1, {arm} − local: " + ", ".join(f"{d:+.4f}" for d in c["differences"])
                  + f" (seeds {c['seeds']}), mean {c['mean']:+.4f}: **{c['verdict']}**"
                  + (" (provisional: fewer than 3 seeds)" if c["provisional"] else "")]
    return "\n".join(lines)


def plot(done: dict[str, dict], path: Path) -> None:
    """Test bits per byte of every run (a dot per seed, a dash at the mean), and validation bits per byte against
    steps (a line per seed), per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [a for a in ARMS if any(r["arm"] == a for r in done.values())]
    if not arms:
        return
    colors = dict(zip(ARMS, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for i, arm in enumerate(arms):
        rows = [r for r in done.values() if r["arm"] == arm]
        values = [r["test_bpb"] for r in rows]
        left.hlines(statistics.mean(values), i - 0.3, i + 0.3, color=colors[arm])
        left.scatter([i] * len(values), values, color=colors[arm], s=14, zorder=3)
        for k, r in enumerate(sorted(rows, key=lambda r: r["seed"])):
            steps, bpb = zip(*r["validation"], strict=True)
            right.plot(steps, bpb, color=colors[arm], lw=1, marker=".", label=arm if k == 0 else None)
    every = [r["test_bpb"] for r in done.values()]
    left.set_ylim(min(every) - 0.02, max(every) + 0.02)
    left.set_xticks(range(len(arms)), arms, fontsize=8)
    left.set_ylabel("test bits per byte (dots: seeds; dash: mean)")
    right.set_xlabel("step")
    right.set_ylabel("validation bits per byte")
    right.legend(fontsize=7)
    b = BUDGET
    fig.suptitle(f"Books in hybrid stacks: 3 windowed layers + 1 dense ({b['steps']} steps, batch {b['batch']} × "
                 f"{b['seq_len']} bytes)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- cost side by side -------------------------------------------------------------------------------

def timing(args) -> int:
    """Clause 2: each hybrid's training step (forward, backward, clipping, AdamW) on one batch of the budget,
    one warm-up step each, then `--repeats` rounds in which every arm takes one step, the order rotated."""
    torch.set_num_threads(1)
    b = BUDGET
    models = {}
    for arm in HYBRIDS:
        a = ARMS[arm]
        fields = dict(window=a.window, layers=a.layers)
        if a.period is not None:
            fields["period"] = parse_period(a.period)
        torch.manual_seed(0)
        model = GPT(GPTConfig.from_name(b["config"], attention=a.attention, vocab_size=256, block_size=b["seq_len"],
                                        dropout=0.0, **fields))
        models[arm] = (model, torch.optim.AdamW(model.parameters(), lr=b["lr"]))
    idx = torch.randint(0, 256, (b["batch"], b["seq_len"] + 1), generator=torch.Generator().manual_seed(0))
    for model, optimizer in models.values():
        timed_step(model, model, optimizer, idx)
    seconds: dict[str, list[float]] = {arm: [] for arm in HYBRIDS}
    for r in tqdm(range(args.repeats), desc="rounds", disable=args.no_progress):
        turn = HYBRIDS[r % 3:] + HYBRIDS[:r % 3]
        for arm in turn:
            model, optimizer = models[arm]
            seconds[arm].append(timed_step(model, model, optimizer, idx))
    ratios = {arm: [s / base for s, base in zip(seconds[arm], seconds["local"], strict=True)]
              for arm in ("pi", "cover")}
    result = dict(machine=machine_info(), cpu=cpu_model(),
                  command=command_line("experiments/hybrid_text.py", args.argv),
                  budget=BUDGET, repeats=args.repeats, seconds=seconds,
                  median_seconds={a: statistics.median(s) for a, s in seconds.items()},
                  ratio_to_local={a: dict(median=statistics.median(r), low=min(r), high=max(r))
                                  for a, r in ratios.items()},
                  clause_two={a: statistics.median(r) <= 1.1 for a, r in ratios.items()})
    lines = [f"Training step, hybrids side by side (`{result['command']}`; one thread, batch {b['batch']} × "
             f"{b['seq_len']}, {args.repeats} rounds, order rotated):", "",
             "| arm | median s | × local (median, range) |", "|---|---|---|"]
    for arm in HYBRIDS:
        r = result["ratio_to_local"].get(arm)
        shown = "1" if r is None else f"{r['median']:.3f} ({r['low']:.3f}–{r['high']:.3f})"
        lines.append(f"| {arm} | {result['median_seconds'][arm]:.3f} | {shown} |")
    save_results(args.out, "text_timing", result, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--books", type=Path, default=ROOT.parent / "shared" / "data" / "books",
                   help="the books folder (default ../shared/data/books)")
    p.add_argument("--runs", type=Path, default=ROOT / "runs" / "hybrids_text", help="where the run folders go")
    p.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "hybrids")
    p.add_argument("--plan", action="store_true")
    p.add_argument("--report", action="store_true")
    p.add_argument("--limit", type=int)
    p.add_argument("--timing", action="store_true", help="time the hybrids' training steps side by side")
    p.add_argument("--repeats", type=int, default=9, help="--timing: rounds (default 9)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv  # the command, as run through hybrids.py or not
    args.books = args.books.resolve()
    if args.timing:
        return timing(args)
    path = args.out / "text_runs.json"
    done = load(path)
    todo = [(arm, seed) for arm, seed in PLAN if key(arm, seed) not in done]
    if args.plan:
        for arm, seed in PLAN:
            print(f"{key(arm, seed):18s} {' '.join(ARMS[arm].flags()):45s} "
                  f"{'done' if key(arm, seed) in done else 'to run'}")
        return 0
    if not args.report:
        todo = todo[: args.limit] if args.limit is not None else todo
        for arm, seed in tqdm(todo, desc="hybrid text runs", disable=args.no_progress):
            start = time.perf_counter()
            done[key(arm, seed)] = one_run(args, arm, seed)
            write_json(path, dict(budget=BUDGET, runs=list(done.values())))
            tqdm.write(f"{key(arm, seed)}: test bpb {done[key(arm, seed)]['test_bpb']:.4f} "
                       f"({time.perf_counter() - start:.0f} s)")
    text = table(done)
    write_json(args.out / "text.json", dict(budget=BUDGET, arms={a: dataclasses.asdict(x) for a, x in ARMS.items()},
                                            runs=list(done.values()), clause_one=clause_one(done)))
    (args.out / "text.md").write_text("# Books in hybrid stacks (experiments/hybrid_text.py)\n\n" + text + "\n")
    plot(done, args.out / "text.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
