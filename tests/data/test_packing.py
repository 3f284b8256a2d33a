"""Packing documents into sequences and batches, checked against sequences enumerated by hand."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from piattn.data.packing import PackedSequences, SequenceLoader, load_corpus, tokenize_corpus
from piattn.data.tokenizers import ByteTokenizer

# Document k holds the tokens 1000k, 1000k + 1, …: a token's document is token // 1000.
LENGTHS = [5, 17, 3, 40, 9, 0, 26, 1]


def distinct_range_corpus(lengths=LENGTHS):
    docs = [1000 * k + np.arange(n) for k, n in enumerate(lengths)]
    starts = np.cumsum([0, *lengths[:-1]])
    return np.concatenate(docs), starts, docs


def windows(stream, seq_len):
    """Every run of seq_len + 1 tokens starting at 0, seq_len, 2 seq_len, … that fits in `stream`."""
    return [list(stream[s:s + seq_len + 1]) for s in range(0, len(stream) - seq_len, seq_len)]


@pytest.mark.parametrize("seq_len", [1, 4, 8, 25])
def test_sequences_never_cross_documents(seq_len):
    tokens, starts, docs = distinct_range_corpus()
    packed = PackedSequences(tokens, starts, seq_len)
    got = [packed[i].tolist() for i in range(len(packed))]
    assert got == [w for doc in docs for w in windows(doc, seq_len)]
    for seq in got:
        assert len({t // 1000 for t in seq}) == 1
        assert seq == list(range(seq[0], seq[0] + seq_len + 1))
    covered = {t for seq in got for t in seq}
    assert packed.dropped_tokens == len(tokens) - len(covered)


def test_dropped_tokens_counts_each_short_tail():
    # seq_len 4: windows of 5 overlapping by one, so a document of length L uses 1 + 4 * ((L - 1) // 4) tokens.
    tokens, starts, _ = distinct_range_corpus([5, 17, 3, 40, 9, 0, 26, 1])
    packed = PackedSequences(tokens, starts, 4)
    assert len(packed) == 1 + 4 + 0 + 9 + 2 + 0 + 6 + 0
    assert packed.dropped_tokens == 0 + 0 + 3 + 3 + 0 + 0 + 1 + 1


@pytest.mark.parametrize("seq_len", [3, 10])
def test_cross_documents_concatenates_the_stream(seq_len):
    tokens, starts, _ = distinct_range_corpus()
    packed = PackedSequences(tokens, starts, seq_len, cross_documents=True)
    got = [packed[i].tolist() for i in range(len(packed))]
    assert got == windows(tokens, seq_len)
    assert any(len({t // 1000 for t in seq}) > 1 for seq in got)
    assert packed.dropped_tokens == len(tokens) - (len(got) * seq_len + 1)


def test_items_are_int64_and_indexable_from_the_end():
    tokens, starts, _ = distinct_range_corpus()
    packed = PackedSequences(tokens.astype(np.uint16), starts, 4)
    item = packed[-1]
    assert item.dtype == torch.int64 and item.shape == (5,)
    assert item.tolist() == [6020, 6021, 6022, 6023, 6024]
    with pytest.raises(IndexError):
        packed[len(packed)]


def test_no_sequence_fits():
    tokens, starts, _ = distinct_range_corpus([300, 700])
    with pytest.raises(ValueError, match=r"no document has seq_len\+1=1025 tokens \(the longest has 700\)"):
        PackedSequences(tokens, starts, 1024)
    with pytest.raises(ValueError, match=r"the token stream has 1000 tokens, fewer than seq_len\+1=1025"):
        PackedSequences(tokens, starts, 1024, cross_documents=True)


@pytest.mark.parametrize("starts,message", [([1, 3], "starting at 0"), ([0, 5, 3], "non-decreasing"),
                                            ([0, 99], r"in \[0, 10\]")])
def test_bad_doc_starts(starts, message):
    with pytest.raises(ValueError, match=message):
        PackedSequences(np.arange(10), starts, 2)


class HugeVocabTokenizer:
    vocab_size = 70_000

    def encode(self, text):
        return [69_999, *map(ord, text)]


def test_tokenize_corpus_writes_and_memory_maps(tmp_path):
    docs = ["abc", "", "héllo wörld", "z"]
    corpus = tokenize_corpus(docs, ByteTokenizer(), tmp_path / "sub" / "train", progress=False)
    encoded = [d.encode("utf-8") for d in docs]
    assert isinstance(corpus.tokens, np.memmap) and corpus.tokens.dtype == np.uint16
    assert corpus.tokens.tolist() == list(b"".join(encoded))
    assert corpus.doc_starts.tolist() == [0, 3, 3, 3 + len(encoded[2])]
    again = load_corpus(tmp_path / "sub" / "train")
    assert np.array_equal(again.tokens, corpus.tokens) and again.n_documents == 4
    # No temporary or partial file is left beside the two results.
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["train.docs.npy", "train.tokens.npy"]


def test_tokenize_corpus_uses_uint32_above_65536_ids(tmp_path):
    corpus = tokenize_corpus(["ab"], HugeVocabTokenizer(), tmp_path / "c", progress=True)
    assert corpus.tokens.dtype == np.uint32 and corpus.tokens.tolist() == [69_999, 97, 98]


def test_tokenize_corpus_errors(tmp_path):
    with pytest.raises(ValueError, match="documents must not be empty"):
        tokenize_corpus([], ByteTokenizer(), tmp_path / "empty", progress=False)

    class Broken(ByteTokenizer):
        def encode(self, text):
            return [300]

    with pytest.raises(ValueError, match=r"ids outside \[0, 256\)"):
        tokenize_corpus(["x"], Broken(), tmp_path / "broken", progress=False)
    with pytest.raises(FileNotFoundError, match="no tokenized corpus"):
        load_corpus(tmp_path / "absent")


def arange_dataset(n_sequences, seq_len=3):
    """Sequence i starts with token i * seq_len, so a batch row names its sequence: row[0] // seq_len."""
    return PackedSequences(np.arange(n_sequences * seq_len + 1), [0], seq_len)


def indices(batch, seq_len=3):
    return (batch[:, 0] // seq_len).tolist()


def test_loader_epochs_are_seeded_permutations():
    data = arange_dataset(20)
    loader = SequenceLoader(data, batch_size=4, seed=7)
    assert loader.batches_per_epoch == 5
    batches = list(loader.epoch_batches())
    assert all(b.shape == (4, 4) and b.dtype == torch.int64 for b in batches)
    epoch0 = [i for b in batches for i in indices(b)]
    assert epoch0 == torch.randperm(20, generator=torch.Generator().manual_seed(7)).tolist()
    epoch1 = [i for b in loader.epoch_batches() for i in indices(b)]
    assert sorted(epoch1) == list(range(20)) and epoch1 != epoch0
    same_seed = SequenceLoader(data, batch_size=4, seed=7)
    assert [i for b in same_seed.epoch_batches() for i in indices(b)] == epoch0
    other_seed = SequenceLoader(data, batch_size=4, seed=8)
    assert [i for b in other_seed.epoch_batches() for i in indices(b)] != epoch0


def test_loader_without_shuffle_keeps_order_and_last_partial_batch():
    loader = SequenceLoader(arange_dataset(10), batch_size=4, shuffle=False, drop_last=False)
    assert [indices(b) for b in loader.epoch_batches()] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["position"] == 0


@pytest.mark.parametrize("drop_last", [True, False])
def test_ranks_get_disjoint_shards_of_equal_length(drop_last):
    data, world_size = arange_dataset(23), 3
    shards = []
    for rank in range(world_size):
        loader = SequenceLoader(data, batch_size=2, seed=1, rank=rank, world_size=world_size, drop_last=drop_last)
        shards.append([i for b in loader.epoch_batches() for i in indices(b)])
    assert len({len(s) for s in shards}) == 1
    assert len(shards[0]) == (6 if drop_last else 7)
    everything = [i for s in shards for i in s]
    assert len(set(everything)) == len(everything)
    epoch_order = torch.randperm(23, generator=torch.Generator().manual_seed(1)).tolist()
    assert sorted(everything) == sorted(epoch_order[:len(everything)])


def test_resume_gives_exactly_the_batches_it_would_have_given():
    data = arange_dataset(17)
    loader = SequenceLoader(data, batch_size=4, seed=3, rank=1, world_size=2)
    assert loader.batches_per_epoch == 2
    stream = iter(loader)
    for _ in range(7):
        next(stream)
    state = loader.state_dict()
    expected = [next(stream) for _ in range(5)]
    resumed = SequenceLoader(data, batch_size=4, seed=3, rank=1, world_size=2)
    resumed.load_state_dict(state)
    resumed_stream = iter(resumed)
    got = [next(resumed_stream) for _ in range(5)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    # Not trivially equal: the five batches span three epochs with different orders.
    assert len({tuple(indices(b)) for b in expected}) > 1


def test_load_state_dict_rejects_another_configuration():
    state = SequenceLoader(arange_dataset(17), batch_size=4, seed=3).state_dict()
    with pytest.raises(ValueError, match="state seed=3 does not match this loader's seed=4"):
        SequenceLoader(arange_dataset(17), batch_size=4, seed=4).load_state_dict(state)
    with pytest.raises(ValueError, match="state n_sequences=17"):
        SequenceLoader(arange_dataset(18), batch_size=4, seed=3).load_state_dict(state)


@pytest.mark.parametrize("kwargs,message", [
    ({"batch_size": 0}, "batch_size must be an integer >= 1"),
    ({"batch_size": 2, "world_size": 2, "rank": 2}, r"rank must be an integer in \[0, world_size=2\)"),
    ({"batch_size": 4, "world_size": 2}, "too few for one batch"),
])
def test_loader_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SequenceLoader(arange_dataset(7), **kwargs)


def test_documents_to_batches(tmp_path):
    docs = ["x" * 50, "short", "y" * 33]
    corpus = tokenize_corpus(docs, ByteTokenizer(), tmp_path / "corpus", progress=False)
    packed = PackedSequences(corpus.tokens, corpus.doc_starts, seq_len=8)
    assert len(packed) == 6 + 0 + 4
    batch = next(iter(SequenceLoader(packed, batch_size=10, seed=0)))
    rows = sorted(bytes(row.tolist()).decode() for row in batch)
    assert rows == ["x" * 9] * 6 + ["y" * 9] * 4


@pytest.mark.parametrize("damage", ["truncated tokens", "garbage tokens", "garbage docs", "docs of another corpus",
                                    "2-D docs"])
def test_damaged_corpus_is_a_value_error_naming_the_file(tmp_path, damage):
    tokenize_corpus(["abcdef", "ghij"], ByteTokenizer(), tmp_path / "train", progress=False)
    tokens, docs = tmp_path / "train.tokens.npy", tmp_path / "train.docs.npy"
    if damage == "truncated tokens":
        tokens.write_bytes(tokens.read_bytes()[:-3])
    elif damage == "garbage tokens":
        tokens.write_bytes(b"garbage")
    elif damage == "garbage docs":
        docs.write_bytes(b"\x93NUMPY garbage")
    elif damage == "docs of another corpus":
        np.save(docs, np.array([0, 4, 50], dtype=np.int64))
    else:
        np.save(docs, np.zeros((2, 2), dtype=np.int64))
    file = tokens if "tokens" in damage else docs
    with pytest.raises(ValueError, match=re.escape(str(file))):
        load_corpus(tmp_path / "train")
