"""`LocalAttention`: sliding-window attention, the paper's LocalWindow baseline (Eq. Nr)."""

from __future__ import annotations

import torch

from ..config import PI_DEFAULTS, ModelConfig
from ..masks.local import check_window
from ..ops.pi.decode import decode_rows
from .base import AttentionLayer
from .sharding import pi_operator


class LocalAttention(AttentionLayer):
    """Query i attends to keys i-window … i (causal) or i-window … i+window, nothing else.

    This is π-Attention with the skip folded into the window (period = window, see `Pattern`) and no
    prior ("union"), so it runs on the same O(T·window) operator backends, exactly, with no kernel of its
    own. Needs window >= 1 (window 0 would leave the fold a skip at distance 1). Runs sequence-parallel
    like `PiAttention` (`piattn.layers.sharding`).
    """

    sequence_parallel = True

    def __init__(self, d_model: int, n_heads: int, *, window: int = PI_DEFAULTS.window, causal: bool = True,
                 dropout: float = 0.0, rotary: bool = False, rope_base: float = 10000.0,
                 logit_clamp: float | None = PI_DEFAULTS.logit_clamp, backend: str = "auto"):
        super().__init__(d_model, n_heads, causal=causal, dropout=dropout, rotary=rotary, rope_base=rope_base)
        check_window(window)
        if window < 1:
            raise ValueError(f"window must be >= 1 for local attention, got {window}")
        self.op_kwargs = dict(window=window, period=window, causal=causal, variant="union",
                              logit_clamp=logit_clamp, backend=backend)

    @classmethod
    def config_kwargs(cls, cfg: ModelConfig, layer: int) -> dict:
        return dict(window=cfg.window, logit_clamp=cfg.logit_clamp, backend=cfg.backend)

    def cache_capacity(self) -> int:
        if not self.causal:
            raise ValueError("incremental decoding needs causal attention")
        return self.op_kwargs["window"] + 1

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """q, k, v [B, H, T, D] -> [B, H, T, D]."""
        return pi_operator(q, k, v, dropout_p=self.attention_dropout, **self.op_kwargs)

    def attend_recent(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The last t rows of `attend` (causal, eval) from the t new rows' q and all N rows' k, v."""
        w = self.op_kwargs["window"]
        return decode_rows(q, k, v, None, window=w, period=w, variant="union", prior=PI_DEFAULTS.prior,
                           logit_clamp=self.op_kwargs["logit_clamp"], eps=PI_DEFAULTS.eps, scale=self.head_dim**-0.5)
