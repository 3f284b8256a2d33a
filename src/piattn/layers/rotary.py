"""Rotary position embedding (RoPE), applied to queries and keys before attention."""

from __future__ import annotations

import torch
from torch import nn

from ..caching import untainted


class Rotary(nn.Module):
    """Rotates channel pairs (i, i + D/2) of q and k by position·θ_i, θ_i = base^(-2i/D).

    Args:
        head_dim: D, even.
        base: the frequency base (10000 in RoFormer and most LMs).

    cos and sin are read from a table of positions 0 … n − 1 kept per device (grown by doubling when a
    later position is asked for): a decoding step then costs a slice, not an arange, a product and two
    trigonometric calls per layer. The table holds exactly what computing them afresh gives (the same
    fp32 product position·θ_i), so results do not depend on the table's history.
    """

    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {head_dim}")
        inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @untainted  # kept for later calls, which may train
    def _table(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [≥ n, 1, D] fp32 of positions 0 … on `device`, in the layout `rotate` needs: cos twice,
        then −sin and sin."""
        table = self._tables.get(device)
        if table is None or table[0].shape[0] < n:
            size = max(n, 2 * table[0].shape[0] if table is not None else 256)
            angles = torch.arange(size, device=device, dtype=torch.float32)[:, None] * self.inv_freq.to(device)
            cos, sin = angles.cos()[:, None], angles.sin()[:, None]
            table = (torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1))
            # Under torch.compile the table is computed in the graph, not stored: storing it would change what
            # dynamo guarded on (the dict's keys), and the next call would recompile the whole model.
            if not torch.compiler.is_compiling():
                self._tables[device] = table
        return table

    def cos_sin(self, T: int, offset: int = 0, positions: torch.Tensor | None = None,
                device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The angles of positions offset … offset + T − 1 ([T, 1, D]) or of `positions` [B, T] int64 in
        [0, T) ([B, T, 1, D]), for `rotate` on [B, T, heads, D].

        The table for `positions` is sized by T, not by positions.max(): a value-dependent size would
        break a compiled graph (and guard on data), and packed documents' positions t − start(t) are < T.
        """
        device = self.inv_freq.device if device is None else device
        if positions is None:
            cos, sin = self._table(offset + T, device)
            return cos[offset:offset + T], sin[offset:offset + T]
        cos, sin = self._table(max(T, 1), device)
        return cos[positions], sin[positions]

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, T, heads, D] rotated by the angles `cos_sin` gave (in fp32); same shape and dtype.

        y = x·cos + swap(x)·(−sin, sin), swap exchanging the halves: (x1 cos − x2 sin, x2 cos + x1 sin), the
        same rounding as writing the two halves out, in three tensor ops.
        """
        xf = x.float()
        *lead, D = xf.shape
        swapped = xf.reshape(*lead, 2, D // 2).flip(-2).view(*lead, D)
        y = xf * cos + swapped * sin
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def forward(self, x: torch.Tensor, offset: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, H, T, D] at positions offset … offset + T - 1, or at `positions` [B, T] (int64) when given
        -> rotated, same shape and dtype."""
        y = self.rotate(x.transpose(1, 2), *self.cos_sin(x.shape[-2], offset, positions, x.device))
        return y.transpose(1, 2)
