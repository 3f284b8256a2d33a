"""Incremental decoding through the caches equals the full forward, and windowed caches stay constant."""

import pytest
import torch

from piattn.config.pi import VARIANTS
from piattn.decoding import RingCache
from piattn.models import GPT, GPTConfig
from utils import tiny_model


@pytest.mark.parametrize("variant", VARIANTS)
def test_one_token_at_a_time_equals_full_forward_over_ten_periods(variant):
    model = tiny_model("pi", variant)
    period = model.config.period
    idx = torch.randint(0, 50, (2, 10 * period + 3), generator=torch.Generator().manual_seed(1))
    full = model(idx)
    cache = model.init_cache(2)
    steps = [model(idx[:, t:t + 1], cache) for t in range(idx.shape[1])]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-5)


@pytest.mark.parametrize("attention", ["pi", "local", "dense"])
def test_uneven_chunks_equal_full_forward(attention):
    model = tiny_model(attention)
    idx = torch.randint(0, 50, (3, 61), generator=torch.Generator().manual_seed(2))
    cache = model.init_cache(3)
    bounds = [0, 5, 6, 30, 31, 32, 61]  # a prompt, single tokens, a chunk longer than the ring
    pieces = [model(idx[:, a:b], cache) for a, b in zip(bounds, bounds[1:], strict=False)]
    torch.testing.assert_close(torch.cat(pieces, 1), model(idx), rtol=0, atol=1e-5)
    assert cache.position == 61


def test_windowed_cache_bytes_do_not_grow_dense_ones_do():
    pi, dense = tiny_model("pi"), tiny_model("dense")
    pi_cache, dense_cache = pi.init_cache(1), dense.init_cache(1)
    chunk = torch.randint(0, 50, (1, 1000), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        pi(chunk[:, :100], pi_cache)
        dense(chunk[:, :100], dense_cache)
        at_100, dense_at_100 = pi_cache.nbytes, dense_cache.nbytes
        for _ in range(100):  # 100 + 100·1000 positions
            pi(chunk, pi_cache)
        dense(chunk, dense_cache)
    assert pi_cache.position == 100_100
    assert pi_cache.nbytes == at_100
    # ring of max(window, period) + 1 = 9 positions, 2 layers, k and v, fp32, and each ring's slot table
    # (2 · 9 int64)
    assert at_100 == 2 * (2 * (1 * 2 * 9 * 16) * 4 + 2 * 9 * 8)
    assert dense_cache.nbytes == dense_at_100 * 11


def test_ring_cache_returns_the_last_positions_in_order():
    ring = RingCache(1, 1, 1, capacity=4)
    ring.append(torch.arange(3.0).view(1, 1, 3, 1), torch.zeros(1, 1, 3, 1))
    assert ring.recent()[0].flatten().tolist() == [0, 1, 2]
    ring.append(torch.arange(3.0, 9.0).view(1, 1, 6, 1), torch.zeros(1, 1, 6, 1))
    assert ring.recent()[0].flatten().tolist() == [5, 6, 7, 8]
    assert ring.seen == 9


def test_kinds_without_decoding_say_which_have_it():
    from piattn.layers import PiAttention

    layer = PiAttention(16, 2, causal=False)
    with pytest.raises(ValueError, match="causal"):
        layer.init_cache(1)


def _pi_model(period: int, sinks: int = 0) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.from_name("tiny", attention="pi", vocab_size=50, n_layer=2, d_model=32, n_head=2, window=3,
                                   period=period, sinks=sinks, dropout=0.0, block_size=64)).eval()


@pytest.mark.parametrize("period, sinks", [(10**9, 0), (40, 2), (8, 0)])
def test_max_positions_caps_the_ring_and_decodes_the_same(period, sinks):
    """A ring capped at the positions it will hold (prompt + new tokens) decodes what the uncapped model
    computes in one forward, token by token; a period of 10^9 costs a ring of that many positions, not 10^9
    (before, `generate` died allocating 256 GB)."""
    model = _pi_model(period, sinks)
    idx = torch.randint(0, 50, (2, 30), generator=torch.Generator().manual_seed(1))
    full = model(idx)
    cache = model.init_cache(2, max_positions=30)
    steps = [model(idx[:, :12], cache)] + [model(idx[:, t:t + 1], cache) for t in range(12, 30)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    assert all(layer.capacity == min(30, max(3, period) + 1) for layer in cache.layers)
    with pytest.raises(ValueError, match="at most 30 positions"):
        model(idx[:, :1], cache)


def test_generate_sizes_the_ring_by_the_text():
    model = _pi_model(10**9)
    out = model.generate(torch.zeros(1, 5, dtype=torch.long), 7, seed=0)
    assert out.shape == (1, 12)


def test_a_capped_ring_is_refused_where_it_could_overwrite():
    """A ring shorter than the layer's reach serves it only when it holds every position it will get."""
    cache = RingCache(1, 1, 4, 10, max_positions=10)
    cache.check(batch_size=1, n_heads=1, head_dim=4, capacity=100, sinks=0)
    short = RingCache(1, 1, 4, 10, max_positions=11)
    with pytest.raises(ValueError, match="needs at least 100 positions"):
        short.check(batch_size=1, n_heads=1, head_dim=4, capacity=100, sinks=0)
    with pytest.raises(ValueError, match="max_positions must be an int >= 1"):
        RingCache(1, 1, 4, 10, max_positions=0)
