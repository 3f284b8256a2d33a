"""Steps of 2–4 tokens through the compiled step (`DecodePlan.rows` -> `decode_native.run`): each new
query its own one-query step in one C call, equal to the full operator and to the torch-ops step (fp64 to
1e-12, fp32 stated below) for every form it takes (α, the gate MLP's hidden layer, fixed, union), with sinks,
grouped-query attention and short texts; the models' few-token steps go through it (a spy counts the calls),
per-head periods included; what it does not take runs in torch ops, exactly."""

from __future__ import annotations

import pytest
import torch

import piattn.ops.pi.native as native
from piattn.config import PI_DEFAULTS
from piattn.models import GPT, GPTConfig
from piattn.ops.pi import pi_attention
from piattn.ops.pi.decode import decode_settings, gate_tail
from piattn.ops.pi.settings import OpSettings
from utils import compiled_rows, decode_rows

TOL = {torch.float32: dict(rtol=2e-5, atol=2e-6), torch.float64: dict(rtol=1e-12, atol=1e-12)}
EPS = 1e-3


pytestmark = pytest.mark.usefixtures("native_step_built")


def _torch_ops(monkeypatch):
    monkeypatch.setattr(native, "_state", {"functions": None, "reason": "switched off by the test"})


def _settings(*, scale, **pi) -> OpSettings:
    """The decoding functions' settings for `pi_attention`'s keywords `pi` (the defaults for the rest), built
    as-is: the functions check them."""
    return decode_settings(PI_DEFAULTS, scale)._replace(**pi)


CASES = [  # B, H, H_kv, D, N, t, window, period, sinks
    (2, 4, 2, 8, 30, 3, 3, 8, 0),
    (1, 2, 1, 5, 20, 4, 2, 5, 2),
    (3, 6, 3, 4, 9, 2, 3, 6, 1),   # a short text: slots before position 0, sinks in the window
    (2, 4, 4, 8, 40, 4, 4, 3, 3),  # period <= window: no skip
    (1, 4, 2, 8, 5, 4, 3, 8, 2),   # the queries are nearly the whole text
]


def _inputs(B, H, H_kv, D, N, t, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = 3 * torch.randn(B, H, N, D, generator=g, dtype=dtype)  # scores beyond the clamp
    k = 3 * torch.randn(B, H_kv, N, D, generator=g, dtype=dtype)
    v = torch.randn(B, H_kv, N, D, generator=g, dtype=dtype)
    gate = 0.01 + 0.98 * torch.rand(B, H, N, generator=g, dtype=dtype)
    hidden = 2 * torch.randn(B, t, 6, generator=g, dtype=dtype)
    head = torch.randn(H, 6, generator=g, dtype=dtype), torch.randn(H, generator=g, dtype=dtype)
    return q, k, v, gate, hidden, head


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("form", ["alpha", "hidden", "fixed", "union"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_compiled_rows_equal_the_full_operator_and_the_torch_ops(case, form, dtype, compiled_calls, monkeypatch):
    B, H, H_kv, D, N, t, window, period, sinks = CASES[case]
    q, k, v, gate, hidden, head = _inputs(B, H, H_kv, D, N, t, dtype, seed=case)
    variant = {"alpha": "adaptive", "hidden": "adaptive"}.get(form, form)
    if form == "hidden":  # the α the hidden layer gives, for the full operator
        gate = torch.cat([gate[:, :, :N - t], EPS + (1 - 2 * EPS) * gate_tail(hidden, *head).transpose(1, 2)], 2)
    kw = dict(window=window, period=period, variant=variant, prior=0.3, logit_clamp=4.0, eps=EPS, sinks=sinks,
              scale=D**-0.5)
    step_gate = None if variant != "adaptive" else hidden if form == "hidden" else gate[:, :, -t:]
    gate_head = head if form == "hidden" else None
    compiled = compiled_rows(q[:, :, -t:], k, v, step_gate, _settings(**kw), gate_head=gate_head)
    assert compiled is not None and compiled.shape == (B, H, t, D)
    assert decode_rows(q[:, :, -t:], k, v, step_gate, _settings(**kw), gate_head=gate_head).equal(compiled)
    assert compiled_calls == [True, True]
    full = pi_attention(q, k, v, gate if variant == "adaptive" else None, causal=True, **kw)[:, :, -t:]
    torch.testing.assert_close(compiled, full, **TOL[dtype])
    _torch_ops(monkeypatch)
    torch_ops = decode_rows(q[:, :, -t:], k, v, step_gate, _settings(**kw), gate_head=gate_head)
    torch.testing.assert_close(compiled, torch_ops, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_compiled_rows_take_per_head_periods_whole(dtype, compiled_calls, monkeypatch):
    """Per-head periods: one compiled call, each head over its own slot table (`decode_slots.block_slots`; the
    head whose period folds into the window reads nothing in the others' skip place), rows equal to the "auto"
    plan's and the full operator's; where the step declines that call, None for the whole (never half of it)."""
    periods = (5, 2, 9, 5)  # 2 folds into the window: 4 slots a query, the others 5
    q, k, v, gate, _, _ = _inputs(2, 4, 2, 8, 30, 3, dtype, seed=11)
    kw = dict(window=3, period=periods, variant="adaptive", prior=0.3, logit_clamp=4.0, eps=EPS, sinks=1,
              scale=8**-0.5)
    compiled = compiled_rows(q[:, :, -3:], k, v, gate[:, :, -3:], _settings(**kw))
    assert compiled is not None and compiled_calls == [True]
    assert decode_rows(q[:, :, -3:], k, v, gate[:, :, -3:], _settings(**kw)).equal(compiled)
    full = pi_attention(q, k, v, gate, causal=True, **kw)[:, :, -3:]
    torch.testing.assert_close(compiled, full, **TOL[dtype])
    monkeypatch.setattr(native, "MAX_SLOTS", 5)  # 6 slots a query in one call (the period-2 head's 5 among them)
    assert compiled_rows(q[:, :, -3:], k, v, gate[:, :, -3:], _settings(**kw)) is None


@pytest.mark.parametrize("why", ["separate", "autograd", "bf16"])
def test_what_the_compiled_step_does_not_take_runs_in_torch_ops(why, compiled_calls):
    dtype = torch.bfloat16 if why == "bf16" else torch.float32
    q, k, v, gate, _, _ = _inputs(2, 4, 2, 8, 20, 3, dtype, seed=7)
    if why == "autograd":
        q.requires_grad_(True)
    variant = "separate" if why == "separate" else "adaptive"
    kw = dict(window=3, period=8, variant=variant, prior=0.3, logit_clamp=4.0, eps=EPS, sinks=1, scale=8**-0.5)
    assert compiled_rows(q[:, :, -3:], k, v, gate[:, :, -3:], _settings(**kw)) is None
    y = decode_rows(q[:, :, -3:], k, v, gate[:, :, -3:], _settings(**kw))
    assert not any(compiled_calls)  # offered (autograd, bf16) or not even that ("separate"), never run
    full = pi_attention(q.detach().float(), k.float(), v.float(), gate.float(), causal=True, **kw)[:, :, -3:]
    torch.testing.assert_close(y.detach().float(), full, **({} if dtype == torch.float32 else
                                                            dict(rtol=2e-2, atol=2e-2)))
    if why == "autograd":
        y.sum().backward()
        assert q.grad is not None and q.grad.abs().sum() > 0


def _model(dtype, **extra):
    cfg = GPTConfig.from_name("tiny", **{**dict(vocab_size=50, dropout=0.0, n_layer=2, d_model=32, n_head=4,
                                                window=2, period=5), **extra})
    torch.manual_seed(0)
    model = GPT(cfg).eval().to(dtype)
    for block in model.blocks:  # gates that vary per token
        if getattr(block.attn, "gate", None) is not None:
            torch.nn.init.normal_(block.attn.gate[2].weight, std=1.0)
    return model


MODELS = {"adaptive": {}, "fixed": dict(variant="fixed"), "union": dict(variant="union"), "sinks": dict(sinks=2),
          "GQA": dict(n_kv_head=2), "per-head periods": dict(period=[3, 7, 5, 7], n_kv_head=2, sinks=1),
          "local": dict(attention="local")}


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("name", list(MODELS))
def test_model_steps_of_a_few_tokens_go_through_the_compiled_step(name, n, compiled_calls, monkeypatch):
    model = _model(torch.float64, **MODELS[name])
    idx = torch.randint(0, 50, (2, 26), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(idx)
        cache = model.init_cache(2)
        steps = torch.cat([model(idx[:, t:t + n], cache) for t in range(0, idx.shape[1], n)], 1)
    assert compiled_calls and all(compiled_calls)  # one call a layer and step (per-head periods: a table per head)
    assert len(compiled_calls) == -(-idx.shape[1] // n) * len(model.blocks)
    torch.testing.assert_close(steps, full, rtol=1e-10, atol=1e-10)
    _torch_ops(monkeypatch)
    with torch.no_grad():
        cache = model.init_cache(2)
        torch_ops = torch.cat([model(idx[:, t:t + n], cache) for t in range(0, idx.shape[1], n)], 1)
    torch.testing.assert_close(steps, torch_ops, rtol=1e-12, atol=1e-12)


def test_fp32_model_steps_of_three_equal_the_full_forward(compiled_calls):
    model = _model(torch.float32, sinks=1, n_kv_head=2)
    idx = torch.randint(0, 50, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(idx)
        cache = model.init_cache(2)
        steps = torch.cat([model(idx[:, t:t + 3], cache) for t in range(0, 24, 3)], 1)
    assert len(compiled_calls) == 8 * len(model.blocks) and all(compiled_calls)
    torch.testing.assert_close(steps, full, rtol=0, atol=2e-5)
