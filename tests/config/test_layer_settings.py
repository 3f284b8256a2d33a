"""Per-layer settings inside a layer pattern ("local(window=16),local(window=64),dense"): the syntax and its
refusals, patterns without settings exactly as before, each layer built with its own window, sinks and period
(against a one-kind model of the same weights and attention by hand), the reach of such a stack against a
brute-force composition of its layers' masks, cached decoding, checkpoints and `piattn train --layers`."""

from __future__ import annotations

import pytest
import torch

import piattn
from piattn.analysis.multiscale import periods_per_layer, schedule
from piattn.cli import main
from piattn.config import GPTConfig, PiSettings
from piattn.config.model import (
    LayerItem,
    check_pattern_settings,
    layer_fields,
    layer_items,
    parse_layers,
    pattern_items,
    pattern_kinds,
)
from piattn.decoding.cache import GrowingCache, RingCache
from piattn.layers import DenseAttention, LocalAttention, PiAttention, kinds_with, model_reach
from piattn.masks import dense_mask
from piattn.masks.local import local_mask
from piattn.masks.pi import pi_mask
from piattn.models import GPT
from piattn.train.checkpoint import read_config
from utils import train_summary

# No logit clamp: the attention written out by hand below has none.
SMALL = dict(n_head=2, d_model=32, d_ff=64, block_size=64, vocab_size=40, window=2, period=5, dropout=0.0,
             logit_clamp=None)
KEYS = "window (an int >= 0), sinks (an int >= 0), period (an int >= 1)"


def test_items_carry_their_own_settings():
    local = LayerItem("local", {"window": 1024}, "local(window=1024)*5")
    assert pattern_items("local(window=1024)*5,dense") == (local,) * 5 + (LayerItem("dense", {}, "dense"),)
    pi = pattern_items("pi(window=64, period=128, sinks=4)*3,dense")
    assert [item.settings for item in pi] == [{"window": 64, "period": 128, "sinks": 4}] * 3 + [{}]
    assert pattern_kinds("pi(window=64, period=128, sinks=4)*3,dense") == ("pi",) * 3 + ("dense",)
    grown = "local(window=16),local(window=64),dense"
    assert parse_layers(grown, 6) == ("local", "local", "dense") * 2
    assert [item.settings for item in layer_items(grown, 6)] == [{"window": 16}, {"window": 64}, {}] * 2
    assert pattern_items(" pi( window = 3 ,sinks=0 ) ")[0].settings == {"window": 3, "sinks": 0}


@pytest.mark.parametrize("pattern, message", [
    ("pi(depth=3)", f"layers 'pi(depth=3)', item 'pi(depth=3)': settings are key=value with keys {KEYS}, got "
                    "'depth=3'"),
    ("pi(window)", f"layers 'pi(window)', item 'pi(window)': settings are key=value with keys {KEYS}, got 'window'"),
    ("local()", f"layers 'local()', item 'local()': settings are key=value with keys {KEYS}, got ''"),
    ("pi(window=2, window=3)", "layers 'pi(window=2, window=3)', item 'pi(window=2, window=3)': window is given "
                               "twice"),
    ("pi(window=-1)", "layers 'pi(window=-1)', item 'pi(window=-1)': window must be an int >= 0, got '-1'"),
    ("pi(period=0)", "layers 'pi(period=0)', item 'pi(period=0)': period must be an int >= 1, got '0'"),
    ("local(sinks=2.5)", "layers 'local(sinks=2.5)', item 'local(sinks=2.5)': sinks must be an int >= 0, got '2.5'"),
    ("local(window=2,dense", "layers 'local(window=2,dense': unbalanced parentheses; an item's settings go in one "
                             "pair after its kind, like 'local(window=16)*2'"),
    ("local),dense", "layers 'local),dense': unbalanced parentheses; an item's settings go in one pair after its "
                     "kind, like 'local(window=16)*2'"),
    ("pi(window=(2))", "layers 'pi(window=(2))': nested parentheses; an item's settings go in one pair after its "
                       "kind, like 'local(window=16)*2'"),
    ("pi*2(window=2)", "layers 'pi*2(window=2)': each item must be a kind or kind*N (N >= 1), with settings "
                       "kind(key=value, ...) or kind(key=value, ...)*N, got 'pi*2(window=2)'"),
])
def test_malformed_settings_are_refused_in_one_line(pattern, message):
    with pytest.raises(ValueError) as refused:
        GPTConfig(n_layer=1, layers=pattern, **SMALL)
    assert str(refused.value) == message


@pytest.mark.parametrize("pattern, message", [
    ("local,dense(window=4)", "layers 'local,dense(window=4)', item 'dense(window=4)': dense takes no window (kinds "
                              "that take it: {window}); dense takes none of window, sinks, period"),
    ("local(period=8),dense", "layers 'local(period=8),dense', item 'local(period=8)': local takes no period (kinds "
                              "that take it: {period}); local takes window, sinks"),
    ("pi,longformer(sinks=1)", "layers 'pi,longformer(sinks=1)', item 'longformer(sinks=1)': longformer takes no "
                               "sinks (kinds that take it: {sinks}); longformer takes window"),
])
def test_a_setting_its_kind_does_not_take_is_refused_by_the_registry(pattern, message):
    """The kinds that take a setting are the registry's answer (`kinds_with`), which the training flags scoped to
    that setting read too; the model refuses when it is built, and so does the reach analysis of its fields."""
    expected = message.format(**{key: ", ".join(kinds_with(key)) for key in ("window", "sinks", "period")})
    cfg = GPTConfig(n_layer=2, layers=pattern, **SMALL)  # the config has no registry: the model asks it
    for build in (lambda: GPT(cfg), lambda: model_reach(cfg.to_dict(), 10)):
        with pytest.raises(ValueError) as refused:
            build()
        assert str(refused.value) == expected
    check_pattern_settings(pattern, lambda key: ("dense", "local", "longformer"))  # whoever answers decides


def test_patterns_without_settings_are_as_before():
    """Each layer takes the shared settings: its config is the model's own, its operator settings those of the
    shared window, sinks and its row of periods, and the weights are those of before (keys and shapes)."""
    for pattern, period in (("pi*3,dense", 5), ("local,dense,pi,pi", [[3, 5], [7, 9], [4, 6], [8, 16]]),
                            ("pi,dense", "cover:40"), ("pi , local*2 ,dense", "geometric:4")):
        cfg = GPTConfig(n_layer=4, layers=pattern, **{**SMALL, "period": period, "sinks": 1})
        heads = periods_per_layer(cfg.period, 4, 2)
        for i in range(4):
            assert cfg.layer_config(i) is cfg and layer_fields(cfg.to_dict(), i) == cfg.to_dict()
            assert cfg.pi_settings(i) == PiSettings(window=2, period=heads[i], logit_clamp=None, sinks=1)
    shapes = {k: tuple(v.shape) for k, v in GPT(GPTConfig(n_layer=2, layers="pi,dense", **SMALL)).state_dict().items()}
    block = {"ln1.weight": (32,), "ln1.bias": (32,), "attn.qkv.weight": (96, 32), "attn.qkv.bias": (96,),
             "attn.out.weight": (32, 32), "attn.out.bias": (32,), "ln2.weight": (32,), "ln2.bias": (32,),
             "ffn.fc.weight": (64, 32), "ffn.fc.bias": (64,), "ffn.proj.weight": (32, 64), "ffn.proj.bias": (32,)}
    gate = {"attn.gate.0.weight": (16, 32), "attn.gate.0.bias": (16,), "attn.gate.2.weight": (2, 16),
            "attn.gate.2.bias": (2,)}
    assert shapes == {"embed.weight": (40, 32), **{f"blocks.0.{k}": s for k, s in {**block, **gate}.items()},
                      **{f"blocks.1.{k}": s for k, s in block.items()}, "ln_f.weight": (32,), "ln_f.bias": (32,),
                      "head.weight": (40, 32)}


def test_settings_equal_to_the_shared_ones_build_the_same_model():
    torch.manual_seed(0)
    plain = GPT(GPTConfig(n_layer=3, layers="pi*2,local", **SMALL)).eval()
    torch.manual_seed(0)
    spelled = GPT(GPTConfig(n_layer=3, layers="pi(window=2, period=5)*2,local(sinks=0)", **SMALL)).eval()
    idx = torch.randint(0, 40, (2, 20))
    torch.testing.assert_close(spelled(idx), plain(idx), rtol=0, atol=0)
    assert [b.attn.settings for b in spelled.blocks] == [b.attn.settings for b in plain.blocks]


STACK = "local(window=6),pi(window=1, period=7, sinks=2),local(window=1, sinks=1),dense"
OWN = [dict(window=6), dict(window=1, period=7, sinks=2), dict(window=1, sinks=1), {}]


def test_each_layer_takes_its_items_settings():
    cfg = GPTConfig(n_layer=4, layers=STACK, **SMALL)
    model = GPT(cfg)
    assert [type(b.attn) for b in model.blocks] == [LocalAttention, PiAttention, LocalAttention, DenseAttention]
    assert model.blocks[1].attn.settings == PiSettings(window=1, period=7, sinks=2, logit_clamp=None)
    assert [(b.attn.settings.window, b.attn.settings.sinks) for b in model.blocks[::2][:2]] == [(6, 0), (1, 1)]
    assert [cfg.pi_settings(i).window for i in range(4)] == [6, 1, 1, 2]  # the dense layer's: the shared window
    for i, own in enumerate(OWN):
        layer = cfg.layer_config(i)
        assert {key: getattr(layer, key) for key in own} == own and layer.pi_settings(i) == cfg.pi_settings(i)
        assert layer_fields(cfg.to_dict(), i) == layer.to_dict()  # the stored fields' view is the config's
    assert cfg.to_dict()["layers"] == STACK and (cfg.window, cfg.period, cfg.sinks) == (2, 5, 0)  # as given


def test_each_layer_computes_what_a_model_of_its_settings_computes():
    """The oracle: block i of the stack, its weights loaded into block i of a one-kind model whose shared settings
    are layer i's, gives the same output bit for bit."""
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=4, layers=STACK, **SMALL)
    stack = GPT(cfg).eval()
    x = torch.randn(2, 20, cfg.d_model)
    for i, (kind, own) in enumerate(zip(cfg.layer_kinds(), OWN, strict=True)):
        alone = GPT(GPTConfig(n_layer=4, attention=kind, **{**SMALL, **own})).eval()
        alone.blocks[i].load_state_dict(stack.blocks[i].state_dict())
        torch.testing.assert_close(stack.blocks[i](x), alone.blocks[i](x), rtol=0, atol=0)


def allowed_keys(kind: str, T: int, window: int | None, period: int | None, sinks: int) -> torch.Tensor:
    """bool [T, T]: the keys query i of a causal layer of `kind` reads (the local window, π's skip, the sinks)."""
    if kind == "dense":
        return torch.ones(T, T, dtype=torch.bool).tril()
    mask = dense_mask(local_mask(window) if kind == "local" else pi_mask(window, period), T)
    return mask | (torch.arange(T)[None, :] < sinks) & torch.ones(T, T, dtype=torch.bool).tril()


def test_the_local_and_dense_layers_are_softmax_over_their_own_keys():
    """Written out by hand: softmax over the keys each layer's own window and sinks allow; and the π layer is the
    reference operator with its own window, period and sinks."""
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=4, layers=STACK, **SMALL)
    stack = GPT(cfg).double().eval()
    x = torch.randn(2, 20, cfg.d_model, dtype=torch.float64)
    for block, kind, own in zip(stack.blocks, cfg.layer_kinds(), OWN, strict=True):
        layer = block.attn
        q, k, v = layer.heads(x)
        if kind == "pi":
            y = piattn.pi_attention(q, k, v, layer.gate_values(x), window=1, period=7, sinks=2, logit_clamp=None,
                                    backend="reference")
        else:
            allowed = allowed_keys(kind, 20, own.get("window"), None, own.get("sinks", 0))
            scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
            y = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v
        expected = layer.out(y.transpose(1, 2).reshape(2, 20, cfg.d_model))
        torch.testing.assert_close(layer(x), expected, rtol=1e-10, atol=1e-10)


def brute_force_reach(kinds, settings, T: int, max_lag: int) -> list[bool]:
    """Lag d is reachable when the product of the layers' causal masks (first layer rightmost; a layer's mask
    the union of its heads', each with its own period) links the last query to the key d before it."""
    paths = torch.eye(T, dtype=torch.int64)
    for layer, (kind, own) in enumerate(zip(kinds, settings, strict=True)):
        periods = set(periods_per_layer(own["period"], len(kinds), own["n_head"])[layer])
        mask = sum(allowed_keys(kind, T, own["window"], p, 0).long() for p in periods).clamp(max=1)
        paths = (mask @ paths).clamp(max=1)
    return [bool(paths[T - 1, T - 1 - d]) for d in range(max_lag + 1)]


@pytest.mark.parametrize("pattern", ["local(window=3),pi(window=1, period=7),local(window=2),pi",
                                     "pi(period=11),local(window=1)*2,pi(window=0, period=4)",
                                     "local(window=3),dense"])
def test_the_reach_of_a_stack_is_the_composition_of_its_layers(pattern):
    cfg = GPTConfig(n_layer=4, layers=pattern, **SMALL)
    layers = [layer_fields(cfg.to_dict(), i) for i in range(4)]
    expected = brute_force_reach(cfg.layer_kinds(), layers, T=64, max_lag=40)
    assert model_reach(cfg.to_dict(), 40).reachable.tolist() == expected
    shared = GPTConfig(n_layer=4, layers=",".join(pattern_kinds(pattern)), **SMALL)
    if "dense" not in pattern:  # the items' settings change what is reached
        assert model_reach(shared.to_dict(), 40).reachable.tolist() != expected


def test_cover_is_designed_for_the_pi_layers_own_window():
    cfg = GPTConfig(n_layer=4, layers="pi(window=3)*2,dense,dense", **{**SMALL, "period": "cover:40"})
    assert [cfg.period[0], cfg.period[1]] == [list(h) for h in schedule("cover", 3, 2, 2, target=40)]
    assert GPTConfig.from_dict(cfg.to_dict()).period == cfg.period


@pytest.mark.parametrize("pattern", ["pi(window=3),pi,local,pi(window=5)", "pi,pi(window=6)*3"])
def test_cover_over_pi_layers_of_their_own_windows_is_designed_for_the_narrowest_and_covers(pattern):
    """SMALL's window is 2: the design is cover's for window 2 over the π layers, and the stack with its real
    (wider) windows reaches every lag up to the target, by a brute-force mask product."""
    target = 40
    cfg = GPTConfig(n_layer=4, layers=pattern, **{**SMALL, "period": f"cover:{target}"})
    kinds = cfg.layer_kinds()
    pi_layers = [i for i, kind in enumerate(kinds) if kind == "pi"]
    designed = schedule("cover", 2, len(pi_layers), 2, target=target)
    assert [cfg.period[i] for i in pi_layers] == [list(h) for h in designed]
    layers = [layer_fields(cfg.to_dict(), i) for i in range(4)]
    assert all(brute_force_reach(kinds, layers, T=64, max_lag=target))
    assert all(model_reach(cfg.to_dict(), target).reachable.tolist())


def test_cover_refuses_pi_layers_of_their_own_periods():
    pattern = "pi(period=9),pi,dense,dense"
    with pytest.raises(ValueError) as refused:
        GPTConfig(n_layer=4, layers=pattern, **{**SMALL, "period": "cover"})
    assert str(refused.value) == (f"period 'cover' designs the periods of the π layers, but layers {pattern!r} "
                                  "gives them periods of their own: give the periods (--period, or period= in the "
                                  "items) or the schedule, not both")


@pytest.mark.parametrize("prompt, max_positions", [(1, None), (5, 24)])
def test_decoding_a_stack_of_own_windows_is_exact_at_every_position(prompt, max_positions):
    torch.manual_seed(1)
    cfg = GPTConfig(n_layer=4, layers=STACK, **SMALL)
    model = GPT(cfg).eval()
    idx = torch.randint(0, cfg.vocab_size, (2, 24))
    with torch.no_grad():
        full = model(idx)
        cache = model.init_cache(2, max_positions=max_positions)
        rings = [(c.capacity, c.sinks) for c in cache.layers[:3]]
        assert rings == [(7, 0), (8, 2), (2, 1)] and isinstance(cache.layers[3], GrowingCache)
        assert all(isinstance(c, RingCache) for c in cache.layers[:3])
        steps = [model(idx[:, :prompt], cache)]
        steps += [model(idx[:, t:t + 1], cache) for t in range(prompt, idx.shape[1])]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)


def test_a_checkpoint_config_rebuilds_the_same_model(tmp_path):
    torch.manual_seed(2)
    cfg = GPTConfig(n_layer=4, layers=STACK, **SMALL)
    model = GPT(cfg).eval()
    torch.save({"model": cfg.to_dict(), "weights": model.state_dict()}, tmp_path / "ckpt.pt")
    stored = torch.load(tmp_path / "ckpt.pt")
    again = GPT(GPTConfig.from_dict(stored["model"])).eval()
    again.load_state_dict(stored["weights"])
    assert again.config.layers == STACK
    assert [again.config.pi_settings(i) for i in range(4)] == [cfg.pi_settings(i) for i in range(4)]
    idx = torch.randint(0, cfg.vocab_size, (1, 16))
    torch.testing.assert_close(again(idx), model(idx), rtol=0, atol=0)


ARGS = ["--task", "reach", "--lag", "8", "--seq-len", "32", "--reach-vocab", "6", "--train-size", "8",
        "--eval-size", "8", "--n-layer", "3", "--d-model", "32", "--n-head", "2", "--batch-size", "4", "--warmup", "1",
        "--eval-every", "2", "--eval-batches", "1", "--device", "cpu", "--no-progress"]


def test_train_eval_resume_load_with_own_windows(tmp_path, capsys):
    run, layers = tmp_path / "run", "local(window=8),local(window=2),dense"
    argv = ["train", "--layers", layers, "--out", str(run), *ARGS]
    assert main([*argv, "--steps", "2"]) == 0
    assert read_config(train_summary(run, capsys)["checkpoint"])["model"]["layers"] == layers
    assert main(["eval", "--checkpoint", str(run), "--device", "cpu"]) == 0
    assert f"layers {layers}, window 2, 8, 3 layers" in capsys.readouterr().out
    assert main([*argv, "--steps", "4", "--resume"]) == 0
    assert train_summary(run, capsys)["step"] == 4
    model, config, *_ = piattn.load(run)
    assert config.layers == layers
    assert [(type(b.attn), getattr(b.attn, "settings", None)) for b in model.blocks][:2] == [
        (LocalAttention, PiSettings(window=8, period=8, variant="union")),
        (LocalAttention, PiSettings(window=2, period=2, variant="union"))]


@pytest.mark.parametrize("layers, flags, words", [
    ("dense(window=4),local", [], "layers 'dense(window=4),local', item 'dense(window=4)': dense takes no window"),
    ("local(period=8),local", [], "local takes no period"),
    ("pi(period=9)*2,pi", ["--period", "cover"], "gives them periods of their own"),
    ("pi(window=2", [], "unbalanced parentheses"),
])
def test_train_refuses_in_one_line(tmp_path, capsys, layers, flags, words):
    assert main(["train", "--layers", layers, *flags, "--out", str(tmp_path / "r"), *ARGS]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0]
