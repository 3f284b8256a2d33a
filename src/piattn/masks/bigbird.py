"""BigBird attention (Zaheer et al. 2020, "Big Bird: Transformers for Longer Sequences") as a mask_mod.

The blocked form of the paper (BigBird-ITC, App. D): the sequence is cut into blocks of `block` tokens and
query block b sees
- the sliding blocks b - window_blocks … b + window_blocks (causal: b - window_blocks … b); the paper's
  sliding part is 3 blocks, window_blocks = 1;
- the first n_global blocks (global BLOCKS, not tokens, as in the paper's blocked implementation), in both
  directions: every query sees the global blocks and a query in a global block sees every key;
- n_random random key blocks, drawn once from a fixed seed (`random_blocks`) among the blocks that are
  neither sliding nor global; causal mode draws only from blocks before the sliding ones.
Causal mode additionally requires kv <= q token by token. The random table is fixed for the layer, so
training and evaluation use the same graph, and a causal row depends on its block index only, never on the
sequence length, so a prefix keeps its graph when the sequence grows.
"""

from __future__ import annotations

import random

import torch

from ..checks import is_int
from .local import MaskMod
from .longformer import check_count


def check_block(block: int) -> None:
    if not is_int(block) or block < 1:
        raise ValueError(f"block must be an integer >= 1, got {block!r}")


def check_bigbird(window_blocks: int, n_global: int, n_random: int, seed: int) -> None:
    """ValueError naming the first argument outside its allowed values."""
    check_count("window_blocks", window_blocks)
    check_count("n_global", n_global)
    check_count("n_random", n_random)
    if not is_int(seed):
        raise ValueError(f"seed must be an integer, got {seed!r}")


def _sample_distinct(rng: random.Random, population: int, k: int) -> list[int]:
    """k distinct integers from range(population) in O(k) steps (Floyd's algorithm), sorted."""
    chosen: set[int] = set()
    for top in range(population - k, population):
        pick = rng.randrange(top + 1)
        chosen.add(top if pick in chosen else pick)
    return sorted(chosen)


def random_blocks(n_blocks: int, *, window_blocks: int = 1, n_global: int = 1, n_random: int = 2,
                  causal: bool = True, seed: int = 0) -> torch.Tensor:
    """long [n_blocks, n_random]: the random key blocks of each query block, -1 where fewer are available.

    Candidates of query block b: blocks n_global … end-1 minus the sliding blocks, where end = b -
    window_blocks (causal: strictly before the sliding part) or n_blocks (bidirectional). Row b is drawn
    from its own generator seeded by (seed, b), so in causal mode (where its candidates depend on b only)
    it does not depend on the number of rows.
    """
    check_count("n_blocks", n_blocks)
    check_bigbird(window_blocks, n_global, n_random, seed)
    rows = []
    for b in range(n_blocks):
        end = b - window_blocks if causal else n_blocks
        # the sliding blocks form a gap [gap_lo, gap_hi] inside [n_global, end) that the draw skips over
        gap_lo, gap_hi = max(b - window_blocks, n_global), min(b + window_blocks, end - 1)
        gap = max(0, gap_hi - gap_lo + 1)
        population = max(0, end - n_global - gap)
        rng = random.Random(f"bigbird:{seed}:{b}")  # str seeds hash deterministically (sha512), run to run
        picks = [n_global + t for t in _sample_distinct(rng, population, min(n_random, population))]
        row = [p + gap if p >= gap_lo else p for p in picks]
        rows.append(row + [-1] * (n_random - len(row)))
    return torch.tensor(rows, dtype=torch.long).view(n_blocks, n_random)


def bigbird_mask(n: int, block: int, *, window_blocks: int = 1, n_global: int = 1, n_random: int = 2,
                 causal: bool = True, seed: int = 0, device: torch.device | str | None = None) -> MaskMod:
    """mask_mod(b, h, q_idx, kv_idx) -> bool for sequences of up to n tokens (n sizes the random table).

    The random part indexes the precomputed [n_blocks, n_random] table with q_idx // block and compares
    each of its n_random columns (a Python-unrolled loop) with kv_idx // block, so the mask stays
    elementwise for FlexAttention. `device` is where the table lives: the device of the index tensors.
    """
    check_count("n", n)
    check_block(block)
    check_bigbird(window_blocks, n_global, n_random, seed)
    n_blocks = -(-n // block)
    table = random_blocks(n_blocks, window_blocks=window_blocks, n_global=n_global, n_random=n_random,
                          causal=causal, seed=seed).to(device)
    last_block = max(n_blocks - 1, 0)

    def mask_mod(b, h, q_idx, kv_idx):
        q_block, kv_block = q_idx // block, kv_idx // block
        lag = q_block - kv_block
        sliding = (lag >= 0) & (lag <= window_blocks) if causal else lag.abs() <= window_blocks
        allowed = sliding | (kv_block < n_global) | (q_block < n_global)
        # clamp: a kernel may evaluate padding positions past n, whose result it discards anyway
        rows = q_block.clamp(max=last_block)
        for r in range(n_random if n_blocks else 0):
            allowed = allowed | (table[rows, r] == kv_block)
        return allowed & (kv_idx <= q_idx) if causal else allowed

    mask_mod.__name__ = (f"bigbird_b{block}_w{window_blocks}_g{n_global}_r{n_random}_s{seed}_"
                         f"{'causal' if causal else 'bidirectional'}")
    return mask_mod
