"""ListOps generation against an oracle written here: a recursive-descent parser using numpy's median."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from piattn.data import listops

OPS = {"[MIN": min, "[MAX": max, "[MED": lambda a: int(np.median(a)), "[SM": lambda a: int(np.sum(a)) % 10}


def oracle(source: str) -> tuple[int, int, list[int]]:
    """(value, levels counting digits, argument counts of every operator) by recursive descent."""
    tokens = [t for t in source.split() if t not in "()"]
    arg_counts: list[int] = []

    def parse(i):
        if tokens[i].isdigit():
            return int(tokens[i]), 1, i + 1
        op, i, args, levels = tokens[i], i + 1, [], 0
        while tokens[i] != "]":
            value, sub_levels, i = parse(i)
            args.append(value)
            levels = max(levels, sub_levels)
        arg_counts.append(len(args))
        return OPS[op](args), levels + 1, i + 1

    value, levels, end = parse(0)
    assert end == len(tokens), "trailing tokens"
    return value, levels, arg_counts


@pytest.fixture(scope="module")
def sample():
    return listops.generate(50, seed=3)


def test_targets_match_the_oracle_and_bounds_hold(sample):
    assert len(sample) == 50
    assert len({s for s, _ in sample}) == 50  # distinct, as LRA's set-based generation
    for source, target in sample:
        tokens = source.split()
        assert 500 < len(tokens) < 2000
        assert set(tokens) <= set(listops.TOKENS[1:])
        value, levels, arg_counts = oracle(source)
        assert target == value == listops.evaluate(source)
        assert levels <= 10 and listops.depth(source) == levels
        assert arg_counts and all(2 <= c <= 10 for c in arg_counts)
        assert tokens.count("]") == len(arg_counts)


def test_deterministic_per_seed():
    assert listops.generate(5, seed=7) == listops.generate(5, seed=7)
    assert listops.generate(5, seed=7) != listops.generate(5, seed=8)


def test_generating_fifty_is_fast():
    start = time.perf_counter()
    listops.generate(50, seed=11)
    assert time.perf_counter() - start < 2.0


@pytest.mark.parametrize(("source", "value"), [
    ("[MED 3 8 2 9 ]", 5),  # sorted 2 3 8 9: floor((3 + 8) / 2) = 5, not the lower middle 3
    ("[MED 1 2 ]", 1),
    ("[MED 4 0 9 ]", 4),
    ("[SM 9 8 7 ]", 4),
    ("[MAX 2 9 [MIN 4 7 ] 0 ]", 9),
    ("[MIN [MAX 1 2 ] [SM 5 5 ] ]", 0),
    ("( ( ( [MAX 2 ) 9 ) ] )", 9),  # LRA's parenthesised file form
])
def test_evaluate_hand_examples(source, value):
    assert listops.evaluate(source) == value == oracle(source)[0]


def test_small_trees_respect_depth_and_args():
    for source, target in listops.generate(200, seed=1, min_length=3, max_length=60, max_depth=3, max_args=4):
        value, levels, arg_counts = oracle(source)
        assert target == value and levels <= 3 and all(2 <= c <= 4 for c in arg_counts)
        assert 3 < len(source.split()) < 60


@pytest.mark.parametrize("source", ["[MAX 1 2", "[MAX 1 2 ] ]", "[MAX ]", "1 2", "[FOO 1 ]", ""])
def test_evaluate_rejects_malformed(source):
    with pytest.raises(ValueError):
        listops.evaluate(source)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="max_args"):
        listops.generate(1, max_args=1)
    with pytest.raises(ValueError, match="min_length"):
        listops.generate(1, max_depth=3)  # at most 2 + 10·12 = 122 tokens < 500
    with pytest.raises(ValueError, match="max_length"):
        listops.generate(1, min_length=10, max_length=11)
    with pytest.raises(ValueError, match="widen"):  # only the 10 single digits fit, 11 asked for
        listops.generate(11, min_length=0, max_length=2, max_depth=1)


def test_tsv_round_trip(tmp_path, sample):
    path = tmp_path / "basic_test.tsv"
    listops.write_tsv(sample[:5], path)
    lines = path.read_text().splitlines()
    assert lines[0] == "Source\tTarget" and len(lines) == 6
    assert lines[1] == f"{sample[0][0]}\t{sample[0][1]}"
    assert listops.read_tsv(path) == sample[:5]


def test_reads_lra_parenthesised_file(tmp_path):
    path = tmp_path / "basic_val.tsv"
    path.write_text("Source\tTarget\n( ( ( [MAX 2 ) 9 ) ( ( [MIN 4 ) 7 ) ] ) ] )\t9\n")
    [(source, target)] = listops.read_tsv(path)
    assert target == 9 == listops.evaluate(source)
    ids = listops.encode([source, "[MAX 2 9 [MIN 4 7 ] ]"], length=12)
    assert torch.equal(ids[0], ids[1])


@pytest.mark.parametrize(("text", "message"), [
    ("[MAX 1 2 ]\t3\n", "header"),
    ("Source\tTarget\n[MAX 1 2 ]\t12\n", "Target"),
    ("Source\tTarget\n[MAX 1 2 ]\n", "2 tab-separated"),
])
def test_read_tsv_rejects_malformed(tmp_path, text, message):
    path = tmp_path / "bad.tsv"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        listops.read_tsv(path)


def test_encode_ids_and_padding():
    ids = listops.encode(["[MAX 2 9 [MIN 4 7 ] 0 ]"], length=12)
    tokens = ["[MAX", "2", "9", "[MIN", "4", "7", "]", "0", "]"]
    expected = [listops.TOKENS.index(t) for t in tokens] + [listops.PAD_ID] * 3
    assert ids.dtype == torch.int64 and ids.tolist() == [expected]
    assert listops.PAD_ID == 0 and listops.VOCAB_SIZE == 16
    with pytest.raises(ValueError, match="length"):
        listops.encode(["[MAX 2 9 ]"], length=3)


def test_class_balance():
    examples = [("1", 1), ("1", 1), ("9", 9), ("0", 0)]
    assert listops.class_balance(examples) == {**dict.fromkeys(range(10), 0.0), 1: 0.5, 9: 0.25, 0: 0.25}
    assert listops.targets(examples).tolist() == [1, 1, 9, 0]
