"""Hybrid stacks (`ModelConfig.layers`): a kind per layer, NoPE on the dense layers, the designer over the π
layers, the reach of a hybrid, and cached decoding with a cache per layer sized for its kind."""

from __future__ import annotations

import pytest
import torch

from piattn.analysis.multiscale import schedule
from piattn.config import GPTConfig
from piattn.config.model import global_every_pattern, parse_layers
from piattn.decoding.cache import GrowingCache, RingCache
from piattn.layers import DenseAttention, LocalAttention, PiAttention, model_reach
from piattn.models import GPT

SMALL = dict(n_head=2, d_model=32, d_ff=64, block_size=64, vocab_size=40, window=2, period=5, dropout=0.0)


def test_pattern_repeats_over_depth():
    assert parse_layers("pi*3,dense", 8) == ("pi", "pi", "pi", "dense") * 2
    assert parse_layers(" local , dense ", 2) == ("local", "dense")
    assert global_every_pattern(4, "pi") == "pi*3,dense"
    assert global_every_pattern(1, "local") == "dense"
    assert GPTConfig(n_layer=3, **SMALL).layer_kinds() == ("pi",) * 3  # no pattern: `attention` everywhere


@pytest.mark.parametrize("pattern, words", [("", "pattern of attention kinds"), ("pi,,dense", "each item"),
                                            ("pi*0", "each item"), ("pi*x", "each item"),
                                            ("pi*2,dense", "must divide n_layer (4)")])
def test_bad_patterns_are_refused(pattern, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        GPTConfig(n_layer=4, layers=pattern, **SMALL)


def test_unknown_kind_is_refused_when_built():
    with pytest.raises(ValueError, match="attention must be one of"):
        GPT(GPTConfig(n_layer=2, layers="pi,global", **SMALL))


def test_blocks_take_their_layers_kinds():
    model = GPT(GPTConfig(n_layer=4, layers="pi,local,dense,pi", **SMALL))
    assert [type(b.attn) for b in model.blocks] == [PiAttention, LocalAttention, DenseAttention, PiAttention]
    assert GPTConfig(n_layer=4, layers="pi,local,dense,pi", **SMALL).is_hybrid()


@pytest.mark.parametrize("pattern", ["pi,pi,dense", "local,dense,pi"])
def test_each_layer_computes_what_a_one_kind_model_of_its_kind_computes(pattern):
    """The per-layer oracle: block i of the hybrid, its weights loaded into block i of a model of one kind (layer
    i's), gives the same output on the same input."""
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=3, layers=pattern, **SMALL)
    hybrid = GPT(cfg).eval()
    x = torch.randn(2, 20, cfg.d_model)
    for i, kind in enumerate(cfg.layer_kinds()):
        alone = GPT(GPTConfig(n_layer=3, attention=kind, **SMALL)).eval()
        alone.blocks[i].load_state_dict(hybrid.blocks[i].state_dict())
        torch.testing.assert_close(hybrid.blocks[i](x), alone.blocks[i](x), rtol=0, atol=0)


def test_nope_drops_rotary_on_the_dense_layers_only():
    cfg = GPTConfig(n_layer=2, layers="pi,dense", nope_global=True, **SMALL)
    pi, dense = (b.attn for b in GPT(cfg).eval().blocks)
    assert pi.rotary is not None and dense.rotary is None
    assert GPT(GPTConfig(n_layer=2, layers="pi,dense", **SMALL)).blocks[1].attn.rotary is not None
    # Without RoPE a dense layer sees no position: its heads do not change when the positions shift.
    x = torch.randn(1, 6, cfg.d_model)
    for layer, moves in ((dense, False), (pi, True)):
        q0, k0, _ = layer.heads(x, offset=0)
        q1, k1, _ = layer.heads(x, offset=7)
        assert (not torch.allclose(q0, q1)) == moves and (not torch.allclose(k0, k1)) == moves


def test_cover_is_designed_over_the_pi_layers():
    cfg = GPTConfig(n_layer=4, layers="pi,dense", **{**SMALL, "period": "cover:40"})
    designed = [list(h) for h in schedule("cover", 2, 2, 2, target=40)]
    assert [cfg.period[0], cfg.period[2]] == designed  # the π layers take the two-layer design, in order
    assert GPTConfig.from_dict(cfg.to_dict()).period == cfg.period  # stored resolved: rebuilt as is


def test_a_dense_layer_makes_every_lag_reachable():
    model = dict(n_layer=2, n_head=2, window=2, period=5, attention="pi", layers=None)
    assert not bool(model_reach(model, 40).reachable.all())
    hybrid = model_reach({**model, "layers": "pi,dense"}, 40)
    assert bool(hybrid.reachable.all())
    local = model_reach({**model, "layers": "local,local"}, 10)  # one-layer reaches summed: lags 0 … 4
    assert local.reachable.tolist() == [True] * 5 + [False] * 6
    # a hybrid without dense layers: the sum set of its layers' hops, as the one-kind analysis counts them
    mixed = model_reach({**model, "layers": "pi,local"}, 20).reachable
    assert mixed.nonzero().flatten().tolist() == sorted({a + b for a in (0, 1, 2, 5) for b in (0, 1, 2)})


@pytest.mark.parametrize("pattern, nope", [("pi,pi,dense", False), ("local,dense", True)])
@pytest.mark.parametrize("prompt, max_positions", [(1, None), (5, None), (3, 24)])
def test_hybrid_decoding_is_exact_at_every_position(pattern, nope, prompt, max_positions):
    torch.manual_seed(1)
    n_layer = len(pattern.split(","))
    cfg = GPTConfig(n_layer=n_layer, layers=pattern, nope_global=nope, **{**SMALL, "sinks": 0})
    model = GPT(cfg).eval()
    idx = torch.randint(0, cfg.vocab_size, (2, 24))
    with torch.no_grad():
        full = model(idx)
        cache = model.init_cache(2, max_positions=max_positions)
        kinds = [type(layer) for layer in cache.layers]
        assert kinds == [GrowingCache if k == "dense" else RingCache for k in cfg.layer_kinds()]
        steps = [model(idx[:, :prompt], cache)]
        steps += [model(idx[:, t:t + 1], cache) for t in range(prompt, idx.shape[1])]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)
    sizes = cache.nbytes_by_layer
    assert sum(sizes) == cache.nbytes and len(sizes) == n_layer
    ring = [s for s, k in zip(sizes, cfg.layer_kinds(), strict=True) if k != "dense"]
    grown = [s for s, k in zip(sizes, cfg.layer_kinds(), strict=True) if k == "dense"]
    assert grown[0] == 2 * 2 * cfg.kv_heads * 24 * cfg.head_dim * 4  # k and v of all 24 positions, fp32
    assert all(s < grown[0] for s in ring)  # the rings hold a few positions
    held = "growing, 24 positions" if max_positions is None else "dense, 24 of 24 positions"
    assert "layer 0: ring" in cache.describe() and held in cache.describe()
    if max_positions is not None:  # allocated once: one position more is refused, not grown into
        with pytest.raises(ValueError, match="at most 24 positions"):
            model(idx[:, :1], cache)


def test_a_dense_cache_given_max_positions_is_allocated_once():
    cache = GrowingCache(1, 2, 4, max_positions=3)
    assert cache.nbytes == 2 * 2 * 3 * 4 * 4  # the whole buffer, from the start
    k = torch.randn(1, 2, 2, 4)
    cache.append(k, -k)
    torch.testing.assert_close(cache.recent()[0], k)
    torch.testing.assert_close(cache.recent()[1], -k)
    with pytest.raises(ValueError, match="at most 3 positions"):
        cache.append(k, k)
    assert cache.seen == 2


def test_eval_describes_a_hybrid_by_its_pattern():
    from piattn.commands.eval_report import describe_attention

    model = dict(attention="pi", layers="local,dense", n_layer=2, window=2, period=16, nope_global=True, sinks=0)
    assert describe_attention(model) == "layers local,dense, window 2, no RoPE on dense layers, 2 layers"
    assert "period 16" in describe_attention({**model, "layers": "pi,dense", "nope_global": False})


def test_the_encoder_stacks_a_hybrid_too():
    from piattn.config import EncoderConfig
    from piattn.models import Encoder

    cfg = EncoderConfig(n_layer=2, layers="local,dense", nope_global=True, **SMALL)
    model = Encoder(cfg).eval()
    assert [type(b.attn) for b in model.blocks] == [LocalAttention, DenseAttention]
    assert model(torch.randint(0, cfg.vocab_size, (2, 12))).shape == (2, 2)
