"""Document loaders for language modelling: each returns a re-iterable collection of documents (str).

Nothing here downloads. A loader checks its path when called (a missing path raises FileNotFoundError
naming it) and reads lazily, one file or article at a time, so a corpus never has to fit in memory twice.
Documents that are empty or only whitespace are skipped; a source that yields none raises ValueError.

`load_documents(source, split)` picks the loader from the source string:

    "wikitext:<dir or file>"      WikiText files, one document per article       -> wikitext_documents
    "books:<dir>"                 Project Gutenberg books (*_pgN.txt), four of
                                  them held out (BOOK_SPLITS)                     -> books_documents
    "hf:<name>" / "hf:<name>:<config>"
                                  a Hugging Face dataset, one document per row    -> hf_documents
    any other string              a text file (one document) or a folder of .txt
                                  files, PG-19 layout when a split is given       -> text_documents
                                  (with a split, a single file or a folder without
                                  train/ validation/ test/ is split 90/5/5 by
                                  contiguous bytes: AUTO_SPLIT, split_plan)

Splits are named "train", "validation" or "test"; "valid" and "val" mean "validation".

A file that is not UTF-8 raises ValueError naming it and the byte offset of the first invalid byte (when the
documents are read). `source_fingerprint(source, split)` is a digest of what a split holds, to key caches of
tokenized data by content rather than by path.
"""

from __future__ import annotations

import codecs
import hashlib
import itertools
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

SPLITS = ("train", "validation", "test")
SPLIT_ALIASES = {"train": ("train",), "validation": ("validation", "valid", "val"), "test": ("test",)}

# The held-out books of the fixed book corpus (validation and test); every other book file is train.
BOOK_SPLITS = {
    "validation": ("treasure_island_pg120.txt", "huckleberry_finn_pg76.txt"),
    "test": ("adventures_of_sherlock_holmes_pg1661.txt", "frankenstein_pg84.txt"),
}
BOOK_FILE = re.compile(r".+_pg\d+\.txt")

GUTENBERG_START = re.compile(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG EBOOK.*$", re.MULTILINE)
GUTENBERG_END = re.compile(r"^\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG EBOOK.*$", re.MULTILINE)


FINGERPRINT_VERSION = "piattn-source-fingerprint-1"
_CHUNK = 1 << 20  # bytes read at a time when scanning or hashing a file


class MissingPackageError(ValueError, ImportError):
    """An optional package is not installed. A ValueError (the CLI prints it as one line) and an ImportError."""


class Documents:
    """A lazy, re-iterable collection of documents; iterating it raises ValueError if it yields none.

    Re-iterable because a corpus is usually read twice: once to fit a tokenizer, once to tokenize it.
    `size_hint` is the number of documents when known before reading (one per file), else None; it is an
    upper bound, as empty documents are skipped.
    """

    def __init__(self, source: str, read: Callable[[], Iterable[str]], size_hint: int | None = None):
        self.source = source
        self.size_hint = size_hint
        self._read = read

    def __iter__(self) -> Iterator[str]:
        empty = True
        for doc in self._read():
            if doc.strip():
                empty = False
                yield doc
        if empty:
            raise ValueError(f"no documents in {self.source}: every document is empty or whitespace")

    def __repr__(self) -> str:
        return f"Documents({self.source!r})"


def normalize_split(split: str) -> str:
    for name, aliases in SPLIT_ALIASES.items():
        if split in aliases:
            return name
    raise ValueError(f"split must be one of {SPLITS} (or 'valid'/'val' for validation), got {split!r}")


def _first_invalid_utf8(path: Path) -> tuple[int, int] | None:
    """(byte offset, byte value) of the first byte of `path` that is not valid UTF-8, or None."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            pending = decoder.getstate()[0]  # the bytes of a character cut at the previous chunk's end
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as err:
                data = pending + chunk
                return offset - len(pending) + err.start, data[err.start]
            if not chunk:
                return None
            offset += len(chunk)


def not_utf8_error(path: Path) -> ValueError:
    """The ValueError for a file that failed to decode as UTF-8: names it and the first invalid byte."""
    try:
        found = _first_invalid_utf8(path)
    except OSError:
        found = None
    where = "" if found is None else f" (invalid byte 0x{found[1]:02x} at byte offset {found[0]})"
    return ValueError(f"{path}: not UTF-8 text{where}; convert it to UTF-8, e.g. with iconv")


def read_text(path: Path) -> str:
    """A UTF-8 file as text: a byte-order mark dropped, CRLF and CR line ends turned into LF.

    ValueError naming the file and the offset of the first invalid byte when it is not UTF-8.
    """
    try:
        with open(path, encoding="utf-8-sig") as f:
            return f.read()
    except UnicodeDecodeError:
        raise not_utf8_error(path) from None


def _existing(path: str | Path) -> Path:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"path does not exist: {path}")
    return path


def _files_documents(source: str, files: list[Path], transform: Callable[[Path, str], str] | None = None):
    def read():
        for file in files:
            text = read_text(file)
            yield transform(file, text) if transform else text

    return Documents(source, read, size_hint=len(files))


def text_files(path: str | Path, split: str | None = None) -> list[Path]:
    """The files `text_documents` reads, in the order it reads them (sorted by name).

    With a split and no split folders (`is_auto_split`): every file of the byte split (`split_plan`).
    """
    path = _existing(path)
    if split is not None and is_auto_split(path):
        return auto_split_files(path)
    if path.is_file():
        if split is not None:
            raise ValueError(f"split must be None when path is a single file, got {split!r} for {path}")
        return [path]
    folder = path
    if split is not None:
        candidates = [path / alias for alias in SPLIT_ALIASES[normalize_split(split)]]
        found = [c for c in candidates if c.is_dir()]
        if not found:
            names = ", ".join(c.name for c in candidates)
            raise FileNotFoundError(f"no folder for split {split!r} in {path} (looked for {names})")
        folder = found[0]
    files = sorted(f for f in folder.glob("*.txt") if f.is_file() and not f.name.startswith("."))
    if not files:
        hint = "" if split is not None else "; pass split= for a folder with train/validation/test subfolders"
        raise ValueError(f"no .txt files in {folder}{hint}")
    return files


def text_documents(path: str | Path, split: str | None = None) -> Documents:
    """Plain-text documents: a single file is one document; a folder gives one document per `*.txt` file.

    With `split`, the folder has PG-19's layout (`train/`, `validation/`, `test/` subfolders) and the
    documents are the `*.txt` files of that subfolder. Order is sorted by file name, so it is the same on
    every machine.
    """
    if split is not None and is_auto_split(path):
        return split_documents(path, split)
    files = text_files(path, split)
    return _files_documents(str(path) if split is None else f"{path} [{split}]", files)


# --- A file, or a folder without split folders, split by bytes --------------------------------------------

# Train, validation and test: contiguous byte ranges of the text (the files concatenated in name order), in
# this order and these shares, nanoGPT-style: the first 90 % trains, the next 5 % validates, the last 5 % tests.
AUTO_SPLIT = {"train": 0.90, "validation": 0.05, "test": 0.05}
_SNIFF = 1024  # bytes of each file checked for NUL bytes and invalid UTF-8 before anything is read


# The loaders named by a "scheme:" prefix (`load_documents`); any other source is a path.
SCHEMES = ("wikitext", "books", "hf")


def is_auto_split(path: str | Path) -> bool:
    """Whether `path` is split by bytes: a single file, or a folder with none of the split folders. A source
    with a scheme (`SCHEMES`: books:, wikitext:, hf:) never is: its loader has its own splits."""
    if isinstance(path, str) and path.partition(":")[0] in SCHEMES:
        return False
    path = _existing(path)
    if path.is_file():
        return True
    return not any((path / alias).is_dir() for aliases in SPLIT_ALIASES.values() for alias in aliases)


def auto_split_files(path: str | Path) -> list[Path]:
    """The files split by bytes: `path` itself, or every regular file at the top of the folder (names
    starting with "." skipped), sorted by name; each checked by `check_text_file`."""
    path = _existing(path)
    if path.is_file():
        files = [path]
    else:
        files = sorted(f for f in path.iterdir() if f.is_file() and not f.name.startswith("."))
        if not files:
            raise ValueError(f"no files in {path}: expected text files, or train/ validation/ test/ folders of them")
    for file in files:
        check_text_file(file)
    return files


def check_text_file(file: Path) -> None:
    """ValueError in one line naming `file` when it is empty or looks binary: a NUL byte or a byte that is
    not UTF-8 in its first KB."""
    expected = "expected UTF-8 text"
    if file.stat().st_size == 0:
        raise ValueError(f"{file}: empty file; {expected}")
    with open(file, "rb") as f:
        head = f.read(_SNIFF)
    nul = head.find(b"\0")
    if nul >= 0:
        raise ValueError(f"{file}: binary file (NUL byte at byte offset {nul}); {expected}")
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)  # a character cut at the end is fine
    except UnicodeDecodeError as err:
        raise ValueError(f"{file}: binary or not UTF-8 (invalid byte 0x{head[err.start]:02x} at byte offset "
                         f"{err.start}); {expected}, e.g. converted with iconv") from None


@dataclass(frozen=True)
class SplitPlan:
    """Where the byte split of a file or folder cuts: `files` in order, their byte `sizes`, and for each
    split its [start, end) in the concatenation of the files' bytes."""

    files: tuple[Path, ...]
    sizes: tuple[int, ...]
    ranges: dict

    def pieces(self, split: str) -> list[tuple[Path, int, int]]:
        """(file, start, end) byte ranges inside each file that `split` covers, in order."""
        start, end = self.ranges[normalize_split(split)]
        out, offset = [], 0
        for file, size in zip(self.files, self.sizes, strict=True):
            lo, hi = max(start, offset), min(end, offset + size)
            if lo < hi:
                out.append((file, lo - offset, hi - offset))
            offset += size
        return out

    def note(self, source: str) -> str:
        """One line: how the text was split and what went to validation and test."""
        def where(split: str) -> str:
            start, end = self.ranges[split]
            files = ", ".join(f"{file.name} bytes {lo}-{hi}" for file, lo, hi in self.pieces(split))
            return f"{split} {end - start:,} bytes ({files})"

        order = " in name order" if len(self.files) > 1 else ""
        return (f"--data {source}: no train/ validation/ test/ folders, so split by contiguous bytes 90/5/5 of "
                f"{len(self.files)} file(s){order}; {where('validation')}, {where('test')}")


def _char_start(plan_files: list[Path], sizes: list[int], cut: int) -> int:
    """`cut` moved forward past UTF-8 continuation bytes, so that no character is split."""
    offset = 0
    for file, size in zip(plan_files, sizes, strict=True):
        if offset <= cut < offset + size:
            with open(file, "rb") as f:
                f.seek(cut - offset)
                ahead = f.read(4)
            skip = 0
            while skip < len(ahead) and 0x80 <= ahead[skip] < 0xC0:
                skip += 1
            return cut + skip
        offset += size
    return cut


def split_plan(path: str | Path) -> SplitPlan:
    """The byte split of a file or a folder without split folders (AUTO_SPLIT): cuts at 90 % and 95 % of
    the bytes, each moved forward to the start of a UTF-8 character. Deterministic: it depends only on
    the files' names and bytes. ValueError when validation or test would be empty."""
    files = auto_split_files(path)
    sizes = [f.stat().st_size for f in files]
    total = sum(sizes)
    shares = list(AUTO_SPLIT.values())
    first = _char_start(files, sizes, round(total * shares[0]))
    second = max(first, _char_start(files, sizes, round(total * (shares[0] + shares[1]))))
    ranges = dict(zip(AUTO_SPLIT, ((0, first), (first, second), (second, total)), strict=True))
    short = [name for name, (start, end) in ranges.items() if start >= end]
    if short:
        raise ValueError(f"{path}: {total} bytes are too few to split 90/5/5 ({', '.join(short)} would be empty)")
    return SplitPlan(tuple(files), tuple(sizes), ranges)


def _decode_piece(file: Path, start: int, end: int) -> str:
    with open(file, "rb") as f:
        f.seek(start)
        data = f.read(end - start)
    try:
        text = data.decode("utf-8-sig" if start == 0 else "utf-8")
    except UnicodeDecodeError:
        raise not_utf8_error(file) from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def split_documents(path: str | Path, split: str) -> Documents:
    """The documents of `split` of a file or a folder without split folders: the part of each file that
    falls in the split's byte range (`split_plan`) is one document."""
    plan = split_plan(path)
    split = normalize_split(split)

    def read():
        for file, start, end in plan.pieces(split):
            yield _decode_piece(file, start, end)

    return Documents(f"{path} [{split}, bytes {plan.ranges[split][0]}-{plan.ranges[split][1]}]", read,
                     size_hint=len(plan.pieces(split)))


def strip_gutenberg_boilerplate(text: str) -> str:
    """The book between Project Gutenberg's "*** START OF …" and "*** END OF …" lines (both excluded).

    The licence text around it is nearly the same in every book, so left in it would be memorised and
    would leak from the train books into the held-out ones.
    """
    start, end = GUTENBERG_START.search(text), GUTENBERG_END.search(text)
    if start is None or end is None or end.start() < start.end():
        raise ValueError("text has no '*** START OF … PROJECT GUTENBERG EBOOK' … '*** END OF …' lines")
    return text[start.end():end.start()].strip()


def book_files(root: str | Path, split: str) -> list[Path]:
    """The book files of one split of the fixed book corpus (BOOK_SPLITS), sorted by name.

    validation and test are the two books each that the README names; train is every other
    `<title>_pg<number>.txt` file in `root` (so `SOURCES.txt` is not a book).
    """
    root = _existing(root)
    if not root.is_dir():
        raise ValueError(f"root must be the books folder, got a file: {root}")
    split = normalize_split(split)
    held_out = {name for names in BOOK_SPLITS.values() for name in names}
    missing = sorted(name for name in held_out if not (root / name).is_file())
    if missing:
        raise FileNotFoundError(f"{root} lacks the held-out books {missing}; is it the fixed book corpus?")
    if split in BOOK_SPLITS:
        return sorted(root / name for name in BOOK_SPLITS[split])
    train = sorted(f for f in root.iterdir() if BOOK_FILE.fullmatch(f.name) and f.name not in held_out)
    if not train:
        raise ValueError(f"no train books (<title>_pg<number>.txt) in {root}")
    return train


def books_documents(root: str | Path, split: str, strip_boilerplate: bool = True) -> Documents:
    """The fixed book corpus: one document per book, split as BOOK_SPLITS says.

    `strip_boilerplate` keeps only the text between the Project Gutenberg start and end lines.
    """
    def body(file: Path, text: str) -> str:
        try:
            return strip_gutenberg_boilerplate(text)
        except ValueError as err:
            raise ValueError(f"{file}: {err}") from err

    files = book_files(root, split)
    return _files_documents(f"books {root} [{split}]", files, body if strip_boilerplate else None)


def wikitext_file(path: str | Path, split: str) -> Path:
    """The file of `split` in a WikiText folder, raw text preferred over the tokenized form.

    Accepts the release names (`wiki.valid.raw`, `wiki.valid.tokens`), the same without `wiki.`, and
    `valid.txt` (pytorch/examples' copy, which is the tokenized form).
    """
    folder = _existing(path)
    aliases = SPLIT_ALIASES[normalize_split(split)]
    names = [f"{prefix}{alias}.{ext}" for ext in ("raw", "tokens") for prefix in ("wiki.", "") for alias in aliases]
    names += [f"{alias}.txt" for alias in aliases]
    for name in names:
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(f"no WikiText {split!r} file in {folder} (looked for {', '.join(names)})")


def is_heading_line(line: str) -> bool:
    """` = Title = ` (a top-level heading); ` = = Section = = ` and deeper headings are not."""
    stripped = line.strip()
    return len(stripped) > 4 and stripped.startswith("= ") and stripped.endswith(" =") and stripped[2] != "="


def wikitext_articles(lines: Iterable[str]) -> Iterator[str]:
    """Group WikiText lines into articles, each starting at its title line.

    A title line is a top-level heading with a blank line on both sides: inside articles, equations such
    as ` = 1 rad / s and a nominal impedance k = ` look like headings but sit between text lines.
    """
    article: list[str] = []
    previous, current = "", None
    # One line of look-ahead; the "" appended at the end is the blank after the last line, never emitted.
    for following in itertools.chain(lines, [""]):
        if current is not None:
            title = is_heading_line(current) and not previous.strip() and not following.strip()
            if title and article:
                yield "".join(article)
                article = []
            article.append(current)
            previous = current
        current = following
    if article:
        yield "".join(article)


def _wikitext_source(path: str | Path, split: str | None) -> Path:
    """The one file `wikitext_documents(path, split)` reads."""
    path = _existing(path)
    if path.is_file():
        if split is not None:
            raise ValueError(f"split must be None when path is a single file, got {split!r} for {path}")
        return path
    if split is None:
        raise ValueError(f"split is required for the WikiText folder {path}; one of {SPLITS}")
    return wikitext_file(path, split)


def wikitext_documents(path: str | Path, split: str | None = None) -> Documents:
    """WikiText articles, one document each. `path`: a WikiText folder (then `split` is required) or one file."""
    file = _wikitext_source(path, split)

    def read():
        try:
            with open(file, encoding="utf-8-sig") as f:
                yield from wikitext_articles(f)
        except UnicodeDecodeError:
            raise not_utf8_error(file) from None

    return Documents(f"wikitext {file}", read)


def _import_datasets():
    try:
        import datasets
    except ImportError as err:
        raise MissingPackageError(
            "hf_documents needs the Hugging Face `datasets` package: pip install datasets") from err
    return datasets


def hf_documents(name: str, split: str, text_field: str = "text", config: str | None = None) -> Documents:
    """Rows of a Hugging Face dataset, one document per row's `text_field`.

    Reads through `datasets.load_dataset(name, config, split=split)`, so `name` may be a local folder or a
    dataset in the local cache. This is the one loader that can reach the network: for a hub name not yet
    cached, `datasets` downloads it unless HF_DATASETS_OFFLINE=1 is set. Note that the hub's `wikitext`
    has one row per line, not per article; `wikitext_documents` reads articles. Without `datasets`
    installed, raises MissingPackageError (a ValueError and an ImportError) saying how to install it.
    """
    datasets = _import_datasets()
    dataset = datasets.load_dataset(name, config, split=split)
    if text_field not in dataset.column_names:
        raise ValueError(f"text_field must be a column of {name!r}, one of {dataset.column_names}; "
                         f"got {text_field!r}")
    if len(dataset) == 0:
        raise ValueError(f"dataset {name!r} split {split!r} has no rows")

    def read():
        for row in dataset:
            yield row[text_field]

    return Documents(f"hf {name} [{split}]", read, size_hint=len(dataset))


def load_documents(source: str, split: str | None = None) -> Documents:
    """Documents from a source string; the syntax is in this module's docstring."""
    scheme, _, rest = source.partition(":")
    if scheme == "wikitext":
        return wikitext_documents(rest, split)
    if scheme == "books":
        if split is None:
            raise ValueError(f"split is required for books, one of {SPLITS}")
        return books_documents(rest, split)
    if scheme == "hf":
        if split is None:
            raise ValueError("split is required for a Hugging Face dataset, e.g. 'train'")
        name, _, config = rest.partition(":")
        return hf_documents(name, split, config=config or None)
    return text_documents(source, split)


def file_sha256(path: Path) -> bytes:
    """The SHA-256 digest of the file at `path`, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.digest()


def source_fingerprint(source: str, split: str | None = None) -> str:
    """A hex digest (sha256) of what `load_documents(source, split)` reads; it changes when the content does.

    Meant as the cache key of tokenized data in place of the source string, so that a file edited in place
    is tokenized again. It covers the loader kind (plain, `books:`, `wikitext:`, `hf:`), the split, and:

    - files (a folder, a single file, `books:`, `wikitext:`): the files the loader reads, in its order,
      each as its name relative to the source folder (a single file: its name), its size, its mtime_ns and
      a sha256 of its bytes, read in 1 MiB chunks. The content hash makes the digest exact (a rewrite of
      the same size within the same mtime tick is still seen); size and mtime are cheap extras, so a touched
      or copied-without-timestamps file counts as changed too (one needless re-tokenization, never a stale
      one). The folder's own location is not in it: a moved folder keeps its digest. Hashing reads every
      byte of the split once (about a second per GB).
    - `hf:<name>[:<config>]`: the name, config and split plus the dataset's own `_fingerprint`, which the
      `datasets` library derives from its cached files (so a new version of the dataset changes it). It
      loads the dataset (from the local cache when it is there), as `hf_documents` does. A dataset object
      without a fingerprint leaves only the name, config and split, so changes to it are not seen.

    Errors are the loader's: a missing path raises FileNotFoundError naming it, a bad split ValueError, and
    `hf:` without `datasets` installed MissingPackageError (a ValueError).
    """
    scheme, _, rest = source.partition(":")
    digest = hashlib.sha256()

    def add(*fields) -> None:
        digest.update("\0".join(str(f) for f in fields).encode("utf-8", errors="surrogateescape") + b"\0")

    if scheme == "hf":
        if split is None:
            raise ValueError("split is required for a Hugging Face dataset, e.g. 'train'")
        name, _, config = rest.partition(":")
        dataset = _import_datasets().load_dataset(name, config or None, split=split)
        add(FINGERPRINT_VERSION, "hf", name, config, split, getattr(dataset, "_fingerprint", None))
        return digest.hexdigest()
    if scheme == "wikitext":
        kind, root, files = "wikitext", None, [_wikitext_source(rest, split)]
    elif scheme == "books":
        if split is None:
            raise ValueError(f"split is required for books, one of {SPLITS}")
        kind, root, files = "books", Path(rest), book_files(rest, split)
    else:
        # a byte split (is_auto_split) hashes every file: where it cuts depends on all of them
        kind = "text-bytes-90-5-5" if split is not None and is_auto_split(source) else "text"
        files = text_files(source, split)
        root = Path(source) if Path(source).is_dir() else None
    add(FINGERPRINT_VERSION, kind, None if split is None else normalize_split(split), len(files))
    for file in files:
        stat = file.stat()
        add(file.relative_to(root).as_posix() if root is not None else file.name, stat.st_size, stat.st_mtime_ns)
        digest.update(file_sha256(file))
    return digest.hexdigest()
