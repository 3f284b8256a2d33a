"""Byte-level language modelling on the shared Gutenberg books: attention kinds, π variants, k × π sweep.

Every run trains the same GPT config on the same token budget with `piattn train`, then scores the test
books with `piattn eval`; the table collects validation and test bits per byte, perplexity, tokens/s, peak
memory and wall time from the runs' own metrics. Runs already finished in --runs are not repeated.

    python experiments/books_lm.py --books ../shared/data/books --runs runs/books --out docs/books_lm.md
    python experiments/books_lm.py --groups kinds --steps 50 ...        # a quicker subset
    python experiments/books_lm.py --groups kinds --names local pi --seed 1 --runs runs/books-seed1 ...
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from runs import train_and_test

from piattn.models import GPT, GPTConfig

# name -> extra `piattn train` flags; every run also gets the shared flags built in `train_argv`
GROUPS: dict[str, dict[str, list[str]]] = {
    "kinds": {
        "dense": ["--attention", "dense"],
        "local": ["--attention", "local"],
        "pi": ["--attention", "pi"],
        "longformer": ["--attention", "longformer"],
    },
    "variants": {
        "pi-union": ["--attention", "pi", "--variant", "union"],
        "pi-separate": ["--attention", "pi", "--variant", "separate"],
        "pi-fixed-0.3": ["--attention", "pi", "--variant", "fixed", "--prior", "0.3"],
    },
    "sweep": {
        "pi-k2-p16": ["--attention", "pi", "--window", "2", "--period", "16"],
        "pi-k8-p16": ["--attention", "pi", "--window", "8", "--period", "16"],
        "pi-k4-p8": ["--attention", "pi", "--window", "4", "--period", "8"],
        "pi-k4-p64": ["--attention", "pi", "--window", "4", "--period", "64"],
    },
}


def train_argv(args: argparse.Namespace, run: Path, extra: list[str]) -> list[str]:
    return ["train", "--data", f"books:{args.books}", "--tokenizer", "byte", "--config", args.config,
            "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--lr", str(args.lr), "--min-lr", str(args.lr / 10),
            "--dropout", "0.0", "--seed", str(args.seed), "--eval-every", str(args.steps),
            "--eval-batches", str(args.eval_batches), "--save-every", "0", "--log-every", "10",
            "--device", "cpu", "--no-progress", "--out", str(run), *extra]


def collect(name: str, run: Path, test: dict) -> dict:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in records if r["split"] == "train"]
    validation = [r for r in records if r["split"] == "validation"]
    config = json.loads((run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
                         / "config.json").read_text())
    speeds = [r["tokens_per_second"] for r in train[1:] or train]  # the first interval includes warm-up
    with torch.device("meta"):
        params = GPT(GPTConfig(**config["model"])).num_params()
    return dict(name=name, attention=config["model"]["attention"], variant=config["model"]["variant"],
                window=config["model"]["window"], period=config["model"]["period"],
                params=params, val_bpb=validation[-1]["bpb"], test_bpb=test["bpb"],
                test_ppl_byte=math.exp(test["loss"]), test_bytes=test.get("bytes"),
                tokens=train[-1]["tokens"], tokens_per_s=sorted(speeds)[len(speeds) // 2],
                peak_mib=train[-1]["peak_memory_bytes"] / 2**20, wall_s=train[-1]["wall_seconds"])


def table(rows: list[dict], args: argparse.Namespace) -> str:
    out = [f"Budget per run: GPT `{args.config}`, byte-level, context {args.seq_len}, batch {args.batch_size}, "
           f"{args.steps} steps ({args.steps * args.batch_size * args.seq_len:,} training tokens), warmup "
           f"{args.warmup}, peak LR {args.lr}, dropout 0, seed {args.seed}; validation on {args.eval_batches} "
           f"batches, test on {args.test_batches} batches of {args.batch_size}×{args.seq_len} bytes.", "",
           "| run | attention | variant | k | π | params | val bpb | test bpb | test ppl (per byte) | tokens/s | "
           "peak RSS MiB | wall s |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pi = r["attention"] == "pi"  # variant and π mean nothing to the other kinds
        out.append(f"| {r['name']} | {r['attention']} | {r['variant'] if pi else '–'} | {r['window']} | "
                   f"{r['period'] if pi else '–'} | "
                   f"{r['params']:,} | {r['val_bpb']:.4f} | {r['test_bpb']:.4f} | {r['test_ppl_byte']:.3f} | "
                   f"{r['tokens_per_s']:.0f} | {r['peak_mib']:.0f} | {r['wall_s']:.0f} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--books", type=Path, default=Path("../shared/data/books"))
    parser.add_argument("--runs", type=Path, default=Path("runs/books"))
    parser.add_argument("--out", type=Path, help="markdown table to write (JSON beside it)")
    parser.add_argument("--groups", nargs="+", default=list(GROUPS), choices=list(GROUPS))
    parser.add_argument("--names", nargs="+", help="only these runs of the chosen groups (e.g. local pi)")
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=15)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-batches", type=int, default=16)
    parser.add_argument("--test-batches", type=int, default=32)
    args = parser.parse_args(argv)
    if not args.books.is_dir():
        raise SystemExit(f"--books: no folder {args.books}")
    rows = []
    for group in args.groups:
        for name, extra in GROUPS[group].items():
            if args.names and name not in args.names:
                continue
            run = args.runs / name
            test = train_and_test(run, train_argv(args, run, extra), ["--batches", str(args.test_batches)])
            rows.append(collect(name, run, test))
            if args.out:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.with_suffix(".json").write_text(json.dumps(dict(args={k: str(v) for k, v in
                                                                               vars(args).items()}, rows=rows),
                                                                    indent=1))
                args.out.write_text(table(rows, args))
    print(table(rows, args))


if __name__ == "__main__":
    main()
