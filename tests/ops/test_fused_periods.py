"""The fused CPU backend with per-head periods (one call, every head's π_h), sinks and packed documents:
forward and every gradient (dq, dk, dv, dgate) against "reference" (run once per period group, as
`heads.by_period` does) and against the dense oracle of tests/ops/test_head_periods.py, fp64 (1e-10) and
fp32 (the fp64 reference of the same values, test_fused_cpu's tolerances). Outputs are NaN-poisoned, so an
element the kernels do not write cannot pass. `pi_attention` sends per-head periods to "fused" in one call;
with dropout, the same seed gives the same masks, so "fused" equals "reference" there too.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_fused_cpu import FP32, FP32_DGATE, NAMES, compiled_kernels  # noqa: F401 (the fixture skips without cc)
from test_head_periods import grouped_inputs, oracle_backward

import piattn
from piattn.config.pi import VARIANTS
from piattn.ops.pi import heads
from piattn.ops.pi.fused import pi_attention_fused
from piattn.ops.pi.reference import pi_attention_reference
from utils import TOLERANCES, assert_close, param_id

KW = dict(prior=0.3, logit_clamp=2.5, eps=1e-6, dropout_keep=None, dropout_p=0.0)


def _per_group(function, q, k, v, gate, periods, **kw):
    """`function` once per period group (heads.by_period), or in one call when `function` is fused."""
    if function is pi_attention_fused:
        return function(q, k, v, gate, period=periods, **kw)

    def run(p, q_g, gate_g, k_g, v_g):
        return function(q_g, k_g, v_g, gate_g, period=p, **kw)

    return heads.by_period(periods, k.shape[1], run, [(q, 1), (gate, 1)], [(k, 1), (v, 1)])


def _grads(function, inputs, periods, dy, kw):
    live = [t for t in inputs if t is not None]
    y = _per_group(function, *inputs, periods, **kw)
    return (y, *torch.autograd.grad(y, live, dy), *([None] if inputs[3] is None else []))


def compare(inputs, periods, *, window, causal, variant, sinks=0, document_ids=None, scale=None, dy_seed=1):
    """Fused (one call) against the reference run per period group: fp64 at 1e-10, fp32 against the fp64
    reference of the same values."""
    dtype = inputs[0].dtype
    kw = dict(KW, window=window, causal=causal, variant=variant, sinks=sinks, document_ids=document_ids,
              scale=inputs[0].shape[-1] ** -0.5 if scale is None else scale)
    dy = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(dy_seed), dtype=torch.float64)
    wide = [None if t is None else t.detach().double().requires_grad_() for t in inputs]
    expected = _grads(pi_attention_reference, wide, periods, dy, kw)
    actual = _grads(pi_attention_fused, inputs, periods, dy.to(dtype), kw)
    for name, e, a in zip(NAMES, expected, actual, strict=True):
        assert (e is None) == (a is None), name
        if e is None:
            continue
        assert a.dtype == dtype, name
        tol = TOLERANCES[dtype] if dtype == torch.float64 else FP32_DGATE if name == "dgate" else FP32
        assert_close(name, e, a, tol=tol)


# 4 query heads on 2 key/value heads; T = 29, window 3: 2 folds into the window, 40 >= T reaches nothing,
# 6 twice (across key/value heads), 11 beside 2 on one key/value head.
PERIODS = (2, 6, 11, 6)
DOCS = torch.tensor([[0] * 9 + [1] * 13 + [2] * 7, [4] * 29])


@pytest.mark.parametrize("causal", (True, False), ids=param_id)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("features", ("plain", "sinks", "documents", "sinks+documents"))
def test_per_head_periods_fp64(variant, causal, features, nan_poison):
    inputs = grouped_inputs(2, 4, 2, 29, 8, variant)
    compare(inputs, PERIODS, window=3, causal=causal, variant=variant, sinks=3 if "sinks" in features else 0,
            document_ids=DOCS if "documents" in features else None)


@pytest.mark.parametrize("causal", (True, False), ids=param_id)
@pytest.mark.parametrize("variant", VARIANTS)
def test_per_head_periods_fp32(variant, causal, nan_poison):
    """D = 64 (the kernels compiled for it as a constant), sinks and documents."""
    inputs = grouped_inputs(2, 4, 2, 29, 64, variant, dtype=torch.float32)
    compare(inputs, (40, 6, 1, 13), window=3, causal=causal, variant=variant, sinks=2, document_ids=DOCS)


@pytest.mark.parametrize("sinks", (1, 4, 40))
@pytest.mark.parametrize("causal", (True, False), ids=param_id)
def test_sinks_beyond_the_window_and_the_document(sinks, causal, nan_poison):
    """Sinks past a short document's end, past T, and a bidirectional sink read by queries far before it
    (its dk, dv rows must be zeroed before the first query that reads them)."""
    inputs = grouped_inputs(1, 2, 1, 33, 8, "separate")
    docs = torch.tensor([[0] * 2 + [1] * 25 + [2] * 6])
    compare(inputs, (5, 9), window=1, causal=causal, variant="separate", sinks=sinks, document_ids=docs)
    compare(inputs, (5, 9), window=1, causal=causal, variant="adaptive", sinks=sinks)


def test_equal_periods_are_the_int_call(nan_poison):
    """Equal entries are the int call bit for bit, forward and gradients."""
    inputs = grouped_inputs(1, 4, 2, 30, 16, "adaptive", dtype=torch.float32)
    kw = dict(KW, window=3, causal=False, variant="adaptive", scale=0.25)
    dy = torch.randn(1, 4, 30, 16)
    want = _grads(pi_attention_fused, inputs, 7, dy, kw)
    got = _grads(pi_attention_fused, inputs, (7, 7, 7, 7), dy, kw)
    for name, e, a in zip(NAMES, want, got, strict=True):
        assert torch.equal(e, a), name


def test_pi_attention_calls_fused_once(monkeypatch, nan_poison):
    """`pi_attention` sends per-head periods to "fused" (it declares per_head_periods) in one call, never
    through `by_period`, and the result is the dense oracle's."""
    def no_groups(*args, **kwargs):
        raise AssertionError("by_period called for a backend that takes per-head periods")

    monkeypatch.setattr(piattn.ops.pi, "by_period", no_groups)
    assert piattn.ops.pi.backends.REGISTRY["fused"].per_head_periods
    inputs = grouped_inputs(2, 4, 2, 23, 8, "adaptive")
    docs = torch.tensor([[0] * 9 + [1] * 14, [3] * 23])
    kw = dict(window=3, prior=0.3, logit_clamp=2.5, eps=1e-4, causal=False, variant="adaptive", sinks=2,
              document_ids=docs)
    periods = (2, 6, 40, 6)
    y = piattn.pi_attention(*inputs, period=periods, backend="fused", **kw)
    used = [t for t in inputs if t is not None]
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = (y, *torch.autograd.grad(y, used, dy))  # oracle_backward's dy: the same seed
    for name, e, a in zip(NAMES, oracle_backward(inputs, periods, **kw), got, strict=True):
        assert_close(name, e, a)


def _fuzz(data, dtype):
    H_kv = data.draw(st.integers(1, 3), "H_kv")
    H = H_kv * data.draw(st.integers(1, 3), "group")
    T = data.draw(st.integers(1, 26), "T")
    window = data.draw(st.integers(0, 5), "window")
    same = data.draw(st.booleans(), "equal across heads")
    periods = data.draw(st.lists(st.integers(1, T + 3), min_size=1 if same else H, max_size=1 if same else H),
                        "periods")
    periods = tuple(periods * H if same else periods)
    variant = data.draw(st.sampled_from(VARIANTS), "variant")
    causal = data.draw(st.booleans(), "causal")
    sinks = data.draw(st.integers(0, 3), "sinks")
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(T - 1, 1)), max_size=3), "document cuts")))
    docs = None
    if cuts and data.draw(st.booleans(), "documents"):
        docs = torch.zeros(2, T, dtype=torch.long)
        for c in cuts:
            docs[0, c:] += 1
    inputs = grouped_inputs(2, H, H_kv, T, data.draw(st.sampled_from((4, 64)), "D"), variant, dtype=dtype,
                            seed=data.draw(st.integers(0, 99), "seed"))
    # the usable pattern, as pi_attention hands it over: window <= T - 1, a period >= T reaches nothing
    compare(inputs, periods, window=min(window, T - 1), causal=causal, variant=variant, sinks=min(sinks, T),
            document_ids=docs)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_fp64(data, nan_poison):
    """Random H, H_kv, T, window, periods (equal across heads, <= window, >= T), sinks, documents, both
    directions, every variant."""
    _fuzz(data, torch.float64)


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_many(data, nan_poison):
    _fuzz(data, data.draw(st.sampled_from((torch.float64, torch.float32)), "dtype"))


# ---------------------------------------------------------------------------------------------------------
# Dropout: the kernels read the keep mask `pi_attention` draws, in the contract's slot layout of each head.

def _seeded(backend, inputs, seed, **kw):
    torch.manual_seed(seed)
    y = piattn.pi_attention(*inputs, backend=backend, **kw)
    used = [t for t in inputs if t is not None]
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype)
    return (y, *torch.autograd.grad(y, used, dy))


@pytest.mark.parametrize("causal", (True, False), ids=param_id)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("periods", ((2, 6, 11, 40), 9), ids=("per-head", "one"))
def test_dropout_same_mask_as_reference(variant, causal, periods, nan_poison):
    """Equal seeds, equal masks: "fused" (per-head periods in one call, their masks drawn per period group as
    `by_period` draws them) equals "reference" (run per group), forward and every gradient, with sinks and
    documents; the mask changes the result."""
    inputs = grouped_inputs(2, 4, 2, 29, 8, variant)
    kw = dict(window=3, prior=0.3, logit_clamp=2.5, eps=1e-6, causal=causal, variant=variant, sinks=2,
              document_ids=DOCS, period=periods, dropout_p=0.3)
    want = _seeded("reference", inputs, 7, **kw)
    got = _seeded("fused", inputs, 7, **kw)
    assert len(want) == len(got)
    for name, e, a in zip(NAMES, want, got, strict=False):  # no dgate without a gate
        assert_close(name, e, a)
    with torch.no_grad():
        plain = piattn.pi_attention(*inputs, backend="fused", **{**kw, "dropout_p": 0.0})
    assert (got[0] - plain).abs().max() > 1e-3, "dropout must change the output"


def test_dropout_of_a_window_and_period_beyond_t(nan_poison):
    """The mask is drawn for the pattern asked for and laid out for the usable one (window clamped to T − 1,
    a period >= T no skip) per head, as for every backend."""
    inputs = grouped_inputs(1, 3, 3, 9, 4, "separate")
    kw = dict(window=12, prior=0.3, logit_clamp=None, eps=1e-6, causal=False, variant="separate", sinks=1,
              period=(3, 20, 9), dropout_p=0.5)
    for name, e, a in zip(NAMES, _seeded("reference", inputs, 3, **kw), _seeded("fused", inputs, 3, **kw),
                          strict=True):
        assert_close(name, e, a)


def test_without_the_kernels_it_refuses_and_auto_runs_the_groups(monkeypatch):
    """No compiled kernels: "fused" refuses the call with the reason (it never runs "torch" in its place), and
    "auto" runs the next backend of its order once per period group, with the same dropout masks."""
    from piattn.ops.pi import fused

    monkeypatch.setattr(fused, "_state", {"functions": None, "reason": "switched off by the test"})
    inputs = grouped_inputs(2, 4, 2, 29, 8, "adaptive")
    kw = dict(window=3, prior=0.3, logit_clamp=2.5, eps=1e-6, causal=True, variant="adaptive", sinks=2,
              document_ids=DOCS, period=(2, 6, 11, 40), dropout_p=0.3)
    with pytest.raises(ValueError, match="backend 'fused' cannot run this call .*: switched off by the test"):
        _seeded("fused", inputs, 4, **kw)
    for name, e, a in zip(NAMES, _seeded("reference", inputs, 4, **kw), _seeded("auto", inputs, 4, **kw),
                          strict=True):
        assert_close(name, e, a)
