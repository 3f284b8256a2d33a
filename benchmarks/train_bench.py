"""Training-step speed and memory of the GPT with each attention kind, side by side, on this machine.

Each (kind, context) runs in a fresh process: a GPT of the named config (byte vocabulary), AdamW, one
warm-up step, then the median of `--repeats` timed steps (forward, backward, optimizer) on a batch of
`--tokens` tokens (batch size = tokens / context). Memory is the resident-set peak of the process.

    python benchmarks/train_bench.py --out benchmarks/results     # tiny config, T = 1024 and 4096
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from piattn.benchmarking import machine_info, rss_kib, save_results
from piattn.layers import ATTENTION
from piattn.models import GPT, GPTConfig


def run_case(kind: str, context: int, tokens: int, repeats: int, config: str) -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name(config, attention=kind, vocab_size=256, block_size=context))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    batch = max(1, tokens // context)
    idx = torch.randint(0, 256, (batch, context + 1), generator=torch.Generator().manual_seed(0))

    def step() -> float:
        start = time.perf_counter()
        logits = model(idx[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    step()
    times = [step() for _ in range(repeats)]
    seconds = statistics.median(times)
    return dict(kind=kind, context=context, batch=batch, step_s=seconds, tokens_per_s=batch * context / seconds,
                peak_rss_mib=rss_kib("VmHWM") / 1024, params=model.num_params())


def markdown(result: dict) -> str:
    m = result["machine"]
    out = [f"# Training-step benchmark ({m['processor']}, {m['cpu_count']} threads, torch {m['torch']})", "",
           f"`{result['command']}`; GPT `{result['config']}` config, byte vocabulary, fp32, AdamW, "
           f"{result['tokens']} tokens per step, median of {result['repeats']} steps after one warm-up, "
           "each row a fresh process. Ratio = step time / dense step time at the same context.", "",
           "| context | kind | params | batch | step (s) | tokens/s | × dense time | peak RSS MiB |",
           "|---|---|---|---|---|---|---|---|"]
    rows = result["rows"]
    for r in rows:
        dense = next((d for d in rows if d["kind"] == "dense" and d["context"] == r["context"]), None)
        ratio = f"{r['step_s'] / dense['step_s']:.2f}" if dense else "–"
        out.append(f"| {r['context']} | {r['kind']} | {r['params']:,} | {r['batch']} | {r['step_s']:.3f} | "
                   f"{r['tokens_per_s']:.0f} | {ratio} | {r['peak_rss_mib']:.0f} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="directory for train_bench.{json,md}")
    parser.add_argument("--kinds", nargs="+", default=sorted(ATTENTION), choices=sorted(ATTENTION))
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per step (batch = tokens / context)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--case", nargs=2, metavar=("KIND", "CONTEXT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:  # child process: one measurement, printed as JSON
        print(json.dumps(run_case(args.case[0], int(args.case[1]), args.tokens, args.repeats, args.config)))
        return
    rows = []
    for context in args.contexts:
        for kind in args.kinds:
            cmd = [sys.executable, __file__, "--case", kind, str(context), "--tokens", str(args.tokens),
                   "--repeats", str(args.repeats), "--config", args.config]
            row = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
            rows.append(row)
            print(f"T={context:5d} {kind:10s} {row['step_s']:7.3f} s/step {row['tokens_per_s']:8.0f} tok/s "
                  f"RSS {row['peak_rss_mib']:6.0f} MiB", flush=True)
    command = "python benchmarks/train_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result = dict(machine=machine_info(), command=command.strip(), config=args.config, tokens=args.tokens,
                  repeats=args.repeats, rows=rows)
    table = markdown(result)
    if args.out:
        save_results(args.out, "train_bench", result, table)
    print(table)


if __name__ == "__main__":
    main()
