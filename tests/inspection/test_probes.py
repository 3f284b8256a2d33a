"""Attention probabilities read by `piattn.inspection`: the slot and dense formulas against the layer's own
operator (probed with one-hot values), masses by hand for a 1-layer model, the token flow's reach."""

from __future__ import annotations

import math

import pytest
import torch

from piattn.inspection import Inspector, columns, layer_weights, masses
from piattn.inspection.probes import probe_columns, reader
from piattn.models import Encoder, EncoderConfig
from utils import tiny_model


def layer_inputs(model, idx):
    """(attention layer of block 0, its input x, q, k) in fp64."""
    block = model.blocks[0]
    x = block.ln1(model.embed(idx))
    q, k, _ = block.attn.heads(x)
    return block.attn, x, q, k


def probed(layer, q, k, x):
    T = q.shape[2]
    return torch.cat([p for _, p in probe_columns(layer, q, k, x, torch.arange(T))], -1)


@pytest.mark.parametrize("attention,variant,causal", [
    ("pi", "adaptive", True), ("pi", "adaptive", False), ("pi", "separate", True), ("pi", "fixed", False),
    ("local", "adaptive", True), ("dense", "adaptive", True), ("dense", "adaptive", False)])
def test_probabilities_match_the_operator(attention, variant, causal):
    torch.manual_seed(0)
    if causal:
        model = tiny_model(attention, variant=variant).double()
    else:
        cfg = EncoderConfig.from_name("tiny", attention=attention, variant=variant, vocab_size=50, n_layer=1,
                                      d_model=32, n_head=2, window=3, period=8, dropout=0.0)
        model = Encoder(cfg).double().eval()
        if attention == "pi" and variant in ("adaptive", "separate"):
            torch.nn.init.normal_(model.blocks[0].attn.gate[2].bias, std=2.0)
    idx = torch.randint(0, 50, (2, 29), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        layer, x, q, k = layer_inputs(model, idx)
        truth = probed(layer, q, k, x)  # [B, H, T, T] from the layer's own attend
        assert torch.allclose(truth.sum(-1), torch.ones(()).double(), atol=1e-9)
        everything = torch.arange(29)
        mine = columns(layer, q, k, x, everything, everything)
        assert reader(layer) == ("dense" if attention == "dense" else "slots")
        torch.testing.assert_close(mine, truth, atol=1e-9, rtol=1e-9)
        rows, cols = torch.arange(10, 25), torch.arange(5, 20)
        torch.testing.assert_close(columns(layer, q, k, x, rows, cols), truth[:, :, 10:25, 5:20], atol=1e-9, rtol=0)


@pytest.mark.parametrize("attention", ["longformer", "bigbird", "reformer"])
def test_other_kinds_are_read_by_probing_and_their_rows_sum_to_one(attention):
    model = tiny_model(attention).double()
    idx = torch.randint(0, 50, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        layer, x, q, k = layer_inputs(model, idx)
        mass, distance = masses(layer, q, k, x, torch.ones(1, 40, dtype=torch.bool))
    assert reader(layer) == "probe" and set(mass) == {"all"}
    torch.testing.assert_close(mass["all"], torch.full((2,), 40.0, dtype=torch.float64))
    assert (distance > 0).all()


def hand_skip_mass(model, idx, period, window):
    """Skip share of a 1-layer causal adaptive π model, averaged over all queries, written out per query."""
    layer, x, q, k = layer_inputs(model, idx)
    gate = layer.gate_values(x)
    eps, clamp = layer.settings.eps, layer.settings.logit_clamp
    B, H, T, D = q.shape
    total = 0.0
    for b in range(B):
        for h in range(H):
            for i in range(T):
                a = float(gate[b, h, i])
                z = {j: min(max(float(q[b, h, i] @ k[b, h, j]) / math.sqrt(D), -clamp), clamp)
                     for j in range(max(0, i - window), i + 1)}
                weights = {j: math.exp(s) * max(a, eps) for j, s in z.items()}
                skip = 0.0
                if i - period >= 0:
                    s = min(max(float(q[b, h, i] @ k[b, h, i - period]) / math.sqrt(D), -clamp), clamp)
                    skip = math.exp(s) * max(1 - a, eps)
                total += skip / (skip + sum(weights.values()))
    return total / (B * H * T)


def test_one_layer_skip_mass_by_hand():
    model = tiny_model("pi", n_layer=1).double()
    idx = torch.randint(0, 50, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), Inspector(model) as inspector:
        model(idx)
        expected = hand_skip_mass(model, idx, period=8, window=3)
    report = inspector.result()
    (layer,) = report["layers"]
    assert layer["kind"] == "pi" and set(layer["mass"]) == {"local", "skip"}
    assert layer["mass"]["skip"] == pytest.approx(expected, rel=1e-9)
    assert sum(layer["mass"].values()) == pytest.approx(1.0, abs=1e-12)
    assert all(sum(h.values()) == pytest.approx(1.0, abs=1e-12) for h in layer["mass_by_head"])
    assert 0 < expected < 0.5  # a case where the skip matters, not a trivial 0
    assert report["tokens"] == 48


def test_slot_probabilities_put_nothing_on_keys_outside_the_text():
    model = tiny_model("pi").double()
    idx = torch.randint(0, 50, (1, 6), generator=torch.Generator().manual_seed(4))  # T < period: no skip key
    with torch.no_grad():
        layer, x, q, k = layer_inputs(model, idx)
        w = layer_weights(layer, q, k, layer.gate_values(x)).weights
    assert w[..., -1].abs().max() == 0  # the skip slot
    assert w[:, :, 0, :3].abs().max() == 0  # query 0 has no key before it


def test_padding_queries_are_left_out():
    cfg = EncoderConfig.from_name("tiny", attention="pi", vocab_size=50, n_layer=1, d_model=32, n_head=2,
                                  window=3, period=8, dropout=0.0)
    model = Encoder(cfg).double().eval()
    idx = torch.randint(1, 50, (1, 20), generator=torch.Generator().manual_seed(5))
    idx[:, 12:] = 0  # padding
    with torch.no_grad(), Inspector(model) as inspector:
        model(idx)
    assert inspector.result()["tokens"] == 12


def flow_of(attention, n_layer, T=40, window=3, period=8):
    model = tiny_model(attention, n_layer=n_layer)
    idx = torch.randint(0, 50, (2, T), generator=torch.Generator().manual_seed(6))
    with torch.no_grad(), Inspector(model, flow_window=T) as inspector:
        model(idx)
    return inspector.result()["flow"]


def test_token_flow_reaches_k_per_layer_for_local_and_the_skip_for_pi():
    local, pi = flow_of("local", 3), flow_of("pi", 3)
    assert local["position"] == 39 and local["window"] == [0, 40] and local["offsets"][-1] == 0
    for flow in (local, pi):
        for row in flow["influence"]:  # a causal window holds every path: each row is a distribution
            assert sum(row) == pytest.approx(1.0, abs=1e-6)
    offsets = local["offsets"]
    for layer, row in enumerate(local["influence"], 1):
        reached = [d for d, v in zip(offsets, row, strict=True) if v > 0]
        assert min(reached) == -3 * layer  # window 3: k further back per layer
    first = dict(zip(offsets, pi["influence"][0], strict=True))
    assert first[-8] > 0 and first[-4] == 0  # after one layer π reaches the skip key, not between
    assert min(d for d, v in zip(offsets, pi["influence"][1], strict=True) if v > 0) == -16


def test_dense_flow_of_one_layer_is_half_identity_half_attention():
    model = tiny_model("dense", n_layer=1)
    idx = torch.randint(0, 50, (1, 30), generator=torch.Generator().manual_seed(7))
    with torch.no_grad(), Inspector(model, flow_window=10) as inspector:
        model(idx)
        layer, x, q, k = layer_inputs(model, idx)
        attention = probed(layer, q, k, x).mean(1)[0, 29, 20:30]
    flow = inspector.result()["flow"]
    assert flow["window"] == [20, 30]
    expected = 0.5 * attention + 0.5 * torch.eye(10)[-1]
    assert flow["influence"][0] == pytest.approx(expected.tolist(), abs=1e-6)
