"""Paired comparisons of two models scored on the same windows: the mean difference with its 95%
t-interval over windows (`piattn eval --compare`).

Adjacent windows of one text are not independent, so the interval reads as optimistic rather than exact.
"""

from __future__ import annotations

import math

import torch


def paired_differences(losses_a: torch.Tensor, losses_b: torch.Tensor, widths: torch.Tensor) -> tuple[dict, list[dict]]:
    """A − B of two [W, bins] matrices of per-window mean losses by position bin (rows: the same windows):
    `paired_interval` over all positions (each window's bins weighted by their `widths` [bins], the
    positions they hold) and of each bin."""
    difference = losses_a - losses_b
    whole = (difference * widths).sum(1) / widths.sum()  # per-window difference over all positions
    return paired_interval(whole), [paired_interval(difference[:, i]) for i in range(difference.shape[1])]


def paired_interval(differences: torch.Tensor) -> dict:
    """Mean of [W] paired differences and its 95% t-interval (W >= 2): mean ± t(0.975, W − 1)·sd/√W."""
    n = len(differences)
    mean = differences.mean().item()
    half = t_quantile_975(n - 1) * differences.std().item() / math.sqrt(n)
    return {"difference": mean, "low": mean - half, "high": mean + half}


def t_quantile_975(df: int) -> float:
    """The 0.975 quantile of Student's t with `df` degrees of freedom: exact for 1 and 2, else the
    Cornish-Fisher expansion in 1/df about the normal quantile (Abramowitz & Stegun 26.7.5), within
    0.2% at df = 3 and closer beyond."""
    if df == 1:
        return math.tan(math.pi * 0.475)
    if df == 2:
        return 0.95 / math.sqrt(2 * 0.975 * 0.025)
    z = 1.959963984540054
    return (z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3)
            + (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / (92160 * df**4))
