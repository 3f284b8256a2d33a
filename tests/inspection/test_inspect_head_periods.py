"""Inspection of multi-scale π (a period per head and per layer): the probabilities read from the operator's
weights are the layer's own (probed with one-hot values), with grouped-query heads, sinks and packed
documents; the skip prior by phase is reported per distinct period over its heads; `piattn inspect` runs on
a checkpoint trained with `--period 4,8` and draws a line per layer and period."""

from __future__ import annotations

import json

import pytest
import torch

from piattn.cli import main
from piattn.inspection import Inspector, columns, plot_skip_prior_by_phase
from piattn.inspection.probes import probe_columns
from piattn.ops.pi.pattern import document_bounds
from utils import tiny_model, write_word_corpus

T, WINDOW = 30, 3
# layer 0: π = 2 inside the window, π = 8 splitting both key/value groups, π = 13; layer 1: two periods
PERIODS = [[2, 8, 8, 13], [5, 5, 9, 9]]
PNG = b"\x89PNG\r\n\x1a\n"

pytestmark = pytest.mark.usefixtures("one_thread")


def packed():
    model = tiny_model("pi", n_head=4, n_kv_head=2, window=WINDOW, period=PERIODS, sinks=1).double()
    idx = torch.randint(0, 50, (2, T), generator=torch.Generator().manual_seed(11))
    ids = torch.tensor([[0] * 6 + [1] * 24, [5] * 30])
    return model, idx, ids


def layer_inputs(model, idx, ids, layer: int):
    """(attention layer `layer`, its input x, q, k as it computes them: RoPE positions restart per document)."""
    x = model.embed(idx)
    for block in model.blocks[:layer]:
        x = block(x, document_ids=ids)
    attn = model.blocks[layer].attn
    x = model.blocks[layer].ln1(x)
    start, _ = document_bounds(ids)
    q, k, _ = attn.heads(x, positions=torch.arange(T) - start)
    return attn, x, q, k


@pytest.mark.parametrize("layer", [0, 1])
def test_probabilities_are_the_layers_own(layer):
    model, idx, ids = packed()
    with torch.no_grad():
        attn, x, q, k = layer_inputs(model, idx, ids, layer)
        assert attn.settings.period == tuple(PERIODS[layer])
        truth = torch.cat([p for _, p in probe_columns(attn, q, k, x, torch.arange(T), ids)], -1)
        everything = torch.arange(T)
        read = columns(attn, q, k, x, everything, everything, ids)
    torch.testing.assert_close(read.sum(-1), torch.ones(2, 4, T, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(read, truth, atol=1e-9, rtol=1e-9)


def test_masses_and_the_skip_prior_per_period(tmp_path):
    model, idx, ids = packed()
    with torch.no_grad(), Inspector(model) as inspector:
        model(idx, document_ids=ids)
        gates = [layer_inputs(model, idx, ids, i)[0].gate_values(layer_inputs(model, idx, ids, i)[1]).double()
                 for i in range(2)]
    report = inspector.result()
    start, _ = document_bounds(ids)
    position = torch.arange(T) - start
    for entry, periods, gate in zip(report["layers"], PERIODS, gates, strict=True):
        assert set(entry["mass"]) == {"local", "skip", "sink"}
        assert all(sum(h.values()) == pytest.approx(1.0, abs=1e-9) for h in entry["mass_by_head"])
        assert "skip_prior_by_phase" not in entry
        groups = entry["skip_prior_by_period"]
        assert [g["period"] for g in groups] == sorted(set(periods))
        for g in groups:
            p, heads = g["period"], g["heads"]
            assert heads == [h for h, ph in enumerate(periods) if ph == p]
            prior = 1 - gate[:, heads].mean(1)  # [B, T], over the period's heads
            expected = [float(prior[position % p == phase].mean()) for phase in range(p)]
            assert g["by_phase"] == pytest.approx(expected, rel=1e-12)
    assert report["layers"][0]["mass_by_head"][0]["skip"] == 0  # π = 2 lies inside the window: no skip key
    assert all(report["layers"][0]["mass_by_head"][h]["skip"] > 0 for h in (1, 2, 3))
    png = plot_skip_prior_by_phase([("multi-scale", report)], tmp_path / "phase.png")
    assert png.read_bytes().startswith(PNG)


def test_piattn_inspect_on_a_per_head_checkpoint(tmp_path, capsys):
    corpus = write_word_corpus(tmp_path / "corpus", {"train": [300, 300], "validation": [200, 200]})
    run = tmp_path / "run"
    assert main(["train", "--n-layer", "2", "--d-model", "32", "--n-head", "2", "--batch-size", "2", "--steps", "2",
                 "--warmup", "1", "--eval-every", "0", "--log-every", "1", "--device", "cpu", "--no-progress",
                 "--data", str(corpus), "--seq-len", "32", "--window", "2", "--attention", "pi", "--period", "4,8",
                 "--out", str(run)]) == 0
    out = tmp_path / "out"
    assert main(["inspect", "--checkpoint", str(run), "--out", str(out), "--batches", "1"]) == 0, capsys.readouterr()
    report = json.loads((out / "inspect.json").read_text())
    assert report["model"]["period"] == [4, 8]
    for entry in report["layers"]:
        assert entry["mass"]["skip"] > 0
        assert [(g["period"], g["heads"], len(g["by_phase"])) for g in entry["skip_prior_by_period"]] == [
            (4, [0], 4), (8, [1], 8)]
    assert report["figures"]["skip_prior_by_phase"] == "skip_prior_by_phase.png"
    assert (out / "skip_prior_by_phase.png").read_bytes().startswith(PNG)
