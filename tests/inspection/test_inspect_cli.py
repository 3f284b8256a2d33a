"""`piattn inspect` on tiny checkpoints: π and local language models side by side, a dense classifier."""

from __future__ import annotations

import json

import pytest

from piattn.cli import main
from utils import write_word_corpus

PNG = b"\x89PNG\r\n\x1a\n"


pytestmark = pytest.mark.usefixtures("one_thread")


def train(out, *flags):
    argv = ["train", "--n-layer", "2", "--d-model", "32", "--n-head", "2", "--batch-size", "2", "--steps", "3",
            "--warmup", "1", "--eval-every", "0", "--log-every", "1", "--device", "cpu", "--no-progress",
            "--out", str(out), *flags]
    assert main(argv) == 0
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("inspect")
    corpus = write_word_corpus(root / "corpus", {"train": [300, 300], "validation": [200, 200]})
    lm = ("--data", str(corpus), "--seq-len", "48", "--window", "3")
    return {
        "pi": train(root / "pi", *lm, "--attention", "pi", "--period", "8"),
        "local": train(root / "local", *lm, "--attention", "local"),
        "pi-gqa-sinks-packed": train(root / "pi-gqa-sinks-packed", *lm, "--attention", "pi", "--period", "8",
                                     "--n-kv-head", "1", "--sinks", "2", "--pack-documents"),
        "dense-listops": train(root / "dense-listops", "--task", "listops", "--seq-len", "48", "--attention", "dense",
                               "--train-size", "16", "--eval-size", "8"),
    }


def inspect(capsys, *argv):
    code = main(["inspect", *argv])
    captured = capsys.readouterr()
    return code, captured


def check_png(path):
    data = path.read_bytes()
    assert data.startswith(PNG) and len(data) > 20_000  # a drawn figure, not an empty canvas


def check_layers(layers, classes, n_layer=2):
    assert [e["layer"] for e in layers] == list(range(n_layer))
    for e in layers:
        assert set(e["mass"]) == classes
        assert sum(e["mass"].values()) == pytest.approx(1.0, abs=1e-5)
        assert all(sum(h.values()) == pytest.approx(1.0, abs=1e-5) for h in e["mass_by_head"])
        assert e["mean_distance"] > 0


def test_pi_beside_local(runs, tmp_path, capsys):
    out = tmp_path / "out"
    code, captured = inspect(capsys, "--checkpoint", str(runs["pi"]), "--compare", str(runs["local"]),
                             "--out", str(out), "--batches", "2", "--flow-window", "32")
    assert code == 0, captured.err
    report = json.loads((out / "inspect.json").read_text())
    assert report["model"]["attention"] == "pi" and report["split"] == "validation" and report["step"] == 3
    check_layers(report["layers"], {"local", "skip"})
    for e in report["layers"]:
        assert 0 < e["alpha_mean"] < 1 and len(e["alpha_by_head"]) == 2 and e["mass"]["skip"] > 0
    assert report["tokens"] == 2 * 2 * 48  # 2 batches of 2 sequences of 48 tokens
    flow = report["flow"]
    assert flow["position"] == 47 and flow["window"] == [16, 48] and len(flow["influence"]) == 2
    assert flow["influence"][0][flow["offsets"].index(-8)] > 0  # the skip key, after one layer

    other = report["compare"]
    assert other["model"]["attention"] == "local"
    check_layers(other["layers"], {"local"})
    assert not any("alpha_mean" in e for e in other["layers"])
    reached = [d for d, v in zip(other["flow"]["offsets"], other["flow"]["influence"][1], strict=True) if v > 0]
    assert min(reached) == -6  # two layers of window 3

    assert report["figures"] == {"token_flow": "token_flow.png", "gate_dynamics": "gate_dynamics.png",
                                 "skip_prior_by_phase": "skip_prior_by_phase.png"}
    check_png(out / "token_flow.png")
    check_png(out / "gate_dynamics.png")
    check_png(out / "skip_prior_by_phase.png")
    for e in report["layers"]:  # the gate figure (d): 1 − α by position modulo π
        assert len(e["skip_prior_by_phase"]) == 8 and all(0 < v < 1 for v in e["skip_prior_by_phase"])
    assert not any("skip_prior_by_phase" in e for e in other["layers"])
    assert "skip" in captured.out and "inspect.json" in captured.err


def test_pi_with_grouped_query_heads_sinks_and_packed_documents(runs, tmp_path, capsys):
    out = tmp_path / "out"
    code, captured = inspect(capsys, "--checkpoint", str(runs["pi-gqa-sinks-packed"]), "--out", str(out),
                             "--batches", "2")
    assert code == 0, captured.err
    report = json.loads((out / "inspect.json").read_text())
    assert report["model"] | {"n_kv_head": 1, "sinks": 2} == report["model"]
    check_layers(report["layers"], {"local", "skip", "sink"})
    assert all(e["mass"]["sink"] > 0 for e in report["layers"])
    assert report["figures"]["skip_prior_by_phase"] == "skip_prior_by_phase.png"
    check_png(out / "skip_prior_by_phase.png")
    assert "sink" in captured.out


def test_dense_classifier(runs, tmp_path, capsys):
    out = tmp_path / "out"
    code, captured = inspect(capsys, "--checkpoint", str(runs["dense-listops"]), "--out", str(out),
                             "--batches", "0", "--position", "0")
    assert code == 0, captured.err
    report = json.loads((out / "inspect.json").read_text())
    assert report["task"] == "listops" and report["metrics"]["examples"] == 8
    check_layers(report["layers"], {"all"})
    assert 0 < report["tokens"] < 8 * 48  # padding queries are not counted
    assert report["flow"]["causal"] is False and report["flow"]["sequences"] == 8
    check_png(out / "token_flow.png")
    assert not (out / "gate_dynamics.png").exists() and report["figures"]["gate_dynamics"] is None


def test_local_alone_has_no_gate_figure(runs, tmp_path, capsys):
    out = tmp_path / "out"
    code, _ = inspect(capsys, "--checkpoint", str(runs["local"]), "--out", str(out), "--batches", "1")
    assert code == 0
    assert (out / "token_flow.png").exists() and not (out / "gate_dynamics.png").exists()
    assert not (out / "skip_prior_by_phase.png").exists()
    assert "compare" not in json.loads((out / "inspect.json").read_text())


@pytest.mark.parametrize("flags,message", [
    (("--batches", "-1"), "--batches must be >= 0"),
    (("--flow-window", "0"), "--flow-window must be >= 1"),
    (("--position", "48"), "flow position must lie in [0, 47]"),
])
def test_bad_flags_are_one_line_errors(runs, tmp_path, capsys, flags, message):
    code, captured = inspect(capsys, "--checkpoint", str(runs["local"]), "--out", str(tmp_path / "o"), *flags)
    assert code == 2 and message in captured.err and "Traceback" not in captured.err
