"""Scoring a Hugging Face causal LM as it is and as converted to π-Attention without training
(`piattn convert-eval`, experiments/convert_finetune.py): next-token losses of evaluation windows
(`piattn.data.windows`), their summary by position, and the mask engine.

`configuration_pattern` turns a configuration's name (dense, local, pi, ms-pi, each optionally +sinks) into
what `convert_to_pi` gets.

The mask engine runs the original model with a π pattern and the gate's priors as an additive [T, T] mask
(`pattern_mask`): the same function as the converted model while its gate is constant (untrained), at the
cost of dense attention, for CPUs where the operator's reference backend is too slow.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ...config.pi import PI_DEFAULTS
from ...layers.gate import clip_gate
from ...ops.pi.pattern import Pattern, log_priors, slot_keys

CONFIGURATIONS = ("dense", "local", "local+sinks", "pi", "pi+sinks", "ms-pi", "ms-pi+sinks")
"""dense: the original model; local: window W only; pi: window W and the skip key π back; ms-pi: window W and
one skip key per head, periods designed per layer (`configuration_pattern`); +sinks: and the first tokens."""


def configuration_pattern(name: str, *, window: int, period: int, sinks: int, context: int, hops: int,
                          n_layer: int, n_head: int) -> dict | None:
    """`convert_to_pi`'s window, period and sinks for configuration `name` (None for "dense"): local gets the
    period `context` (no key of a sequence of at most `context` tokens lies that far back); pi `period`;
    ms-pi one list of per-head periods per layer, the two (or `hops`) layers of
    `design_periods(window, hops, n_head, context − 1)`, which reach every lag below `context` in `hops`
    consecutive layers, repeated over the n_layer layers; sinks only with "+sinks"."""
    if name not in CONFIGURATIONS:
        raise ValueError(f"configuration must be one of {CONFIGURATIONS}, got {name!r}")
    if name == "dense":
        return None
    kind = name.removesuffix("+sinks")
    if kind == "local":
        p = context
    elif kind == "pi":
        p = period
    else:
        from ...analysis.multiscale import design_periods

        layers = design_periods(window, hops, n_head, context - 1).periods
        p = [list(layers[i % len(layers)]) for i in range(n_layer)]
    return dict(window=window, period=p, sinks=sinks if name.endswith("+sinks") else 0)


def pattern_mask(T: int, *, window: int, period: int, sinks: int, alpha: float, eps: float = PI_DEFAULTS.eps,
                 dtype=None) -> torch.Tensor:
    """[1, 1, T, T] additive mask: what the converted model's attention adds to the scores while its gate
    outputs the constant α. Causal; key j of query i gets the log prior of the slot that reads it (`slot_keys`
    of the operator's `Pattern`: local i − window … i, then the skip key i − period, then the sinks, a key in
    one slot only), log α̃ for local and sink slots and log(1 − α̃) for the skip (`log_priors` of the
    "adaptive" variant, ε-floored), α̃ the gate's clip of α (`clip_gate`); keys no slot reads −inf."""
    pattern = Pattern(window, period, causal=True, sinks=sinks)
    key, valid = (x[0] for x in slot_keys(pattern, T))  # [T, |U|]
    gate = clip_gate(torch.tensor([[[alpha]]], dtype=torch.float64), eps)  # α̃ [1, 1, 1]
    log_local, log_skip = (p.flatten() for p in log_priors("adaptive", gate, PI_DEFAULTS.prior, eps))
    bias = torch.cat([log_local if is_local else log_skip for is_local in pattern.slot_is_local()])  # [|U|]
    rows = torch.arange(T)[:, None].expand_as(key)
    mask = torch.full((T, T), float("-inf"), dtype=torch.float64)
    mask[rows[valid], key[valid]] = bias.expand_as(key)[valid]
    return mask.to(dtype or torch.float32)[None, None]


def token_losses(model, windows: torch.Tensor, batch: int, *, progress: bool = True, label: str = "",
                 mask: torch.Tensor | None = None) -> torch.Tensor:
    """Next-token loss of every window: [N, context − 1] fp32 (column t: predicting token t + 1); `mask`: a 4D
    additive attention mask for every window, or None (the model's own attention)."""
    out = []
    with torch.no_grad():
        for i in tqdm(range(0, len(windows), batch), desc=label, unit="batch", disable=not progress,
                      dynamic_ncols=True):
            ids = windows[i : i + batch]
            extra = {} if mask is None else dict(attention_mask=mask.expand(len(ids), -1, -1, -1))
            logits = model(ids, use_cache=False, **extra).logits[:, :-1].float()
            out.append(F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none"))
    return torch.cat(out)


def summarize_losses(nll: torch.Tensor, bins: int, seconds: float) -> dict:
    """Mean loss, perplexity and the loss in `bins` equal position bins of `token_losses` [N, T − 1], with
    the seconds they took: one configuration's record in convert_eval.json."""
    per_position = nll.mean(0)
    edges = [round(b * per_position.numel() / bins) for b in range(bins + 1)]
    loss = float(nll.mean())
    return dict(loss=loss, perplexity=math.exp(loss), seconds=round(seconds, 1),
                loss_by_bin=[float(per_position[a:b].mean()) for a, b in zip(edges[:-1], edges[1:], strict=True)],
                bin_edges=[e + 1 for e in edges])  # positions of the predicted tokens
