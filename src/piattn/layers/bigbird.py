"""`BigBirdAttention`: blocked sliding + global + random attention (Zaheer et al. 2020), in O(T·block·(3+g+r))."""

from __future__ import annotations

import torch

from ..caching import untainted
from ..config import ModelConfig
from ..masks.bigbird import check_bigbird, check_block, random_blocks
from ..masks.local import check_window
from .base import AttentionLayer
from .sparse import global_rows_then_gathered


def bigbird_candidates(n: int, block: int, window_blocks: int, n_global: int, n_random: int, causal: bool,
                       seed: int, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """index long [ceil(n / block), M], one row per query block, and valid bool [n, M], one row per query.

    M = block·(S + n_global + n_random) with S = 2·window_blocks + 1 sliding blocks (causal:
    window_blocks + 1): the tokens of the block's sliding blocks, of the global blocks and of its row of
    `random_blocks`, in that order. Out-of-range tokens, missing random blocks and (causal) tokens after
    the query are invalid; a global block that is also sliding appears twice and is counted once by
    `gathered_attention`.
    """
    n_blocks = -(-n // block)
    query_block = torch.arange(n_blocks, device=device)[:, None]
    within = torch.arange(block, device=device)
    sliding = query_block + torch.arange(-window_blocks, 1 if causal else window_blocks + 1, device=device)
    random = random_blocks(n_blocks, window_blocks=window_blocks, n_global=n_global, n_random=n_random,
                           causal=causal, seed=seed).to(device)
    global_keys = torch.arange(n_global * block, device=device).expand(n_blocks, n_global * block)

    def tokens(blocks):  # [n_blocks, K] block numbers -> [n_blocks, K·block] token positions
        return (blocks[..., None] * block + within).flatten(1)

    # a missing random block (-1) becomes tokens -block … -1, which the range check below drops
    index = torch.cat([tokens(sliding), global_keys, tokens(random)], dim=1)
    query = torch.arange(n, device=device)[:, None]
    per_query = index.repeat_interleave(block, dim=0)[:n]
    valid = (per_query >= 0) & (per_query < n)
    return index, valid & (per_query <= query) if causal else valid


def blocks_covering(window: int, block: int) -> int:
    """The fewest whole blocks of `block` tokens that span `window` tokens: ceil(window / block)."""
    check_window(window)
    check_block(block)
    return -(-window // block)


class BigBirdAttention(AttentionLayer):
    """Blocked BigBird: each query block sees its sliding blocks, n_global global blocks and n_random fixed
    random blocks; a query in a global block sees every key. See `masks.bigbird` for the exact rule.

    n_global counts BLOCKS (the first n_global·block tokens are global), as in the paper's blocked
    implementation. window_blocks is the sliding radius in blocks (1: the paper's 3 sliding blocks). The
    random table is drawn once from `seed` and identical in training and evaluation. Each non-global query
    block gathers its block·(sliding + n_global + n_random) candidate keys once for all its queries
    (`gathered_attention` with group = block); global queries run dense SDPA. Memory O(T·block·(3 +
    n_global + n_random)) for the scores and O(T·(3 + n_global + n_random)·D) for the gathered k/v, no
    [T, T] tensor.
    """

    # `config_kwargs` turns window and sparse_block into window_blocks and block, so they are listed here.
    declared_settings = frozenset({"window", "sparse_block", "n_global", "n_random"})

    def __init__(self, d_model: int, n_heads: int, *, block: int = 16, n_global: int = 1, n_random: int = 2,
                 causal: bool = True, dropout: float = 0.0, rotary: bool = False, rope_base: float = 10000.0,
                 seed: int = 0, window_blocks: int = 1):
        super().__init__(d_model, n_heads, causal=causal, dropout=dropout, rotary=rotary, rope_base=rope_base)
        check_block(block)
        check_bigbird(window_blocks, n_global, n_random, seed)
        self.block, self.window_blocks, self.n_global, self.n_random, self.seed = (
            block, window_blocks, n_global, n_random, seed)
        self._candidates: tuple[tuple, tuple[torch.Tensor, torch.Tensor]] | None = None

    @classmethod
    def config_kwargs(cls, cfg: ModelConfig, layer: int) -> dict:
        """block = sparse_block, n_global (blocks), n_random, and window_blocks = ceil(window / sparse_block):
        the sliding part always covers the config's `window` tokens on each side (defaults 4 and 16 give
        the paper's 3 sliding blocks). Each layer draws its own random blocks (seed = layer index)."""
        return dict(block=cfg.sparse_block, n_global=cfg.n_global, n_random=cfg.n_random,
                    window_blocks=blocks_covering(cfg.window, cfg.sparse_block), seed=layer)

    def candidate_keys(self, n: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """(index [ceil(n / block), M], valid [n, M]) of `bigbird_candidates`, kept for the last (n, device)."""
        key = (n, torch.device(device))
        if self._candidates is None or self._candidates[0] != key:
            self._candidates = key, untainted(bigbird_candidates)(n, self.block, self.window_blocks, self.n_global,
                                                       self.n_random, self.causal, self.seed, key[1])
        return self._candidates[1]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """q, k, v [B, H, T, D] -> [B, H, T, D]."""
        index, valid = self.candidate_keys(q.shape[2], q.device)
        return global_rows_then_gathered(q, k, v, self.n_global * self.block, index, valid, causal=self.causal,
                                         group=self.block, dropout_p=self.attention_dropout)
