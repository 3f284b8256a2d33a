"""The reach task for every kind: accuracy against lag beside the analysis's reachability prediction.

Each run is `piattn train --task reach` (a causal GPT read out at the query, the answer exactly `lag`
tokens back) at the demo's size, then `piattn eval` on the test split. Runs already finished are kept.

    python experiments/reach.py --runs runs/reach --out experiments/results/reach.md
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from runs import train_and_test

from piattn.data.reach import reachable
from piattn.tasks.reach_setting import REACH


def train_argv(kind: str, lag: int, seed: int, steps: int, run: Path) -> list[str]:
    return ["train", "--task", "reach", "--attention", kind, "--lag", str(lag), "--window", str(REACH["window"]),
            "--period", str(REACH["period"]), "--n-layer", str(REACH["layers"]), "--reach-vocab", str(REACH["vocab"]),
            "--seq-len", str(REACH["seq_len"]), "--d-model", "64", "--n-head", "2", "--batch-size", "32",
            "--steps", str(steps), "--lr", "3e-3", "--min-lr", "3e-4", "--warmup", "20", "--dropout", "0",
            "--weight-decay", "0", "--eval-every", "0", "--save-every", "0", "--seed", str(seed),
            "--device", "cpu", "--no-progress", "--out", str(run)]


def predicted(kind: str, lag: int) -> str:
    """What the analysis says a causal model of this kind can do at this lag (dense: anything in the text)."""
    if kind == "dense":
        return "yes"
    # longformer is local plus the first token, which no lag here reaches back to (lag < seq_len − 1)
    period = REACH["period"] if kind == "pi" else None
    return "yes" if reachable(lag, REACH["window"], period, REACH["layers"]) else "no"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=Path, default=Path("runs/reach"))
    parser.add_argument("--out", type=Path, help="markdown table to write (JSON beside it)")
    parser.add_argument("--kinds", nargs="+", default=["local", "pi", "longformer", "dense"])
    parser.add_argument("--lags", type=int, nargs="+", default=[3, 4, 5, 8, 10, 12, 16])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args(argv)
    rows = []
    for lag in args.lags:
        for kind in args.kinds:
            run = args.runs / f"{kind}-lag{lag}-seed{args.seed}"
            accuracy = train_and_test(run, train_argv(kind, lag, args.seed, args.steps, run))["accuracy"]
            rows.append(dict(lag=lag, attention=kind, reachable=predicted(kind, lag), accuracy=accuracy))
            print(f"lag {lag:2d} {kind:10s} reachable {rows[-1]['reachable']:3s} accuracy {accuracy:.3f}", flush=True)
    lines = [f"Causal GPT, window {REACH['window']}, {REACH['layers']} layers, π {REACH['period']}, "
             f"{REACH['vocab']} symbols (chance {1 / REACH['vocab']:.2f}), sequence {REACH['seq_len']}, d_model 64, "
             f"batch 32, {args.steps} steps, seed {args.seed}; test accuracy on 1,000 examples.", "",
             "| lag | " + " | ".join(f"{k}: reachable | {k}: accuracy" for k in args.kinds) + " |",
             "|---|" + "---|---|" * len(args.kinds)]
    for lag in args.lags:
        cells = [next(r for r in rows if r["lag"] == lag and r["attention"] == k) for k in args.kinds]
        lines.append(f"| {lag} | " + " | ".join(f"{c['reachable']} | {c['accuracy']:.3f}" for c in cells) + " |")
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    print(text)


if __name__ == "__main__":
    main()
