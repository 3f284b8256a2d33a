"""GPT and Encoder: shapes, configs, tied weights, init, causality for every registered attention kind."""

import pytest
import torch

import piattn
from piattn.models import GPT, SIZES, Encoder, EncoderConfig, GPTConfig

KINDS = sorted(piattn.layers.ATTENTION)


def small_config(cls=GPTConfig, **overrides):
    base = dict(vocab_size=40, n_layer=2, d_model=32, n_head=2, window=2, period=5, dropout=0.0,
                sparse_block=4, n_global=1, n_random=1, bucket_size=4, image_width=6)
    return cls.from_name("tiny", **{**base, **overrides})


@pytest.mark.parametrize("attention", KINDS)
def test_no_future_leak_in_the_language_model(attention):
    torch.manual_seed(0)
    model = GPT(small_config(attention=attention)).eval()
    idx = torch.randint(0, 40, (2, 37))
    t = 23
    changed = idx.clone()
    changed[:, t] = (idx[:, t] + 1) % 40
    a, b = model(idx), model(changed)
    assert torch.equal(a[:, :t], b[:, :t]), f"{attention}: logits before position {t} moved"
    assert not torch.equal(a[:, t], b[:, t])


@pytest.mark.parametrize("attention", KINDS)
def test_encoder_sees_both_directions(attention):
    torch.manual_seed(0)
    model = Encoder(small_config(EncoderConfig, attention=attention, n_global=0 if attention != "local" else 1))
    model.eval()
    idx = torch.randint(1, 40, (2, 30))
    changed = idx.clone()
    changed[:, 29] = (idx[:, 29] % 39) + 1
    assert model(idx).shape == (2, 2)

    def states(tokens):
        x = model.embed(tokens)
        for block in model.blocks:
            x = block(x)
        return x

    # earlier positions can only react to the last token by looking forward
    assert not torch.equal(states(idx)[:, :29], states(changed)[:, :29]), attention


def test_named_sizes_match_the_paper_table():
    assert SIZES["small"] == dict(n_layer=12, n_head=12, d_model=768, d_ff=3072)
    assert SIZES["medium"] == dict(n_layer=24, n_head=16, d_model=1024, d_ff=4096)
    assert SIZES["large"] == dict(n_layer=32, n_head=20, d_model=1280, d_ff=5120)
    for name in ("small", "medium", "large"):
        assert GPTConfig.from_name(name).head_dim == 64


@pytest.mark.parametrize("name, millions", [("small", 124), ("medium", 353), ("large", 694)])
def test_dense_parameter_counts(name, millions):
    # 12·L·d² + V·d: the paper's Table app_model labels these 125M / 750M / 1.5B, but its own shapes give
    # 124M / 353M / 694M; only the Small label fits (README, "Errors in the paper").
    with torch.device("meta"):
        model = GPT(GPTConfig.from_name(name, attention="dense"))
    assert abs(model.num_params() / 1e6 - millions) / millions < 0.05


def test_tied_embeddings_and_init_std():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("tiny", vocab_size=256, attention="pi"))
    assert model.head.weight is model.embed.weight
    assert abs(model.embed.weight.std().item() - 0.02) < 0.002
    assert abs(model.blocks[0].ffn.fc.weight.std().item() - 0.02) < 0.002
    assert torch.count_nonzero(model.blocks[0].ffn.fc.bias) == 0


def test_gpt_interface_from_the_issue():
    cfg = GPTConfig.from_name("tiny", attention="pi", vocab_size=256, block_size=1024)
    model = GPT(cfg)
    idx = torch.randint(0, 256, (2, 64))
    assert model(idx).shape == (2, 64, 256)
    for field in ("n_layer", "n_head", "d_model", "block_size", "vocab_size", "attention", "window", "period",
                  "variant", "dropout"):
        assert hasattr(cfg, field)


@pytest.mark.parametrize("overrides, match", [
    (dict(d_model=30), "divisible"), (dict(n_layer=0), "n_layer"), (dict(dropout=1.0), "dropout"),
    (dict(colour="red"), "unknown GPTConfig fields"), (dict(window=-1), "window"), (dict(period=0), "period"),
    (dict(variant="mixed"), "variant"), (dict(prior=1.5), "prior"), (dict(gate_eps=0.7), "eps"),
])
def test_bad_configs_name_the_field(overrides, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig.from_name("tiny", **overrides)
    with pytest.raises(ValueError, match="config name"):
        GPTConfig.from_name("huge")


def test_unknown_attention_kind_is_named_when_the_model_is_built():
    with pytest.raises(ValueError, match=r"attention must be one of \['bigbird', 'dense'"):
        GPT(GPTConfig.from_name("tiny", attention="nope", vocab_size=10))


def test_encoder_mean_pool_ignores_padding_and_dual_head():
    torch.manual_seed(0)
    model = Encoder(small_config(EncoderConfig, attention="dense")).eval()
    x = torch.randint(1, 40, (1, 10))
    h = model.encode(x)
    # with dense attention, padding changes the attended set, so compare pooling directly on the states
    padded = torch.cat([x, torch.zeros(1, 5, dtype=torch.long)], 1)
    states = model.embed(padded)
    for block in model.blocks:
        states = block(states)
    states = model.ln_f(states)
    assert torch.allclose(model.encode(padded), states[:, :10].mean(1), atol=1e-6)
    assert h.shape == (1, 32)
    dual = Encoder(small_config(EncoderConfig, attention="pi", dual=True, num_classes=3))
    assert dual(torch.randint(1, 40, (4, 2, 12))).shape == (4, 3)
    with pytest.raises(ValueError, match=r"\[B, 2, T\]"):
        dual(torch.randint(1, 40, (4, 12)))


def test_random_patterns_differ_between_layers():
    """BigBird draws its random blocks and Reformer its hash rotations per layer, not once for all layers."""
    bigbird = GPT(small_config(attention="bigbird", sparse_block=2, n_random=2))
    tables = [block.attn.candidate_keys(64)[0] for block in bigbird.blocks]
    assert not torch.equal(tables[0], tables[1])
    reformer = GPT(small_config(attention="reformer"))
    keys = torch.nn.functional.normalize(torch.randn(1, 2, 64, 16), dim=-1)
    buckets = [block.attn.buckets(keys) for block in reformer.blocks]
    assert not torch.equal(buckets[0], buckets[1])
