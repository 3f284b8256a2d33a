"""`piattn convert-eval --task passkey` on a tiny random Llama (the GGUF loader replaced), and the
configurations' patterns, multi-scale included."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from byte_llama import ByteTokenizer, tiny_llama  # noqa: E402

from piattn.cli import main  # noqa: E402
from piattn.commands import convert_eval  # noqa: E402
from piattn.integrations.hf.evaluation import configuration_pattern  # noqa: E402


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("It was the best of times, it was the worst of times. " * 40)
    return path


@pytest.fixture
def tiny(monkeypatch):
    import piattn.integrations.hf as hf

    loads = []
    monkeypatch.setattr(hf, "load_gguf_model", lambda path: loads.append(path) or (tiny_llama(), ByteTokenizer()))
    return loads


def _argv(corpus, out, *extra):
    # bytes as tokens: the shortest distance is 57, and 128 tokens with a prefix of 4 hold at most 101
    return ["convert-eval", "--task", "passkey", "--data", str(corpus), "--split", "none", "--context", "128",
            "--window", "60", "--period", "70", "--sinks", "2", "--per-bin", "3", "--prefix", "4", "--no-progress",
            "--out", str(out), *extra]


def test_passkey_writes_every_configuration(tmp_path, corpus, tiny):
    out = tmp_path / "out"
    assert main(_argv(corpus, out)) == 0
    results = json.loads((out / "passkey.json").read_text())
    assert list(results["configs"]) == list(convert_eval.PASSKEY_CONFIGS)
    assert results["bins"] == [[57, 64], [65, 101]]
    assert results["bin"] == [0, 0, 0, 1, 1, 1] and all(57 <= d <= 101 for d in results["distance"])
    assert max(results["tokens"]) <= 128
    for r in results["configs"].values():
        assert len(r["correct"]) == 6 and 0 <= r["accuracy"] <= 1 and len(r["accuracy_by_bin"]) == 2
    assert len(results["configs"]["ms-pi+sinks"]["periods"]) == 2
    md = (out / "passkey.md").read_text()
    assert "| pi+sinks |" in md and "Beyond the window (d > 60)" in md
    # a rerun with the same settings reuses the results: the model is not even loaded
    assert main(_argv(corpus, out)) == 0 and len(tiny) == 1


def test_local_window_past_every_distance_is_dense(tmp_path, corpus, tiny):
    out = tmp_path / "out"
    assert main(_argv(corpus, out, "--window", "127", "--configs", "dense,local")) == 0
    configs = json.loads((out / "passkey.json").read_text())["configs"]
    assert configs["local"]["loss"] == pytest.approx(configs["dense"]["loss"], abs=1e-4)


def test_mask_engine_gives_the_converted_models_answers(tmp_path, corpus, tiny):
    common = ["--configs", "local+sinks,pi+sinks", "--gate-alpha", "0.8", "--window", "16", "--period", "64"]
    assert main(_argv(corpus, tmp_path / "pi", *common)) == 0
    assert main(_argv(corpus, tmp_path / "mask", *common, "--engine", "mask", "--check-windows", "2")) == 0
    pi = json.loads((tmp_path / "pi" / "passkey.json").read_text())["configs"]
    mask = json.loads((tmp_path / "mask" / "passkey.json").read_text())["configs"]
    for name in ("local+sinks", "pi+sinks"):
        assert mask[name]["loss"] == pytest.approx(pi[name]["loss"], abs=2e-4)
        assert mask[name]["check"]["examples"] == 2 and mask[name]["check"]["max_abs_loss_difference"] < 1e-4


@pytest.mark.parametrize("extra, flag", [(["--engine", "mask", "--configs", "ms-pi+sinks"], "--engine"),
                                         (["--distances", "70-60"], "--distances"), (["--per-bin", "0"], "--per-bin"),
                                         (["--configs", "dense,nope"], "--configs")])
def test_bad_passkey_arguments_are_one_line_errors(tmp_path, corpus, extra, flag, capsys):
    assert main(_argv(corpus, tmp_path, *extra)) == 2
    assert flag in capsys.readouterr().err


def test_distances_that_do_not_fit_the_context_are_refused(tmp_path, corpus, tiny, capsys):
    assert main(_argv(corpus, tmp_path, "--distances", "57-64,65-102")) == 2
    assert "does not fit --context 128" in capsys.readouterr().err


def test_configuration_patterns():
    kw = dict(window=64, period=128, sinks=4, context=1024, hops=2, n_layer=30, n_head=9)
    assert configuration_pattern("dense", **kw) is None
    assert configuration_pattern("local+sinks", **kw) == dict(window=64, period=1024, sinks=4)
    assert configuration_pattern("pi", **kw) == dict(window=64, period=128, sinks=0)
    ms = configuration_pattern("ms-pi+sinks", **kw)
    assert ms["sinks"] == 4 and len(ms["period"]) == 30 and ms["period"][0] == ms["period"][2] != ms["period"][1]
    # docs/results.md §8b's periods: design_periods(64, 2, 9, 1023)
    assert ms["period"][0] == [129, 194, 259, 324, 389, 454, 519, 584, 649]
    assert ms["period"][1] == [714, 778, 842, 906, 959, 1, 1, 1, 1]
    with pytest.raises(ValueError, match="configuration must be one of"):
        configuration_pattern("nope", **kw)
