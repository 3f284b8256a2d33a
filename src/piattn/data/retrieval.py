"""LRA Retrieval (ACL Anthology Network): do two papers cite each other? Byte-level text pairs.

The release's files (`new_aan_pairs.train.tsv`, `.eval.tsv`, `.test.tsv`) have no header and five
tab-separated columns: label, id1, id2, text1, text2 (LRA reads them with header=False, quoting off and the
label as a float). `read_pairs` takes such files, with or without a header line naming the columns.

Encoding follows LRA's "char" tokenizer (tfds ByteTextEncoder): each UTF-8 byte b becomes id b + 1, id 0
is padding, so the vocabulary has 257 ids; each text is cut to its first `length` bytes (LRA: 4000) and
right-padded. Memory: a pair takes 2·length int64 ids (64 KB at 4000), about 9.4 GB for the 147,086
training pairs, so `limit` reads a prefix.
"""

from __future__ import annotations

from os import PathLike

import numpy as np
import torch

from ..checks import is_int
from . import lra_tsv

COLUMNS = ("label", "id1", "id2", "text1", "text2")
MAX_LENGTH = 4000
PAD_ID = 0
VOCAB_SIZE = 257


def _check_length(length: int) -> None:
    if not is_int(length) or length < 1:
        raise ValueError(f"length must be an integer >= 1, got {length!r}")


def _byte_ids(text: str, length: int) -> np.ndarray:
    """int16 [length]: byte ids of the first `length` bytes of text (undecodable bytes kept as read)."""
    data = text.encode("utf-8", "surrogateescape")[:length]
    ids = np.full(length, PAD_ID, dtype=np.int16)
    ids[: len(data)] = np.frombuffer(data, dtype=np.uint8).astype(np.int16) + 1  # byte 255 -> 256
    return ids


def encode_text(text: str, length: int = MAX_LENGTH) -> torch.Tensor:
    """int64 [length]: byte ids (byte + 1) of the text's first `length` UTF-8 bytes, right-padded with 0."""
    _check_length(length)
    return torch.from_numpy(_byte_ids(text, length)).long()


def _label(field: str, where: str) -> int:
    try:
        value = float(field)
    except ValueError:
        raise ValueError(f"{where}: label must be 0 or 1, got {field[:40]!r}") from None
    if value not in (0.0, 1.0):
        raise ValueError(f"{where}: label must be 0 or 1, got {field[:40]!r}")
    return int(value)


def read_pairs(path: str | PathLike, length: int = MAX_LENGTH,
               limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int64 [n, 2, length], labels int64 [n]) from an AAN pairs TSV; ids[:, 0] is text1, ids[:, 1] text2.

    limit: read at most this many pairs. A row without five fields or with a label other than 0/1 raises
    ValueError naming the file and line.
    """
    _check_length(length)
    if limit is not None and (not is_int(limit) or limit < 0):
        raise ValueError(f"limit must be None or an integer >= 0, got {limit!r}")
    ids, labels = [], []
    for number, (label, _, _, text1, text2) in lra_tsv.read_tsv(path, COLUMNS, header=None):
        if limit is not None and len(labels) == limit:
            break
        labels.append(_label(label, f"{path}:{number}"))
        ids.append(np.stack([_byte_ids(text1, length), _byte_ids(text2, length)]))
    if not ids:
        return torch.zeros(0, 2, length, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    return torch.from_numpy(np.stack(ids)).long(), torch.tensor(labels, dtype=torch.int64)
