"""`LocalAttention`: sliding-window attention, the paper's LocalWindow baseline (Eq. Nr)."""

from __future__ import annotations

import torch

from ..config import PI_DEFAULTS, ModelConfig, PiSettings
from ..decoding.cache import RingCache
from ..masks.local import check_window
from ..ops.pi.decode import decode_ring, decode_rows
from .base import AttentionLayer
from .sharding import pi_operator


class LocalAttention(AttentionLayer):
    """Query i attends to keys i-window … i (causal) or i-window … i+window, nothing else.

    This is π-Attention with the skip folded into the window (period = window, see `Pattern`) and no
    prior ("union"), so it runs on the same O(T·window) operator backends, exactly, with no kernel of its
    own. Needs window >= 1 (window 0 would leave the fold a skip at distance 1). Runs sequence-parallel
    like `PiAttention` (`piattn.layers.sharding`). With `sinks` > 0 every query also sees the first `sinks`
    keys of its document (sliding window with attention sinks); `n_kv_heads` < n_heads is grouped-query
    attention, and `document_ids` keep each packed document to itself, all in the operator.
    """

    sequence_parallel = True
    ring_step = True
    grouped_query = True
    documents = True

    def __init__(self, d_model: int, n_heads: int, *, n_kv_heads: int | None = None,
                 window: int = PI_DEFAULTS.window, causal: bool = True, dropout: float = 0.0,
                 rotary: bool = False, rope_base: float = 10000.0,
                 logit_clamp: float | None = PI_DEFAULTS.logit_clamp, sinks: int = PI_DEFAULTS.sinks,
                 backend: str = "auto"):
        super().__init__(d_model, n_heads, n_kv_heads=n_kv_heads, causal=causal, dropout=dropout, rotary=rotary,
                         rope_base=rope_base)
        check_window(window)
        if window < 1:
            raise ValueError(f"window must be >= 1 for local attention, got {window}")
        # PiSettings checks logit_clamp and sinks; local attention is its union variant with period = window.
        settings = PiSettings(window=window, period=window, variant="union", logit_clamp=logit_clamp, sinks=sinks)
        self.op_kwargs = dict(window=window, period=window, causal=causal, variant="union",
                              logit_clamp=logit_clamp, sinks=sinks, backend=backend)
        self._decode_kwargs = dict(**settings.as_kwargs(), scale=self.head_dim**-0.5)

    @classmethod
    def config_kwargs(cls, cfg: ModelConfig, layer: int) -> dict:
        return dict(window=cfg.window, logit_clamp=cfg.logit_clamp, sinks=cfg.sinks, backend=cfg.backend)

    def cache_capacity(self) -> int:
        if not self.causal:
            raise ValueError("incremental decoding needs causal attention")
        return self.op_kwargs["window"] + 1

    def cache_sinks(self) -> int:
        return self.op_kwargs["sinks"]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor,
               document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, H, T, D], k, v [B, H_kv, T, D], document_ids [B, T] or None -> [B, H, T, D]."""
        return pi_operator(q, k, v, dropout_p=self.attention_dropout, document_ids=document_ids, **self.op_kwargs)

    def attend_recent(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The last t rows of `attend` (causal, eval) from the t new rows' q and all N rows' k, v."""
        return decode_rows(q, k, v, None, **self._decode_kwargs)

    def attend_ring(self, q: torch.Tensor, cache: RingCache, x: torch.Tensor) -> torch.Tensor:
        """One new query's output [B, H, 1, D] read from the ring `cache` that already holds its key."""
        return decode_ring(q, cache.kv, None, capacity=cache.capacity, position=cache.seen - 1,
                           **self._decode_kwargs)
