"""Cached decoding with sinks and grouped-query attention: the decode step against the full operator, cached
generation against the full forward, and a cache whose size does not grow."""

import pytest
import torch

from piattn.config.pi import VARIANTS
from piattn.decoding.cache import RingCache
from piattn.models import GPT, GPTConfig
from piattn.ops.pi import pi_attention
from piattn.ops.pi.decode import pi_decode


def _inputs(N, H, H_kv, seed):
    g = torch.Generator().manual_seed(seed)
    q = 3 * torch.randn(2, H, N, 8, generator=g, dtype=torch.float64)
    k = 3 * torch.randn(2, H_kv, N, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, H_kv, N, 8, generator=g, dtype=torch.float64)
    gate = 0.01 + 0.98 * torch.rand(2, H, N, generator=g, dtype=torch.float64)
    return q, k, v, gate


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("window,period,sinks,H_kv", [(2, 5, 2, 4), (2, 5, 3, 1), (3, 3, 1, 2), (1, 4, 6, 2)])
def test_decode_rows_with_sinks_and_grouped_query_equal_the_full_operator(variant, window, period, sinks, H_kv):
    kw = dict(window=window, period=period, variant=variant, prior=0.3, logit_clamp=4.0, eps=1e-4, sinks=sinks)
    gated = variant in ("separate", "adaptive")
    for t in (1, 3):
        # the sinks inside the window, at the skip, partly in the future of the text, and far behind
        for N in (t, t + 1, sinks + 1, period + 1, period + sinks + t + 4, 40):
            if t > N:
                continue
            q, k, v, gate = _inputs(N, 4, H_kv, seed=N + 100 * t)
            full = pi_attention(q, k, v, gate if gated else None, causal=True, **kw)[:, :, -t:]
            fast = pi_decode(q[:, :, -t:], k, v, gate[:, :, -t:] if gated else None, **kw)
            torch.testing.assert_close(fast, full, rtol=1e-12, atol=1e-12, msg=f"t={t} N={N}")


def test_the_sinks_change_the_decoded_rows():
    q, k, v, gate = _inputs(30, 4, 2, seed=0)
    kw = dict(window=2, period=5, variant="adaptive", logit_clamp=4.0)
    assert not torch.allclose(pi_decode(q[:, :, -1:], k, v, gate[:, :, -1:], sinks=2, **kw),
                              pi_decode(q[:, :, -1:], k, v, gate[:, :, -1:], **kw))


def test_pi_decode_refuses_key_heads_that_do_not_divide_the_query_heads():
    q, k, v, gate = _inputs(10, 4, 3, seed=0)
    with pytest.raises(ValueError, match="H_kv"):
        pi_decode(q[:, :, -1:], k, v, gate[:, :, -1:])


def _model(attention, **extra):
    cfg = GPTConfig.from_name("tiny", attention=attention, vocab_size=50, dropout=0.0, n_layer=2, d_model=32,
                              n_head=4, window=2, period=5, **extra)
    torch.manual_seed(0)
    return GPT(cfg).double().eval()


@pytest.mark.parametrize("attention,extra", [
    ("pi", dict(sinks=2)), ("pi", dict(n_kv_head=2)), ("pi", dict(sinks=3, n_kv_head=1, variant="separate")),
    ("pi", dict(sinks=1, variant="fixed", prior=0.3)), ("local", dict(sinks=2, n_kv_head=2)),
    ("dense", dict(n_kv_head=1)),
])
def test_cached_decoding_equals_the_full_forward(attention, extra):
    model = _model(attention, **extra)
    idx = torch.randint(0, 50, (2, 40), generator=torch.Generator().manual_seed(1))
    full = model(idx)
    # one prompt then single tokens (the decode step), and uneven chunks (the blocked path across the sinks)
    for chunks in ([7] + [1] * 33, [3, 27, 3, 7], [1] * 40):
        cache, outs, start = model.init_cache(2), [], 0
        for n in chunks:
            outs.append(model(idx[:, start:start + n], cache))
            start += n
        torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-10, atol=1e-10, msg=str(chunks))


@pytest.mark.parametrize("attention,extra", [("pi", dict(sinks=3, n_kv_head=2)), ("local", dict(sinks=2))])
def test_the_cache_stays_one_size(attention, extra):
    model = _model(attention, **extra)
    cache = model.init_cache(1)
    sizes = []
    for token in torch.randint(0, 50, (60,)):
        model(token.view(1, 1), cache)
        sizes.append(cache.nbytes)
    layer = cache.layers[0]
    capacity = 5 + 1 if attention == "pi" else 2 + 1
    assert set(sizes) == {sizes[0]}
    assert layer.k.shape == (1, model.config.kv_heads, extra["sinks"] + capacity, 8)


def test_ring_cache_keeps_the_sinks_and_reads_them_first():
    cache = RingCache(1, 1, 1, capacity=3, sinks=2, dtype=torch.float64)
    for p in range(9):
        cache.append(torch.full((1, 1, 1, 1), float(p)), torch.full((1, 1, 1, 1), float(p)))
    k, _ = cache.recent()
    assert k.flatten().tolist() == [0.0, 1.0, 6.0, 7.0, 8.0]
    cache = RingCache(1, 1, 1, capacity=3, sinks=2, dtype=torch.float64)
    cache.append(torch.arange(4.0).view(1, 1, 4, 1), torch.arange(4.0).view(1, 1, 4, 1))
    assert cache.recent()[0].flatten().tolist() == [0.0, 1.0, 2.0, 3.0]  # contiguous: no sink repeated
