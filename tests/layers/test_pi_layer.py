"""PiAttention (the layer): compatibility with the paper's appendix module, rotary, gate, training mode."""

from __future__ import annotations

import pytest
import torch

import piattn
from appendix_module import AppendixPiAttention
from piattn.layers.rotary import Rotary


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_appendix_state_dict_loads_strictly_and_matches(backend, causal):
    torch.manual_seed(0)
    appendix = AppendixPiAttention(48, 4, k=4, pi=16, causal=causal).double()
    layer = piattn.PiAttention(48, 4, window=4, period=16, causal=causal, logit_clamp=None,
                               backend=backend).double()
    layer.load_state_dict(appendix.state_dict(), strict=True)
    x = torch.randn(2, 70, 48, dtype=torch.float64, requires_grad=True)
    y_ref, y = appendix(x), layer(x)
    assert (y - y_ref).abs().max().item() <= 1e-12
    g_ref = torch.autograd.grad(y_ref.square().sum(), [x, *appendix.parameters()])
    g = torch.autograd.grad(y.square().sum(), [x, *layer.parameters()])
    for a, b in zip(g_ref, g, strict=True):
        assert (a - b).abs().max().item() <= 1e-10


def test_parameter_names_follow_the_appendix():
    names = set(piattn.PiAttention(32, 4).state_dict())
    assert names == {"qkv.weight", "qkv.bias", "out.weight", "out.bias",
                     "gate.0.weight", "gate.0.bias", "gate.2.weight", "gate.2.bias"}


@pytest.mark.parametrize("variant", ["union", "fixed"])
def test_ungated_variants_have_no_gate(variant):
    layer = piattn.PiAttention(32, 4, variant=variant)
    assert layer.gate is None and not any(n.startswith("gate") for n in layer.state_dict())
    assert layer(torch.randn(1, 20, 32)).shape == (1, 20, 32)


def test_gate_is_squeezed_into_eps_interval():
    layer = piattn.PiAttention(16, 2, eps=1e-2)
    with torch.no_grad():
        layer.gate[2].bias.fill_(100.0)  # σ saturates at 1
    a = layer.gate_values(torch.randn(1, 5, 16))
    assert a.shape == (1, 2, 5)
    torch.testing.assert_close(a, torch.full_like(a, 1 - 1e-2))


def test_dropout_only_in_training():
    torch.manual_seed(0)
    layer = piattn.PiAttention(32, 4, dropout=0.5)
    x = torch.randn(2, 30, 32)
    layer.eval()
    assert torch.equal(layer(x), layer(x))
    layer.train()
    assert not torch.equal(layer(x), layer(x))


def test_every_parameter_gets_a_gradient():
    layer = piattn.PiAttention(32, 4, rotary=True)
    layer(torch.randn(2, 40, 32)).sum().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_rotary_scores_depend_only_on_relative_position():
    rot = Rotary(8).double()
    q, k = torch.randn(2, 8, dtype=torch.float64)
    x = torch.stack([q, k]).view(1, 1, 2, 8)
    scores = []
    for shift in (0, 7, 100):
        r = rot(x.expand(1, 1, 2, 8).clone(), offset=shift)
        qs = rot(q.view(1, 1, 1, 8), offset=shift + 5)
        scores.append((qs[0, 0, 0] @ r[0, 0, 1]).item())  # query at shift+5, key at shift+1
    assert scores[0] == pytest.approx(scores[1], abs=1e-9) and scores[0] == pytest.approx(scores[2], abs=1e-9)
    # and rotation changes the score compared with no rotation
    assert scores[0] != pytest.approx((q @ k).item(), abs=1e-6)


def test_rotary_off_by_default_and_on_changes_output():
    torch.manual_seed(0)
    plain = piattn.PiAttention(32, 4)
    rotary = piattn.PiAttention(32, 4, rotary=True)
    rotary.load_state_dict(plain.state_dict())
    x = torch.randn(1, 25, 32)
    assert plain.rotary is None
    assert (plain(x) - rotary(x)).abs().max() > 1e-4


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="n_heads"):
        piattn.PiAttention(30, 4)
    with pytest.raises(ValueError, match="variant"):
        piattn.PiAttention(32, 4, variant="magic")
    with pytest.raises(ValueError, match="head_dim"):
        piattn.PiAttention(12, 4, rotary=True)


def test_registry_names_the_layer():
    assert piattn.layers.ATTENTION["pi"] is piattn.PiAttention


def test_bf16_layer_with_saturated_gate_runs():
    """A bf16 sigmoid at 1.0 must still give a gate inside (0, 1) (the squeeze is done in fp32)."""
    layer = piattn.PiAttention(32, 4).to(torch.bfloat16)
    with torch.no_grad():
        layer.gate[2].bias.fill_(50.0)
    x = torch.randn(1, 20, 32, dtype=torch.bfloat16)
    a = layer.gate_values(x)
    assert a.dtype == torch.float32 and bool((a < 1).all())
    assert torch.isfinite(layer(x)).all()
