"""`piattn train --layers / --global-every / --nope-global`: the checkpoint keeps the hybrid stack, and
`--resume`, `piattn eval` (with its reach marks' description) and `piattn generate --stats` rebuild it."""

from __future__ import annotations

import pytest

from piattn.cli import main
from piattn.train.checkpoint import read_config
from utils import train_summary, write_word_corpus

ARGS = ["--n-layer", "2", "--d-model", "32", "--n-head", "2", "--window", "2", "--seq-len", "32", "--batch-size",
        "2", "--warmup", "1", "--eval-every", "2", "--eval-batches", "1", "--save-every", "2", "--device", "cpu",
        "--no-progress"]


def corpus(tmp_path):
    return write_word_corpus(tmp_path / "corpus", {"train": [150, 250], "validation": [150], "test": [150]})


def test_train_eval_resume_generate_with_a_hybrid_stack(tmp_path, capsys):
    run = tmp_path / "run"
    argv = ["train", "--data", str(corpus(tmp_path)), "--out", str(run), "--layers", "pi,dense", "--nope-global",
            "--period", "cover", *ARGS]
    assert main([*argv, "--steps", "2"]) == 0
    model = read_config(train_summary(run, capsys)["checkpoint"])["model"]
    assert model["layers"] == "pi,dense" and model["nope_global"] is True
    assert main(["eval", "--checkpoint", str(run), "--use-stored-data", "--split", "test", "--device", "cpu"]) == 0
    capsys.readouterr()
    assert main([*argv, "--steps", "4", "--resume"]) == 0
    assert train_summary(run, capsys)["step"] == 4
    assert main(["generate", "--checkpoint", str(run), "--prompt", "ab", "--max-new-tokens", "4", "--seed", "0",
                 "--device", "cpu", "--stats"]) == 0
    err = capsys.readouterr().err
    assert "layer 0: ring of" in err and "layer 1: dense, 5 of 6 positions" in err and "total:" in err


def test_global_every_is_a_layer_pattern(tmp_path, capsys):
    run = tmp_path / "run"
    # --window applies: the local layers take it, though the dense ones do not
    assert main(["train", "--data", str(corpus(tmp_path)), "--out", str(run), "--attention", "local",
                 "--global-every", "2", "--steps", "2", *ARGS]) == 0
    model = read_config(train_summary(run, capsys)["checkpoint"])["model"]
    assert model["layers"] == "local*1,dense"


@pytest.mark.parametrize("flags, words", [
    (["--layers", "pi,dense", "--global-every", "2"], "--layers and --global-every both set"),
    (["--layers", "pi,attn"], "--layers kinds must be among"),
    (["--layers", "dense,dense", "--window", "3"], "--window applies to"),
])
def test_refusals_are_one_line(tmp_path, capsys, flags, words):
    assert main(["train", "--data", str(corpus(tmp_path)), "--out", str(tmp_path / "r"), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0]
