"""Training-step speed and memory of the GPT with each attention kind, side by side, on this machine.

Each (kind, context) runs in a fresh process: a GPT of the named config (byte vocabulary), AdamW, one
warm-up step, then the median of `--repeats` timed steps (forward, backward, optimizer) on a batch of
`--tokens` tokens (batch size = tokens / context). Memory is the resident-set peak of the process.
The kinds of `--compile` (default dense and pi) run a second time with the model under
`torch.compile(fullgraph=True)` (inductor; the optimizer step stays eager): their warm-up step, which
includes compiling forward and backward, is reported apart as `first_step_s`.

    python benchmarks/train_bench.py --out benchmarks/results/train     # tiny config, T = 1024 and 4096

`--threads 1` (one intra-op thread per process) keeps the rows comparable on a CPU shared with other
work, where threads of one process wait for each other at every op. The committed results:

    python benchmarks/train_bench.py --kinds pi dense local bigbird longformer reformer --threads 1 \
        --out benchmarks/results/train

`--interleaved` compares compiled with eager side by side instead: per (context, kind), one process builds
the kind twice from one seed (eager, and under `torch.compile(fullgraph=True)`), runs one warm-up step of each
(the compiled one's is `first_step_s`), then `--repeats` rounds in which every model takes one step,
the order rotated each round; compiled / eager is computed within each round (median [range]).
`--profile` then profiles one more step of each with `torch.profiler` (CPU activities) and keeps the
`--top` ops by self CPU time. Results go to NAME_interleaved.{json,md}:

    python benchmarks/train_bench.py --interleaved --profile --compile pi local --contexts 4096 \
        --dropout 0.1 0 --fallback-random both --threads 1 --repeats 7 --out benchmarks/results/train

One process per (context, dropout, fallback_random, kind): a second compiled GPT in one process makes dynamo
recompile (its guards name the module), which would land in the timed rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from piattn.benchmarking import command_line, machine_info, rss_kib, save_results, timed_step
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
        return timed_step(model, forward, optimizer, idx)

    first = step()
    times = [step() for _ in range(repeats)]
    seconds = statistics.median(times)
    return dict(kind=kind, compiled=compiled, context=context, batch=batch, step_s=seconds,
                tokens_per_s=batch * context / seconds, first_step_s=first, peak_rss_mib=rss_kib("VmHWM") / 1024,
                params=model.num_params())


def profile_step(step, top: int) -> dict:
    """One step under torch.profiler (CPU): total self time and the `top` ops by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        wall = step()
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) / 1e6
    return dict(step_s=wall, self_total_s=total,
                ops=[dict(name=e.key, calls=e.count, self_s=e.self_cpu_time_total / 1e6) for e in events[:top]])


def run_interleaved(kinds: list[str], context: int, tokens: int, repeats: int, config: str,
                    threads: int | None, profile: bool, top: int, dropout: float | None = None,
                    fallback_random: bool = False) -> dict:
    """Eager and compiled models of each kind, stepped in rotating order within this process. The benchmark
    passes one kind per process: a second compiled GPT in one process makes dynamo recompile the first (its
    guards name the module), which showed as 30-50 s steps in the first rounds."""
    import torch._inductor.config

    if threads:
        torch.set_num_threads(threads)
    torch._inductor.config.fallback_random = fallback_random
    extra = {} if dropout is None else {"dropout": dropout}
    batch = max(1, tokens // context)
    idx = torch.randint(0, 256, (batch, context + 1), generator=torch.Generator().manual_seed(0))
    steps, names, first = {}, [], {}
    for kind in kinds:
        for compiled in (False, True):
            torch.manual_seed(0)
            model = GPT(GPTConfig.from_name(config, attention=kind, vocab_size=256, block_size=context, **extra))
            forward = torch.compile(model, fullgraph=True) if compiled else model
            optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)

            def step(model=model, forward=forward, optimizer=optimizer) -> float:
                return timed_step(model, forward, optimizer, idx)

            name = f"{kind} (compiled)" if compiled else kind
            names.append(name)
            steps[name] = step
            first[name] = step()
            print(f"T={context} {name}: first step {first[name]:.1f} s", file=sys.stderr, flush=True)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            times[name].append(steps[name]())
        print(f"T={context} round {r + 1}/{repeats}: " + ", ".join(f"{n} {times[n][-1]:.3f}" for n in names),
              file=sys.stderr, flush=True)
    rows = []
    for kind in kinds:
        for compiled in (False, True):
            name = f"{kind} (compiled)" if compiled else kind
            row = dict(kind=kind, compiled=compiled, context=context, batch=batch, times_s=times[name],
                       dropout=GPTConfig.from_name(config, **extra).dropout,
                       fallback_random=fallback_random,
                       step_s=statistics.median(times[name]), first_step_s=first[name])
            row["tokens_per_s"] = batch * context / row["step_s"]
            if compiled:
                ratios = sorted(c / e for c, e in zip(times[name], times[kind], strict=True))
                row["vs_eager"] = dict(median=statistics.median(ratios), low=ratios[0], high=ratios[-1])
            if profile:
                row["profile"] = profile_step(steps[name], top)
            rows.append(row)
    try:
        from torch._dynamo.utils import counters
        dynamo = {k: dict(v) for k, v in counters.items() if k in ("stats", "graph_break", "recompiles")}
    except Exception:  # noqa: BLE001 - counters are diagnostics only
        dynamo = {}
    return dict(context=context, kinds=kinds, dropout=dropout, fallback_random=fallback_random, rows=rows,
                dynamo=dynamo)


def markdown_interleaved(result: dict) -> str:
    m = result["machine"]
    out = [f"# torch.compile against eager, interleaved ({m['processor']}, {m['cpu_count']} cores, "
           f"{result['threads']} intra-op thread(s), torch {m['torch']})", "",
           f"`{result['command']}`", "",
           f"GPT `{result['config']}`, byte vocabulary, fp32, AdamW, {result['tokens']} tokens per step. Per context "
           "one process holds an eager and a compiled (`torch.compile(fullgraph=True)`, inductor; optimizer eager) "
           f"model of each kind, built from one seed; after one warm-up step each, {result['repeats']} rounds in "
           "which every model takes one step, the order rotated each round. compiled / eager is computed within "
           "each round: median [range]. First step = the warm-up (compilation included)."
           + (f" Shared load: {result['load']}." if result.get("load") else ""), "",
           "| context | kind (settings) | batch | eager step (s) | compiled step (s) | compiled / eager "
           "| first compiled step (s) |",
           "|---|---|---|---|---|---|---|"]
    def setting(row: dict) -> str:
        return f"{row['kind']} (dropout {row.get('dropout', '?'):g}" + (
            ", fallback_random" if row.get("fallback_random") else "") + ")"

    for group in result["groups"]:
        by = {(r["kind"], r["compiled"]): r for r in group["rows"]}
        for kind in dict.fromkeys(r["kind"] for r in group["rows"]):
            e, c = by[(kind, False)], by[(kind, True)]
            v = c["vs_eager"]
            out.append(f"| {group['context']} | {setting(e)} | {e['batch']} | {e['step_s']:.3f} | {c['step_s']:.3f} | "
                       f"{v['median']:.2f} [{v['low']:.2f}–{v['high']:.2f}] | {c['first_step_s']:.1f} |")
    for group in result["groups"]:
        for r in group["rows"]:
            if "profile" not in r:
                continue
            p = r["profile"]
            name = setting(r) + (" compiled" if r["compiled"] else " eager")
            out += ["", f"### Profile: {name}, T = {group['context']} (one step, {p['step_s']:.3f} s under the "
                    f"profiler; self CPU time of all ops {p['self_total_s']:.3f} s)", "",
                    "| op | calls | self (ms) | share |", "|---|---|---|---|"]
            out += [f"| `{o['name']}` | {o['calls']} | {1000 * o['self_s']:.1f} | "
                    f"{100 * o['self_s'] / p['self_total_s']:.1f} % |" for o in p["ops"]]
    if any(g.get("dynamo") for g in result["groups"]):
        out += ["", "Dynamo counters per context: " + "; ".join(
            f"T={g['context']} {'/'.join(g.get('kinds', []))}: {json.dumps(g['dynamo'], sort_keys=True)}"
            for g in result["groups"])]
    return "\n".join(out) + "\n"


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
    parser.add_argument("--interleaved", action="store_true",
                        help="compiled against eager of the --compile kinds in one process per context, alternating")
    parser.add_argument("--profile", action="store_true", help="with --interleaved: profile one step of each model")
    parser.add_argument("--top", type=int, default=15, help="ops kept per profile")
    parser.add_argument("--load", help="a note on the machine's shared load, copied into the results")
    parser.add_argument("--dropout", type=float, nargs="+",
                        help="with --interleaved: the models' dropout rates, one process each (default: the config's)")
    parser.add_argument("--fallback-random", choices=["off", "on", "both"], default="off",
                        help="with --interleaved: torch._inductor.config.fallback_random (aten's RNG for dropout "
                        "inside the compiled graph instead of inductor's), or both settings, one process each")
    parser.add_argument("--group", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--case", nargs=2, metavar=("KIND", "CONTEXT"), help=argparse.SUPPRESS)
    parser.add_argument("--compiled", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:  # child process: one measurement, printed as JSON
        print(json.dumps(run_case(args.case[0], int(args.case[1]), args.tokens, args.repeats, args.config,
                                  args.compiled, args.threads)))
        return
    if args.group:  # child process of --interleaved: one context, printed as JSON on the last line
        print(json.dumps(run_interleaved(args.compile, args.group, args.tokens, args.repeats, args.config,
                                         args.threads, args.profile, args.top,
                                         args.dropout[0] if args.dropout else None, args.fallback_random == "on")))
        return
    command = command_line("benchmarks/train_bench.py", argv)
    if args.interleaved:
        result = dict(machine=machine_info(), command=command, config=args.config, tokens=args.tokens,
                      repeats=args.repeats, threads=args.threads, load=args.load, groups=[])
        fallbacks = ["off", "on"] if args.fallback_random == "both" else [args.fallback_random]
        for context, dropout, fallback, kind in [(c, d, f, k) for c in args.contexts for d in args.dropout or [None]
                                                  for f in fallbacks for k in args.compile]:
            if fallback == "on" and dropout == 0:
                continue  # no random numbers to fall back for
            cmd = [sys.executable, __file__, "--group", str(context), "--tokens", str(args.tokens), "--repeats",
                   str(args.repeats), "--config", args.config, "--top", str(args.top), "--compile", kind,
                   "--fallback-random", fallback]
            cmd += (["--threads", str(args.threads)] if args.threads else []) + (["--profile"] if args.profile else [])
            cmd += ["--dropout", str(dropout)] if dropout is not None else []
            proc = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
            result["groups"].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            if args.out:
                save_results(args.out, args.name + "_interleaved", result, markdown_interleaved(result))
        print(markdown_interleaved(result))
        return
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
