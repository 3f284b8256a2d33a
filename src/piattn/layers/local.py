"""`LocalAttention`: sliding-window attention, the paper's LocalWindow baseline (Eq. Nr)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..analysis.copy_distance import Reach, local_reach
from ..analysis.cost import mean_keys
from ..analysis.reachability import step_mask
from ..config import PI_DEFAULTS, ModelConfig, PiSettings
from ..masks.local import check_window
from .windowed import WindowedAttention


class LocalAttention(WindowedAttention):
    """Query i attends to keys i-window … i (causal) or i-window … i+window, nothing else.

    This is π-Attention with the skip folded into the window (period = window, see `Pattern`) and no
    prior ("union"), so it runs on the same O(T·window) operator backends, exactly, with no kernel of its
    own: its `settings` say so. Needs window >= 1 (window 0 would leave the fold a skip at distance 1).
    Runs sequence-parallel like `PiAttention` (`piattn.layers.sharding`). With `sinks` > 0 every query
    also sees the first `sinks` keys of its document (sliding window with attention sinks); `n_kv_heads`
    < n_heads is grouped-query attention, and `document_ids` keep each packed document to itself, all in
    the operator.
    """

    def __init__(self, d_model: int, n_heads: int, *, n_kv_heads: int | None = None,
                 window: int = PI_DEFAULTS.window, causal: bool = True, dropout: float = 0.0,
                 rotary: bool = False, rope_base: float = 10000.0,
                 logit_clamp: float | None = PI_DEFAULTS.logit_clamp, sinks: int = PI_DEFAULTS.sinks,
                 backend: str = "auto"):
        check_window(window)
        if window < 1:
            raise ValueError(f"window must be >= 1 for local attention, got {window}")
        # PiSettings checks logit_clamp and sinks; local attention is its union variant with period = window.
        settings = PiSettings(window=window, period=window, variant="union", logit_clamp=logit_clamp, sinks=sinks)
        super().__init__(d_model, n_heads, settings, n_kv_heads=n_kv_heads, causal=causal, dropout=dropout,
                         rotary=rotary, rope_base=rope_base, backend=backend)

    @classmethod
    def config_kwargs(cls, cfg: ModelConfig, layer: int) -> dict:
        return dict(window=cfg.window, logit_clamp=cfg.logit_clamp, sinks=cfg.sinks, backend=cfg.backend)

    @classmethod
    def lag_reach(cls, model: Mapping[str, Any], max_lag: int) -> Reach:
        """Lags 0 … window·n_layer: one hop of 0 … window a layer (the model's period is not read)."""
        return local_reach(model.get("window"), model["n_layer"], max_lag)

    @classmethod
    def keys_per_query(cls, model: Mapping[str, Any], n: int, causal: bool = True) -> float:
        """The window's keys (and the sinks), counted on the pattern's mask: window + 1 (2·window + 1) inside."""
        return mean_keys(step_mask(n, model.get("window"), None, causal, model.get("sinks") or 0))
