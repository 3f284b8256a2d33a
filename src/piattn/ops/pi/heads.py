"""Per-head periods (multi-scale π): run a one-period computation once per distinct period, on that
period's query heads, and put the outputs back in head order.

Every one-period path (each backend of `pi_attention`, the decoding functions of `decode.py`) is exact on
any subset of heads, so grouping makes each of them exact for per-head periods without touching it; the
price is one call per distinct period. Autograd carries gradients back through the index_select and cat.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def period_groups(periods: tuple[int, ...], n_kv_heads: int) -> list[tuple[int, list[int], list[int]]]:
    """(period, its query heads, the key/value heads they read, in order) per distinct period, increasing.

    Query head h reads key/value head h // (H // n_kv_heads). When a period's query heads make up whole
    key/value groups, each key/value head is listed once (the group's call keeps grouped-query attention);
    otherwise one per query head (a copy of a shared key/value head: the only case that repeats one).
    """
    group = len(periods) // n_kv_heads
    out = []
    for p in sorted(set(periods)):
        heads = [h for h, ph in enumerate(periods) if ph == p]
        kv_heads = sorted({h // group for h in heads})
        if len(heads) != len(kv_heads) * group:
            kv_heads = [h // group for h in heads]
        out.append((p, heads, kv_heads))
    return out


def by_period(periods: tuple[int, ...], n_kv_heads: int, device: torch.device,
              run: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """run(period, heads, kv_heads) -> [B, len(heads), …] for each `period_groups` entry (heads and kv_heads
    as int64 index tensors on `device`), concatenated along dim 1 and reordered to head order: [B, H, …]."""
    outputs, order = [], []
    for p, heads, kv_heads in period_groups(periods, n_kv_heads):
        outputs.append(run(p, torch.tensor(heads, device=device), torch.tensor(kv_heads, device=device)))
        order += heads
    inverse = torch.empty(len(periods), dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(len(periods))
    return torch.cat(outputs, 1).index_select(1, inverse.to(device))
