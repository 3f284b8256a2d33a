"""The registry of attention kinds answers which kinds can do what: the training flags, the layers' refusals
and the tests ask it, so a new kind is its module plus its line in `ATTENTION`, and nothing else."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from piattn.analysis.copy_distance import Reach
from piattn.config import GPTConfig, ModelConfig
from piattn.config.flags import Capability, flag_fields
from piattn.config.training import SECTIONS
from piattn.layers import ATTENTION, AttentionLayer, attention_registry, kinds_with
from piattn.models import GPT
from piattn.tasks import config_class

# Another valid value of each model setting a flag is scoped by, to see which kinds' config_kwargs read it.
OTHER_VALUE = {"window": 40, "period": 7, "variant": "fixed", "prior": 0.3, "sinks": 2, "backend": "torch",
               "radius": 2, "stride": 3}


class ToyAttention(AttentionLayer):
    """Causal softmax attention kept inside each packed document, taking a window it does not use: a kind
    only a test registers."""

    documents = True

    def __init__(self, d_model: int, n_heads: int, *, window: int = 4, **shared):
        super().__init__(d_model, n_heads, **shared)
        self.window = window

    @classmethod
    def config_kwargs(cls, cfg: ModelConfig, layer: int) -> dict:
        return dict(window=cfg.window)

    def attend(self, q, k, v, x, document_ids=None):
        T = q.shape[2]
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        if document_ids is not None:  # ids differ between neighbouring documents in the batches below
            mask = mask & (document_ids[:, None, :, None] == document_ids[:, None, None, :])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.fixture
def toy_kind():
    """"toy" registered for the test only: every later test sees the registry as it was."""
    ATTENTION["toy"] = ToyAttention
    yield "toy"
    del ATTENTION["toy"]


def registries() -> dict:
    return {"attention": attention_registry(), "task": ("lm",), "tokenizer": ("byte",), "backend": ("auto", "torch")}


def test_a_registered_kind_gets_the_flags_of_its_capabilities(toy_kind):
    assert toy_kind in kinds_with("documents") and toy_kind in kinds_with("window")
    assert toy_kind not in kinds_with("grouped_query") + kinds_with("sinks") + kinds_with("decoding")
    cfg = config_class().from_flat({"attention": toy_kind, "window": 3, "pack_documents": True, "out": "run"})
    cfg.check(registries())
    assert "--window 3" in cfg.describe(registries=registries())
    for flag, value, message in (
            ("sinks", 1, "--sinks applies to --attention local / pi only, not 'toy'"),
            ("n_kv_head", 2, "--n-kv-head applies to --attention dense / local / pi only, not 'toy'"),
            ("sequence_parallel", 2, "--sequence-parallel applies to --attention local / pi only, not 'toy'")):
        with pytest.raises(ValueError) as err:
            config_class().from_flat({"attention": toy_kind, flag: value, "out": "run"}).check(registries())
        assert str(err.value) == message


def test_a_registered_kind_runs_in_a_model_and_the_refusals_list_it(toy_kind):
    cfg = GPTConfig.from_name("tiny", vocab_size=40, n_layer=1, d_model=32, n_head=4, dropout=0.0)
    ids = torch.tensor([[0] * 5 + [1] * 4])
    toy = GPT(GPTConfig.from_name("tiny", **{**cfg.to_dict(), "attention": toy_kind}))
    assert toy(torch.randint(0, 40, (1, 9)), document_ids=ids).shape == (1, 9, 40)
    with pytest.raises(ValueError, match="has no incremental decoding; kinds that have one: dense, local, pi$"):
        toy.blocks[0].attn.init_cache(1)
    longformer = GPT(GPTConfig.from_name("tiny", **{**cfg.to_dict(), "attention": "longformer"}))
    with pytest.raises(ValueError, match="kinds that support them: dense, local, pi, toy$"):
        longformer(torch.randint(0, 40, (1, 9)), document_ids=ids)
    with pytest.raises(ValueError, match="kinds with grouped-query attention: dense, local, pi$"):
        GPT(GPTConfig.from_name("tiny", **{**cfg.to_dict(), "attention": toy_kind, "n_kv_head": 2}))


def test_the_settings_a_kind_takes_are_those_its_config_kwargs_read():
    """`model_settings` (what scopes --window, --sinks, …) against what each kind really reads of a config."""
    scoped = {scope.name for cls in SECTIONS.values() for _, meta in flag_fields(cls)
              for scope in (meta.applies or {}).values() if isinstance(scope, Capability)}
    settings = scoped & {f.name for f in dataclasses.fields(ModelConfig)}
    assert settings == set(OTHER_VALUE), "give OTHER_VALUE a value of each setting a flag is scoped by"
    default = ModelConfig()
    for name, kind in ATTENTION.items():
        for setting, value in OTHER_VALUE.items():
            reads = kind.config_kwargs(ModelConfig(**{setting: value}), 0) != kind.config_kwargs(default, 0)
            assert (setting in kind.model_settings()) == reads, (name, setting)


def test_decoding_is_the_kinds_that_set_a_cache_capacity():
    cfg = GPTConfig.from_name("tiny", vocab_size=40, n_layer=1, d_model=32, n_head=4, sparse_block=4, bucket_size=4,
                              image_width=6)
    for name, kind in ATTENTION.items():
        layer = kind.from_config(GPTConfig(**{**cfg.to_dict(), "attention": name}), causal=True)
        if name in kinds_with("decoding"):
            layer.init_cache(1)
        else:
            with pytest.raises(ValueError, match="no incremental decoding"):
                layer.init_cache(1)


def test_an_unknown_capability_is_refused():
    with pytest.raises(ValueError, match=r"capability must be one of \['sequence_parallel', .*got 'colour'"):
        kinds_with("colour")



def brute_reach(hops_of_layer, n_layer: int, max_lag: int) -> tuple[set[int], int]:
    """(the lags 0 … max_lag a path of one hop per layer reaches, the longest path), summing the hop sets."""
    lags, span = {0}, 0
    for layer in range(n_layer):
        hops = hops_of_layer(layer)
        lags = {a + b for a in lags for b in hops if a + b <= max_lag}
        span += max(hops)
    return lags, span


@pytest.mark.parametrize("model", [
    dict(window=3, period=7, n_layer=2, n_head=2),
    dict(window=2, period=[5, 9], n_layer=3, n_head=2),  # per head
    dict(window=2, period=[[5, 9], [4, 13]], n_layer=2, n_head=2),  # per layer and head
    dict(window=4, period=3, n_layer=2, n_head=1),  # the period inside the window
])
def test_the_kinds_that_declare_a_reach_reach_what_their_layers_read(model):
    assert kinds_with("reach") == ("dense", "local", "neighbourhood", "pi", "strided")
    max_lag = 40
    period = model["period"]

    def pi_hops(layer):
        heads = period if isinstance(period, list) else [period]
        heads = heads[layer] if isinstance(heads[0], list) else heads
        return set(range(model["window"] + 1)) | set(heads)

    hops = {"dense": lambda layer: set(range(max_lag + 1)),
            "local": lambda layer: set(range(model["window"] + 1)),
            "pi": pi_hops}
    # neighbourhood's reach depends on the query's column (tests/analysis/test_raster_reach.py); strided's
    # span is that of hops capped at max_lag, the longest path that stays inside the lags asked for
    hops["strided"] = lambda layer: set(range(5)) | set(range(0, max_lag + 1, 5))
    model = {**model, "stride": 5}
    for name in sorted(hops):
        got = ATTENTION[name].lag_reach({**model, "sinks": 4}, max_lag)  # sinks are not a lag
        lags, span = brute_reach(hops[name], model["n_layer"], max_lag)
        assert set(got.reachable.nonzero().flatten().tolist()) == lags, name
        assert got.span == (max_lag if name == "dense" else span), name


def test_a_kind_without_a_declared_reach_is_refused_by_name(toy_kind):
    class Reaching(ToyAttention):
        @classmethod
        def lag_reach(cls, model, max_lag):
            return Reach(torch.arange(max_lag + 1) % model["window"] == 0, max_lag)

    assert toy_kind not in kinds_with("reach")
    for name in ("toy", "longformer", "bigbird", "reformer"):
        with pytest.raises(ValueError) as err:
            ATTENTION[name].lag_reach(dict(window=3, period=7, n_layer=2, n_head=2), 10)
        assert str(err.value) == ("attention must be one of ['dense', 'local', 'neighbourhood', 'pi', 'strided'] "
                                  "(kinds whose reach is a fixed "
                                  f"set of lags, which they declare: `lag_reach`), got '{name}', which declares none")
    ATTENTION["reaching"] = Reaching
    try:
        assert kinds_with("reach") == ("dense", "local", "neighbourhood", "pi", "reaching", "strided")
        assert Reaching.lag_reach(dict(window=3), 7).reachable.tolist() == [1, 0, 0, 1, 0, 0, 1, 0]
        with pytest.raises(ValueError, match=r"one of \['dense', 'local', 'neighbourhood', 'pi', 'reaching', "
                           r"'strided'\] .*got 'toy'"):
            ToyAttention.lag_reach({}, 5)
    finally:
        del ATTENTION["reaching"]
