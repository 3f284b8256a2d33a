"""Tokenizers: round trips, the ids they must produce, save/load, and their errors."""

from __future__ import annotations

import json
import random
import re
import sys

import pytest

from piattn.data.tokenizers import (
    BPETokenizer,
    ByteTokenizer,
    CharTokenizer,
    load_tokenizer,
    make_tokenizer,
)

NON_ASCII = "naïve café — 日本語 😀\r\n\ttabs"
SYLLABLES = ["ka", "lo", "mi", "nu", "re", "sa", "to", "vé", "日", "本", "😀", "qu", "x"]


@pytest.fixture(scope="module")
def generated_texts():
    """150 lines of made-up words: enough distinct pairs for a few hundred merges."""
    rng = random.Random(0)
    words = ["".join(rng.choices(SYLLABLES, k=rng.randint(1, 4))) for _ in range(400)]
    return [" ".join(rng.choices(words, weights=range(400, 0, -1), k=60)) + "\n" for _ in range(150)]


@pytest.fixture(scope="module")
def bpe(generated_texts):
    return BPETokenizer.train(generated_texts, vocab_size=300)


def test_byte_ids_are_utf8_bytes():
    tok = ByteTokenizer()
    assert tok.vocab_size == 256
    assert tok.encode("é") == [0xC3, 0xA9]
    assert tok.encode(NON_ASCII) == list(NON_ASCII.encode("utf-8"))
    assert tok.decode(tok.encode(NON_ASCII)) == NON_ASCII


def test_byte_decode_invalid_utf8_and_range():
    tok = ByteTokenizer()
    assert tok.decode([0x61, 0xFF, 0x62]) == "a\ufffdb"
    with pytest.raises(ValueError, match="ids must lie in"):
        tok.decode([256])


def test_char_ids_are_sorted_characters_and_unknowns_map_to_unk():
    tok = CharTokenizer.fit(["hello", "world"])
    assert tok.chars == list("dehlorw")
    assert tok.vocab_size == 8 and tok.unk_id == 7
    assert tok.encode("hold") == [2, 4, 3, 0]
    assert tok.encode("hez!") == [2, 1, 7, 7]
    assert tok.decode(tok.encode("hez!")) == "he\ufffd\ufffd"
    assert tok.decode(tok.encode("world hello".replace(" ", ""))) == "worldhello"


def test_char_fit_on_nothing_fails():
    with pytest.raises(ValueError, match="at least one character"):
        CharTokenizer.fit(["", ""])


def test_bpe_round_trip_and_vocab(bpe, generated_texts):
    assert bpe.vocab_size == 300
    for text in [*generated_texts[:10], NON_ASCII, "  double  spaces ", "unseen ⅞ xyz", ""]:
        assert bpe.decode(bpe.encode(text)) == text
    ids = bpe.encode(generated_texts[0])
    assert all(0 <= i < 300 for i in ids)
    # Merges were learned: far fewer tokens than bytes on text like the training text.
    assert len(ids) < len(generated_texts[0].encode("utf-8")) / 2


def test_bpe_vocab_size_must_cover_bytes(generated_texts):
    with pytest.raises(ValueError, match="vocab_size must be an integer >= 256"):
        BPETokenizer.train(generated_texts, vocab_size=100)


def test_bpe_without_tokenizers_package_says_how_to_install(monkeypatch, generated_texts):
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ImportError, match=r"pip install 'piattn\[bpe\]'"):
        BPETokenizer.train(generated_texts, vocab_size=300)


@pytest.mark.parametrize("kind", ["byte", "char", "bpe"])
def test_save_load_restores_the_same_encodings(kind, tmp_path, generated_texts, bpe):
    tok = {"byte": ByteTokenizer(), "char": CharTokenizer.fit(generated_texts), "bpe": bpe}[kind]
    tok.save(tmp_path / "tok")
    assert json.loads((tmp_path / "tok" / "tokenizer.json").read_text())["kind"] == kind
    restored = load_tokenizer(tmp_path / "tok")
    assert type(restored) is type(tok)
    assert restored.vocab_size == tok.vocab_size
    for text in [*generated_texts[:5], NON_ASCII]:
        assert restored.encode(text) == tok.encode(text)
        assert restored.decode(tok.encode(text)) == tok.decode(tok.encode(text))


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no saved tokenizer"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text(json.dumps({"kind": "wordpiece"}))
    with pytest.raises(ValueError, match="kind must be one of"):
        load_tokenizer(tmp_path)


def test_make_tokenizer(generated_texts):
    assert isinstance(make_tokenizer("byte"), ByteTokenizer)
    char = make_tokenizer("char", generated_texts)
    assert isinstance(char, CharTokenizer)
    assert set(char.chars) == set("".join(generated_texts))
    bpe = make_tokenizer("bpe", generated_texts, vocab_size=280)
    assert isinstance(bpe, BPETokenizer) and bpe.vocab_size == 280


@pytest.mark.parametrize("kind,texts,vocab_size,message", [
    ("words", ["a"], None, "kind must be one of"),
    ("char", None, None, "texts are required"),
    ("bpe", ["a"], None, "vocab_size is required"),
    ("byte", None, 300, "vocab_size must be None or 256"),
    ("char", ["a"], 50, "vocab_size must be None for kind='char'"),
])
def test_make_tokenizer_rejects_bad_arguments(kind, texts, vocab_size, message):
    with pytest.raises(ValueError, match=message):
        make_tokenizer(kind, texts, vocab_size)


# Damaged or crafted tokenizer folders: one ValueError naming the folder, never a file outside it.

def write_config(folder, config) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    text = config if isinstance(config, str) else json.dumps(config)
    (folder / "tokenizer.json").write_text(text)


@pytest.mark.parametrize("config,message", [
    (None, "no saved tokenizer .*tokenizer.json is missing"),
    ("{not json", "tokenizer.json is not valid JSON"),
    ('["byte"]', "tokenizer.json must hold a JSON object"),
    ({"chars": "ab"}, "kind must be one of"),
    ({"kind": "wordpiece"}, "kind must be one of"),
    ({"kind": "char"}, "'chars' must be a non-empty string"),
    ({"kind": "char", "chars": ["a", "bc"]}, "'chars' must be a non-empty string"),
    ({"kind": "bpe"}, "'model_file' must be a file name"),
    ({"kind": "bpe", "model_file": "bpe.json"}, "bpe.json is missing"),
])
def test_damaged_tokenizer_folder_is_a_value_error_naming_it(tmp_path, config, message):
    folder = tmp_path / "tok"
    if config is not None:
        write_config(folder, config)
    with pytest.raises(ValueError, match=message) as err:
        load_tokenizer(folder)
    assert str(folder) in str(err.value) and "\n" not in str(err.value)


def test_missing_tokenizer_folder_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match=f"no saved tokenizer in {re.escape(str(tmp_path / 'absent'))}"):
        load_tokenizer(tmp_path / "absent")


def test_corrupt_bpe_model_file_is_a_value_error(tmp_path, bpe):
    bpe.save(tmp_path / "tok")
    model = tmp_path / "tok" / "bpe.json"
    model.write_text(model.read_text()[:100])
    with pytest.raises(ValueError, match=f"{re.escape(str(model))}: not a readable BPE model") as err:
        load_tokenizer(tmp_path / "tok")
    assert "\n" not in str(err.value)


def test_bpe_without_tokenizers_package_on_load_is_a_value_error(monkeypatch, tmp_path, bpe):
    bpe.save(tmp_path / "tok")
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ValueError, match=r"pip install 'piattn\[bpe\]'"):
        load_tokenizer(tmp_path / "tok")


@pytest.mark.parametrize("model_file", ["../outside.json", "sub/../../outside.json", "ABSOLUTE", "link.json", ".",
                                        "", "sub/.."])
def test_tokenizer_metadata_cannot_reach_files_outside_its_folder(tmp_path, bpe, model_file):
    outside = tmp_path / "outside.json"
    bpe.model.save(str(outside))  # a valid model: only the check can stop it from being read
    folder = tmp_path / "tok"
    (folder / "sub").mkdir(parents=True)
    (folder / "link.json").symlink_to(outside)
    model_file = str(outside) if model_file == "ABSOLUTE" else model_file
    write_config(folder, {"kind": "bpe", "model_file": model_file})
    with pytest.raises(ValueError, match=f"{re.escape(str(folder))}.*'model_file' must be a file name inside"):
        load_tokenizer(folder)


def test_a_model_file_in_a_subfolder_is_allowed(tmp_path, bpe):
    folder = tmp_path / "tok"
    (folder / "sub").mkdir(parents=True)
    bpe.model.save(str(folder / "sub" / "model.json"))
    write_config(folder, {"kind": "bpe", "model_file": "sub/model.json"})
    assert load_tokenizer(folder).encode("kalo mi") == bpe.encode("kalo mi")
