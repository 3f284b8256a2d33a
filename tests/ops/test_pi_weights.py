"""pi_attention_weights: the weights the operator applies, with grouped-query heads, sinks and documents,
against the "torch" backend (another implementation of the same operator); its argument checks."""

from __future__ import annotations

import math

import pytest
import torch

import piattn
from piattn.config.pi import VARIANTS, PiSettings
from piattn.ops.pi.pattern import log_priors
from piattn.ops.pi.weights import pi_attention_weights
from utils import make_inputs


def documents(B: int, T: int) -> torch.Tensor:
    """[B, T] ids: documents of a few lengths, ids coming back (runs, not values, make documents)."""
    ids = torch.tensor([0] * 7 + [1] * 12 + [0] * 3 + [2] * (T - 22))
    return torch.stack([ids, ids.roll(5)])[:B]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_weights_applied_to_v_give_the_operator(variant, causal):
    q, _, _, gate = make_inputs(2, 4, 40, 8, variant=variant, requires_grad=False)
    _, k, v, _ = make_inputs(2, 2, 40, 8, variant="union", seed=1, requires_grad=False)  # H_kv = 2 of H = 4
    ids = documents(2, 40)
    settings = PiSettings(window=3, period=8, variant=variant, prior=0.3, sinks=2)
    w, key, valid = pi_attention_weights(q, k, gate, settings=settings, causal=causal, document_ids=ids)
    assert w.shape == (2, 4, 40, settings.window * (1 if causal else 2) + 1 + (1 if causal else 2) + 2)
    assert key.shape == valid.shape == (2, 40, w.shape[-1]) and key.dtype == torch.int64
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 40, dtype=torch.float64), atol=1e-12, rtol=0)
    assert (w * ~valid[:, None]).abs().max() == 0  # nothing on a slot that reads no key
    start = torch.tensor([0] * 7 + [7] * 12 + [19] * 3 + [22] * 18)
    assert bool((key[0][valid[0]] >= start[:, None].expand_as(key[0])[valid[0]]).all())  # inside the document
    heads = v.repeat_interleave(2, 1)  # query head h reads key/value head h // 2
    gathered = torch.stack([heads[b][:, key[b]] for b in range(2)])  # [B, H, T, |U|, D]
    y = (w.unsqueeze(-1) * gathered).sum(-2)
    expected = piattn.pi_attention(q, k, v, gate, causal=causal, document_ids=ids, backend="torch",
                                   **settings.as_kwargs())
    torch.testing.assert_close(y, expected, atol=1e-12, rtol=1e-12)


def test_slots_keep_the_settings_layout_when_the_text_is_shorter():
    """T < period: the skip slot is still there, invalid everywhere (slot m is one key class at every T)."""
    q, k, _, gate = make_inputs(1, 2, 5, 4, requires_grad=False)
    w, _, valid = pi_attention_weights(q, k, gate, settings=PiSettings(window=3, period=16, sinks=1))
    assert w.shape[-1] == 4 + 1 + 1 and not valid[..., 4].any() and w[..., 4].abs().max() == 0


def test_bad_arguments_are_named():
    q, k, _, gate = make_inputs(1, 4, 10, 4, requires_grad=False)
    with pytest.raises(ValueError, match="settings must be a piattn.config.PiSettings"):
        pi_attention_weights(q, k, gate, settings={"window": 3})
    with pytest.raises(ValueError, match="k and v have 3 heads"):
        pi_attention_weights(q, k[:, :3], gate)
    with pytest.raises(ValueError, match="document_ids must have shape"):
        pi_attention_weights(q, k, gate, document_ids=torch.zeros(1, 9, dtype=torch.long))


# Multi-scale π: 4 query heads on 2 key/value heads, window 3; π = 2 lies inside the window (no skip slot),
# π = 8 splits both key/value groups (heads 1 and 2), π = 13 has head 3 alone.
HEAD_PERIODS = (2, 8, 8, 13)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_per_head_periods_give_the_dense_weights_of_the_reference(variant, causal):
    """The dense [T, T] weights the reference operator applies (its output on one-hot values, D = T) are the
    per-head slot weights put in their keys' columns; each head's skip slot reads i ∓ π_h."""
    T = 24
    q, _, _, gate = make_inputs(2, 4, T, T, variant=variant, requires_grad=False)
    _, k, _, _ = make_inputs(2, 2, T, T, variant="union", seed=1, requires_grad=False)
    ids = torch.tensor([[0] * 4 + [1] * 20, [3] * 24])  # a short document, long ones that the skips reach
    settings = PiSettings(window=3, period=HEAD_PERIODS, variant=variant, prior=0.3, sinks=2)
    w, key, valid = pi_attention_weights(q, k, gate, settings=settings, causal=causal, document_ids=ids)
    n_local, n_skip = 3 * (1 if causal else 2) + 1, 1 if causal else 2
    assert w.shape == key.shape == valid.shape == (2, 4, T, n_local + n_skip + 2)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, T, dtype=torch.float64), atol=1e-12, rtol=0)
    assert (w * ~valid).abs().max() == 0 and not valid[:, 0, :, n_local:n_local + n_skip].any()  # π = 2: folded
    i = torch.arange(T)
    for h, p in enumerate(HEAD_PERIODS[1:], 1):
        back = valid[:, h, :, n_local]
        assert back.any() and torch.equal(key[:, h, :, n_local][back], (i - p).expand(2, T)[back])
    dense = w.new_zeros(2, 4, T, T).scatter_add_(-1, key, w)
    eye = torch.eye(T, dtype=torch.float64).expand(2, 2, T, T)
    expected = piattn.pi_attention(q, k, eye, gate, causal=causal, document_ids=ids, backend="reference",
                                   **settings.as_kwargs())
    torch.testing.assert_close(dense, expected, atol=1e-12, rtol=1e-12)


def test_per_head_periods_agree_with_one_period_per_head():
    """Each head's weights are those of a call with its period alone (its slots in the largest period's layout)."""
    q, k, _, gate = make_inputs(1, 4, 20, 4, requires_grad=False)
    w, key, valid = pi_attention_weights(q, k, gate, settings=PiSettings(window=3, period=HEAD_PERIODS))
    for h, p in enumerate(HEAD_PERIODS):
        head = slice(h, h + 1)
        one = pi_attention_weights(q[:, head], k[:, head], gate[:, head], settings=PiSettings(window=3, period=p))
        slots = list(range(one.weights.shape[-1]))
        torch.testing.assert_close(w[:, h:h + 1, :, slots], one.weights, atol=0, rtol=0)
        assert torch.equal(key[:, h, :, slots], one.key) and torch.equal(valid[:, h, :, slots], one.valid)


def test_bad_per_head_periods_are_named():
    q, k, _, gate = make_inputs(1, 4, 10, 4, requires_grad=False)
    with pytest.raises(ValueError, match="period has 3 entries; per-head periods need one per query head, H=4"):
        pi_attention_weights(q, k, gate, settings=PiSettings(period=(3, 5, 7)))
    for bad, message in (((3, 0, 5, 5), r"period\[1\] must be an int >= 1, got 0"),
                         ((3, 5.0, 5, 5), r"period\[1\] must be an int >= 1, got 5.0"),
                         ((3, -2, 5, 5), r"period\[1\] must be an int >= 1, got -2")):
        with pytest.raises(ValueError, match=message):
            PiSettings(period=bad)


def test_a_missing_gate_is_the_constant_prior():
    """Without a gate a gated variant takes α = prior for every query, in the weights as in the operator."""
    q, k, _, gate = make_inputs(1, 2, 12, 4, requires_grad=False)
    settings = PiSettings(window=2, period=5, prior=0.3)
    w, *_ = pi_attention_weights(q, k, None, settings=settings)
    fixed, *_ = pi_attention_weights(q, k, None, settings=PiSettings(window=2, period=5, prior=0.3, variant="fixed"))
    assert torch.equal(w, fixed)


@pytest.mark.parametrize("variant", VARIANTS)
def test_log_priors_of_each_variant(variant):
    """Hand-worked priors: α = 0.25 (the gate, or the fixed prior), ε = 0.01; zeros where no prior enters."""
    gate = torch.full((1, 1, 2), 0.25)
    local, skip = log_priors(variant, gate, 0.25, 0.01)
    expected = (math.log(0.25), math.log(0.75)) if variant in ("fixed", "adaptive") else (0.0, 0.0)
    assert float(torch.as_tensor(local).flatten()[0]) == pytest.approx(expected[0])
    assert float(torch.as_tensor(skip).flatten()[0]) == pytest.approx(expected[1])


def test_log_priors_refuses_a_variant_it_does_not_know():
    with pytest.raises(ValueError, match=r"variant must be one of \['union', 'separate', 'fixed', 'adaptive'\]"):
        log_priors("blend", None, 0.5, 1e-4)
