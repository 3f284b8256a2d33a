"""`piattn generate` on a checkpoint that `piattn train` wrote: streams the continuation, same as generate()."""

from __future__ import annotations

import pytest
import torch

from piattn.cli import main
from piattn.tasks.lm import load_language_model
from piattn.train.checkpoint import resolve_checkpoint


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    for split in ("train", "validation"):
        (root / "corpus" / split).mkdir(parents=True)
        (root / "corpus" / split / "a.txt").write_text("abcabd " * 60, encoding="utf-8")
    out = root / "run"
    argv = ["train", "--data", str(root / "corpus"), "--out", str(out), "--attention", "pi", "--n-layer", "1",
            "--d-model", "32", "--n-head", "2", "--seq-len", "32", "--batch-size", "2", "--steps", "2",
            "--warmup", "1", "--eval-every", "0", "--device", "cpu", "--no-progress"]
    assert main(argv) == 0
    return out


def test_generate_streams_what_the_model_generates(run_dir, capsys):
    assert main(["generate", "--checkpoint", str(run_dir), "--prompt", "abc", "--max-new-tokens", "20",
                 "--temperature", "0", "--stats"]) == 0
    captured = capsys.readouterr()
    model, tokenizer = load_language_model(resolve_checkpoint(run_dir), torch.device("cpu"))
    expected = model.generate(torch.tensor([tokenizer.encode("abc")]), 20, temperature=0)
    assert captured.out == tokenizer.decode(expected[0].tolist()) + "\n"
    # π ring: max(window 4, period 16) + 1 = 17 positions, k and v, 1 layer, 2 heads of 16, fp32 (4,352 bytes),
    # and its slot table, 2 · 17 int64 (272 bytes)
    assert "cache 4,624 bytes at position 22" in captured.err


@pytest.mark.parametrize("argv, match", [
    (["--max-new-tokens", "-1"], "--max-new-tokens"),
    (["--prompt", ""], "--prompt"),
])
def test_bad_arguments_give_one_line_errors(run_dir, capsys, argv, match):
    base = ["generate", "--checkpoint", str(run_dir), "--prompt", "abc"]
    assert main(base + argv) == 2
    assert match in capsys.readouterr().err


def test_missing_checkpoint_names_the_flag(tmp_path, capsys):
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompt", "x"]) == 2
    assert "--checkpoint" in capsys.readouterr().err
