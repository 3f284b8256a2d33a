"""What `piattn eval` shows a person: the task and checkpoint, the main metrics with their units, and for the
recall and reach tasks a table of accuracy by lag marking the lags the reachability analysis says the
model's attention can carry to the query (for MQAR: by key–query distance, then by number of pairs).

    recall, step 2000 of runs/recall-pi/checkpoints/step_00002000: test split (generated), 4,096 examples, 1.2 s
      accuracy  61.23%  (chance 12.5%)
      loss      1.0412 nats/example

    accuracy by lag
         lags  reach  accuracy  examples
            3      *   100.00%        64
            …
            7      *    98.44%        64
            8           12.50%        64
            …
    * reachable: the query reaches the value and its marker through pi attention, window 4, period 16, 2 layers (…)

MQAR (`--task mqar`) gets the same table by the distance from each key to its query (a distance d is
marked when the query reaches the key, d back, and its value, d - 1 back), then a table by number of pairs:
accuracy over all its queries, over those at marked distances and over the others.

A language model gets loss (nats per token), perplexity (per token) and bits per byte of the scored text;
with the byte tokenizer one token is one byte, so bits per byte is loss / ln 2. A pixels model gets bits/dim,
by row band and for the first row against the rows below it, with the target's neighbours (left, above-right,
above, above-left, two above) marked by whether its attention reaches them; an image classifier accuracy by
class.
"""

from __future__ import annotations

import math

import torch

from ..config import TrainConfig
from ..config.model import layer_fields
from ..layers import model_kinds, model_reach
from ..tasks import TASKS, config_class, task_class
from ..tasks.mqar import pairs_view
from . import eval_copy

MAX_LAG_ROWS = 24
"""Rows of the accuracy-by-lag table before neighbouring lags share a row (a recall run over a 1024-token
sequence has a thousand lags; the full table stays in the JSON)."""


def report(result: dict, config: dict) -> list[str]:
    """The lines a person reads for `result` (an evaluation, `piattn eval`'s JSON) of the checkpoint whose
    config.json is `config`: the heading, the main metrics, the tables its task declares
    (`Task.report_sections`, drawn by `SECTIONS`), then those of --position-bins, --compare, --by-copy-distance."""
    lines = [heading(result, config), *metric_lines(result, config)]
    task = TASKS.get(config.get("task"))
    for section in task.report_sections if task is not None else ():
        lines += ["", *SECTIONS[section](result, config)]
    return lines + comparison_lines(result)


def heading(result: dict, config: dict) -> str:
    """'TASK, step N of CHECKPOINT: SPLIT split of DATA, COUNT, SECONDS'."""
    step = f"step {result['step']} of " if result.get("step") is not None else ""
    data = f"of {result['data']}" if result.get("data") else "(generated)"
    count = next((f"{result[k]:,} {k}" for k in ("tokens", "queries", "examples", "images", "pixels")
                  if k in result), "")
    return (f"{config.get('task', 'model')}, {step}{result['checkpoint']}: {result['split']} split {data}, "
            f"{count + ', ' if count else ''}{result['seconds']:.1f} s")


def metric_lines(result: dict, config: dict) -> list[str]:
    """The main metrics, one a line, with their units."""
    if "bpb" in result:
        return language_model_lines(result, tokenizer_kind(config))
    if "bits_per_dim" in result:
        return [f"  bits/dim  {result['bits_per_dim']:.4f}  (bits per pixel: loss / ln 2 over all "
                f"{result['height']} × {result['width']} pixels of each image)",
                f"  loss      {result['loss']:.4f} nats/pixel"]
    if "accuracy" in result:
        chance = f"  (chance {result['chance']:.1%})" if "chance" in result else ""
        unit = "query" if "queries" in result else "example"
        return [f"  accuracy  {result['accuracy']:.2%}{chance}", f"  loss      {result['loss']:.4f} nats/{unit}"]
    if "i2t_r1" in result:
        recalls = {d: "/".join(f"{100 * result[f'{d}_r{k}']:.1f}" for k in (1, 5, 10)) for d in ("i2t", "t2i")}
        return [f"  Recall@1/5/10 image→text {recalls['i2t']}%, text→image {recalls['t2i']}% "
                f"({result['captions']:,} captions)"]
    return []


def tokenizer_kind(config: dict) -> str:
    """The tokenizer a language-model checkpoint was trained with ('byte', 'char' or 'bpe')."""
    return config_class().from_flat(config["train_args"]).data.tokenizer


def language_model_lines(result: dict, tokenizer: str) -> list[str]:
    """Loss, perplexity and bits per byte; for the byte tokenizer, bits per byte is said to be loss / ln 2
    (the number byte-level results quote), otherwise how it counts the text's bytes."""
    if tokenizer == "byte":
        how = "= loss / ln 2: byte tokenizer, one token per byte"
    else:
        how = f"{tokenizer} tokenizer: nats over the text's {result['bytes']:,} UTF-8 bytes, / ln 2"
    return [f"  loss        {result['loss']:.4f} nats/token",
            f"  perplexity  {result['perplexity']:.3f} (per token)",
            f"  bits/byte   {result['bpb']:.4f}  ({how})"]


# --- accuracy by lag ---------------------------------------------------------------------------------

def lag_table(result: dict, config: dict) -> list[str]:
    """Accuracy by lag (recall: every lag scored; reach: its one lag), '*' on the lags `reachable_lags` marks."""
    cfg = config_class().from_flat(config["train_args"])
    accuracy, examples = lag_scores(result, cfg)
    reachable, legend = reachable_lags(config["model"], cfg, sorted(accuracy))
    return ["accuracy by lag", *accuracy_rows("lags", accuracy, examples, "examples", reachable), legend]


def accuracy_rows(name: str, accuracy: dict[int, float], counts: dict[int, int], counted: str,
                  reachable: dict[int, bool] | None) -> list[str]:
    """The header and rows of an accuracy-by-lag table: `lag_rows` of the lags of `accuracy`, each with its
    reach mark, accuracy and count (`counted`: what `counts` counts, examples or queries)."""
    lines = [f"{name:>9}  {'reach':>5}  {'accuracy':>8}  {counted:>8}"]
    for lags in lag_rows(sorted(accuracy), reachable):
        n = sum(counts[lag] for lag in lags)
        correct = sum(accuracy[lag] * counts[lag] for lag in lags)
        label = f"{lags[0]}" if len(lags) == 1 else f"{lags[0]}–{lags[-1]}"
        mark = "*" if reachable is not None and reachable[lags[0]] else ""
        lines.append(f"{label:>9}  {mark:>5}  {correct / n:>8.2%}  {n:>8,}")
    return lines


def lag_scores(result: dict, cfg: TrainConfig) -> tuple[dict[int, float], dict[int, int]]:
    """({lag: accuracy}, {lag: examples}): the recall task's per-lag entries, or the reach task's one lag."""
    if "accuracy_by_lag" in result:
        return ({int(k): v for k, v in result["accuracy_by_lag"].items()},
                {int(k): v for k, v in result["examples_by_lag"].items()})
    return {cfg.task.lag: result["accuracy"]}, {cfg.task.lag: result["examples"]}


def reachable_lags(model: dict, cfg: TrainConfig, lags: list[int]) -> tuple[dict[int, bool] | None, str]:
    """({lag: whether the analysis says the query can read the answer at that lag}, the table's legend), or
    (None, why there are no marks).

    The model's attention kind gives the lags its layers reach (`AttentionLayer.lag_reach`). A recall answer
    needs its marker as well (the model finds the value by the marker beside it), so a recall lag counts only
    when both lags are reached, as experiments/recall.py counts it; an MQAR distance d, when the key (d) and
    its value (d - 1) are. Sinks: a key among the first `sinks` positions is read by every later query in one layer
    (`piattn.analysis.reachability`), and every sequence starts at position 0: in recall and reach the query
    is the last position, so a lag reaching a sink is marked; an MQAR query sits anywhere, so the sinks'
    pairs are named in the legend instead."""
    if cfg.task.causal is False:  # the analysis is of causal attention; --no-causal reads a reversed sequence
        return None, "no reachability marks: the analysis covers causal models, not --no-causal"
    seq_len = cfg.data.seq_len
    try:
        reach = model_reach(model, seq_len - 1).reachable  # a hybrid stack: the sum set of its layers' reaches
    except ValueError:  # longformer, bigbird, reformer: they declare no fixed set of lags
        return None, ("no reachability marks: the analysis has no fixed reach for "
                      f"{model.get('layers') or model['attention']} attention")
    sinks = max(layer.get("sinks") or 0 for layer in layers_fields(model))  # a sink read in one layer is read
    task = task_class(cfg.task.task)
    note = task.sinks_note(sinks)
    if note is None:  # the query is the last position: lag d sits at position seq_len - 1 - d
        reach, note = reach | (torch.arange(seq_len) >= seq_len - sinks), ""
    needed = task.lags_needed(cfg, lags)  # recall: the marker too; mqar: the key d back, its value d - 1 back
    marked = {lag: bool(reach[lag]) and all(reach[m] for m in needed[lag]) for lag in lags}
    return marked, (f"* reachable: the query reaches {task.reach_carries} through {describe_attention(model)} "
                    f"(piattn.analysis){note}")


def mqar_tables(result: dict, config: dict) -> list[str]:
    """MQAR: accuracy by key–query distance (marked as `reachable_lags` marks), then by number of pairs, with
    the accuracy over the marked distances and over the others."""
    cfg = config_class().from_flat(config["train_args"])
    accuracy = {int(k): v for k, v in result["accuracy_by_distance"].items()}
    queries = {int(k): v for k, v in result["queries_by_distance"].items()}
    reachable, legend = reachable_lags(config["model"], cfg, sorted(accuracy))
    lines = ["accuracy by key–query distance",
             *accuracy_rows("distances", accuracy, queries, "queries", reachable), legend, "",
             "accuracy by number of pairs"]
    groups = {} if reachable is None else {"reachable": True, "unreachable": False}
    lines.append(f"{'pairs':>9}  {'accuracy':>8}" + "".join(f"  {g:>11}" for g in groups) + f"  {'queries':>8}")
    for n, total in result["queries_by_pairs"].items():
        view, cells = pairs_view(result, int(n)), ""
        for wanted in groups.values():
            counts = {d: q for d, q in view["queries_by_distance"].items() if reachable[int(d)] == wanted}
            right = sum(view["accuracy_by_distance"][d] * q for d, q in counts.items())
            cells += f"  {right / sum(counts.values()):>11.2%}" if counts else f"  {'—':>11}"
        lines.append(f"{n:>9}  {result['accuracy_by_pairs'][n]:>8.2%}{cells}  {total:>8,}")
    if groups:
        lines.append("reachable / unreachable: over the queries at the distances marked * above / at the others")
    return lines


def pixel_tables(result: dict, config: dict) -> list[str]:
    """--task pixels: bits/dim by row band, then the first row (no pixel above) against the rows below, with
    which neighbours of the target pixel the model's attention reaches (`tasks.pixels.neighbour_reach`)."""
    lines = ["bits/dim by row band", f"{'rows':>9}  {'pixels':>10}  {'bits/dim':>8}"]
    for band in result["row_bands"]:
        rows = f"{band['start']}–{band['end'] - 1}" if band["end"] - band["start"] > 1 else f"{band['start']}"
        lines.append(f"{rows:>9}  {band['pixels']:>10,}  {band['bits_per_dim']:>8.4f}")
    reach, lags = result.get("neighbour_reach"), result["neighbour_lags"]
    above = "" if reach is None or "above" not in reach else ("  *" if reach["above"] else "  (not reached)")
    lines += ["", "bits/dim by the pixel above the target (W back in the image, W − 1 back from the query)",
              f"{'first row (none above)':>26}  {result['first_row']['pixels']:>10,}  "
              f"{result['first_row']['bits_per_dim']:>8.4f}",
              f"{'rows below (pixel above)':>26}  {result['rows_below']['pixels']:>10,}  "
              f"{result['rows_below']['bits_per_dim']:>8.4f}{above}"]
    if reach is None:
        lines.append(f"no reachability marks: the analysis has no fixed reach for {config['model']['attention']} "
                     "attention")
    else:
        marks = ", ".join(f"{name} (lag {lags[name]}) {'yes' if hit else 'no'}" for name, hit in reach.items())
        lines.append(f"* reached through {describe_attention(config['model'])} (piattn.analysis): {marks}")
    return lines


def class_table(result: dict) -> list[str]:
    """Accuracy by class (--task image-class)."""
    lines = ["accuracy by class", f"{'class':>9}  {'accuracy':>8}  {'examples':>8}"]
    for label, accuracy in sorted(result["accuracy_by_class"].items(), key=lambda item: int(item[0])):
        lines.append(f"{label:>9}  {accuracy:>8.2%}  {result['examples_by_class'][label]:>8,}")
    return lines


# The tables a task's report may hold (`Task.report_sections`), each drawn from (result, config).
SECTIONS = {"lags": lag_table, "distances": mqar_tables, "row bands": pixel_tables,
            "classes": lambda result, config: class_table(result)}


def describe_attention(model: dict) -> str:
    """'pi attention, window 4, period 16, 2 layers' (the period as stored: an int or per-head lists)."""
    if model.get("layers"):  # a hybrid stack: its pattern, then the settings its windowed layers take
        layers = list(zip(model_kinds(model), layers_fields(model), strict=True))
        windows = sorted({fields.get("window") for kind, fields in layers if kind != "dense"})
        shared_period = any(kind == "pi" and fields.get("period") == model.get("period") for kind, fields in layers)
        sinks = max(fields.get("sinks") or 0 for _, fields in layers)
        parts = [f"layers {model['layers']}", *([f"window {', '.join(map(str, windows))}"] if windows else []),
                 *([f"period {model.get('period')}"] if shared_period else [])]
        if model.get("nope_global"):
            parts.append("no RoPE on dense layers")
        if sinks:
            parts.append(f"{sinks} sinks")
        return ", ".join([*parts, f"{model['n_layer']} layers"])
    parts = [f"{model['attention']} attention"]
    if model["attention"] == "neighbourhood":
        parts.append(f"radius {model.get('radius', 1)} on images {model.get('image_width')} wide")
    elif model["attention"] == "strided":
        parts.append(f"stride {model.get('stride') or model.get('image_width')}")
    elif model["attention"] != "dense":
        parts.append(f"window {model.get('window')}")
    if model["attention"] == "pi":
        parts.append(f"period {model.get('period')}")
    if model.get("sinks"):
        parts.append(f"{model['sinks']} sinks")
    return ", ".join([*parts, f"{model['n_layer']} layers"])


def layers_fields(model: dict) -> list[dict]:
    """The fields of each layer of a model, as it takes them (`layer_fields`: the settings its pattern item gives
    it in place of the shared ones)."""
    return [layer_fields(model, layer) for layer in range(model["n_layer"])]


def lag_rows(lags: list[int], reachable: dict[int, bool] | None) -> list[list[int]]:
    """The sorted `lags` split into table rows: one lag a row up to MAX_LAG_ROWS lags, else runs of
    neighbouring lags of about len(lags) / MAX_LAG_ROWS each. A row never mixes reachable and unreachable
    lags, so each row's mark holds for every lag in it."""
    width = max(1, math.ceil(len(lags) / MAX_LAG_ROWS))
    rows: list[list[int]] = []
    for lag in lags:
        last = rows[-1] if rows else None
        same = last is not None and (reachable is None or reachable[last[0]] == reachable[lag])
        if same and len(last) < width and lag == last[-1] + 1:
            last.append(lag)
        else:
            rows.append([lag])
    return rows


# --- language models: position bins, --compare, --by-copy-distance ---------------------------------------

def comparison_lines(result: dict) -> list[str]:
    """The table of --by-copy-distance, --compare or --position-bins when the result holds one."""
    if "copy_distance" in result:
        c = result["compare"]
        return ["", f"B = {c['checkpoint']} (step {c['step']}): loss {c['loss']:.4f} nats/token, "
                f"{c['bpb']:.4f} bits/byte", *eval_copy.summary_lines(result["copy_distance"])]
    if "compare" in result:
        return compare_lines(result)
    if "position_bins" in result:
        return ["", f"{'positions':>12}{'tokens':>12}{'loss':>10}  (nats/token)",
                *(f"{positions(b):>12}{b['tokens']:>12,}{b['loss']:>10.4f}" for b in result["position_bins"])]
    return []


def compare_lines(result: dict) -> list[str]:
    """--compare: A's loss and A − B with its interval per position bin and over all positions."""
    c = result["compare"]
    lines = ["", f"A − B, B = {c['checkpoint']} (step {c['step']}): loss {c['loss']:.4f} nats/token; "
             f"{c['interval']}", f"{'positions':>12}{'loss A':>10}{'A − B':>10}{'95% interval':>24}"]
    rows = [(positions(a), a["loss"], b) for a, b in zip(result["position_bins"], c["position_bins"], strict=True)]
    rows.append(("all", result["loss"], c["total"]))
    for name, loss, d in rows:
        interval = f"[{d['low']:+.4f}, {d['high']:+.4f}]"
        lines.append(f"{name:>12}{loss:>10.4f}{d['difference']:>+10.4f}{interval:>24}")
    return lines


def positions(row: dict) -> str:
    """The target positions of a bin, first–last (its "end" is exclusive)."""
    return f"{row['start']}–{row['end'] - 1}"
