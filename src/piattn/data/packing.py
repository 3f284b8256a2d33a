"""From documents to fixed-length training batches, for corpora larger than memory.

`tokenize_corpus` streams documents through a tokenizer into two .npy files (tokens, document starts) that
`load_corpus` memory-maps. `PackedSequences` cuts the token stream into sequences of seq_len + 1 tokens
(inputs and their next-token targets), and `SequenceLoader` batches them: shuffled per epoch from a seed,
sharded across ranks, and resumable from a checkpoint to exactly the batch where it stopped.

Three ways to cut (`PackedSequences`): inside each document (the default: a document's tail shorter than a
sequence is dropped), across documents as one stream (`cross_documents`: attention would mix documents),
or packed (`document_ids`): one stream whose items also carry each token's document index, so that the
model keeps attention inside each document and the loss skips the targets that start a new document.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from piattn.data.tokenizers import Tokenizer
from piattn.safe_files import atomic_save_npy, atomic_writer

from ..checks import is_int
from ..progress import progress_bar


@dataclass(frozen=True)
class TokenizedCorpus:
    """tokens: [N] unsigned ints, all documents back to back; doc_starts: [n_documents] int64 offsets."""

    tokens: np.ndarray
    doc_starts: np.ndarray

    @property
    def n_documents(self) -> int:
        return len(self.doc_starts)


def corpus_files(path: str | Path) -> tuple[Path, Path]:
    """The two files of the corpus at `path`: `<path>.tokens.npy` and `<path>.docs.npy`."""
    return Path(f"{path}.tokens.npy"), Path(f"{path}.docs.npy")


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id (0 … vocab_size-1) fits in it, else uint32: half the disk for common vocabularies."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def tokenize_corpus(documents: Iterable[str], tokenizer: Tokenizer, path: str | Path,
                    progress: bool = True) -> TokenizedCorpus:
    """Tokenize `documents` into `<path>.tokens.npy` and `<path>.docs.npy`, then memory-map them.

    Tokens go to a raw temporary file one document at a time, so memory holds one document, never the
    corpus; the .npy header is written once the total length is known. Files are replaced atomically, a
    link at their names (a cache folder made elsewhere) replaced rather than written through.
    """
    tokens_file, docs_file = corpus_files(path)
    tokens_file.parent.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(tokenizer.vocab_size)
    doc_starts: list[int] = []
    n_tokens = 0
    total = getattr(documents, "size_hint", None) or (len(documents) if hasattr(documents, "__len__") else None)
    with tempfile.TemporaryFile(dir=tokens_file.parent) as raw:
        for doc in progress_bar(total, desc="tokenizing", unit="doc", enabled=progress, iterable=documents):
            ids = np.asarray(tokenizer.encode(doc), dtype=np.int64)
            if ids.size and (ids.min() < 0 or ids.max() >= tokenizer.vocab_size):
                raise ValueError(f"tokenizer produced ids outside [0, {tokenizer.vocab_size})")
            doc_starts.append(n_tokens)
            raw.write(ids.astype(dtype).tobytes())
            n_tokens += ids.size
        if not doc_starts:
            raise ValueError("documents must not be empty")
        raw.seek(0)
        header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (n_tokens,)}
        with atomic_writer(tokens_file) as out:
            np.lib.format.write_array_header_1_0(out, header)
            shutil.copyfileobj(raw, out)
    atomic_save_npy(docs_file, np.asarray(doc_starts, dtype=np.int64))
    return load_corpus(path)


def load_corpus(path: str | Path) -> TokenizedCorpus:
    """The corpus that `tokenize_corpus(…, path)` wrote, tokens memory-mapped read-only.

    A missing file raises FileNotFoundError; a symbolic link, a truncated or corrupt file, or document starts
    that do not fit the tokens (files of two different corpora), raise ValueError naming the file: both mean
    "tokenize again".
    """
    tokens_file, docs_file = corpus_files(path)
    for file in (tokens_file, docs_file):
        if file.is_symlink():  # a file elsewhere would pass for the cache; tokenizing again replaces the link
            raise ValueError(f"{file}: a symbolic link, not a tokenized corpus")
        if not file.is_file():
            raise FileNotFoundError(f"no tokenized corpus at {path}: {file} is missing")
    arrays = []
    for file, mmap_mode in ((tokens_file, "r"), (docs_file, None)):
        try:
            array = np.load(file, mmap_mode=mmap_mode, allow_pickle=False)
        except (ValueError, OSError, EOFError) as err:
            raise ValueError(f"{file}: truncated or corrupt tokenized corpus ({err})") from None
        if not isinstance(array, np.ndarray) or array.ndim != 1 or array.dtype.kind not in "ui":
            raise ValueError(f"{file}: not a 1-D integer array; a damaged tokenized corpus")
        arrays.append(array)
    tokens, doc_starts = arrays
    n = len(tokens)
    if len(doc_starts) == 0 or doc_starts[0] != 0 or np.any(np.diff(doc_starts) < 0) or doc_starts[-1] > n:
        raise ValueError(f"{docs_file}: document starts do not fit the {n} tokens of {tokens_file}; "
                         "the two files come from different corpora")
    return TokenizedCorpus(tokens, doc_starts)


class PackedSequences:
    """Sequences of seq_len + 1 consecutive tokens: item i is [seq_len + 1] int64, inputs = [:-1], targets = [1:].

    Consecutive sequences overlap by one token (the last target of one is the first input of the next), so
    every token but a document's first is a target exactly once. Without `cross_documents` no sequence spans
    two documents, and each document's tail that cannot fill a sequence is dropped (`dropped_tokens`
    counts them); with it, the documents form one stream and only the stream's tail is dropped.

    With `document_ids` the documents form one stream as with `cross_documents`, and item i is a pair
    (tokens [seq_len + 1], document index [seq_len + 1]) of int64: the index into doc_starts of the
    document each token belongs to.

    tokens: [N] integer ids (a numpy memmap stays on disk); doc_starts: [n_documents] offsets into tokens,
    non-decreasing, the first 0.
    """

    def __init__(self, tokens, doc_starts, seq_len: int, cross_documents: bool = False, document_ids: bool = False):
        if not is_int(seq_len) or seq_len < 1:
            raise ValueError(f"seq_len must be an integer >= 1, got {seq_len!r}")
        if cross_documents and document_ids:
            raise ValueError("cross_documents and document_ids exclude each other: packed sequences (document_ids) "
                             "already run across documents, keeping attention inside each")
        self.tokens = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens)
        starts = np.asarray(doc_starts, dtype=np.int64)
        if self.tokens.ndim != 1 or starts.ndim != 1:
            raise ValueError(f"tokens and doc_starts must be 1-D, got shapes {self.tokens.shape} and {starts.shape}")
        n = len(self.tokens)
        if len(starts) == 0 or starts[0] != 0 or np.any(np.diff(starts) < 0) or starts[-1] > n:
            raise ValueError(f"doc_starts must be non-decreasing offsets in [0, {n}] starting at 0")
        self.seq_len = seq_len
        self.cross_documents = cross_documents
        self.document_ids = document_ids
        self._all_starts = starts
        window = seq_len + 1
        if cross_documents or document_ids:
            starts, ends = np.zeros(1, dtype=np.int64), np.full(1, n, dtype=np.int64)
        else:
            ends = np.append(starts[1:], n)
        lengths = ends - starts
        counts = np.where(lengths >= window, (lengths - 1) // seq_len, 0)
        if counts.sum() == 0:
            if cross_documents:
                raise ValueError(f"the token stream has {n} tokens, fewer than seq_len+1={window}")
            raise ValueError(f"no document has seq_len+1={window} tokens (the longest has {int(lengths.max())})")
        used = np.where(counts > 0, counts * seq_len + 1, 0)
        self.dropped_tokens = int((lengths - used).sum())
        keep = counts > 0
        self._starts = starts[keep]
        self._first_index = np.cumsum(counts[keep]) - counts[keep]
        self._len = int(counts.sum())

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> torch.Tensor:
        if not -self._len <= index < self._len:
            raise IndexError(f"index {index} out of range for {self._len} sequences")
        index %= self._len
        doc = int(np.searchsorted(self._first_index, index, side="right")) - 1
        start = int(self._starts[doc]) + (index - int(self._first_index[doc])) * self.seq_len
        # np.array copies, so a caller editing the tensor in place never writes into the corpus.
        tokens = torch.from_numpy(np.array(self.tokens[start:start + self.seq_len + 1], dtype=np.int64))
        if not self.document_ids:
            return tokens
        positions = np.arange(start, start + self.seq_len + 1)
        doc = np.searchsorted(self._all_starts, positions, side="right") - 1
        return tokens, torch.from_numpy(doc.astype(np.int64))


def _collate(items: list):
    """Stack dataset items into a batch: tensors into one tensor, tuples of tensors into a tuple of batches."""
    if isinstance(items[0], tuple):
        return tuple(torch.stack(parts) for parts in zip(*items, strict=True))
    return torch.stack(items)


class SequenceLoader:
    """Batches [batch_size, seq_len + 1] int64 of a PackedSequences-like dataset (a tuple of such batches when its
    items are tuples, e.g. tokens and document ids), shuffled, sharded, resumable.

    Epoch e visits the dataset in the order `torch.randperm(len, generator=Generator().manual_seed(seed + e))`
    (in index order when shuffle=False), the same on every rank; rank r takes every world_size-th index
    of it, so ranks see disjoint sequences. The order is trimmed to a multiple of world_size (and, with
    drop_last, of world_size * batch_size) so every rank takes the same number of steps per epoch.

    Iterating the loader yields batches forever, epoch after epoch; `epoch_batches()` yields the rest of the
    current epoch. `state_dict()` records (epoch, position) after the batches already taken.
    """

    def __init__(self, dataset, batch_size: int, seed: int = 0, shuffle: bool = True, rank: int = 0,
                 world_size: int = 1, drop_last: bool = True):
        for name, value, low in (("batch_size", batch_size, 1), ("world_size", world_size, 1), ("seed", seed, 0)):
            if not is_int(value) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if not is_int(rank) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an integer in [0, world_size={world_size}), got {rank!r}")
        self.dataset = dataset
        self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle
        self.rank, self.world_size, self.drop_last = rank, world_size, drop_last
        per_rank = len(dataset) // world_size
        self.batches_per_epoch = per_rank // batch_size if drop_last else -(-per_rank // batch_size)
        if self.batches_per_epoch == 0:
            raise ValueError(f"the dataset has {len(dataset)} sequences, too few for one batch of "
                             f"batch_size={batch_size} on each of world_size={world_size} ranks")
        self.per_rank = self.batches_per_epoch * batch_size if drop_last else per_rank
        self.epoch = 0
        self.position = 0
        self._order_epoch, self._order = -1, torch.empty(0, dtype=torch.int64)

    def _rank_order(self) -> torch.Tensor:
        """[per_rank] dataset indices of this rank for the current epoch."""
        if self._order_epoch != self.epoch:
            n = len(self.dataset)
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + self.epoch)
                order = torch.randperm(n, generator=generator)
            else:
                order = torch.arange(n)
            self._order = order[: self.per_rank * self.world_size][self.rank::self.world_size]
            self._order_epoch = self.epoch
        return self._order

    def next_batch(self) -> torch.Tensor:
        """The next batch, [B, seq_len + 1] int64; B is batch_size except maybe at an epoch's end without drop_last."""
        indices = self._rank_order()[self.position * self.batch_size:(self.position + 1) * self.batch_size]
        # Advance before returning, so a state_dict taken after this batch resumes at the one after it.
        self.position += 1
        if self.position == self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        return _collate([self.dataset[int(i)] for i in indices])

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            yield self.next_batch()

    def epoch_batches(self) -> Iterator[torch.Tensor]:
        """The batches left in the current epoch (all of them at its start)."""
        epoch = self.epoch
        while self.epoch == epoch:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "batch_size": self.batch_size,
                "world_size": self.world_size, "shuffle": self.shuffle, "drop_last": self.drop_last,
                "n_sequences": len(self.dataset)}

    def load_state_dict(self, state: dict) -> None:
        """Resume where `state` was taken; the loader must be configured as the one that produced it."""
        mine = self.state_dict()
        for key in ("seed", "batch_size", "world_size", "shuffle", "drop_last", "n_sequences"):
            if state[key] != mine[key]:
                raise ValueError(f"state {key}={state[key]!r} does not match this loader's {key}={mine[key]!r}; "
                                 "resuming would give different batches")
        if not 0 <= state["position"] < self.batches_per_epoch:
            raise ValueError(f"state position must lie in [0, {self.batches_per_epoch}), got {state['position']}")
        self.epoch, self.position = state["epoch"], state["position"]
