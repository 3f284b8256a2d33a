"""Scoring a Hugging Face causal LM as it is and as converted to π-Attention without training
(`piattn convert-eval`, experiments/convert_finetune.py): next-token losses of evaluation windows
(`piattn.data.windows`), their summary by position, and the mask engine.

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


def pattern_mask(T: int, *, window: int, period: int, sinks: int, alpha: float, eps: float = PI_DEFAULTS.eps,
                 dtype=None) -> torch.Tensor:
    """[1, 1, T, T] additive mask: what the converted model's attention adds to the scores while its gate
    outputs the constant α. Causal; key j of query i is local if i − window <= j <= i, else skip if
    j = i − period, else sink if j < sinks; local and sink keys get log α̃, the skip key log(1 − α̃), with
    α̃ = ε + (1 − 2ε)·α as the gate computes it; other keys −inf."""
    a = eps + (1 - 2 * eps) * alpha
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    causal = j <= i
    local = causal & (i - j <= window)
    skip = causal & ~local & (i - j == period)
    sink = causal & ~local & ~skip & (j < sinks)
    mask = torch.full((T, T), float("-inf"), dtype=torch.float64)
    mask[local | sink] = math.log(max(a, eps))
    mask[skip] = math.log(max(1 - a, eps))
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
