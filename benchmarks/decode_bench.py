"""Decoding speed and memory versus position: `pi` and `local` (ring caches) against `dense` (growing cache).

Each (kind, position) runs in a fresh process: a tiny-config GPT, batch 1, whose cache is brought to the
position, then `--steps` single-token decoding steps are timed. The cache is filled with random keys and
values rather than by decoding every earlier token (decoding 128K tokens per point would take hours on a
CPU); the time of a step does not depend on what the cache holds. Memory: the cache's own bytes and the
process's resident set after the timed steps. With `--repeats R` every point is measured R times, the
repeats interleaved (all points once, then all again) so that a slow spell of a shared machine touches
every kind alike, and the table gives the median tokens/s. With `--baseline DIR` (the `src` folder of
another checkout of piattn, e.g. an older commit unpacked with `git archive`) every point is also measured
with that code, interleaved with the current one, and a before / after table is added. Within a process
the steps are timed in blocks of 16 and a point's time per token is the median block's.

    python benchmarks/decode_bench.py --out benchmarks/results/decode          # 512 … 128K, ~3 min on 2 cores
    python benchmarks/decode_bench.py --out benchmarks/results/decode --threads 1 --repeats 5 \
        --positions 128 256 512 1024 2048 4096 8192                    # the medians of the decoding issue
    python benchmarks/plot_decode.py benchmarks/results/decode/decode_bench.json

With `--interleaved` every kind runs in one process instead, π beside local (and dense, and "pi-torchops":
π with the compiled step switched off) at each point: one model and a freshly filled cache per kind, and
in each repeat the kinds take turns (the order rotated from one repeat to the next), so that neighbouring
measurements share the machine's state; the table gives, per point and per tokens-per-step (`--tokens`:
1, and steps of 2–4 tokens), each kind's median tokens/s with the range over repeats, and the ratios
π / local and π / dense computed within each repeat (median and range):

    python benchmarks/decode_bench.py --out benchmarks/results/decode --name decode_interleaved --interleaved \
        --threads 1 --repeats 7 --positions 512 4096 32768 --tokens 1 3 --kinds pi local dense pi-torchops
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import piattn.ops.pi.native as native
from piattn.benchmarking import (
    DECODE_KINDS,
    block_sizes,
    command_line,
    cpu_model,
    decode_model,
    fill_cache,
    machine_info,
    rss_kib,
    save_results,
    spread,
)
from piattn.models import GPT

# Kind name -> the DECODE_KINDS model it runs (piattn.benchmarking: pi, pi-union, ms-pi, local, dense, each
# itself) and what is done to it: "pi-torchops" is π with the compiled decoding step switched off
# (`torch_ops_only`); the diagnostics of π's gate (`hold_gate_layers`, `share_gate_storage`) are not paths the
# library offers; the Hugging Face kinds (--interleaved only) are a small converted Llama with PiCache
# (`_hf_model`), no GPT (None).
KIND_MODEL = {**{kind: kind for kind in DECODE_KINDS}, "pi-torchops": "pi", "pi-gate-held": "pi",
               "pi-gate-one-storage": "pi",
               **dict.fromkeys(("hf-pi", "hf-pi-torchops", "hf-pi-operator", "hf-dense", "hf-ms-pi"))}
KINDS = ("pi", "local", "dense")  # the default; pi and dense are always measured (their ratio is the table's)
POSITIONS = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


@contextlib.contextmanager
def torch_ops_only(kind: str):
    """For "pi-torchops": the compiled decoding step switched off for the duration (as `PIATTN_NATIVE=0`
    does for a process), so that the torch-ops step can be timed beside the compiled one in one process."""
    if kind not in ("pi-torchops", "hf-pi-torchops"):
        yield
        return
    saved = dict(native._state)
    native._state.clear()
    native._state.update(functions=None, reason="switched off by decode_bench")
    try:
        yield
    finally:
        native._state.clear()
        native._state.update(saved)


def _model(kind: str, config: str) -> GPT:
    model = decode_model(KIND_MODEL[kind], config)
    if kind == "pi-gate-held":
        hold_gate_layers(model)
    elif kind == "pi-gate-one-storage":
        share_gate_storage(model)
    return model


def hold_gate_layers(model: GPT) -> None:
    """For "pi-gate-held": each layer's gate layers read once, here, and handed to every step as they are,
    instead of read from the gate's modules and checked for hooks on every step (`whole_gate_layers`). Not a
    path the library offers (a new hook, or a parameter replaced, would go unseen): it measures what that
    reading costs a step, the most that trimming it could gain."""
    for block in model.blocks:
        layers = block.attn.whole_gate_layers()
        block.attn.whole_gate_layers = lambda layers=layers: layers


def share_gate_storage(model: GPT) -> None:
    """For "pi-gate-one-storage": every layer's gate parameters made to hold layer 0's memory (through `.data`;
    each layer keeps its own modules and parameter objects, so the step's Python is unchanged). The gate's
    weights are then in memory once instead of once per layer: what their trip through the caches costs a step."""
    first = model.blocks[0].attn.gate
    for block in model.blocks[1:]:
        for mine, theirs in zip(block.attn.gate.parameters(), first.parameters(), strict=True):
            mine.data = theirs.data


def run_case(kind: str, position: int, steps: int, config: str) -> dict:
    model = _model(kind, config)
    cache = model.init_cache(1)
    fill_cache(cache, position, torch.Generator().manual_seed(0))
    token = torch.zeros(1, 1, dtype=torch.long)
    blocks = []
    with torch.no_grad(), torch_ops_only(kind):
        for _ in range(3):  # warm-up: first calls allocate and pick kernels (and build the compiled step)
            token = model(token, cache)[:, -1].argmax(-1, keepdim=True)
        for size in block_sizes(steps):
            start = time.perf_counter()
            for _ in range(size):
                token = model(token, cache)[:, -1].argmax(-1, keepdim=True)
            blocks.append((time.perf_counter() - start) / size)
    per_token = statistics.median(blocks)
    return dict(kind=kind, position=position, steps=steps, tokens_per_s=1 / per_token, ms_per_token=1000 * per_token,
                cache_mib=cache.nbytes / 2**20, rss_mib=rss_kib("VmRSS") / 1024)


def median_row(repeats: list[dict]) -> dict:
    """One point's row: the median tokens/s (and its ms/token) of its repeats, every repeat's tokens/s."""
    tps = statistics.median(r["tokens_per_s"] for r in repeats)
    return {**repeats[0], "tokens_per_s": tps, "ms_per_token": 1000 / tps,
            "repeats_tokens_per_s": [r["tokens_per_s"] for r in repeats],
            "rss_mib": max(r["rss_mib"] for r in repeats)}


def best_ratio(rows: dict, position: int) -> float:
    """pi / dense from each kind's fastest repeat: the repeats least slowed by a shared machine's other work
    (a second reading of the median ratio, not a replacement)."""
    best = {k: max(rows[(k, position)].get("repeats_tokens_per_s", [rows[(k, position)]["tokens_per_s"]]))
            for k in ("pi", "dense")}
    return best["pi"] / best["dense"]


def before_after(result: dict) -> list[str]:
    """Markdown lines: tokens/s of the baseline code and of the current code per position and kind."""
    kinds = result.get("kinds", KINDS)
    by = {(r["kind"], r["position"]): r for r in result["rows"]}
    old = {(r["kind"], r["position"]): r for r in result["baseline_rows"]}
    out = ["", f"Before (`{result['baseline']}`) and after (this code), medians of the same interleaved run:", "",
           "| position | " + " | ".join(f"{k} before | {k} after" for k in kinds)
           + " | pi / dense before | pi / dense after | best repeats: before | after |",
           "|" + "---|" * (5 + 2 * len(kinds))]
    for p in sorted({r["position"] for r in result["rows"]}):
        cells = [f"{old[(k, p)]['tokens_per_s']:.0f} | {by[(k, p)]['tokens_per_s']:.0f}" for k in kinds]
        ratios = [d[("pi", p)]["tokens_per_s"] / d[("dense", p)]["tokens_per_s"] for d in (old, by)]
        out.append(f"| {p:,} | " + " | ".join(cells) + f" | {ratios[0]:.2f}× | {ratios[1]:.2f}× | "
                   f"{best_ratio(old, p):.2f}× | {best_ratio(by, p):.2f}× |")
    return out


def markdown(result: dict) -> str:
    m = result["machine"]
    rows = result["rows"]
    kinds = result.get("kinds", KINDS)
    by = {(r["kind"], r["position"]): r for r in rows}
    positions = sorted({r["position"] for r in rows})
    out = [f"# Decoding benchmark ({m['processor']}, {m['cpu_count']} threads, torch {m['torch']})", "",
           f"`{result['command']}`; GPT `{result['config']}` config, vocab 256, batch 1, fp32, window 4, "
           f"period 16; {result['steps']} timed single-token steps per point, each point in a fresh process, timed "
           f"in blocks of 16 (a point: its median block); tokens/s: median of {result.get('repeats', 1)} "
           "interleaved repeats.",
           "", "| position | " + " | ".join(f"{k} tok/s" for k in kinds) + " | pi / dense | pi / dense, best repeats | "
           + " | ".join(f"{k} cache MiB" for k in kinds) + " | " + " | ".join(f"{k} RSS MiB" for k in kinds) + " |",
           "|" + "---|" * (3 + 3 * len(kinds))]
    for p in positions:
        r = [by[(k, p)] for k in kinds]
        ratio = by[("pi", p)]["tokens_per_s"] / by[("dense", p)]["tokens_per_s"]
        out.append(f"| {p:,} | " + " | ".join(f"{x['tokens_per_s']:.0f}" for x in r)
                   + f" | {ratio:.2f}× | {best_ratio(by, p):.2f}× | "
                   + " | ".join(f"{x['cache_mib']:.3f}" for x in r) + " | "
                   + " | ".join(f"{x['rss_mib']:.0f}" for x in r) + " |")
    if result.get("baseline_rows"):
        out += before_after(result)
    return "\n".join(out) + "\n"


def time_steps(model: GPT, position: int, steps: int, tokens: int, batch: int = 1) -> float:
    """Seconds per token of one sequence (a step's time over its tokens, not over the batch's) of `steps`
    decoding steps of `tokens` tokens each for `batch` sequences, from a fresh cache at `position` (median of
    blocks of 16 steps, after 3 steps of warm-up)."""
    cache = model.init_cache(batch)
    fill_cache(cache, position, torch.Generator().manual_seed(0))
    idx = torch.zeros(batch, tokens, dtype=torch.long)
    blocks = []
    with torch.no_grad():
        for _ in range(3):
            model(idx, cache)
        for size in block_sizes(steps):
            start = time.perf_counter()
            for _ in range(size):
                idx = model(idx, cache)[:, -tokens:].argmax(-1)
            blocks.append((time.perf_counter() - start) / (size * tokens))
    return statistics.median(blocks)


def run_interleaved(kinds: list[str], positions: list[int], steps: int, repeats: int, config: str,
                    token_counts: list[int], batches: tuple[int, ...] = (1,)) -> list[dict]:
    """Every kind in this process, taking turns within each repeat (order rotated per repeat); one row per
    (batch, tokens per step, position, kind) with every repeat's tokens/s (of one sequence of the batch)."""
    models = {kind: _hf_model(kind) if kind in HF_KINDS else _model(kind, config) for kind in kinds}
    runs: dict[tuple[int, int, int, str], list[float]] = {}
    for repeat in range(repeats):
        for batch in batches:
            for tokens in token_counts:
                for position in positions:
                    turn = kinds[repeat % len(kinds):] + kinds[:repeat % len(kinds)]
                    for kind in turn:
                        with torch_ops_only(kind):
                            if kind in HF_KINDS:
                                per_token = time_hf_steps(kind, models[kind], position, steps, tokens, batch)
                            else:
                                per_token = time_steps(models[kind], position, steps, tokens, batch)
                        runs.setdefault((batch, tokens, position, kind), []).append(1 / per_token)
                        print(f"[{repeat + 1}/{repeats}] batch {batch} {tokens} tok/step {kind:12s} position "
                              f"{position:>7,}: {1 / per_token:8.1f} tok/s", flush=True)
    return [dict(batch=b, tokens_per_step=t, position=p, kind=k, tokens_per_s=statistics.median(r),
                 repeats_tokens_per_s=r) for (b, t, p, k), r in runs.items()]



def interleaved_markdown(result: dict) -> str:
    m = result["machine"]
    kinds = result["kinds"]
    by = {(r.get("batch", 1), r["tokens_per_step"], r["position"], r["kind"]): r["repeats_tokens_per_s"]
          for r in result["rows"]}
    pairs = (("pi", "local"), ("pi", "dense"), ("pi", "pi-torchops"), ("pi-union", "local"), ("pi-gate-held", "local"),
             ("pi-gate-one-storage", "local"), ("hf-pi", "hf-pi-torchops"),
             ("hf-pi", "hf-pi-operator"), ("hf-pi", "hf-dense"),
             ("hf-ms-pi", "hf-pi"), ("ms-pi", "pi"), ("ms-pi", "local"),
             ("ms-pi", "dense"))
    ratios = [(a, b) for a, b in pairs if a in kinds and b in kinds]
    out = [f"# Decoding, kinds interleaved in one process ({m['processor']}, {m['cpu_count']} thread(s), "
           f"torch {m['torch']}, Python {m['python']})", "",
           f"`{result['command']}`; GPT `{result['config']}` config, vocab 256, fp32, window 4, period 16; "
           f"{result['steps']} timed steps per measurement (blocks of 16, a measurement: its median block), "
           f"{result['repeats']} repeats in which the kinds take turns (order rotated each repeat). Cells: median "
           "tokens/s (range over repeats); ratios computed within each repeat, median (range). `pi-torchops`: π "
           f"with the compiled decoding step switched off{GATE_NOTE if set(kinds) & set(GATE_KINDS) else ''}"
           f"{HF_NOTE if set(kinds) & set(HF_KINDS) else ''}. Steps of "
           "t > 1 tokens: t new tokens per call (`decode_rows`, through the compiled step). Absolute tokens/s move "
           "with the machine's load (its load average is given at the end), the ratios side by side much less: "
           "they are what to trust. Batch b: b sequences decoded together; tokens/s are one sequence's (a step's "
           "tokens over its time; the batch's are b times as many)."
           + (f" CPU: {result['cpu']}; load average (1 min) at the end: {result['load']:.2f}." if "load" in result
              else ""), "",
           "| batch | tokens / step | position | " + " | ".join(f"{k} tok/s" for k in kinds) + " | "
           + " | ".join(f"{a} / {b}" for a, b in ratios) + " |",
           "|" + "---|" * (3 + len(kinds) + len(ratios))]
    for b in result.get("batches", [1]):
        for t in result["tokens"]:
            for p in result["positions"]:
                cells = [spread(by[(b, t, p, k)], ".0f") for k in kinds]
                rel = [spread([x / y for x, y in zip(by[(b, t, p, a0)], by[(b, t, p, b0)], strict=True)], ".2f") + "×"
                       for a0, b0 in ratios]
                out.append(f"| {b} | {t} | {p:,} | " + " | ".join(cells) + " | " + " | ".join(rel) + " |")
    return "\n".join(out) + "\n"


GATE_KINDS = ("pi-union", "pi-gate-held", "pi-gate-one-storage")
GATE_NOTE = ("; `pi-union`: π without the gate MLP (the same ring, slots and compiled step); `pi-gate-held`: π with "
             "each layer's gate layers read once and handed to every step, not read from its modules and checked "
             "for hooks per step (a diagnostic, not a path the library offers); `pi-gate-one-storage`: π with every "
             "layer's gate parameters in layer 0's memory (its own modules and parameter objects kept), the gate's "
             "weights in memory once")
HF_KINDS = ("hf-pi", "hf-pi-torchops", "hf-pi-operator", "hf-dense", "hf-ms-pi")
# The per-head periods of the hf-ms-pi kinds: one per query head, all beyond the window (multi-scale π).
HF_MS_PERIODS = [5, 6, 7, 9, 12, 16, 24, 32]


HF_NOTE = ("; `hf-*`: a Llama of 4 layers, width 256, 8 query heads on 4 key/value heads, converted to π (window 4, "
           "period 16) with `PiCache` (`hf-pi`: compiled step, `hf-pi-torchops`: torch-ops step, `hf-pi-operator`: "
           "backend \"torch\", every step the full operator on the cached block, as every step ran before the PiCache "
           "steps took the decoding path; `hf-dense`: the plain model, sdpa, DynamicCache; `hf-ms-pi`: per-head "
           "periods 5, 6, 7, 9, 12, 16, 24, 32, every head over its own slots in one compiled call a layer; position = "
           "prompt length)")


def _hf_model(kind: str):
    """A small Llama (4 layers, width 256, 8 query heads on 4 key/value heads, fp32), converted to π (window 4,
    period 16) for the hf-pi kinds: "hf-pi" decodes through the compiled step, "hf-pi-torchops" with it
    switched off (`torch_ops_only`), "hf-pi-operator" with backend "torch" (each step the full operator on the
    cached block, as every step ran before the PiCache steps took the decoding path); "hf-dense" is the
    plain model with its DynamicCache (sdpa)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from piattn.integrations.hf import convert_to_pi

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=256, max_position_embeddings=8192, bos_token_id=None,
                      eos_token_id=None, pad_token_id=None, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).eval()
    if kind != "hf-dense":
        period = HF_MS_PERIODS if kind.startswith("hf-ms-pi") else 16
        model = convert_to_pi(model, window=4, period=period, backend="torch" if kind == "hf-pi-operator" else "auto")
    return model


def time_hf_steps(kind: str, model, position: int, steps: int, tokens: int, batch: int = 1) -> float:
    """Seconds per token of one sequence of `steps` steps of `tokens` tokens after a prompt of `position`
    tokens, `batch` sequences at once."""
    from transformers import DynamicCache

    from piattn.integrations.hf import PiCache

    cache = DynamicCache() if kind == "hf-dense" else PiCache(model.config)
    idx = torch.zeros(batch, tokens, dtype=torch.long)
    blocks = []
    with torch.no_grad():
        model(torch.zeros(batch, position, dtype=torch.long), cache=cache)
        for _ in range(3):
            model(idx, cache=cache)
        for size in block_sizes(steps):
            start = time.perf_counter()
            for _ in range(size):
                idx = model(idx, cache=cache).logits[:, -tokens:].argmax(-1)
            blocks.append((time.perf_counter() - start) / (size * tokens))
    return statistics.median(blocks)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="directory for decode_bench.{json,md}")
    parser.add_argument("--positions", type=int, nargs="+", default=list(POSITIONS))
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1, help="measurements per point; the table gives medians")
    parser.add_argument("--name", default="decode_bench", help="file name of the results in --out")
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KIND_MODEL),
                        help="what to measure (pi and dense always are)")
    parser.add_argument("--baseline", help="src folder of another piattn to measure alongside (before / after)")
    parser.add_argument("--threads", type=int, help="intra-op threads (default: torch's); 1 is steadier on a "
                        "shared machine, where two threads wait on each other")
    parser.add_argument("--interleaved", action="store_true", help="every kind in this one process, taking turns "
                        "within each repeat (π / local and π / dense per repeat)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1], help="with --interleaved: tokens per "
                        "decoding step (1, or a few: 2–4 take the few-token path)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1], help="with --interleaved: sequences decoded "
                        "together (each batch size measured in turn)")
    parser.add_argument("--case", nargs=2, metavar=("KIND", "POSITION"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.interleaved:
        kinds = list(dict.fromkeys(args.kinds))
        rows = run_interleaved(kinds, args.positions, args.steps, args.repeats, args.config, args.tokens,
                               tuple(args.batch))
        result = dict(machine=machine_info(), command=command_line("benchmarks/decode_bench.py", argv),
                      config=args.config, steps=args.steps, repeats=args.repeats, kinds=kinds,
                      positions=args.positions, tokens=args.tokens, batches=args.batch, load=os.getloadavg()[0],
                      cpu=cpu_model(), compiled_step=native.unavailable() or "built",
                      note="absolute tokens/s move with the machine's load: trust the ratios side by side",
                      rows=rows)
        table = interleaved_markdown(result)
        if args.out:
            save_results(args.out, args.name, result, table)
        print(table)
        return
    if args.case:  # child process: one measurement, printed as JSON
        print(json.dumps(run_case(args.case[0], int(args.case[1]), args.steps, args.config)))
        return
    kinds = [k for k in KIND_MODEL if k in {"pi", "dense", *args.kinds}]
    codes = {"current": None, **({"baseline": str(Path(args.baseline).resolve())} if args.baseline else {})}
    runs: dict[tuple[str, str, int], list[dict]] = {}
    for repeat in range(args.repeats):
        for position in args.positions:
            for kind in kinds:
                for code, src in codes.items():
                    cmd = [sys.executable, __file__, "--case", kind, str(position), "--steps", str(args.steps),
                           "--config", args.config] + (["--threads", str(args.threads)] if args.threads else [])
                    env = None if src is None else {**os.environ, "PYTHONPATH": src}
                    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
                    row = json.loads(out)
                    runs.setdefault((code, kind, position), []).append(row)
                    print(f"[{repeat + 1}/{args.repeats}] {code:8s} {kind:8s} position {position:>7,}: "
                          f"{row['tokens_per_s']:8.1f} tok/s, cache {row['cache_mib']:8.3f} MiB, "
                          f"RSS {row['rss_mib']:6.0f} MiB", flush=True)
    rows = {code: [median_row(r) for (c, *_), r in runs.items() if c == code] for code in codes}
    command = command_line("benchmarks/decode_bench.py", argv)
    result = dict(machine=machine_info(), command=command, config=args.config, steps=args.steps,
                  repeats=args.repeats, kinds=kinds, rows=rows["current"])
    if args.baseline:
        result.update(baseline=args.baseline, baseline_rows=rows["baseline"])
    table = markdown(result)
    if args.out:
        save_results(args.out, args.name, result, table)
    print(table)


if __name__ == "__main__":
    main()
