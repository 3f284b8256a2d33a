"""Tokenizers: round trips, the ids they must produce, save/load, and their errors."""

from __future__ import annotations

import json
import random
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
