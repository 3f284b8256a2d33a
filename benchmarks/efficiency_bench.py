"""The efficiency table (the paper's Table eff): dense, local and π GPTs of a named size at a few contexts.

Per row, in a fresh process: a GPT of `--config` (byte vocabulary 256 unless `--vocab-size`) with one
attention kind and one dropout rate, batch `--batch` sequences of the context T:

- training step: forward, loss, backward, grad clipping, AdamW (median of `--repeats` after one
  warm-up); tokens/s = batch·T / step time; peak memory of the step (CPU: growth of the resident set
  over the process after the model is built; CUDA: `max_memory_allocated`);
- prefill: one forward over the T prompt tokens in eval mode without gradients (all logits; filling a
  decoding cache adds a copy of k and v), median of `--repeats`;
- decode: tokens/s of `--decode-steps` single-token steps at position T (batch 1, the cache brought to
  position T with random contents, as in decode_bench.py: a step's time does not depend on them).

Dropout: the paper trains with 0.1. Dense attention with dropout cannot use the fused CPU kernel, so
scaled_dot_product_attention falls back to a math kernel that builds the [T, T] matrix; with dropout 0 it
runs the fused O(T)-memory kernel (flash on CUDA, which handles dropout itself). Rows are labelled with
their rate; the fair comparison is at equal rates. Eval mode has no dropout, so prefill and decode are
measured once per kind (in its dropout-0 row). Dense rows with dropout above `--dense-dropout-max-context`
are listed as not run (the math kernel's [T, T] matrices).

GPU: `--device cuda --dtype bf16` (autocast) runs the same rows with flash SDPA for dense and the Triton
π kernels, and adds MFU = model FLOPs per token × tokens/s / the device's peak (a table of known peaks);
no GPU figure has been measured by this script yet. On a CPU MFU is not reported.

    python benchmarks/efficiency_bench.py --out benchmarks/results/efficiency     # CPU plan: tiny 1K/4K/8K, small 1K
    python benchmarks/efficiency_bench.py --threads 1 --rounds 2 --out benchmarks/results/efficiency  # the table kept
    python benchmarks/efficiency_bench.py --render benchmarks/results/efficiency  # the .md again from the .json

On a shared machine single timings move a lot between minutes; `--rounds N` runs the whole plan N times,
rows interleaved, and reports medians, each ratio as the median [range] of the rounds' ratios (each round's
pair measured minutes apart). `--threads 1` keeps a busy machine's other work from stalling intra-op threads.

`--interleaved` measures the kinds side by side instead (the committed table, efficiency_bench.{json,md}):
per plan group (config, T) one process builds a model of every kind (dropout `--interleaved-dropout`, default
0), gives each one warm-up training step and prefill, then runs `--repeats` rounds; in each round every kind
takes one training step, then every kind one prefill, the order of the kinds rotated each round. Each ratio
(π / local, π / dense, ...) is computed within a round, from steps seconds apart, and reported as the median
[range] over the rounds. Peak memory is not taken from that process (its three models share one heap): each
kind gets two short fresh processes, one for a warm-up + one training step, one for two prefills, each
reporting the growth of its resident set over the process after the model is built. Decode is not measured
in this mode (benchmarks/decode_bench.py has its own interleaved table).

    python benchmarks/efficiency_bench.py --interleaved --threads 1 --plan tiny:1024:0:15 tiny:4096:0:11 \
        tiny:8192:0:7 --out benchmarks/results/efficiency
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

from piattn.benchmarking import (
    command_line,
    fill_cache,
    fmt,
    machine_info,
    reset_peak_rss,
    rss_kib,
    save_results,
    spread,
    sync,
)
from piattn.models import GPT, GPTConfig

KINDS = ("dense", "local", "pi")
# bf16 dense peaks (FLOP/s, no sparsity) of devices the GPU plan may meet; matched by substring of the name
PEAK_FLOPS = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}
# CONFIG:T[:DROPOUTS[:REPEATS]]; `small` (85M parameters with bytes) takes ~20-40 s a step on 2 CPU cores
DEFAULT_PLAN = ("tiny:1024", "tiny:4096", "tiny:8192", "small:1024:0:1")
DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def timed_train_step(model, optimizer, idx: torch.Tensor, device: torch.device, amp) -> float:
    """Seconds of one training step on idx [B, T + 1]: forward (under autocast to `amp`, None: off), loss,
    backward, gradient clipping, optimizer step."""
    sync(device)
    start = time.perf_counter()
    with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
        logits = model(idx[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), idx[:, 1:].flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    sync(device)
    return time.perf_counter() - start


def keys_per_query(cfg: GPTConfig, T: int) -> float:
    """Keys a query scores, averaged over the T positions of a causal sequence."""
    if cfg.attention == "dense":
        return (T + 1) / 2
    if cfg.attention == "local":
        return cfg.window + 1
    return cfg.window + 1 + (cfg.period > cfg.window)


def train_flops_per_token(cfg: GPTConfig, params: int, T: int) -> float:
    """6·N (the tied matrix counted once, as the output projection) + 3 × the attention scores and weighted
    sums (4·d FLOPs per key a query scores, per layer)."""
    return 6 * params + 3 * 4 * cfg.d_model * cfg.n_layer * keys_per_query(cfg, T)


def peak_flops(device: torch.device, dtype: str) -> float | None:
    if device.type != "cuda" or dtype != "bf16":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def run_case(case: dict) -> dict:
    """One row: the measurements of one (config, context, kind, dropout) in this process."""
    device = torch.device(case["device"])
    if case.get("threads"):
        torch.set_num_threads(case["threads"])
    amp = DTYPES[case["dtype"]]
    T, batch, repeats = case["context"], case["batch"], case["repeats"]
    torch.manual_seed(0)
    cfg = GPTConfig.from_name(case["config"], attention=case["kind"], vocab_size=case["vocab_size"],
                              block_size=T, dropout=case["dropout"])
    model = GPT(cfg).to(device)
    params = model.num_params()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab_size, (batch, T + 1), generator=gen).to(device)

    def autocast():
        return torch.autocast(device.type, dtype=amp, enabled=amp is not None)

    def train_step() -> float:
        return timed_train_step(model, optimizer, idx, device, amp)

    row = dict(config=case["config"], context=T, kind=case["kind"], dropout=case["dropout"], batch=batch,
               params=params, d_model=cfg.d_model, n_layer=cfg.n_layer, n_head=cfg.n_head,
               window=cfg.window, period=cfg.period, dtype=case["dtype"], device=str(device), repeats=repeats,
               threads=torch.get_num_threads())
    model.train()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    else:
        base = rss_kib("VmRSS") if reset_peak_rss() else None
    times = [train_step() for _ in range(repeats + 1)][1:]
    if device.type == "cuda":
        row["train_peak_mib"] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    else:
        row["train_peak_mib"] = None if base is None else (rss_kib("VmHWM") - base) / 1024
    row["train_step_s"] = statistics.median(times)
    row["train_tokens_per_s"] = batch * T / row["train_step_s"]
    peak = peak_flops(device, case["dtype"])
    row["mfu"] = None if peak is None else train_flops_per_token(cfg, params, T) * row["train_tokens_per_s"] / peak
    optimizer.state.clear()  # its memory is not the inference rows'
    if not case["inference"]:
        return row

    model.eval()
    with torch.no_grad(), autocast():
        prompt = idx[:1, :T]
        prefill = []
        for _ in range(repeats + 1):
            sync(device)
            start = time.perf_counter()
            model(prompt)
            sync(device)
            prefill.append(time.perf_counter() - start)
        row["prefill_ms"] = 1000 * statistics.median(prefill[1:])
        cache = model.init_cache(1)
        fill_cache(cache, T, gen)
        token = idx[:1, :1]
        for _ in range(3):  # warm-up: first calls allocate and pick kernels
            token = model(token, cache)[:, -1].argmax(-1, keepdim=True)
        sync(device)
        start = time.perf_counter()
        for _ in range(case["decode_steps"]):
            token = model(token, cache)[:, -1].argmax(-1, keepdim=True)
        sync(device)
        row["decode_tokens_per_s"] = case["decode_steps"] / (time.perf_counter() - start)
        row["decode_position"] = T
        row["cache_mib"] = cache.nbytes / 2**20
    return row


def measure_memory(case: dict) -> dict:
    """Peak resident-set growth of one kind in this (fresh) process: case["what"] = "train" (warm-up + one
    training step) or "prefill" (two eval forwards over the T-token prompt); CUDA: allocated bytes."""
    device = torch.device(case["device"])
    if case.get("threads"):
        torch.set_num_threads(case["threads"])
    torch.manual_seed(0)
    T = case["context"]
    cfg = GPTConfig.from_name(case["config"], attention=case["kind"], vocab_size=case["vocab_size"],
                              block_size=T, dropout=case["dropout"])
    model = GPT(cfg).to(device)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab_size, (case["batch"], T + 1), generator=gen).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4) if case["what"] == "train" else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    else:
        base = rss_kib("VmRSS") if reset_peak_rss() else None
    for _ in range(2):
        if optimizer is None:
            model.eval()
            with torch.no_grad():
                model(idx[:1, :T])
        else:
            model.train()
            logits = model(idx[:, :-1])
            torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), idx[:, 1:].flatten()).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    sync(device)
    if device.type == "cuda":
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    else:
        peak = None if base is None else (rss_kib("VmHWM") - base) / 1024
    return {"kind": case["kind"], "what": case["what"], "peak_mib": peak}


def run_group(group: dict) -> dict:
    """--interleaved: every kind of one (config, T) in this process, training steps and prefills timed in
    rounds with the kinds' order rotated each round."""
    device = torch.device(group["device"])
    if group.get("threads"):
        torch.set_num_threads(group["threads"])
    amp = DTYPES[group["dtype"]]
    T, batch, kinds = group["context"], group["batch"], group["kinds"]
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, group["vocab_size"], (batch, T + 1), generator=gen).to(device)
    models, optimizers, params = {}, {}, {}
    for kind in kinds:
        torch.manual_seed(0)
        cfg = GPTConfig.from_name(group["config"], attention=kind, vocab_size=group["vocab_size"], block_size=T,
                                  dropout=group["dropout"])
        models[kind] = GPT(cfg).to(device)
        params[kind] = models[kind].num_params()
        optimizers[kind] = torch.optim.AdamW(models[kind].parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)

    def autocast():
        return torch.autocast(device.type, dtype=amp, enabled=amp is not None)

    def train_step(kind: str) -> float:
        models[kind].train()
        return timed_train_step(models[kind], optimizers[kind], idx, device, amp)

    def prefill(kind: str) -> float:
        model = models[kind]
        model.eval()
        with torch.no_grad(), autocast():
            sync(device)
            start = time.perf_counter()
            model(idx[:1, :T])
            sync(device)
        return time.perf_counter() - start

    for kind in kinds:  # warm-up
        train_step(kind)
        prefill(kind)
    train = {k: [] for k in kinds}
    pre = {k: [] for k in kinds}
    for r in range(group["repeats"]):
        order = kinds[r % len(kinds):] + kinds[:r % len(kinds)]
        for kind in order:
            train[kind].append(train_step(kind))
        for kind in order:
            pre[kind].append(prefill(kind))
        print(f"{group['config']} T={T} round {r + 1}/{group['repeats']} ({' '.join(order)}): "
              + ", ".join(f"{k} {train[k][-1]:.3f} s / {1000 * pre[k][-1]:.1f} ms" for k in kinds),
              file=sys.stderr, flush=True)
    return dict(config=group["config"], context=T, batch=batch, dropout=group["dropout"], kinds=kinds,
                params=params, threads=torch.get_num_threads(), repeats=group["repeats"], train_step_s=train,
                prefill_s=pre)


def interleaved_markdown(result: dict) -> str:
    m = result["machine"]
    groups = result["groups"]
    threads = sorted({g["threads"] for g in groups}) or [m["cpu_count"]]
    out = [f"# Efficiency table, kinds interleaved ({m['processor']}, {m['cpu_count']} cores, "
           f"{'/'.join(map(str, threads))} intra-op thread(s), torch {m['torch']}, {result['device']}, "
           f"{result['dtype']})", "", f"`{result['command']}`", "",
           f"Python {m.get('python', '?')}, {m.get('platform', '')}. "
           + (f"Shared load during the run: {result['load']}. " if result.get("load") else "")
           + f"Total {result['seconds'] / 60:.1f} min.", "",
           f"GPT configs {', '.join(sorted({g['config'] for g in groups}))}, vocabulary {result['vocab_size']}, "
           f"batch {result['batch']} sequence(s) of T tokens (prefill: 1), window 4, period 16 (π adaptive), dropout "
           f"{result['dropout']:g}. Per (config, T) one process holds a model of every kind; after one warm-up "
           "each, every round times one training step of each kind (forward + backward + clip + AdamW), then one "
           "prefill of each (eval forward over the T-token prompt, no gradients), the kinds' order rotated each "
           "round. Times: median [range] over the rounds. Ratios (× local, × dense): computed within each round, "
           "median [range]; < 1 is faster. Peak MiB: growth of the resident set of a separate fresh process per "
           "kind (warm-up + one training step; two prefills), over the process after the model is built.", "",
           "| config | T | kind | rounds | train step (s) | tokens/s | step × local | step × dense | train peak MiB "
           "| peak × local | prefill (ms) | prefill × local | prefill × dense | prefill peak MiB |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def ratio(g, key, kind, base):
        if base not in g["kinds"]:
            return "–"
        if kind == base:
            return "1.00"
        return spread([a / b for a, b in zip(g[key][kind], g[key][base], strict=True)], ".2f", "[]")

    for g in groups:
        mem = g.get("memory", {})
        for kind in g["kinds"]:
            step = statistics.median(g["train_step_s"][kind])
            tp, pp = mem.get(kind, {}).get("train"), mem.get(kind, {}).get("prefill")
            tl = mem.get("local", {}).get("train")
            out.append(
                f"| {g['config']} | {g['context']:,} | {kind} | {g['repeats']} | "
                f"{spread(g['train_step_s'][kind], brackets='[]')} | "
                f"{g['batch'] * g['context'] / step:,.0f} | {ratio(g, 'train_step_s', kind, 'local')} | "
                f"{ratio(g, 'train_step_s', kind, 'dense')} | {fmt(tp, ',.0f')} | "
                f"{fmt(tp and tl and tp / tl, '.2f')} | "
                f"{spread([1000 * x for x in g['prefill_s'][kind]], ',.1f', '[]')} | "
                f"{ratio(g, 'prefill_s', kind, 'local')} | {ratio(g, 'prefill_s', kind, 'dense')} | "
                f"{fmt(pp, ',.0f')} |")
    return "\n".join(out) + "\n"


def run_child(flag: str, payload: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, flag, json.dumps(payload)], stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{flag} {payload} failed with exit {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def interleaved(args: argparse.Namespace, argv: list[str] | None) -> dict:
    started, groups = time.perf_counter(), []
    result = dict(machine=machine_info(), command=command_line("benchmarks/efficiency_bench.py", argv),
                  mode="interleaved", device=args.device, dtype=args.dtype, vocab_size=args.vocab_size,
                  batch=args.batch, dropout=args.interleaved_dropout, load=args.load, groups=groups)
    for item in args.plan:
        parts = item.split(":")
        config, context = parts[0], int(parts[1])
        repeats = int(parts[3]) if len(parts) > 3 else args.repeats
        group = dict(config=config, context=context, kinds=list(args.kinds), dropout=args.interleaved_dropout,
                     batch=args.batch, repeats=repeats, vocab_size=args.vocab_size, device=args.device,
                     dtype=args.dtype, threads=args.threads)
        measured = run_child("--group", group)
        measured["memory"] = {}
        for kind in args.kinds:
            for what in ("train", "prefill"):
                case = {**group, "kind": kind, "what": what}
                measured["memory"].setdefault(kind, {})[what] = run_child("--memory", case)["peak_mib"]
        groups.append(measured)
        result["seconds"] = time.perf_counter() - started
        print(f"{config} T={context}: " + ", ".join(
            f"{k} step {statistics.median(measured['train_step_s'][k]):.3f} s, "
            f"prefill {1000 * statistics.median(measured['prefill_s'][k]):.1f} ms, "
            f"peak {fmt(measured['memory'][k]['train'], '.0f')} MiB" for k in args.kinds), flush=True)
        if args.out:  # after every group, so that a run cut short keeps what it measured
            save_results(args.out, args.name, result, interleaved_markdown(result))
    return result


def label(row: dict) -> str:
    return f"{row['kind']} (dropout {row['dropout']:g})"


MEASURES = ("train_step_s", "train_peak_mib", "prefill_ms", "decode_tokens_per_s", "mfu")


def merge_rounds(rows: list[dict]) -> dict:
    """One row from the rounds of a case: each measure the median over rounds, the rounds kept under
    "rounds" (for the paired ratios)."""
    if len(rows) == 1:
        return {**rows[0], "rounds": [{k: rows[0].get(k) for k in MEASURES}]}
    merged = dict(rows[0])
    for key in MEASURES:
        values = [r[key] for r in rows if r.get(key) is not None]
        merged[key] = statistics.median(values) if values else None
    merged["train_tokens_per_s"] = merged["batch"] * merged["context"] / merged["train_step_s"]
    merged["rounds"] = [{k: r.get(k) for k in MEASURES} for r in rows]
    return merged


def paired_ratio(row: dict, base: dict | None, key: str, invert: bool = False) -> str:
    """Median over rounds of row/base (base/row with `invert`), each round's pair measured side by side;
    with several rounds, the range follows in brackets."""
    if base is None:
        return "–"
    if base is row:
        return "1.00"
    pairs = [(a[key], b[key]) for a, b in zip(row["rounds"], base["rounds"], strict=False)
             if a.get(key) and b.get(key)]
    ratios = sorted((b / a) if invert else (a / b) for a, b in pairs)
    if not ratios:
        return "–"
    text = f"{statistics.median(ratios):.2f}"
    return text + (f" [{ratios[0]:.2f}–{ratios[-1]:.2f}]" if len(ratios) > 1 else "")


def markdown(result: dict) -> str:
    m, rows = result["machine"], result["rows"]
    threads = sorted({r["threads"] for r in rows if "threads" in r}) or [m["cpu_count"]]
    rounds = result.get("rounds", 1)
    out = [f"# Efficiency table ({m['processor']}, {'/'.join(map(str, threads))} "
           f"thread{'s' if threads != [1] else ''}, torch {m['torch']}, {result['device']}, {result['dtype']})", "",
           f"`{result['command']}`", "",
           f"GPT configs {', '.join(sorted({r['config'] for r in rows}))}, vocabulary {result['vocab_size']}, "
           f"batch {result['batch']} sequence(s) of T tokens, window 4, period 16 (π adaptive); each row a fresh "
           f"process, median of {result['repeats']} after one warm-up (or the group's own count, in the JSON). "
           "Training step = forward + backward + clip + AdamW; peak = memory growth of the training step (CPU: "
           "resident set; CUDA: allocated). Prefill = eval forward over the T-token prompt; decode = "
           f"{result['decode_steps']} single-token steps at position T. × dense: time ratio to dense (training: "
           "with the same dropout), < 1 is faster. Prefill and decode run in eval mode (no dropout), so they are "
           "given once per kind."
           + (f" The whole plan ran {rounds} times, rows interleaved; figures are medians over the rounds and each "
              "ratio is the median of the rounds' ratios, each round's pair measured minutes apart, with the "
              "range in brackets." if rounds > 1 else ""), ""]
    header = ("| config | T | attention (dropout) | train step (s) | train tokens/s | step time × dense | "
              "train peak MiB | prefill (ms) | prefill × dense | decode tok/s at T | decode time × dense | MFU |")
    out += [header, "|" + "---|" * (header.count("|") - 1)]
    for r in rows:
        if "skipped" in r:
            out.append(f"| {r['config']} | {r['context']:,} | {label(r)} | not run: {r['skipped']} |"
                       + " |" * 8)
            continue
        dense = next((d for d in rows if d["kind"] == "dense" and d["config"] == r["config"]
                      and d["context"] == r["context"] and d["dropout"] == r["dropout"] and "skipped" not in d), None)
        dense0 = next((d for d in rows if d["kind"] == "dense" and d["config"] == r["config"]
                       and d["context"] == r["context"] and d.get("prefill_ms") is not None), None)
        inference = r.get("prefill_ms") is not None
        out.append(
            f"| {r['config']} | {r['context']:,} | {label(r)} | {r['train_step_s']:.3f} | "
            f"{r['train_tokens_per_s']:,.0f} | {paired_ratio(r, dense, 'train_step_s')} | "
            f"{fmt(r['train_peak_mib'], ',.0f')} | "
            + (f"{r['prefill_ms']:,.1f} | {paired_ratio(r, dense0, 'prefill_ms')} | "
               f"{r['decode_tokens_per_s']:,.0f} | {paired_ratio(r, dense0, 'decode_tokens_per_s', invert=True)} | "
               if inference else "= dropout 0 | | = dropout 0 | | ")
            + f"{fmt(r['mfu'] and 100 * r['mfu'], '.1f', 'not measured')}{'' if r['mfu'] is None else ' %'} |")
    out += ["", "MFU needs a GPU with a known bf16 peak; on a CPU it is not measured."
            if result["device"] == "cpu" else "MFU: model FLOPs (6N + attention scores) × tokens/s / device peak."]
    return "\n".join(out) + "\n"


def plan(args: argparse.Namespace) -> list[dict]:
    """The rows to run, in order; dense rows with dropout beyond --dense-dropout-max-context are skipped."""
    cases = []
    for item in args.plan:
        parts = item.split(":")
        if len(parts) not in (2, 3, 4):
            raise ValueError(f"--plan items are CONFIG:T[:DROPOUTS[:REPEATS]], got {item!r}")
        config, context = parts[0], int(parts[1])
        dropouts = [float(p) for p in parts[2].split(",")] if len(parts) > 2 else args.dropouts
        repeats = int(parts[3]) if len(parts) > 3 else args.repeats
        for kind in args.kinds:
            for dropout in dropouts if kind in args.dropout_kinds else [d for d in dropouts if d == 0]:
                case = dict(config=config, context=context, kind=kind, dropout=dropout, batch=args.batch,
                            repeats=repeats, decode_steps=args.decode_steps, vocab_size=args.vocab_size,
                            device=args.device, dtype=args.dtype, inference=dropout == 0, threads=args.threads)
                math_kernel = kind == "dense" and dropout > 0 and args.device == "cpu"
                if math_kernel and context > args.dense_dropout_max_context:
                    shape = GPTConfig.from_name(config)
                    gib = 3 * 4 * shape.n_layer * shape.n_head * args.batch * context**2 / 2**30
                    case["skipped"] = (f"dropout on CPU needs the [T, T] math kernel (about {gib:.0f} GiB saved "
                                       "for backward); raise --dense-dropout-max-context to run it")
                cases.append(case)
    return cases


def run_row(case: dict) -> dict:
    """`run_case` in a fresh process; a failed one comes back as {"skipped": "failed: <last stderr line>"}."""
    proc = subprocess.run([sys.executable, __file__, "--case", json.dumps(case)], capture_output=True, text=True)
    if proc.returncode != 0:
        last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
        return {k: case[k] for k in ("config", "context", "kind", "dropout")} | {"skipped": f"failed: {last}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def describe(row: dict) -> str:
    if "skipped" in row:
        return row["skipped"]
    inference = (f", prefill {row['prefill_ms']:.1f} ms, decode {row['decode_tokens_per_s']:.0f} tok/s"
                 if "prefill_ms" in row else "")
    return f"step {row['train_step_s']:.3f} s, {row['train_tokens_per_s']:,.0f} tok/s{inference}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="directory for efficiency_bench.{json,md}")
    parser.add_argument("--plan", nargs="+", default=list(DEFAULT_PLAN), metavar="CONFIG:T[:DROPOUTS[:REPEATS]]",
                        help="named config, context, and optionally the dropout rates (comma-separated) and "
                        f"repeats of the group (default {' '.join(DEFAULT_PLAN)})")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--dropouts", type=float, nargs="+", default=[0.1, 0.0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="fp32, or bf16 autocast (GPU)")
    parser.add_argument("--dense-dropout-max-context", type=int, default=4096,
                        help="CPU: longest context at which dense runs with dropout (math kernel, [T, T])")
    parser.add_argument("--threads", type=int, help="intra-op threads of each row (default: torch's, the cores)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the whole plan this many times, rows interleaved; medians and ratio ranges")
    parser.add_argument("--dropout-kinds", nargs="+", default=["dense", "pi"], choices=KINDS,
                        help="kinds measured at every --dropouts rate; the others at dropout 0 only")
    parser.add_argument("--interleaved", action="store_true",
                        help="kinds side by side in one process per (config, T), order rotated each round")
    parser.add_argument("--interleaved-dropout", type=float, default=0.0, help="dropout of --interleaved's models")
    parser.add_argument("--load", help="a note on the machine's shared load, copied into the results")
    parser.add_argument("--name", default="efficiency_bench", help="file name of the results (NAME.{json,md})")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--group", help=argparse.SUPPRESS)
    parser.add_argument("--memory", help=argparse.SUPPRESS)
    parser.add_argument("--render", type=Path, metavar="DIR", help="rewrite DIR/NAME.md from its .json")
    args = parser.parse_args(argv)
    if args.render:
        result = json.loads((args.render / f"{args.name}.json").read_text())
        render = interleaved_markdown if result.get("mode") == "interleaved" else markdown
        save_results(args.render, args.name, result, render(result))
        return 0
    if args.case:  # child process: one row, printed as JSON
        print(json.dumps(run_case(json.loads(args.case))))
        return 0
    if args.group:  # child process of --interleaved: one (config, T), printed as JSON
        print(json.dumps(run_group(json.loads(args.group))))
        return 0
    if args.memory:  # child process of --interleaved: one kind's peak memory
        print(json.dumps(measure_memory(json.loads(args.memory))))
        return 0
    if args.interleaved:
        print(interleaved_markdown(interleaved(args, argv)))
        return 0
    cases, started = plan(args), time.perf_counter()
    measured: list[list[dict]] = [[] for _ in cases]
    for round_ in range(args.rounds):
        for case, results in zip(cases, measured, strict=True):
            if "skipped" in case or (results and "skipped" in results[-1]):
                continue
            row = run_row(case)
            results.append(row)
            print(f"{round_ + 1}/{args.rounds} {row['config']:6s} T={row['context']:6,d} {label(row):22s} "
                  f"{describe(row)}", flush=True)
    rows = []
    for case, results in zip(cases, measured, strict=True):
        failed = next((r for r in results if "skipped" in r), None)
        if "skipped" in case or failed:
            rows.append({k: case[k] for k in ("config", "context", "kind", "dropout")}
                        | {"skipped": case.get("skipped") or failed["skipped"]})
        else:
            rows.append(merge_rounds(results))
    command = command_line("benchmarks/efficiency_bench.py", argv)
    result = dict(machine=machine_info(), command=command, device=args.device, dtype=args.dtype,
                  vocab_size=args.vocab_size, batch=args.batch, repeats=args.repeats, decode_steps=args.decode_steps,
                  rounds=args.rounds, seconds=time.perf_counter() - started, rows=rows)
    table = markdown(result)
    if args.out:
        save_results(args.out, args.name, result, table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
