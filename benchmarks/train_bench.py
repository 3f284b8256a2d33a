"""Training-step speed and memory of the GPT with each attention kind, side by side, on this machine.

Each (kind, context) runs in a fresh process: a GPT of the named config (byte vocabulary), AdamW, one
warm-up step, then the median of `--repeats` timed steps (forward, backward, optimizer) on a batch of
`--tokens` tokens (batch size = tokens / context). Memory is the resident-set peak of the process.
The kinds of `--compile` (default dense and pi) run a second time with the model under
`torch.compile(fullgraph=True)` (inductor; the optimizer step stays eager): their warm-up step, which
includes compiling forward and backward, is reported apart as `first_step_s`.

    python benchmarks/train_bench.py --out benchmarks/results     # tiny config, T = 1024 and 4096

`--threads 1` (one intra-op thread per process) keeps the rows comparable on a CPU shared with other
work, where threads of one process wait for each other at every op. The committed results:

    python benchmarks/train_bench.py --kinds pi dense local bigbird longformer reformer --threads 1 \
        --out benchmarks/results
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

from piattn.benchmarking import command_line, machine_info, rss_kib, save_results
from piattn.layers import ATTENTION
from piattn.models import GPT, GPTConfig


def run_case(kind: str, context: int, tokens: int, repeats: int, config: str, compiled: bool = False,
             threads: int | None = None) -> dict:
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name(config, attention=kind, vocab_size=256, block_size=context))
    forward = torch.compile(model, fullgraph=True) if compiled else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    batch = max(1, tokens // context)
    idx = torch.randint(0, 256, (batch, context + 1), generator=torch.Generator().manual_seed(0))

    def step() -> float:
        start = time.perf_counter()
        logits = forward(idx[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    first = step()
    times = [step() for _ in range(repeats)]
    seconds = statistics.median(times)
    return dict(kind=kind, compiled=compiled, context=context, batch=batch, step_s=seconds,
                tokens_per_s=batch * context / seconds, first_step_s=first, peak_rss_mib=rss_kib("VmHWM") / 1024,
                params=model.num_params())


def markdown(result: dict) -> str:
    m = result["machine"]
    threads = result.get("threads") or m["cpu_count"]
    out = [f"# Training-step benchmark ({m['processor']}, {m['cpu_count']} cores, {threads} intra-op threads, "
           f"torch {m['torch']})", "",
           f"`{result['command']}`; GPT `{result['config']}` config, byte vocabulary, fp32, AdamW, "
           f"{result['tokens']} tokens per step, median of {result['repeats']} steps after one warm-up, "
           "each row a fresh process. × dense = step time / eager dense step time at the same context. "
           "Compiled rows: the model under `torch.compile(fullgraph=True)` (inductor), × eager = step time / "
           "the same kind's eager step time; first step = the warm-up, compilation included.", "",
           "| context | kind | params | batch | step (s) | tokens/s | × dense time | × eager | first step (s) "
           "| peak RSS MiB |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    rows = result["rows"]

    def eager(kind: str, context: int) -> dict | None:
        return next((r for r in rows if (r["kind"], r["context"]) == (kind, context) and not r.get("compiled")), None)

    for r in rows:
        dense, same = eager("dense", r["context"]), eager(r["kind"], r["context"])
        ratio = f"{r['step_s'] / dense['step_s']:.2f}" if dense else "–"
        compiled = r.get("compiled")
        vs_eager = f"{r['step_s'] / same['step_s']:.2f}" if compiled and same else "–"
        first = f"{r['first_step_s']:.1f}" if compiled else "–"
        kind = f"{r['kind']} (compiled)" if compiled else r["kind"]
        out.append(f"| {r['context']} | {kind} | {r['params']:,} | {r['batch']} | {r['step_s']:.3f} | "
                   f"{r['tokens_per_s']:.0f} | {ratio} | {vs_eager} | {first} | {r['peak_rss_mib']:.0f} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="directory for NAME.{json,md}")
    parser.add_argument("--name", default="train_bench", help="file name of the results")
    parser.add_argument("--kinds", nargs="+", default=sorted(ATTENTION), choices=sorted(ATTENTION))
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per step (batch = tokens / context)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--threads", type=int, help="intra-op threads per process (default: torch's)")
    parser.add_argument("--compile", nargs="*", default=["dense", "pi"], choices=sorted(ATTENTION),
                        help="kinds also timed under torch.compile (none: pass the flag alone)")
    parser.add_argument("--case", nargs=2, metavar=("KIND", "CONTEXT"), help=argparse.SUPPRESS)
    parser.add_argument("--compiled", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:  # child process: one measurement, printed as JSON
        print(json.dumps(run_case(args.case[0], int(args.case[1]), args.tokens, args.repeats, args.config,
                                  args.compiled, args.threads)))
        return
    command = command_line("benchmarks/train_bench.py", argv)
    result = dict(machine=machine_info(), command=command, config=args.config, tokens=args.tokens,
                  repeats=args.repeats, threads=args.threads, rows=[])
    for context in args.contexts:
        for kind, compiled in [(k, c) for k in args.kinds for c in (False, True) if not c or k in args.compile]:
            cmd = [sys.executable, __file__, "--case", kind, str(context), "--tokens", str(args.tokens),
                   "--repeats", str(args.repeats), "--config", args.config] + (["--compiled"] if compiled else [])
            if args.threads:
                cmd += ["--threads", str(args.threads)]
            row = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
            result["rows"].append(row)
            print(f"T={context:5d} {kind + (' (compiled)' if compiled else ''):21s} {row['step_s']:7.3f} s/step "
                  f"{row['tokens_per_s']:8.0f} tok/s RSS {row['peak_rss_mib']:6.0f} MiB", flush=True)
            if args.out:  # after every row, so that a run cut short keeps what it measured
                save_results(args.out, args.name, result, markdown(result))
    print(markdown(result))

if __name__ == "__main__":
    main()
