"""Gate statistics in metrics.jsonl: present for gated π runs on logging steps, absent for every other run."""

from __future__ import annotations

import pytest
import torch

from piattn.cli import main
from piattn.train.gates import GateMonitor, alpha_statistics, gated_layers
from piattn.train.metrics import read_metrics
from utils import tiny_model

STATS = ("mean", "std", "min", "max", "q05", "q25", "q50", "q75", "q95", "head_mean")


def reach_run(tmp_path, *flags):
    out = tmp_path / "run"
    window = [] if "dense" in flags else ["--window", "2"]
    argv = ["train", "--task", "reach", "--lag", "4", *window, "--n-layer", "2", "--d-model", "16",
            "--n-head", "2", "--seq-len", "16", "--train-size", "32", "--eval-size", "8", "--batch-size", "4",
            "--steps", "5", "--log-every", "2", "--eval-every", "0", "--warmup", "1", "--lr", "1e-2",
            "--device", "cpu", "--no-progress", "--out", str(out), *flags]
    assert main(argv) == 0
    return [r for r in read_metrics(out) if r["split"] == "train"]


def test_statistics_of_known_values():
    # head 0 holds 0.00 … 0.99, head 1 holds 1.00 … 1.99 (not gate values, but exact arithmetic)
    values = torch.stack([torch.arange(100) / 100, 1 + torch.arange(100) / 100]).reshape(1, 2, 100)
    stats = alpha_statistics(values)
    flat = values.flatten().double()
    assert stats["mean"] == pytest.approx(float(flat.mean()))
    assert stats["std"] == pytest.approx(float(flat.std(correction=0)))
    assert (stats["min"], stats["max"]) == (0.0, pytest.approx(1.99))
    assert stats["q50"] == pytest.approx(0.995)
    assert stats["q05"] == pytest.approx(float(torch.quantile(flat, 0.05)))
    assert stats["head_mean"] == pytest.approx([0.495, 1.495])


def test_monitor_captures_the_gates_a_forward_computes_and_only_inside_capture():
    model = tiny_model("pi")
    idx = torch.randint(0, 50, (3, 20), generator=torch.Generator().manual_seed(0))
    monitor = GateMonitor(model)
    assert monitor.layers == [b.attn for b in model.blocks]
    model(idx)  # outside capture: nothing recorded
    assert monitor.summary() == {}
    with torch.no_grad(), monitor.capture():
        model(idx)
        model(idx[:1])  # a second micro batch of another shape joins the same statistics
    stats = monitor.summary()
    with torch.no_grad():
        block = model.blocks[0]
        gates = torch.cat([block.attn.gate_values(block.ln1(model.embed(i))).flatten() for i in (idx, idx[:1])])
    assert stats["alpha/layer0/mean"] == pytest.approx(float(gates.double().mean()), rel=1e-6)
    assert stats["alpha/layer0/q50"] == pytest.approx(float(torch.quantile(gates.double(), 0.5)), rel=1e-6)
    assert {f"alpha/layer{i}/{s}" for i in (0, 1) for s in STATS} == set(stats)
    assert monitor.summary() == {}  # emptied
    with pytest.raises(RuntimeError), monitor.capture():
        raise RuntimeError
    model(idx)  # the observers were removed on the way out
    assert monitor.summary() == {}


@pytest.mark.parametrize("attention,variant", [("pi", "union"), ("pi", "fixed"), ("local", None), ("dense", None)])
def test_no_gated_layer_no_monitor(attention, variant):
    model = tiny_model(attention, variant=variant or "adaptive")
    assert gated_layers(model) == []
    monitor = GateMonitor(model)
    with monitor.capture():
        model(torch.zeros(1, 8, dtype=torch.long))
    assert not monitor.active and monitor.summary() == {}


def test_pi_adaptive_run_logs_alpha_per_layer_on_log_steps(tmp_path):
    records = reach_run(tmp_path, "--attention", "pi", "--period", "4", "--variant", "adaptive")
    assert [r["step"] for r in records] == [2, 4, 5]
    for r in records:
        assert {f"alpha/layer{i}/{s}" for i in (0, 1) for s in STATS} <= set(r)
        for i in (0, 1):
            s = {k: r[f"alpha/layer{i}/{k}"] for k in STATS}
            assert 0 < s["min"] <= s["q05"] <= s["q25"] <= s["q50"] <= s["q75"] <= s["q95"] <= s["max"] < 1
            assert len(s["head_mean"]) == 2 and s["std"] >= 0
    # the gate is trained: its statistics change between log steps
    assert records[0]["alpha/layer0/mean"] != records[-1]["alpha/layer0/mean"]


@pytest.mark.parametrize("flags", [("--attention", "local"), ("--attention", "dense"),
                                   ("--attention", "pi", "--period", "4", "--variant", "union")])
def test_runs_without_a_gate_log_no_alpha(tmp_path, flags):
    records = reach_run(tmp_path, *flags)
    assert records and not any("alpha" in key for r in records for key in r)
