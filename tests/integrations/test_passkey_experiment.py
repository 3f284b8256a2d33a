"""experiments/passkey.py on a tiny random Llama and a made-up book corpus: the plan, the runs and their
records, exact resumption of an interrupted training run, and the summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from byte_llama import ByteTokenizer, tiny_llama  # noqa: E402

from piattn.data.text import BOOK_SPLITS  # noqa: E402
from utils import load_script  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "passkey.py"


@pytest.fixture(scope="module")
def experiment():
    return load_script(SCRIPT, "passkey_experiment")


@pytest.fixture
def books(tmp_path):
    folder = tmp_path / "books"
    folder.mkdir()
    text = "It was the best of times, it was the worst of times, it was the age of wisdom. " * 30
    for name in [*(n for names in BOOK_SPLITS.values() for n in names), "a_train_book_pg1.txt"]:
        (folder / name).write_text(f"*** START OF THE PROJECT GUTENBERG EBOOK X ***\n{text}\n"
                                   "*** END OF THE PROJECT GUTENBERG EBOOK X ***\n")
    return folder


@pytest.fixture
def tiny(experiment, monkeypatch):
    monkeypatch.setattr(experiment, "load_gguf_model", lambda path: (tiny_llama(max_positions=256), ByteTokenizer()))


def _argv(books, tmp_path, runs="runs", *extra):
    # bytes as tokens: distances 57 … 133 fit 160 tokens with a prefix of 4 (bins 57–64, 65–128, 129–133)
    return ["--books", str(books), "--context", "160", "--window", "64", "--period", "96", "--sinks", "2",
            "--prefix", "4", "--per-bin", "2", "--steps", "4", "--save-every", "2", "--seeds", "0",
            "--runs", str(tmp_path / runs), "--records", str(tmp_path / runs / "records"),
            "--out", str(tmp_path / "out" / "passkey"), "--no-progress", *extra]


def test_plan_lists_every_run_with_an_estimate(experiment, tiny, books, tmp_path, capsys):
    assert experiment.main(_argv(books, tmp_path, "runs", "--plan")) == 0
    out = capsys.readouterr().out
    for name in ("zero-shot/dense", "zero-shot/local", "zero-shot/pi", "zero-shot/multiscale",
                 "trained-gates/pi/seed0", "trained-gates/multiscale/seed0"):
        assert name in out
    assert "trained-gates/local" not in out  # local's gates cannot change it
    for name in ("trained-gates+qk/local/seed0", "trained-gates+qk/pi/seed0", "trained-gates+qk/multiscale/seed0"):
        assert name in out
    assert "total" in out and "4 steps + 6 test examples" in out
    timing = json.loads((tmp_path / "runs" / "timing.json").read_text())
    assert set(timing["test"]) == {"dense", "local", "pi", "multiscale"}
    assert set(timing["train"]) == {"gates/pi", "gates/multiscale", "gates+qk/local", "gates+qk/pi",
                                    "gates+qk/multiscale"}
    assert not list((tmp_path / "runs").rglob("zero-shot__*.json"))  # nothing run


def test_runs_resume_exactly_and_summarize(experiment, tiny, books, tmp_path, monkeypatch):
    # one call, every run
    assert experiment.main(_argv(books, tmp_path, "straight", "--train", "gates")) == 0
    summary = json.loads((tmp_path / "out" / "passkey.json").read_text())
    assert set(summary["runs"]) == {"zero-shot/dense", "zero-shot/local", "zero-shot/pi", "zero-shot/multiscale",
                                    "trained-gates/pi/seed0", "trained-gates/multiscale/seed0"}
    assert summary["bins"] == [[57, 64], [65, 128], [129, 133]] and summary["beyond_window_bins"] == [1, 2]
    r = summary["runs"]["trained-gates/pi/seed0"]
    assert r["steps"] == 4 and len(r["train_losses"]) == 4 and len(r["correct"]) == 6
    assert "zero-shot/dense" in summary["against_local"]
    assert (tmp_path / "out" / "passkey.md").read_text().startswith("# Passkey retrieval by distance")
    straight = torch.load(tmp_path / "straight" / "trained-gates__pi__seed0.train.pt", weights_only=False)

    # the same, interrupted: --limit stops after the zero-shot runs; then training dies after step 3 (saved at 2)
    assert experiment.main(_argv(books, tmp_path, "resumed", "--train", "gates", "--limit", "4")) == 0
    # 4 records and examples.json under --records, timing.json beside the training state
    assert len(list((tmp_path / "resumed" / "records").glob("*.json"))) == 4 + 1
    assert (tmp_path / "resumed" / "timing.json").is_file()
    calls = []
    real = experiment.answer_loss

    def dying(model, example, mask=None):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(model, example, mask)

    monkeypatch.setattr(experiment, "answer_loss", dying)
    with pytest.raises(KeyboardInterrupt):
        experiment.main(_argv(books, tmp_path, "resumed", "--train", "gates", "--only", "trained-gates/pi/*"))
    kept = torch.load(tmp_path / "resumed" / "trained-gates__pi__seed0.train.pt", weights_only=False)
    assert kept["step"] == 2 and len(kept["losses"]) == 2 and "optimizer" in kept
    monkeypatch.setattr(experiment, "answer_loss", real)
    assert experiment.main(_argv(books, tmp_path, "resumed", "--train", "gates")) == 0
    resumed = torch.load(tmp_path / "resumed" / "trained-gates__pi__seed0.train.pt", weights_only=False)
    assert resumed["step"] == 4 and resumed["losses"] == straight["losses"]
    assert "optimizer" not in resumed  # a finished run keeps its trained parameters only
    assert straight["params"].keys() == resumed["params"].keys() and len(straight["params"]) == 2 * 4  # 2 layers
    for name, t in straight["params"].items():
        torch.testing.assert_close(resumed["params"][name], t, rtol=0, atol=1e-7)
    # the gates moved from their start
    last_weights = [t for n, t in straight["params"].items() if n.endswith("pi_gate.2.weight")]
    assert any(bool(t.abs().sum() > 0) for t in last_weights)

    # other settings are refused rather than mixed
    with pytest.raises(SystemExit, match="other settings"):
        experiment.main(_argv(books, tmp_path, "resumed", "--train", "gates", "--lr", "0.1"))


def test_head_gates_train_one_bias_per_head(experiment):
    model = tiny_llama()
    from piattn.integrations.hf import convert_to_pi

    convert_to_pi(model, window=4, period=8, sinks=2, logit_clamp=None, gate_init_alpha=0.5)
    groups = experiment.trainable(model, "head-gates", 0.1, 0.0)
    assert [tuple(p.shape) for p in groups[0]["params"]] == [(4,), (4,)]  # 4 heads, 2 layers
    assert sum(p.requires_grad for p in model.parameters()) == 2
    groups = experiment.trainable(model, "gates+qk", 0.1, 0.01)
    assert len(groups) == 2 and len(groups[1]["params"]) == 4


def test_verdicts_follow_the_rule(experiment):
    dense = [dict(difference=0.6, low=0.5, high=0.7)] * 2
    v = experiment.verdict
    assert v(dense, [dict(difference=0.2, low=0.1, high=0.3)] * 2)["verdict"] == "supported"
    assert v(dense, [dict(difference=0.1, low=0.05, high=0.15)] * 2)["verdict"] == "inconclusive"  # < 25 % of 0.6
    assert v(dense, [dict(difference=0.02, low=-0.01, high=0.05)] * 2)["verdict"] == "refuted"
    assert v(dense, [dict(difference=-0.2, low=-0.3, high=-0.1)] * 2)["verdict"] == "refuted"  # worse
    assert v(dense, [dict(difference=0.2, low=0.1, high=0.3), dict(difference=0.0, low=-0.02, high=0.02)])[
        "verdict"] == "inconclusive"  # the seeds disagree
    assert v([dict(difference=0.01, low=-0.01, high=0.03)], [dict(difference=0.2, low=0.1, high=0.3)])[
        "verdict"] == "invalid"


def test_gates_and_qk_mode_trains_local_and_compares_with_it(experiment, tiny, books, tmp_path):
    argv = _argv(books, tmp_path, "qk", "--train", "gates+qk", "--steps", "2")
    assert experiment.main(argv) == 0
    summary = json.loads((tmp_path / "out" / "passkey.json").read_text())
    assert {"trained-gates+qk/local/seed0", "trained-gates+qk/pi/seed0"} <= set(summary["runs"])
    assert summary["against_local"]["trained-gates+qk/pi/seed0"]["reference"] == "trained-gates+qk/local/seed0"
    assert summary["against_local"]["trained-gates+qk/local/seed0"]["reference"] == "zero-shot/local"
    assert summary["settings"]["modes"]["gates+qk"]["lr_qk"] == 3e-5
    assert set(summary["verdicts"]) == {"zero-shot/pi", "zero-shot/multiscale", "trained-gates+qk/pi",
                                        "trained-gates+qk/multiscale"}
    state = torch.load(tmp_path / "qk" / "trained-gates+qk__pi__seed0.train.pt", weights_only=False)
    assert any(n.endswith("q_proj.weight") for n in state["params"])
