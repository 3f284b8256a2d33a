"""Longformer and BigBird mask_mods against cell-by-cell statements of their rules, and inside FlexAttention."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, create_mask, flex_attention

from piattn.masks import dense_mask, local_mask
from piattn.masks.bigbird import bigbird_mask, random_blocks
from piattn.masks.longformer import longformer_mask


def longformer_cells(n, window, n_global, causal):
    """The rule of Beltagy et al. read one (query, key) pair at a time."""
    def allowed(i, j):
        if causal and j > i:
            return False
        return abs(i - j) <= window or i < n_global or j < n_global
    return torch.tensor([[allowed(i, j) for j in range(n)] for i in range(n)], dtype=torch.bool).view(n, n)


def bigbird_cells(n, block, window_blocks, n_global, n_random, causal, seed):
    """The blocked rule of Zaheer et al. read one pair at a time, random blocks from `random_blocks`."""
    table = random_blocks(-(-n // block), window_blocks=window_blocks, n_global=n_global, n_random=n_random,
                          causal=causal, seed=seed).tolist()

    def allowed(i, j):
        qb, kb = i // block, j // block
        if causal and j > i:
            return False
        return abs(qb - kb) <= window_blocks or qb < n_global or kb < n_global or kb in table[qb]
    return torch.tensor([[allowed(i, j) for j in range(n)] for i in range(n)], dtype=torch.bool).view(n, n)


@pytest.mark.parametrize("n,window,n_global,causal",
                         list(itertools.product([0, 1, 7, 30], [0, 2, 9], [0, 1, 3], [True, False])))
def test_longformer_matches_rule(n, window, n_global, causal):
    assert torch.equal(dense_mask(longformer_mask(window, n_global, causal), n),
                       longformer_cells(n, window, n_global, causal))


@pytest.mark.parametrize("n,block,window_blocks,n_global,n_random,causal", [
    (1, 4, 1, 1, 2, True), (5, 8, 1, 1, 2, False), (23, 4, 1, 1, 2, True), (23, 4, 1, 1, 2, False),
    (40, 3, 2, 0, 1, True), (40, 3, 0, 2, 3, False), (37, 5, 1, 1, 0, True), (64, 4, 1, 2, 4, False),
])
def test_bigbird_matches_rule(n, block, window_blocks, n_global, n_random, causal):
    mod = bigbird_mask(n, block, window_blocks=window_blocks, n_global=n_global, n_random=n_random,
                       causal=causal, seed=3)
    assert torch.equal(dense_mask(mod, n), bigbird_cells(n, block, window_blocks, n_global, n_random, causal, 3))


def test_longformer_hand_checked_cells():
    causal = dense_mask(longformer_mask(2, 2, True), 12)
    assert causal[0].tolist() == [True] + [False] * 11
    assert causal[1].tolist() == [True, True] + [False] * 10
    assert torch.nonzero(causal[7]).flatten().tolist() == [0, 1, 5, 6, 7]
    bidir = dense_mask(longformer_mask(2, 2, False), 12)
    assert bidir[0].all() and bidir[1].all() and bidir[:, 0].all() and bidir[:, 1].all()
    assert torch.nonzero(bidir[7]).flatten().tolist() == [0, 1, 5, 6, 7, 8, 9]


def test_bigbird_hand_checked_cells():
    # blocks of 4, no random blocks: block 0 is global, sliding radius 1 block
    causal = dense_mask(bigbird_mask(24, 4, n_global=1, n_random=0, causal=True), 24)
    assert torch.nonzero(causal[10]).flatten().tolist() == list(range(11))  # blocks 0 (global), 1, 2
    assert torch.nonzero(causal[21]).flatten().tolist() == [0, 1, 2, 3] + list(range(16, 22))
    assert torch.nonzero(causal[3]).flatten().tolist() == [0, 1, 2, 3]
    bidir = dense_mask(bigbird_mask(24, 4, n_global=1, n_random=0, causal=False), 24)
    assert bidir[:4].all() and bidir[:, :4].all()
    assert torch.nonzero(bidir[13]).flatten().tolist() == [0, 1, 2, 3] + list(range(8, 20))


@pytest.mark.parametrize("causal", [True, False])
def test_bigbird_covers_the_local_window_it_was_sized_for(causal):
    window, block = 5, 4
    mod = bigbird_mask(50, block, window_blocks=-(-window // block), n_global=0, n_random=0, causal=causal)
    assert (dense_mask(local_mask(window, causal), 50) <= dense_mask(mod, 50)).all()


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window_blocks,n_global,n_random", [(1, 1, 2), (0, 0, 3), (2, 2, 1), (1, 0, 7)])
def test_random_blocks_are_distinct_and_outside_sliding_and_global(causal, window_blocks, n_global, n_random):
    n_blocks = 20
    table = random_blocks(n_blocks, window_blocks=window_blocks, n_global=n_global, n_random=n_random,
                          causal=causal, seed=5)
    assert table.shape == (n_blocks, n_random) and table.dtype == torch.long
    for b, row in enumerate(table.tolist()):
        drawn = [r for r in row if r >= 0]
        assert row == drawn + [-1] * (n_random - len(drawn)), "padding -1 only at the end"
        end = b - window_blocks if causal else n_blocks
        available = [c for c in range(n_global, end) if abs(c - b) > window_blocks]
        assert len(set(drawn)) == len(drawn) == min(n_random, len(available))
        assert set(drawn) <= set(available)
        if causal:
            assert all(r < b - window_blocks for r in drawn), "causal: only blocks before the sliding ones"


def test_random_blocks_are_deterministic_per_seed():
    kwargs = dict(window_blocks=1, n_global=1, n_random=2, causal=False)
    assert torch.equal(random_blocks(30, seed=7, **kwargs), random_blocks(30, seed=7, **kwargs))
    assert not torch.equal(random_blocks(30, seed=7, **kwargs), random_blocks(30, seed=8, **kwargs))
    # the same seed gives the same mask, a different one another
    n = 60
    assert torch.equal(dense_mask(bigbird_mask(n, 2, seed=1), n), dense_mask(bigbird_mask(n, 2, seed=1), n))
    assert not torch.equal(dense_mask(bigbird_mask(n, 2, seed=1), n), dense_mask(bigbird_mask(n, 2, seed=2), n))


def test_causal_random_rows_do_not_depend_on_sequence_length():
    short, long = random_blocks(12, seed=4), random_blocks(40, seed=4)
    assert torch.equal(short, long[:12])
    prefix = dense_mask(bigbird_mask(160, 4, seed=4), 160)[:45, :45]
    assert torch.equal(dense_mask(bigbird_mask(45, 4, seed=4), 45), prefix)


def test_names_and_broadcasting():
    assert longformer_mask(3, 1, True).__name__ == "longformer_w3_g1_causal"
    assert bigbird_mask(64, 16, causal=False).__name__ == "bigbird_b16_w1_g1_r2_s0_bidirectional"
    for mod, n in ((longformer_mask(2, 1), 9), (bigbird_mask(9, 2, n_random=1), 9)):
        q, kv = torch.arange(n).view(1, 1, n, 1), torch.arange(n).view(1, 1, 1, n)
        out = mod(torch.zeros(2, 1, 1, 1, dtype=torch.long), torch.zeros(1, 3, 1, 1, dtype=torch.long), q, kv)
        assert out.dtype == torch.bool and torch.broadcast_shapes(out.shape, (2, 3, n, n)) == (2, 3, n, n)
        assert torch.equal(torch.broadcast_to(out, (2, 3, n, n))[1, 2], dense_mask(mod, n))


@pytest.mark.parametrize("call,name", [
    (lambda: longformer_mask(-1, 1), "window"), (lambda: longformer_mask(2, -1), "n_global"),
    (lambda: longformer_mask(2, 1.5), "n_global"), (lambda: bigbird_mask(10, 0), "block"),
    (lambda: bigbird_mask(10, 2.0), "block"), (lambda: bigbird_mask(-1, 4), "n"),
    (lambda: bigbird_mask(10, 4, window_blocks=-1), "window_blocks"),
    (lambda: bigbird_mask(10, 4, n_global=True), "n_global"), (lambda: bigbird_mask(10, 4, n_random=-2), "n_random"),
    (lambda: bigbird_mask(10, 4, seed="x"), "seed"), (lambda: random_blocks(-3), "n_blocks"),
])
def test_bad_arguments_name_themselves(call, name):
    with pytest.raises(ValueError, match=rf"^{name} must"):
        call()


def masked_softmax_attention(q, k, v, allowed):
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kind", ["longformer", "bigbird"])
def test_flex_attention_eager(kind, causal):
    """vmap (create_mask, create_block_mask) and the eager flex_attention accept the mask_mods."""
    n = 40  # not a multiple of FlexAttention's block size, so padding positions reach the mask_mod
    if kind == "longformer":
        mod, allowed = longformer_mask(3, 2, causal), longformer_cells(n, 3, 2, causal)
    else:
        mod, allowed = bigbird_mask(n, 4, n_random=2, causal=causal, seed=1), bigbird_cells(n, 4, 1, 1, 2, causal, 1)
    assert torch.equal(create_mask(mod, 1, 1, n, n, device="cpu")[0, 0], allowed)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 8, generator=g) for _ in range(3))
    block_mask = create_block_mask(mod, 1, 1, n, n, device="cpu", BLOCK_SIZE=16)
    y = flex_attention(q, k, v, block_mask=block_mask)
    torch.testing.assert_close(y, masked_softmax_attention(q, k, v, allowed))
