"""`LongformerAttention`: sliding window plus global tokens (Beltagy et al. 2020), in O(T·(window + globals))."""

from __future__ import annotations

import torch

from ..caching import untainted
from ..config import PI_DEFAULTS, ModelConfig
from ..masks.local import check_window
from ..masks.longformer import check_count
from .base import AttentionLayer
from .sparse import global_rows_then_gathered


def longformer_candidates(n: int, window: int, n_global: int, causal: bool,
                          device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """index long [n, M], valid bool [n, M] with M = window + 1 + n_global (bidirectional: 2·window + 1 +
    n_global): query i's window keys i - window … i (+ window), then the global keys 0 … n_global - 1.

    Out-of-range and (causal) future keys are invalid; a global key inside the window appears twice and
    is counted once by `gathered_attention`.
    """
    query = torch.arange(n, device=device)[:, None]
    offsets = torch.arange(-window, 1 if causal else window + 1, device=device)
    global_keys = torch.arange(n_global, device=device).expand(n, n_global)
    index = torch.cat([query + offsets, global_keys], dim=1)
    valid = (index >= 0) & (index < n)
    return index, valid & (index <= query) if causal else valid


class LongformerAttention(AttentionLayer):
    """Query i attends keys i-window … i (bidirectional: … i+window) and the first n_global tokens; those
    global tokens attend every key (causal: every key at or before them). See `masks.longformer`.

    Non-global queries gather their window + n_global candidate keys (`gathered_attention`); the n_global
    global queries run dense SDPA over all keys. Memory O(T·(window + n_global)), no [T, T] tensor.
    Unlike the paper, global tokens reuse the layer's q/k/v projections (no separate global projections),
    so the state dict is that of every other kind.
    """

    def __init__(self, d_model: int, n_heads: int, *, window: int = PI_DEFAULTS.window, n_global: int = 1,
                 causal: bool = True, dropout: float = 0.0, rotary: bool = False, rope_base: float = 10000.0):
        super().__init__(d_model, n_heads, causal=causal, dropout=dropout, rotary=rotary, rope_base=rope_base)
        check_window(window)
        check_count("n_global", n_global)
        self.window, self.n_global = window, n_global
        self._candidates: tuple[tuple, tuple[torch.Tensor, torch.Tensor]] | None = None

    @classmethod
    def config_kwargs(cls, cfg: ModelConfig, layer: int) -> dict:
        return dict(window=cfg.window, n_global=cfg.n_global)

    def candidate_keys(self, n: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """(index, valid) [n, M] of `longformer_candidates`, kept for the last (n, device) asked for."""
        key = (n, torch.device(device))
        if self._candidates is None or self._candidates[0] != key:
            self._candidates = key, untainted(longformer_candidates)(n, self.window, self.n_global, self.causal, key[1])
        return self._candidates[1]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """q, k, v [B, H, T, D] -> [B, H, T, D]."""
        index, valid = self.candidate_keys(q.shape[2], q.device)
        return global_rows_then_gathered(q, k, v, self.n_global, index, valid, causal=self.causal,
                                         dropout_p=self.attention_dropout)
