"""piattn.data.passkey: the passkey-in-text generator (distances, placement, determinism), its scoring on
fake models, and the paired bootstrap. Tokenizers and text are built here; the real books only where present."""

from __future__ import annotations

import math
import random
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from piattn.data import passkey as pk

TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
        "foolishness, it was the epoch of belief, it was the epoch of incredulity. ") * 8
BOOKS = Path(__file__).resolve().parents[3] / "shared" / "data" / "books"


class CharTokenizer:
    """One token per character (its code point): the space before the key is a token of its own."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [ord(c) for c in text]}

    @staticmethod
    def decode(ids) -> str:
        return "".join(chr(i) for i in ids)


class WordTokenizer:
    """Words with their leading space (" 12345" is one token, "12345" another), punctuation alone."""

    def __init__(self):
        self.vocab: dict[str, int] = {}

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        words = re.findall(r" ?\w+| ?[^\w\s]|\s", text)
        return {"input_ids": [self.vocab.setdefault(w, len(self.vocab)) for w in words]}


def char_stream() -> torch.Tensor:
    return torch.tensor([ord(c) for c in TEXT])


def test_char_template_hand_checked():
    t = pk.PasskeyTemplate(CharTokenizer())
    statement, offset, question, answer = t.pieces("12345")
    assert CharTokenizer.decode(statement) == " The pass key is 12345. Remember it."
    assert offset == len(" The pass key is ") == 17
    assert CharTokenizer.decode(question) == " What is the pass key? The pass key is "  # the lone space moved here
    assert CharTokenizer.decode(answer) == "12345"
    # statement 36, key at 17, question 39: with no filler the query (the question's last token) sits
    # 36 − 17 + 39 − 1 = 57 after the key's first digit
    assert t.min_distance() == 57
    assert t.length(57, prefix=3) == 3 + 17 + 57 + 1 + 5


def test_example_text_distance_and_placement_hand_checked():
    t = pk.PasskeyTemplate(CharTokenizer())
    stream = char_stream()
    ex = pk.make_example(t, stream, 60, random.Random(7), prefix=3)
    # replay the draws: the key first, then the span's start
    rng = random.Random(7)
    key = t.random_key(rng)
    start = rng.randrange(0, len(stream) - 6 + 1)  # prefix 3 + filler 60 − 57 = 3
    span = TEXT[start : start + 6]
    question = " What is the pass key? The pass key is "
    expected = span[:3] + f" The pass key is {key}. Remember it." + span[3:] + question + key
    assert ex.key == key and CharTokenizer.decode(ex.ids.tolist()) == expected
    assert ex.key_position == 3 + 17
    assert CharTokenizer.decode(ex.ids[ex.key_position : ex.key_position + 5].tolist()) == key
    assert ex.distance == 60 == ex.query_position - ex.key_position
    assert CharTokenizer.decode([int(ex.ids[ex.query_position])]) == " "
    assert torch.equal(ex.answer, ex.ids[-5:]) and ex.answer_start + ex.answer_length == len(ex.ids)
    assert len(ex.ids) == t.length(60, prefix=3)


@pytest.mark.parametrize("distance", [57, 58, 100, 333])
def test_every_answer_token_is_read_at_the_distance(distance):
    """Answer token j (predicted at query_position + j) is the statement's token key_position + j."""
    t = pk.PasskeyTemplate(CharTokenizer())
    ex = pk.make_example(t, char_stream(), distance, random.Random(distance), prefix=10)
    for j in range(ex.answer_length):
        assert int(ex.ids[ex.query_position + j + 1]) == int(ex.ids[ex.key_position + j])
        assert (ex.query_position + j) - (ex.key_position + j) == distance


def test_word_tokenizer_keeps_the_space_in_the_answer_token():
    tok = WordTokenizer()
    t = pk.PasskeyTemplate(tok)
    statement, offset, question, answer = t.pieces("12345")
    assert answer == tok(" 12345")["input_ids"] and len(answer) == 1
    assert statement[offset] == answer[0]
    stream = torch.tensor(tok(TEXT)["input_ids"])
    ex = pk.make_example(t, stream, 40, random.Random(0), prefix=4)
    assert ex.query_position - ex.key_position == 40 and int(ex.ids[-1]) == int(ex.ids[ex.key_position])


def test_too_short_a_distance_or_stream_is_refused():
    t = pk.PasskeyTemplate(CharTokenizer())
    with pytest.raises(ValueError, match="below this template's shortest, 57"):
        pk.make_example(t, char_stream(), 56, random.Random(0), prefix=0)
    with pytest.raises(ValueError, match="fewer than"):
        pk.make_example(t, char_stream()[:20], 100, random.Random(0), prefix=0)


def test_distance_bins_are_cut_after_powers_of_two():
    assert pk.distance_bins(19, 981) == [(19, 32), (33, 64), (65, 128), (129, 256), (257, 512), (513, 981)]
    assert pk.distance_bins(32, 100) == [(32, 64), (65, 100)]
    assert pk.distance_bins(5, 5) == [(5, 5)]
    assert pk.bins_beyond(pk.distance_bins(19, 981), 64) == [2, 3, 4, 5]
    assert pk.parse_bins("19-32, 33-64") == [(19, 32), (33, 64)]
    for bad in ("19-32,30-64", "32-19", "a-b", "19"):
        with pytest.raises(ValueError):
            pk.parse_bins(bad)


def test_evaluation_examples_fall_in_their_bins_and_are_deterministic():
    t = pk.PasskeyTemplate(CharTokenizer())
    bins = [(57, 64), (65, 128), (129, 200)]
    a = pk.evaluation_examples(t, char_stream(), bins, 4, seed=3, prefix=5)
    b = pk.evaluation_examples(t, char_stream(), bins, 4, seed=3, prefix=5)
    c = pk.evaluation_examples(t, char_stream(), bins, 4, seed=4, prefix=5)
    assert [e.bin for e in a] == [0] * 4 + [1] * 4 + [2] * 4
    assert all(bins[e.bin][0] <= e.distance <= bins[e.bin][1] for e in a)
    assert all(torch.equal(x.ids, y.ids) and x.key == y.key for x, y in zip(a, b, strict=True))
    assert any(not torch.equal(x.ids, y.ids) for x, y in zip(a, c, strict=True))
    # example i of bin b does not depend on how many others were drawn
    fewer = pk.evaluation_examples(t, char_stream(), bins, 2, seed=3, prefix=5)
    assert all(torch.equal(x.ids, y.ids) for x, y in zip(fewer[:2], a[:2], strict=True))
    assert torch.equal(fewer[2].ids, a[4].ids)
    with pytest.raises(ValueError, match="below the template's shortest"):
        pk.evaluation_examples(t, char_stream(), [(50, 64)], 1, seed=0, prefix=0)


def test_train_examples_depend_on_seed_and_step_only():
    t = pk.PasskeyTemplate(CharTokenizer())
    bins = [(57, 64), (65, 128)]
    x = [pk.train_example(t, char_stream(), bins, seed=1, step=s, prefix=2) for s in range(30)]
    assert torch.equal(pk.train_example(t, char_stream(), bins, seed=1, step=17, prefix=2).ids, x[17].ids)
    assert not torch.equal(pk.train_example(t, char_stream(), bins, seed=2, step=17, prefix=2).ids, x[17].ids)
    assert {e.bin for e in x} == {0, 1} and all(bins[e.bin][0] <= e.distance <= bins[e.bin][1] for e in x)


class Oracle(torch.nn.Module):
    """A fake causal LM that knows the example: logits put `margin` on the true next token; `wrong` (an
    offset from the end of the answer) is predicted as another token. It returns the last `logits_to_keep`
    positions only, as transformers' models do."""

    def __init__(self, example: pk.PasskeyExample, vocab: int = 128, wrong: int | None = None, margin: float = 10.0):
        super().__init__()
        self.example, self.vocab, self.wrong, self.margin = example, vocab, wrong, margin
        self.calls: list[dict] = []

    def forward(self, ids, use_cache=False, logits_to_keep=0, **kwargs):
        self.calls.append(dict(length=ids.shape[1], keep=logits_to_keep, **kwargs))
        full = self.example.ids
        assert torch.equal(ids[0], full[: ids.shape[1]])
        target = full[1 : ids.shape[1] + 1].clone()
        if self.wrong is not None:
            target[len(target) - self.wrong] = (target[len(target) - self.wrong] + 1) % self.vocab
        logits = torch.zeros(1, ids.shape[1], self.vocab)
        logits[0, torch.arange(ids.shape[1]), target] = self.margin
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


def test_scoring_on_a_fake_model():
    t = pk.PasskeyTemplate(CharTokenizer())
    ex = pk.make_example(t, char_stream(), 80, random.Random(1), prefix=4)
    right = Oracle(ex)
    r = pk.score_example(right, ex)
    assert r["correct"] and r["tokens"] == 5
    # −log softmax of a logit 10 among 127 zeros, exactly; the fp32 loss is log-sum-exp (≈ 10) minus 10, so its
    # error is a few ulps of 10 (1e-6 each), whatever order a CPU's vector units sum in
    expected_loss = math.log1p(127 * math.exp(-10.0))
    assert r["loss"] == pytest.approx(expected_loss, abs=1e-5)
    # one forward over all but the last token, keeping the answer's five positions
    assert right.calls == [dict(length=len(ex.ids) - 1, keep=5)]
    for wrong in (1, 3, 5):  # the last, a middle and the first key digit
        r = pk.score_example(Oracle(ex, wrong=wrong), ex)
        assert not r["correct"] and r["tokens"] == 4
    scores = pk.score_examples(Oracle(ex, wrong=2), [ex, ex])
    assert scores["correct"] == [False, False] and scores["tokens"] == [4, 4]
    mask = torch.zeros(1, 1, len(ex.ids) - 1, len(ex.ids) - 1)
    model = Oracle(ex)
    pk.score_examples(model, [ex], mask_for=lambda T: mask)
    assert model.calls[0]["attention_mask"] is mask
    loss = pk.answer_loss(Oracle(ex), ex)
    assert loss.ndim == 0 and float(loss) == pytest.approx(expected_loss, abs=1e-5)


def test_summaries_and_the_paired_bootstrap():
    assert pk.accuracy_by_bin([1, 0, 1, 1], [0, 0, 1, 1], 3) == [0.5, 1.0, None]
    same = pk.paired_bootstrap([1, 0, 1, 0], [1, 0, 1, 0], [0, 0, 1, 1])
    assert same["difference"] == same["low"] == same["high"] == 0.0 and same["n"] == 4
    better = pk.paired_bootstrap([1] * 8, [0] * 8, [0] * 4 + [1] * 4)
    assert better["difference"] == better["low"] == better["high"] == 1.0
    gen = torch.Generator().manual_seed(0)
    a = (torch.rand(200, generator=gen) < 0.6).int().tolist()
    b = (torch.rand(200, generator=gen) < 0.4).int().tolist()
    strata = [i % 4 for i in range(200)]
    r = pk.paired_bootstrap(a, b, strata, seed=1)
    assert r["low"] < r["difference"] < r["high"] and r == pk.paired_bootstrap(a, b, strata, seed=1)
    # the half-width of a difference of two independent ~0.5 proportions over 200 pairs is about 0.1
    assert 0.05 < (r["high"] - r["low"]) / 2 < 0.15
    with pytest.raises(ValueError, match="equal-length"):
        pk.paired_bootstrap([1, 0], [1], [0, 0])
    bins = [(57, 64), (65, 128), (129, 200)]
    c = pk.compare_beyond([1, 1, 0, 1, 1, 1], [1, 1, 0, 0, 0, 0], [0, 0, 1, 1, 2, 2], bins, 64)
    assert c["accuracy"] == 0.75 and c["reference_accuracy"] == 0.0 and c["n"] == 4 and c["difference"] == 0.75
    assert pk.compare_beyond([1], [0], [0], bins, 300) is None


def test_summarize_scores():
    t = pk.PasskeyTemplate(CharTokenizer())
    ex = pk.evaluation_examples(t, char_stream(), [(57, 64), (65, 128)], 2, seed=0, prefix=0)
    scores = dict(correct=[True, False, True, True], tokens=[5, 4, 5, 5], loss=[0.1, 1.0, 0.2, 0.2])
    record = pk.summarize_scores(scores, ex, 2, 3.21)
    assert record["accuracy"] == 0.75 and record["accuracy_by_bin"] == [0.5, 1.0]
    assert record["tokens_right_by_bin"] == [0.9, 1.0] and record["correct"] == [1, 0, 1, 1]
    assert record["loss_by_bin"] == pytest.approx([0.55, 0.2]) and record["seconds"] == 3.2


def test_filler_stream_reads_documents(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text(TEXT)
    assert CharTokenizer.decode(pk.filler_stream(str(path), None, CharTokenizer()).tolist()) == TEXT
    assert len(pk.filler_stream(str(path), None, CharTokenizer(), max_chars=50)) == 50


@pytest.mark.skipif(not BOOKS.is_dir(), reason="the books corpus (../shared/data/books) is not here")
def test_examples_from_the_test_books():
    stream = pk.filler_stream(f"books:{BOOKS}", "test", CharTokenizer(), max_chars=20_000)
    t = pk.PasskeyTemplate(CharTokenizer())
    ex = pk.evaluation_examples(t, stream, [(57, 64), (500, 600)], 2, seed=0, prefix=8)
    assert all(e.query_position - e.key_position == e.distance for e in ex)
    assert " The pass key is " in CharTokenizer.decode(ex[-1].ids.tolist())
