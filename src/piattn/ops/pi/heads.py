"""Per-head periods (multi-scale π): run a one-period computation once per distinct period, on that
period's query heads, and put the outputs back in head order.

Every one-period path (each backend of `pi_attention`, the operators built on it) is exact on
any subset of heads, so grouping makes each of them exact for per-head periods without touching it; the
price is one call per distinct period. Autograd carries gradients back through the split, index_select
and cat.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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


def by_period(periods: tuple[int, ...], n_kv_heads: int, run: Callable[..., torch.Tensor],
              per_head: Sequence[tuple[torch.Tensor | None, int]],
              per_kv: Sequence[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """run(period, *its query heads' parts of `per_head`, *its key/value heads' parts of `per_kv`) ->
    [B, H_g, …] for each `period_groups` entry, concatenated along dim 1 in head order: [B, H, …].

    per_head: (tensor, dim) pairs with the H query heads along dim (None passes None); per_kv: (tensor, dim)
    pairs with the key/value heads along dim. Each is reordered once (no copy when the order is already
    that of the groups) and split into views, so that the backward gathers each gradient with one cat and
    one index_select instead of one full-size zeros-and-add per group.
    """
    groups = period_groups(periods, n_kv_heads)
    order = [h for _, heads, _ in groups for h in heads]
    kv_order = [j for _, _, kv_heads in groups for j in kv_heads]

    def parts(x: torch.Tensor | None, dim: int, index: list[int], sizes: list[int]) -> list:
        if x is None:
            return [None] * len(sizes)
        if index != list(range(x.shape[dim])):
            x = x.index_select(dim, torch.tensor(index, device=x.device))
        return list(x.split(sizes, dim))

    sizes, kv_sizes = [len(g[1]) for g in groups], [len(g[2]) for g in groups]
    head_parts = [parts(x, dim, order, sizes) for x, dim in per_head]
    kv_parts = [parts(x, dim, kv_order, kv_sizes) for x, dim in per_kv]
    y = torch.cat([run(p, *(hp[i] for hp in head_parts), *(kp[i] for kp in kv_parts))
                   for i, (p, _, _) in enumerate(groups)], 1)
    if order == list(range(len(periods))):
        return y
    inverse = torch.empty(len(periods), dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(len(periods))
    return y.index_select(1, inverse.to(y.device))


def operator_by_period(periods: tuple[int, ...], run: Callable[..., torch.Tensor], q: torch.Tensor,
                       gate: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """run(period, q_g, gate_g, k_g, v_g) -> [B, H_g, T, D] for an operator's call: on every head at once where
    they share one period, else once per period group (`by_period`), [B, H, T, D] in head order. q [B, H, T, D],
    gate [B, H, T] or None, k and v [B, H_kv, T, D]; periods one per query head, as `validate.head_periods`
    returns them. For the operators built on `pi_attention` (sequence parallelism), so that they group heads
    here, not apart."""
    if len(set(periods)) == 1:
        return run(periods[0], q, gate, k, v)
    return by_period(periods, k.shape[1], run, [(q, 1), (gate, 1)], [(k, 1), (v, 1)])
