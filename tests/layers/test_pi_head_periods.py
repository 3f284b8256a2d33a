"""Per-head and per-layer periods in the layer, the model, its config and `piattn train --period`: the layer
runs the operator's per-head periods, cached decoding (ring step, few-token steps, long chunks) equals the
full forward, the ring holds the largest period, schedules resolve, bad input is one line naming `period`."""

from __future__ import annotations

import inspect

import pytest
import torch

import piattn.layers.windowed as windowed_module
import piattn.ops.pi.decode_native as decode_native
import piattn.ops.pi.decode_torch as decode_torch
import piattn.ops.pi.native as native
from piattn.analysis.multiscale import SCHEDULES, schedule
from piattn.config import PiSettings
from piattn.config.model import PERIOD_SCHEDULES
from piattn.config.pi import VARIANTS
from piattn.config.training import ModelFlags, parse_period
from piattn.layers import PiAttention
from piattn.models import GPT, GPTConfig
from piattn.ops.pi import pi_attention
from utils import tiny_model

PERIODS = [[5, 2, 9, 5], [12, 3, 7, 30]]  # per layer; 2 and 3 fold into the window


def model(variant="adaptive", period=PERIODS, **overrides) -> GPT:
    """tests/utils.py's tiny_model with 4 query heads over 2 key/value heads and `period` (per head)."""
    return tiny_model("pi", variant, n_head=4, n_kv_head=2, period=period, block_size=64, **overrides)


def test_layer_runs_the_operator_per_head():
    layer = PiAttention(16, 4, n_kv_heads=2, window=2, period=(3, 8, 8, 5), variant="fixed").eval()
    x = torch.randn(2, 20, 16)
    q, k, v = layer.heads(x)
    want = pi_attention(q, k, v, window=2, period=(3, 8, 8, 5), variant="fixed")
    torch.testing.assert_close(layer.attend(q, k, v, x), want, rtol=0, atol=0)
    assert layer.settings.period == (3, 8, 8, 5) and layer.cache_capacity() == 9


def test_model_hands_each_layer_its_periods():
    m = model()
    assert [b.attn.settings.period for b in m.blocks] == [tuple(p) for p in PERIODS]
    assert [b.attn.cache_capacity() for b in m.blocks] == [10, 31]


@pytest.mark.parametrize("variant", VARIANTS)
def test_cached_decoding_equals_the_full_forward(variant):
    """Steps of 1 (the ring step, adaptive's gate head cut per period), 2-4 (few-token rows) and a long chunk."""
    m = model(variant)
    idx = torch.randint(0, 50, (2, 48), generator=torch.Generator().manual_seed(4))
    cache = m.init_cache(2)
    bounds = [0, 1, 3, 6, 10, 11, 13, 16, 20, 21, 22, 26, 35, 36, 37, 48]
    with torch.no_grad():
        pieces = [m(idx[:, a:b], cache) for a, b in zip(bounds, bounds[1:], strict=False)]
        torch.testing.assert_close(torch.cat(pieces, 1), m(idx), rtol=0, atol=1e-5)


def test_one_token_steps_take_one_compiled_call_per_layer_over_each_heads_own_slots(monkeypatch):
    """A layer's one-token step with per-head periods is its projections and one call of the compiled step
    (`DecodePlan.token`), every head over the slot table of its own period (`DecodePlan.ring_slots`): as many
    tables as heads, a head whose period folds into the window (2, 3) reading nothing in the skip place."""
    m = model()
    idx = torch.randint(0, 50, (1, 40), generator=torch.Generator().manual_seed(5))
    cache = m.init_cache(1)
    tables = []
    real = decode_native.run

    def spy(plan, proj, kv_store, slot, valid, *args, **kwargs):
        assert kwargs["fresh_slot"] is not None  # the whole one-token step
        tables.append((slot.shape, None if valid is None else valid[:, 0].tolist()))
        return real(plan, proj, kv_store, slot, valid, *args, **kwargs)

    with torch.no_grad():
        expected = m(idx)[:, -1]
        m(idx[:, :39], cache)
        monkeypatch.setattr(decode_native, "run", spy)
        step = m(idx[:, 39:], cache)[:, -1]
    S = 3 + 1 + 1  # the local keys i − 3 … i, one skip place
    no_skip = [True] * 4 + [False]
    assert tables == [((4, S), [[True] * S, no_skip, [True] * S, [True] * S]),
                      ((4, S), [[True] * S, no_skip, [True] * S, [True] * S])]
    torch.testing.assert_close(step, expected, rtol=0, atol=1e-5)


def test_without_the_compiled_step_the_ring_step_runs_once_per_period(monkeypatch):
    """Where the compiled step does not run (here switched off), a layer's one-token step is one call of the
    torch-ops step, which reads the ring once per distinct period of its heads (`DecodePlan.groups`), every head
    kept from the pass of its own period: the same logits."""
    m = model()
    idx = torch.randint(0, 50, (1, 40), generator=torch.Generator().manual_seed(5))
    cache = m.init_cache(1)
    calls = []
    real = decode_torch.run

    def spy(plan, *args):
        calls.extend(plan.settings.period[row] for row, _ in plan.groups)
        return real(plan, *args)

    with torch.no_grad():
        expected = m(idx)[:, -1]
        m(idx[:, :39], cache)
        monkeypatch.setattr(native, "_state", {"functions": None, "reason": "switched off by the test"})
        monkeypatch.setattr(decode_torch, "run", spy)
        step = m(idx[:, 39:], cache)[:, -1]
    assert calls == [2, 5, 9, 3, 7, 12, 30]
    torch.testing.assert_close(step, expected, rtol=0, atol=1e-5)


def test_the_layer_does_not_group_heads_by_period():
    """Heads are grouped by period in `piattn.ops.pi` alone (issue 38): the layer hands its periods on."""
    source = inspect.getsource(windowed_module)
    for grouping in ("by_period", "period_groups", "pi.heads import"):
        assert grouping not in source, grouping


def test_one_period_is_todays_model():
    """A list of equal periods is the int: the same config, the same outputs bit for bit."""
    idx = torch.randint(0, 50, (1, 30), generator=torch.Generator().manual_seed(6))
    a, b = model(period=7), model(period=[[7] * 4, [7] * 4])
    assert b.config.period == 7 and b.blocks[0].attn.settings.period == 7
    with torch.no_grad():
        assert torch.equal(a(idx), b(idx))


def test_config_forms_and_checkpoint_round_trip():
    base = dict(n_layer=2, n_head=4, d_model=32, block_size=64, window=4)
    assert GPTConfig.from_name("tiny", period=[8, 16, 32, 64], **base).period == [8, 16, 32, 64]
    assert GPTConfig.from_name("tiny", period=[[5, 6, 7, 8], [5, 6, 7, 8]], **base).period == [5, 6, 7, 8]
    assert GPTConfig.from_name("tiny", period="geometric:4", **base).period == [4, 8, 16, 32]
    assert GPTConfig.from_name("tiny", period="single", **base).period == 16
    cover = GPTConfig.from_name("tiny", period="cover", **base)
    assert cover.period == [list(h) for h in schedule("cover", 4, 2, 4, target=63)]
    assert GPTConfig.from_dict(cover.to_dict()).period == cover.period  # a checkpoint stores the resolved form
    assert cover.pi_settings(1).reach == max(cover.period[1])


@pytest.mark.parametrize("period, message", [
    ([8, 16], r"periods has 2 entries: a list of ints needs one per head, n_head=4"),
    ([[1, 2, 3, 4]], r"periods has 1 layers, the model n_layer=2"),
    ([8, 0, 8, 8], r"periods\[1\] must be an int >= 1"),
    (1.5, r"period must be an int, a list of n_head ints"),
    ("nope", r"period schedule must be one of single, geometric, cover"),
    ("cover:x", r"period schedule must be one of"),
])
def test_bad_config_periods(period, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig.from_name("tiny", n_layer=2, n_head=4, d_model=32, period=period)


def test_layer_and_settings_refuse_bad_periods():
    with pytest.raises(ValueError, match="period has 3 entries; per-head periods need one per query head, n_heads=4"):
        PiAttention(16, 4, period=(3, 8, 5))
    with pytest.raises(ValueError, match=r"period\[1\] must be an int >= 1, got 0"):
        PiSettings(period=(3, 0))
    assert PiSettings(period=[6, 6]).period == 6 and PiSettings(period=[6, 9]).period == (6, 9)
    assert PiSettings(window=12, period=(6, 9)).reach == 12


def test_sharded_layer_hands_per_head_periods_to_the_exchange(monkeypatch):
    """Inside `sequence_parallel` the layer passes its per-head periods on, in its settings object handed over
    whole (tests/parallel checks the result across processes)."""
    import piattn.layers.sharding as sharding

    layer = PiAttention(16, 2, period=(3, 8))
    seen = {}
    monkeypatch.setattr(sharding, "active_shard", lambda: type("Shard", (), {"group": "g"})())
    monkeypatch.setattr(sharding, "sequence_parallel_pi_attention_with_settings",
                        lambda q, k, v, gate, settings, group, **kw: seen.update(kw, settings=settings, group=group)
                        or q)
    q = k = v = torch.randn(1, 2, 8, 8)
    layer.attend(q, k, v, torch.randn(1, 8, 16))
    assert seen["settings"] is layer.settings and seen["settings"].period == (3, 8) and seen["group"] == "g"


def test_one_period_functions_refuse_per_head_periods():
    from piattn.ops.pi.decode import pi_decode

    q = torch.randn(1, 2, 1, 4)
    with pytest.raises(ValueError, match="period must be one int >= 1 here, got per-head periods"):
        pi_decode(q, q, q, None, period=(3, 5), variant="union")


@pytest.mark.parametrize("text, value", [
    ("16", 16), ("8,16,32,64", [8, 16, 32, 64]), ("5,6,7,8/9,14,19,24", [[5, 6, 7, 8], [9, 14, 19, 24]]),
    ("cover", "cover"), ("geometric:8", "geometric:8"), (" 7 ", 7),
])
def test_period_flag_text(text, value):
    assert parse_period(text) == value
    assert ModelFlags(period=text).model_fields()["period"] == value


@pytest.mark.parametrize("text", ["", "a", "8,,16", "8,0", "-3", "1.5", "8/x"])
def test_period_flag_bad_text(text):
    with pytest.raises(ValueError, match=r"--period must be an int >= 1, per-head ints"):
        parse_period(text)


def test_config_schedules_are_the_analysis_schedules():
    assert PERIOD_SCHEDULES == SCHEDULES


def test_a_stored_int_period_reads_as_its_text():
    """Checkpoints written before --period took text store an int: it resumes as the same flag."""
    assert ModelFlags(period=16).period == "16" and ModelFlags(period=16).model_fields()["period"] == 16
