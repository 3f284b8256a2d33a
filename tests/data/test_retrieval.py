"""AAN pair parsing on small TSVs written here; expected ids computed from Python's own bytes."""

from __future__ import annotations

import pytest
import torch

from piattn.data import retrieval

ROWS = [
    ("1", "P05-1001", "W04-2201", "Attention over citations.", "A résumé of parsing"),
    ("0.0", "A00-1002", "J93-2004", "short", ""),
    ("1.0", "N06-1020", "P02-1017", "x" * 5000, "tab-free text"),
]


def expected_ids(text: str, length: int) -> list[int]:
    data = list(text.encode("utf-8"))[:length]
    return [b + 1 for b in data] + [0] * (length - len(data))


def write(path, rows, header=False):
    lines = (["label\tid1\tid2\ttext1\ttext2"] if header else []) + ["\t".join(r) for r in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


@pytest.mark.parametrize("header", [False, True])
def test_read_pairs(tmp_path, header):
    path = tmp_path / "new_aan_pairs.eval.tsv"
    write(path, ROWS, header)
    ids, labels = retrieval.read_pairs(path, length=32)
    assert ids.shape == (3, 2, 32) and ids.dtype == torch.int64
    assert labels.tolist() == [1, 0, 1] and labels.dtype == torch.int64
    for row, (_, _, _, text1, text2) in enumerate(ROWS):
        assert ids[row, 0].tolist() == expected_ids(text1, 32)
        assert ids[row, 1].tolist() == expected_ids(text2, 32)
    assert (ids[1, 1] == retrieval.PAD_ID).all()  # empty text: all padding


def test_default_length_is_lras_4000(tmp_path):
    path = tmp_path / "pairs.tsv"
    write(path, ROWS[2:])
    ids, _ = retrieval.read_pairs(path)
    assert retrieval.MAX_LENGTH == 4000 and ids.shape == (1, 2, 4000)
    assert (ids[0, 0] == ord("x") + 1).all()  # 5000 bytes cut to 4000


def test_limit_and_empty_file(tmp_path):
    path = tmp_path / "pairs.tsv"
    write(path, ROWS)
    ids, labels = retrieval.read_pairs(path, length=8, limit=2)
    assert ids.shape == (2, 2, 8) and labels.tolist() == [1, 0]
    empty = tmp_path / "empty.tsv"
    empty.write_text("")
    ids, labels = retrieval.read_pairs(empty, length=8)
    assert ids.shape == (0, 2, 8) and labels.shape == (0,)


def test_undecodable_bytes_keep_their_value(tmp_path):
    path = tmp_path / "raw.tsv"
    path.write_bytes(b"1\ta\tb\t\xff\xfe ok\t\xc3\xa9\n")
    ids, _ = retrieval.read_pairs(path, length=6)
    assert ids[0, 0].tolist() == [256, 255, 33, 112, 108, 0]
    assert ids[0, 1].tolist() == [0xC3 + 1, 0xA9 + 1, 0, 0, 0, 0]


def test_encode_text():
    assert retrieval.encode_text("AB", length=4).tolist() == [66, 67, 0, 0]
    assert retrieval.VOCAB_SIZE == 257
    with pytest.raises(ValueError, match="length"):
        retrieval.encode_text("AB", length=0)


@pytest.mark.parametrize(("line", "message"), [
    ("1\tP05-1001\tW04-2201\tonly four fields", r":2: expected 5 tab-separated fields"),
    ("1\tP05-1001\tW04-2201\ta\tb\tc", r":2: expected 5 tab-separated fields"),
    ("2\tP05-1001\tW04-2201\ta\tb", r":2: label must be 0 or 1"),
    ("yes\tP05-1001\tW04-2201\ta\tb", r":2: label must be 0 or 1"),
])
def test_malformed_rows_raise(tmp_path, line, message):
    path = tmp_path / "bad.tsv"
    path.write_text("0\tA\tB\tfine\tfine\n" + line + "\n")
    with pytest.raises(ValueError, match=message):
        retrieval.read_pairs(path, length=4)


def test_bad_arguments_raise(tmp_path):
    path = tmp_path / "pairs.tsv"
    write(path, ROWS)
    with pytest.raises(ValueError, match="limit"):
        retrieval.read_pairs(path, limit=-1)
    with pytest.raises(ValueError, match="length"):
        retrieval.read_pairs(path, length=0)
