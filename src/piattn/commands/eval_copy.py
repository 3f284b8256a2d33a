"""`piattn eval --compare B --by-copy-distance`: the loss of A and B by copy-distance class, paired.

Every target byte of the scored windows is classed by how far back the token it could copy lies
(`piattn.analysis.copy_distance`: the most recent earlier position of its window that followed the same
n = COPY_N tokens; the lag is the one the predicting query must reach back) against two reaches: the
reference B's (class A: B reaches the lag) and the one of the checkpoint named by --classes-of (default
A itself): B, what that kind reaches and B does not; C, its gaps; D, beyond its every path; N, no match.
Per class: the byte count, the mean loss of A and of B (nats per token) and the paired difference A − B
with a 95 % percentile bootstrap interval whose unit is a window (the bytes of one window share a text).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from ..analysis.copy_distance import (
    CLASSES,
    COPY_N,
    copy_classes,
    copy_lags,
    lag_classes,
    paired_class_stats,
)
from ..analysis.report import lag_runs
from ..layers import attention_class, model_kinds, model_reach
from ..train import checkpoint as ckpt

RESAMPLES = 1000
"""Bootstrap resamples of the windows."""

INTERVAL = (f"95% percentile bootstrap over windows ({RESAMPLES} resamples, seed 0) of the class mean of the "
            "per-byte loss difference A − B (nats/token)")
LAG = (f"the lag from the query predicting a target back to the token after the most recent earlier match "
       f"of the target's preceding {COPY_N} tokens in its window")


def checkpoint_reach(folder: Path, flag: str, max_lag: int):
    """(the Reach of the model in checkpoint `folder` over lags 0 … max_lag, its description): the reach its
    attention kind declares (`AttentionLayer.lag_reach`); a kind that declares none is refused."""
    model = ckpt.read_config(folder)["model"]
    kind = model.get("attention")
    try:
        kinds = model_kinds(model)
        reach = model_reach(model, max_lag)  # a hybrid stack (`layers`): the sum set of its layers' reaches
    except ValueError as err:
        raise ValueError(f"{flag}: {folder}: {err}") from None
    described = {"checkpoint": str(folder), "attention": kind, "n_layer": model["n_layer"]}
    if model.get("layers"):
        described["layers"] = model["layers"]
    settings = set().union(*(attention_class(k).model_settings() for k in set(kinds)))
    described.update({s: model.get(s) for s in ("window", "period") if s in settings})
    if model.get("sinks"):
        described["sinks"] = model["sinks"]
    return reach, {**described, "span": reach.span, "reachable_lags": int(reach.reachable[1:].sum())}


def lag_ranges(mask: torch.Tensor) -> str:
    """"0–20, 32–40": the lags where the bool [max_lag + 1] mask holds, as ranges ("" for none)."""
    return lag_runs(mask.nonzero().flatten().tolist())


def by_copy_distance(losses_a: torch.Tensor, losses_b: torch.Tensor, windows: torch.Tensor, *,
                     classes_of: Path, reference: Path) -> dict:
    """The "copy_distance" entry of an evaluation: A's and B's per-target losses [W, T] on `windows`
    [W, T + 1], classed by the reaches of the checkpoints `classes_of` and `reference` (module docstring)."""
    if len(windows) < 2:
        raise ValueError(f"--by-copy-distance needs at least 2 windows for an interval, got {len(windows)}; "
                         "raise --batches or --batch-size")
    max_lag = windows.shape[1] - 2  # the longest lag within the T inputs
    kind, kind_described = checkpoint_reach(classes_of, "--classes-of", max_lag)
    local, local_described = checkpoint_reach(reference, "--compare", max_lag)
    codes = copy_classes(copy_lags(windows), kind, local)
    stats = paired_class_stats(losses_a, losses_b, codes, n_resamples=RESAMPLES, seed=0)
    table = lag_classes(kind, local)
    lags = {name: lag_ranges(table == code) for code, name in enumerate(CLASSES)}
    lags["N"] = "no match"
    return {"n": COPY_N, "lag": LAG, "classes_of": kind_described, "reference": local_described,
            "windows": len(windows), "interval": INTERVAL,
            "classes": {name: {"lags": lags[name], **asdict(stats[name])} for name in CLASSES}}


# What each class code of `analysis.copy_distance.lag_classes` means, for the table: words, so that the rows
# are not read as the models A (--checkpoint) and B (--compare) of its columns.
CLASS_NAMES = {"A": "local reach", "B": "skips only", "C": "in a gap", "D": "beyond", "N": "no match"}


def summary_lines(c: dict) -> list[str]:
    """A reader's table of a "copy_distance" entry: one row per copy-distance class (named by CLASS_NAMES), the
    columns A = --checkpoint and B = --compare."""
    lines = ["", f"by copy-distance class: A = {c['classes_of']['checkpoint']}, whose reach makes the classes, "
             f"B = {c['reference']['checkpoint']}; {c['interval']}",
             f"{'copy distance':<13}  {'lags':<24}{'bytes':>10}{'loss A':>10}{'loss B':>10}{'A − B':>10}"
             f"{'95% interval':>22}"]
    for code, row in c["classes"].items():
        lags = row["lags"] if len(row["lags"]) <= 22 else row["lags"][:21] + "…"
        interval = f"[{row['low']:+.4f}, {row['high']:+.4f}]"
        lines.append(f"{CLASS_NAMES[code]:<13}  {lags:<24}{row['count']:>10,}{row['loss']:>10.4f}"
                     f"{row['reference_loss']:>10.4f}{row['diff']:>+10.4f}{interval:>22}")
    return lines
