"""`piattn train --period` with per-head and per-layer periods and schedules: the checkpoint stores the
resolved periods, and `piattn eval` / `piattn generate` rebuild that model from it."""

from __future__ import annotations

import pytest

from piattn.cli import main
from piattn.train.checkpoint import read_config
from utils import train_summary, write_word_corpus


def train(tmp_path, period: str):
    corpus = write_word_corpus(tmp_path / "corpus", {"train": [150, 250], "validation": [150], "test": [150]})
    run = tmp_path / "run"
    argv = ["train", "--data", str(corpus), "--out", str(run), "--attention", "pi", "--n-layer", "2", "--d-model",
            "32", "--n-head", "2", "--window", "2", "--period", period, "--seq-len", "32", "--batch-size", "2",
            "--steps", "2", "--warmup", "1", "--eval-every", "2", "--eval-batches", "1", "--save-every", "2",
            "--device", "cpu", "--no-progress"]
    assert main(argv) == 0
    return run


@pytest.mark.parametrize("period, stored", [("3,9/5,17", [[3, 9], [5, 17]]), ("4,8", [4, 8]),
                                            ("geometric:3", [3, 6])])
def test_train_stores_the_resolved_periods_and_eval_generate_rebuild(tmp_path, capsys, period, stored):
    run = train(tmp_path, period)
    checkpoint = train_summary(run, capsys)["checkpoint"]
    assert read_config(checkpoint)["model"]["period"] == stored
    assert main(["eval", "--checkpoint", str(run), "--use-stored-data", "--split", "test", "--device", "cpu"]) == 0
    assert main(["generate", "--checkpoint", str(run), "--prompt", "ab", "--max-new-tokens", "5", "--seed", "0",
                 "--device", "cpu"]) == 0


def test_cover_targets_the_sequence(tmp_path, capsys):
    run = train(tmp_path, "cover")
    periods = read_config(train_summary(run, capsys)["checkpoint"])["model"]["period"]
    from piattn.analysis.multiscale import schedule

    assert periods == [list(h) for h in schedule("cover", 2, 2, 2, target=31)]
    assert run.exists()


def test_bad_period_text_is_one_line(tmp_path, capsys):
    corpus = write_word_corpus(tmp_path / "corpus", {"train": [150], "validation": [150], "test": [150]})
    assert main(["train", "--data", str(corpus), "--out", str(tmp_path / "r"), "--period", "8,x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--period must be an int >= 1, per-head ints" in err[0]
