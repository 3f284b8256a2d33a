"""Inspection of a model with grouped-query heads, attention sinks and packed documents: what is read is what
the layer computes (each row of the probabilities sums to 1 and equals the layer's own attend, probed with
one-hot values), the mass report has a "sink" share, and the skip prior 1 − α by position modulo π."""

from __future__ import annotations

import pytest
import torch

from piattn.inspection import Inspector, columns, plot_skip_prior_by_phase
from piattn.inspection.probes import probe_columns
from piattn.ops.pi.pattern import document_bounds
from utils import tiny_model

T, WINDOW, PERIOD, SINKS = 30, 3, 8, 2
PNG = b"\x89PNG\r\n\x1a\n"


def packed(attention: str):
    """A 2-layer causal model (4 query heads, 2 key/value heads, 2 sinks, gates spread as in tests/utils.py's
    tiny_model), tokens [2, T] and their documents."""
    model = tiny_model(attention, n_head=4, n_kv_head=2, window=WINDOW, period=PERIOD, sinks=SINKS).double()
    idx = torch.randint(0, 50, (2, T), generator=torch.Generator().manual_seed(11))
    ids = torch.tensor([[0] * 9 + [1] * 13 + [2] * 8, [5] * 17 + [6] * 13])
    return model, idx, ids


def first_layer(model, idx, ids):
    """(layer 0, its input x, q, k as the layer computes them: RoPE positions restart per document)."""
    layer = model.blocks[0].attn
    x = model.blocks[0].ln1(model.embed(idx))
    start, _ = document_bounds(ids)
    q, k, _ = layer.heads(x, positions=torch.arange(T) - start)
    return layer, x, q, k


def truth(layer, q, k, x, ids):
    """[B, H, T, T]: the layer's own attend (the operator, with its documents) probed with one-hot values."""
    return torch.cat([p for _, p in probe_columns(layer, q, k, x, torch.arange(T), ids)], -1)


@pytest.mark.parametrize("attention", ["pi", "local", "dense"])
def test_probabilities_are_the_layers_own(attention):
    model, idx, ids = packed(attention)
    with torch.no_grad():
        layer, x, q, k = first_layer(model, idx, ids)
        assert k.shape[1] == 2 and q.shape[1] == 4  # grouped-query: a key/value head for two query heads
        expected = truth(layer, q, k, x, ids)
        everything = torch.arange(T)
        read = columns(layer, q, k, x, everything, everything, ids)
    torch.testing.assert_close(read.sum(-1), torch.ones(2, 4, T, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(read, expected, atol=1e-9, rtol=1e-9)
    assert read[0, :, 9:22, :9].abs().max() == 0  # document 1 reads nothing of document 0


def sink_share(p: torch.Tensor, ids: torch.Tensor, skip: int | None) -> float:
    """Mean over queries and heads of the probability on sink keys: the first SINKS keys of the query's
    document that are neither in its window nor its skip key i − `skip` (design.md §3.8: local > skip > sink)."""
    start, _ = document_bounds(ids)
    B, H = p.shape[:2]
    total = 0.0
    for b in range(B):
        for i in range(T):
            s = int(start[b, i])
            sinks = [j for j in range(s, s + SINKS) if j <= i and not i - WINDOW <= j <= i and j != i - (skip or 0)]
            total += float(p[b, :, i, sinks].sum())
    return total / (B * H * T)


@pytest.mark.parametrize("attention", ["pi", "local"])
def test_mass_report_has_a_sink_share(attention):
    model, idx, ids = packed(attention)
    with torch.no_grad(), Inspector(model, flow_window=T) as inspector:
        model(idx, document_ids=ids)
        layer, x, q, k = first_layer(model, idx, ids)
        expected = sink_share(truth(layer, q, k, x, ids), ids, PERIOD if attention == "pi" else None)
    report = inspector.result()
    for entry in report["layers"]:
        assert set(entry["mass"]) == ({"local", "skip", "sink"} if attention == "pi" else {"local", "sink"})
        assert sum(entry["mass"].values()) == pytest.approx(1.0, abs=1e-12)
        assert all(sum(h.values()) == pytest.approx(1.0, abs=1e-12) for h in entry["mass_by_head"])
    assert report["layers"][0]["mass"]["sink"] == pytest.approx(expected, rel=1e-9)
    assert expected > 0.01  # the sinks matter here, not a trivial 0
    for row in report["flow"]["influence"]:  # the causal flow window holds every path
        assert sum(row) == pytest.approx(1.0, abs=1e-9)


def test_skip_prior_by_phase_counts_positions_from_the_document_start(tmp_path):
    model, idx, ids = packed("pi")
    with torch.no_grad(), Inspector(model) as inspector:
        model(idx, document_ids=ids)
        layer, x, _, _ = first_layer(model, idx, ids)
        skip_prior = 1 - layer.gate_values(x).double().mean(1)  # [B, T], over heads
    start, _ = document_bounds(ids)
    phase = (torch.arange(T) - start) % PERIOD
    expected = [float(skip_prior[phase == p].mean()) for p in range(PERIOD)]
    report = inspector.result()
    assert report["layers"][0]["skip_prior_by_phase"] == pytest.approx(expected, rel=1e-12)
    assert all(len(e["skip_prior_by_phase"]) == PERIOD for e in report["layers"])

    png = plot_skip_prior_by_phase([("packed", report)], tmp_path / "phase.png")
    assert png.read_bytes().startswith(PNG)
    local, local_idx, local_ids = packed("local")
    with torch.no_grad(), Inspector(local) as ungated:
        local(local_idx, document_ids=local_ids)
    assert plot_skip_prior_by_phase([("local", ungated.result())], tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()


def test_a_phase_no_query_had_is_none():
    model = tiny_model("pi")
    with torch.no_grad(), Inspector(model) as inspector:
        model(torch.randint(0, 50, (1, 5), generator=torch.Generator().manual_seed(12)))  # T < π
    phases = inspector.result()["layers"][0]["skip_prior_by_phase"]
    assert len(phases) == PERIOD and all(v is not None for v in phases[:5]) and set(phases[5:]) == {None}
