"""Tokenizers behind one small interface: bytes, characters, or byte-level BPE.

Every tokenizer has `encode(text) -> list[int]`, `decode(ids) -> str`, `vocab_size` and `save(directory)`;
`load_tokenizer(directory)` restores whichever kind was saved. A saved directory always holds
`tokenizer.json` with a "kind" field; BPE keeps its trained model beside it in `bpe.json`, the file format
of the Hugging Face `tokenizers` library, so other tools can read it too.

`load_tokenizer` treats the folder as untrusted data: a missing or damaged file raises one ValueError naming
the folder or file, and a file name stored in `tokenizer.json` may only name a file inside the folder.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

from piattn.data.text import MissingPackageError

from ..checks import is_int

CONFIG_FILE = "tokenizer.json"
BPE_MODEL_FILE = "bpe.json"
KINDS = ("byte", "char", "bpe")


class TokenizerNotFoundError(ValueError, FileNotFoundError):
    """No saved tokenizer in a folder: a ValueError (the CLI prints it as one line) and a FileNotFoundError."""


class Tokenizer(Protocol):
    kind: str

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def save(self, directory: str | Path) -> None: ...


def _write_config(directory: str | Path, config: dict) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=1), encoding="utf-8")
    return directory


def _check_ids(ids: Sequence[int], vocab_size: int) -> None:
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"ids must lie in [0, {vocab_size}), got {bad[:5]}")


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, nothing to fit, every string encodable."""

    kind = "byte"

    @property
    def vocab_size(self) -> int:
        return 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        _check_ids(ids, 256)
        # A model may sample byte sequences that are not valid UTF-8; show them as U+FFFD, never fail.
        return bytes(ids).decode("utf-8", errors="replace")

    def save(self, directory: str | Path) -> None:
        _write_config(directory, {"kind": self.kind})


class CharTokenizer:
    """One token per character of a fitted character set; characters outside it map to `unk_id`.

    Ids 0 … len(chars)-1 are the sorted characters (the same ids as nanoGPT's `shakespeare_char`), and
    `unk_id = len(chars)` is the last id. `decode` writes the unknown id as U+FFFD, so decoded text keeps
    one character per token.
    """

    kind = "char"
    unk_text = "\ufffd"

    def __init__(self, chars: Iterable[str]):
        self.chars = sorted(set(chars))
        if not self.chars or any(len(c) != 1 for c in self.chars):
            raise ValueError("chars must be a non-empty collection of single characters")
        self.unk_id = len(self.chars)
        self._ids = {c: i for i, c in enumerate(self.chars)}
        self._texts = [*self.chars, self.unk_text]

    @classmethod
    def fit(cls, texts: Iterable[str]) -> CharTokenizer:
        chars: set[str] = set()
        for text in texts:
            chars.update(text)
        if not chars:
            raise ValueError("texts must contain at least one character to fit a CharTokenizer")
        return cls(chars)

    @property
    def vocab_size(self) -> int:
        return len(self.chars) + 1

    def encode(self, text: str) -> list[int]:
        return [self._ids.get(c, self.unk_id) for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        _check_ids(ids, self.vocab_size)
        return "".join(self._texts[i] for i in ids)

    def save(self, directory: str | Path) -> None:
        _write_config(directory, {"kind": self.kind, "chars": "".join(self.chars)})


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError as err:
        raise MissingPackageError(
            "the BPE tokenizer needs the Hugging Face `tokenizers` package: pip install 'piattn[bpe]'"
        ) from err
    return tokenizers


class BPETokenizer:
    """GPT-2 style byte-level BPE (Hugging Face `tokenizers`): any string encodes, decoding is exact."""

    kind = "bpe"

    def __init__(self, model):
        """`model`: a trained `tokenizers.Tokenizer`; use `BPETokenizer.train` or `load_tokenizer`."""
        self.model = model

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, min_frequency: int = 2,
              show_progress: bool = False) -> BPETokenizer:
        """Learn merges on `texts` until the vocabulary holds `vocab_size` tokens (fewer if the text runs out).

        The 256 byte symbols are always in the vocabulary, so `vocab_size` must be at least 256.
        """
        if not is_int(vocab_size) or vocab_size < 256:
            raise ValueError(f"vocab_size must be an integer >= 256 (the byte alphabet), got {vocab_size!r}")
        tk = _import_tokenizers()
        model = tk.Tokenizer(tk.models.BPE())
        model.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        model.decoder = tk.decoders.ByteLevel()
        trainer = tk.trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
            show_progress=show_progress,
        )
        model.train_from_iterator(texts, trainer=trainer)
        return cls(model)

    @property
    def vocab_size(self) -> int:
        return self.model.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.model.encode(text).ids

    def decode(self, ids: Sequence[int]) -> str:
        _check_ids(ids, self.vocab_size)
        return self.model.decode(list(ids))

    def save(self, directory: str | Path) -> None:
        directory = _write_config(directory, {"kind": self.kind, "model_file": BPE_MODEL_FILE})
        self.model.save(str(directory / BPE_MODEL_FILE))


def _one_line(err: BaseException, limit: int = 200) -> str:
    lines = str(err).strip().splitlines()
    text = (lines[0] if lines else type(err).__name__)[:limit]
    return text


def _model_path(directory: Path, config_path: Path, name) -> Path:
    """The file `name` (from tokenizer.json) inside `directory`; ValueError if it would lead anywhere else."""
    bad = ValueError(f"{config_path}: 'model_file' must be a file name inside {directory} "
                     f"(no absolute path, no '..'), got {name!r}")
    if not isinstance(name, str) or not name.strip() or "\\" in name or "\0" in name:
        raise bad
    relative = Path(name)
    if relative.is_absolute() or relative.anchor or ".." in relative.parts:
        raise bad
    path = directory / relative
    resolved, inside = path.resolve(), directory.resolve()
    if resolved == inside or not resolved.is_relative_to(inside):  # ".", or a symbolic link leading out
        raise bad
    if not path.is_file():
        raise ValueError(f"incomplete tokenizer in {directory}: {path} is missing")
    return path


def load_tokenizer(directory: str | Path) -> ByteTokenizer | CharTokenizer | BPETokenizer:
    """Restore the tokenizer that `save(directory)` wrote, whatever its kind.

    A missing folder or `tokenizer.json` raises TokenizerNotFoundError (a ValueError); invalid JSON, an
    unknown kind, missing fields, a missing or unreadable model file, and a `model_file` that is absolute or
    leads out of the folder raise ValueError naming the folder or file. Nothing outside the folder is read.
    """
    directory = Path(directory)
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise TokenizerNotFoundError(f"no saved tokenizer in {directory}: {config_path} is missing")
    try:
        config = json.loads(config_path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{config_path} is not valid JSON ({_one_line(err)}); is {directory} a tokenizer "
                         "saved by piattn?") from None
    except OSError as err:
        raise ValueError(f"{config_path} cannot be read ({_one_line(err)})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_path} must hold a JSON object, got {type(config).__name__}")
    kind = config.get("kind")
    if kind == "byte":
        return ByteTokenizer()
    if kind == "char":
        chars = config.get("chars")
        if not isinstance(chars, str) or not chars:
            raise ValueError(f"{config_path}: 'chars' must be a non-empty string for kind 'char', got {chars!r}")
        return CharTokenizer(chars)
    if kind == "bpe":
        path = _model_path(directory, config_path, config.get("model_file"))
        tk = _import_tokenizers()
        try:
            model = tk.Tokenizer.from_file(str(path))
        except Exception as err:  # the Rust library raises plain Exception for a missing field, bad JSON, …
            raise ValueError(f"{path}: not a readable BPE model ({_one_line(err)})") from None
        return BPETokenizer(model)
    raise ValueError(f"{config_path}: kind must be one of {KINDS}, got {kind!r}")


def make_tokenizer(kind: str, texts: Iterable[str] | None = None,
                   vocab_size: int | None = None) -> ByteTokenizer | CharTokenizer | BPETokenizer:
    """Build a tokenizer by name: "byte" (needs nothing), "char" (fits `texts`), "bpe" (trains on `texts`)."""
    if kind == "byte":
        if vocab_size not in (None, 256):
            raise ValueError(f"vocab_size must be None or 256 for kind='byte', got {vocab_size!r}")
        return ByteTokenizer()
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if texts is None:
        raise ValueError(f"texts are required to build a {kind!r} tokenizer")
    if kind == "char":
        if vocab_size is not None:
            raise ValueError(f"vocab_size must be None for kind='char' (the text fixes it), got {vocab_size!r}")
        return CharTokenizer.fit(texts)
    if vocab_size is None:
        raise ValueError("vocab_size is required for kind='bpe'")
    return BPETokenizer.train(texts, vocab_size)
