"""`piattn train --data my.txt` (a byte split, noted in one line) and `piattn.load` of the run it writes."""

from __future__ import annotations

import io
import shutil
import sys

import pytest
import torch

import piattn
from piattn.cli import main
from piattn.data.text import BOOK_SPLITS, is_auto_split
from piattn.data.tokenizers import CharTokenizer
from piattn.models import GPT, GPTConfig
from piattn.train.checkpoint import load_weights, read_config, read_latest

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hum "


def train(text_source, out, *extra):
    return main(["train", "--data", str(text_source), "--out", str(out), "--attention", "pi", "--n-layer", "1",
                 "--d-model", "32", "--n-head", "2", "--seq-len", "32", "--batch-size", "2", "--steps", "2",
                 "--warmup", "1", "--eval-every", "2", "--eval-batches", "1", "--save-every", "2",
                 "--log-every", "1", "--device", "cpu", "--no-progress", *extra])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A two-step char-level run on one text file; (run folder, stderr of `piattn train`)."""
    root = tmp_path_factory.mktemp("own-text")
    my_text = root / "my.txt"
    my_text.write_text(WORDS * 40, encoding="utf-8")  # 2,960 bytes
    capture = pytest.MonkeyPatch()
    err = io.StringIO()
    capture.setattr(sys, "stderr", err)
    try:
        code = train(my_text, root / "run", "--tokenizer", "char")
    finally:
        capture.undo()
    assert code == 0, err.getvalue()
    return root / "run", err.getvalue()


def test_training_on_one_file_notes_the_byte_split_in_one_line(run):
    _, err = run
    notes = [line for line in err.splitlines() if "90/5/5" in line]
    assert len(notes) == 1
    assert "validation 148 bytes (my.txt bytes 2664-2812)" in notes[0]
    assert "test 148 bytes (my.txt bytes 2812-2960)" in notes[0]


def test_load_returns_the_model_in_eval_mode_with_config_and_tokenizer(run):
    folder, _ = run
    model, config, tokenizer, task, checkpoint = piattn.load(folder)
    assert task == "lm" and checkpoint == read_latest(folder / "checkpoints")
    assert isinstance(config, GPTConfig) and isinstance(tokenizer, CharTokenizer) and not model.training
    assert next(model.parameters()).device.type == "cpu"
    # the same logits as the checkpoint's weights loaded by hand, from a checkpoint folder too
    reference = GPT(GPTConfig.from_dict(read_config(checkpoint)["model"])).eval()
    load_weights(reference, checkpoint)
    ids = torch.tensor([tokenizer.encode("the lazy dog hums")])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference(ids), rtol=0, atol=0)
        torch.testing.assert_close(piattn.load(checkpoint, device="cpu").model(ids), reference(ids), rtol=0, atol=0)


def test_load_refuses_a_foreign_or_corrupted_folder_in_one_line(run, tmp_path):
    folder, _ = run
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "model.txt").write_text("hello")
    for path, says in ((tmp_path / "notes", "no checkpoint at"), (tmp_path / "nowhere", "does not exist")):
        with pytest.raises(ValueError, match=f"^piattn.load: .*{says}") as err:
            piattn.load(path)
        assert "\n" not in str(err.value)
    broken = tmp_path / "broken"
    checkpoint = read_latest(folder / "checkpoints")
    shutil.copytree(checkpoint, broken)
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage" + bytes(100))
    with pytest.raises(ValueError, match="model.safetensors: not a readable safetensors file") as err:
        piattn.load(broken)
    assert "\n" not in str(err.value)


def test_load_a_run_of_another_task_has_no_tokenizer(tmp_path, capsys):
    out = tmp_path / "reach"
    assert main(["train", "--task", "reach", "--lag", "4", "--window", "2", "--n-layer", "1", "--d-model", "16",
                 "--n-head", "2", "--seq-len", "16", "--train-size", "16", "--eval-size", "8", "--batch-size", "4",
                 "--steps", "1", "--warmup", "0", "--eval-every", "0", "--device", "cpu", "--no-progress",
                 "--out", str(out)]) == 0
    loaded = piattn.load(out)
    assert loaded.task == "reach" and loaded.tokenizer is None and not loaded.model.training
    assert loaded.config == type(loaded.config).from_dict(read_config(loaded.checkpoint)["model"])


def test_training_on_the_books_scheme_is_not_taken_for_a_path(tmp_path, capsys):
    """`--data books:DIR` (the README's lines) trains on the books' fixed splits: the byte-split check once took
    "books:DIR" for a file name and refused it as missing."""
    books = tmp_path / "books"
    books.mkdir()
    for names in [*BOOK_SPLITS.values(), ["emma_pg158.txt"]]:  # the held-out books and one to train on
        for name in names:
            title = name.removesuffix(".txt")
            (books / name).write_text(f"*** START OF THIS PROJECT GUTENBERG EBOOK {title.upper()} ***\n\n"
                                      f"{WORDS * 8}\n\n*** END OF THIS PROJECT GUTENBERG EBOOK {title.upper()} ***\n")
    assert not is_auto_split(f"books:{books}")
    assert train(f"books:{books}", tmp_path / "run", "--tokenizer", "byte") == 0
    assert "byte split" not in capsys.readouterr().err  # the books' own splits, no 90/5/5 note
    assert read_latest(tmp_path / "run" / "checkpoints") is not None
