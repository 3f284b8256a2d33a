"""Document loaders on folders built here, their errors, and the real shared data when it is present."""

from __future__ import annotations

import os
import re
import sys
import types
from pathlib import Path

import pytest

from piattn.data import text
from piattn.data.text import (
    book_files,
    books_documents,
    hf_documents,
    load_documents,
    source_fingerprint,
    strip_gutenberg_boilerplate,
    text_documents,
    wikitext_documents,
)

SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
needs_shared_data = pytest.mark.skipif(not (SHARED_DATA / "README.md").is_file(),
                                       reason=f"shared data folder {SHARED_DATA} is absent (only on dev machines/CI)")


def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def pg19(tmp_path):
    for split, names in {"train": ["b", "a", "c"], "validation": ["v"], "test": ["t1", "t2"]}.items():
        for name in names:
            write(tmp_path / split / f"{name}.txt", f"{split} book {name}\n")
    write(tmp_path / "train" / "notes.md", "not a document")
    return tmp_path


def test_pg19_layout_splits_in_sorted_order(pg19):
    assert list(text_documents(pg19, "train")) == [f"train book {n}\n" for n in "abc"]
    assert list(text_documents(pg19, "validation")) == ["validation book v\n"]
    assert list(text_documents(pg19, "valid")) == ["validation book v\n"]
    assert list(load_documents(str(pg19), "test")) == ["test book t1\n", "test book t2\n"]


def test_documents_are_reiterable_and_sized(pg19):
    docs = text_documents(pg19, "train")
    assert docs.size_hint == 3
    assert list(docs) == list(docs)


def test_folder_of_files_without_split(tmp_path):
    write(tmp_path / "2.txt", "second")
    write(tmp_path / "1.txt", "first")
    write(tmp_path / "blank.txt", " \n\n ")
    assert list(text_documents(tmp_path)) == ["first", "second"]


def test_single_file_is_one_document_with_bom_and_crlf_normalised(tmp_path):
    file = write(tmp_path / "book.txt", b"\xef\xbb\xbfline one\r\nline two\r\n")
    assert list(load_documents(str(file))) == ["line one\nline two\n"]


def test_missing_and_empty_paths_fail_naming_the_path(tmp_path):
    missing = tmp_path / "nowhere"
    for load in (lambda: text_documents(missing), lambda: wikitext_documents(missing, "test"),
                 lambda: books_documents(missing, "train"), lambda: load_documents(f"wikitext:{missing}", "test")):
        with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
            load()
    with pytest.raises(ValueError, match=r"no \.txt files in .*pass split="):
        text_documents(tmp_path)
    (tmp_path / "train").mkdir()
    with pytest.raises(FileNotFoundError, match="no folder for split 'test'"):
        text_documents(tmp_path, "test")
    with pytest.raises(ValueError, match="split must be one of"):
        text_documents(tmp_path, "dev")
    empty = write(tmp_path / "empty.txt", "\n  \n")
    with pytest.raises(ValueError, match=f"no documents in {re.escape(str(empty))}"):
        list(text_documents(empty))


# Two articles; an equation inside the second looks like a heading but has text on both sides.
WIKITEXT = (
    " \n"
    " = Alpha = \n"
    " \n"
    " Alpha text . \n"
    " \n"
    " = = History = = \n"
    " \n"
    " Alpha history . \n"
    " \n"
    " = Beta = \n"
    " \n"
    " Beta text with an equation : \n"
    " = 1 rad / s and k = \n"
    " more Beta text . \n"
)
ALPHA = " = Alpha = \n \n Alpha text . \n \n = = History = = \n \n Alpha history . \n \n"
BETA = " = Beta = \n \n Beta text with an equation : \n = 1 rad / s and k = \n more Beta text . \n"


def test_wikitext_splits_articles_on_top_level_headings(tmp_path):
    write(tmp_path / "wiki.valid.raw", WIKITEXT)
    assert list(wikitext_documents(tmp_path, "validation")) == [ALPHA, BETA]
    assert list(load_documents(f"wikitext:{tmp_path}", "valid")) == [ALPHA, BETA]
    assert list(wikitext_documents(tmp_path / "wiki.valid.raw")) == [ALPHA, BETA]


@pytest.mark.parametrize("names,chosen", [
    (["wiki.test.raw", "wiki.test.tokens"], "wiki.test.raw"),
    (["wiki.test.tokens"], "wiki.test.tokens"),
    (["test.raw"], "test.raw"),
    (["test.tokens"], "test.tokens"),
    (["test.txt"], "test.txt"),
])
def test_wikitext_file_names(tmp_path, names, chosen):
    for name in names:
        write(tmp_path / name, f" = From {name} = \n")
    assert list(wikitext_documents(tmp_path, "test")) == [f" = From {chosen} = \n"]


def test_wikitext_errors(tmp_path):
    write(tmp_path / "wiki.train.raw", " = A = \n")
    with pytest.raises(FileNotFoundError, match="no WikiText 'test' file .*wiki.test.raw"):
        wikitext_documents(tmp_path, "test")
    with pytest.raises(ValueError, match="split is required"):
        wikitext_documents(tmp_path)
    write(tmp_path / "wiki.valid.raw", " \n \n")
    with pytest.raises(ValueError, match="no documents in wikitext"):
        list(wikitext_documents(tmp_path, "valid"))


def gutenberg(title: str) -> str:
    return (f"The Project Gutenberg EBook of {title}\r\nlicence\r\n"
            f"*** START OF THIS PROJECT GUTENBERG EBOOK {title.upper()} ***\r\n\r\n"
            f"{title} body.\r\n\r\n"
            f"*** END OF THIS PROJECT GUTENBERG EBOOK {title.upper()} ***\r\nlicence again\r\n")


@pytest.fixture
def fake_books(tmp_path):
    names = ["treasure_island_pg120", "huckleberry_finn_pg76", "adventures_of_sherlock_holmes_pg1661",
             "frankenstein_pg84", "emma_pg158", "dracula_pg345"]
    for name in names:
        write(tmp_path / f"{name}.txt", gutenberg(name))
    write(tmp_path / "SOURCES.txt", "where the books came from")
    return tmp_path


def test_books_split_as_the_readme_fixes_it(fake_books):
    names = {split: [f.name for f in book_files(fake_books, split)] for split in ("train", "valid", "test")}
    assert names == {
        "train": ["dracula_pg345.txt", "emma_pg158.txt"],
        "valid": ["huckleberry_finn_pg76.txt", "treasure_island_pg120.txt"],
        "test": ["adventures_of_sherlock_holmes_pg1661.txt", "frankenstein_pg84.txt"],
    }
    assert list(load_documents(f"books:{fake_books}", "train")) == ["dracula_pg345 body.", "emma_pg158 body."]
    raw = list(books_documents(fake_books, "test", strip_boilerplate=False))
    assert raw[1] == gutenberg("frankenstein_pg84").replace("\r\n", "\n")


def test_books_errors(fake_books):
    write(fake_books / "emma_pg158.txt", "no markers")
    with pytest.raises(ValueError, match="emma_pg158.txt: text has no"):
        list(books_documents(fake_books, "train"))
    (fake_books / "frankenstein_pg84.txt").unlink()
    with pytest.raises(FileNotFoundError, match="lacks the held-out books"):
        book_files(fake_books, "train")


def test_strip_gutenberg_boilerplate_keeps_only_the_body():
    assert strip_gutenberg_boilerplate(gutenberg("Emma").replace("\r\n", "\n")) == "Emma body."


def test_hf_documents_without_datasets_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match="pip install datasets"):
        hf_documents("wikitext", "train")


class FakeDataset:
    column_names = ["text", "label"]

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __iter__(self):
        return iter(self.rows)


def test_hf_documents_reads_rows_through_load_dataset(monkeypatch):
    calls = []

    def load_dataset(name, config, split):
        calls.append((name, config, split))
        return FakeDataset([{"text": "one", "label": 0}, {"text": " ", "label": 1}, {"text": "two", "label": 2}])

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    assert list(load_documents("hf:some/corpus:cfg", "train")) == ["one", "two"]
    assert calls == [("some/corpus", "cfg", "train")]
    with pytest.raises(ValueError, match=r"text_field must be a column of 'x', one of \['text', 'label'\]"):
        hf_documents("x", "train", text_field="body")


@needs_shared_data
def test_shared_books_split_matches_the_readme():
    readme = (SHARED_DATA / "README.md").read_text(encoding="utf-8")
    listed = {m.group(1): re.findall(r"`([^`]+)`", m.group(2))
              for m in re.finditer(r"^- (valid|test): (.*)$", readme, re.MULTILINE)}
    books = SHARED_DATA / "books"
    everything = {f.name for f in books.iterdir()} - {"SOURCES.txt"}
    expected = {"validation": set(listed["valid"]), "test": set(listed["test"]),
                "train": everything - set(listed["valid"]) - set(listed["test"])}
    for split, names in expected.items():
        assert {f.name for f in book_files(books, split)} == names
    assert len(expected["validation"]) == len(expected["test"]) == 2 and len(expected["train"]) >= 10
    docs = list(books_documents(books, "test"))
    assert len(docs) == 2
    for doc in docs:
        assert "*** START OF" not in doc and "*** END OF" not in doc
        assert "\r" not in doc and not doc.startswith("\ufeff") and len(doc) > 100_000


@needs_shared_data
@pytest.mark.parametrize("split", ["valid", "test"])
def test_shared_wikitext2_has_sixty_articles_per_held_out_split(split):
    # WikiText-2 (Merity et al. 2016) has 60 articles in validation and 60 in test.
    docs = list(wikitext_documents(SHARED_DATA / "wikitext-2", split))
    assert len(docs) == 60
    assert all(re.match(r" = [^=].* = \n", doc) for doc in docs)


# Damaged sources: one ValueError naming the file.

@pytest.mark.parametrize("data,offset", [(b"ok\n\xff bad", 3), (b"\xef\xbb\xbfab\xc3", 5), (b"\xe9t\xe9", 0)])
def test_non_utf8_text_is_a_value_error_naming_the_file_and_offset(tmp_path, data, offset):
    file = write(tmp_path / "train" / "latin1.txt", data)
    for docs in (text_documents(file), text_documents(tmp_path, "train")):
        with pytest.raises(ValueError, match=rf"{re.escape(str(file))}: not UTF-8 text .*byte offset {offset}\b"):
            list(docs)


def test_non_utf8_wikitext_and_books_name_the_file(tmp_path, fake_books):
    wiki = write(tmp_path / "wiki" / "wiki.test.raw", b" = A = \n" * 5000 + b"caf\xe9\n")  # past a read chunk
    with pytest.raises(ValueError, match=rf"{re.escape(str(wiki))}: not UTF-8 text .*byte offset {8 * 5000 + 3}\b"):
        list(wikitext_documents(tmp_path / "wiki", "test"))
    book = fake_books / "emma_pg158.txt"
    book.write_bytes(book.read_bytes() + b"\x80")
    with pytest.raises(ValueError, match=rf"{re.escape(str(book))}: not UTF-8 text"):
        list(books_documents(fake_books, "train"))


def test_hf_documents_without_datasets_is_a_value_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` fails as when it is not installed
    for load in (lambda: hf_documents("wikitext", "train"), lambda: load_documents("hf:wikitext", "train"),
                 lambda: source_fingerprint("hf:wikitext", "train")):
        with pytest.raises(ValueError, match="needs the Hugging Face `datasets` package: pip install datasets"):
            load()


# source_fingerprint: changes with the content of the split, stable otherwise.

def rewrite_same_size(file: Path) -> None:
    """Change one byte in place, keeping the size and (to show the content is hashed) the mtime."""
    stat = file.stat()
    data = bytearray(file.read_bytes())
    data[-2] = ord("X") if data[-2] != ord("X") else ord("Y")
    file.write_bytes(bytes(data))
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert file.stat().st_size == stat.st_size and file.stat().st_mtime_ns == stat.st_mtime_ns


def test_fingerprint_of_a_pg19_folder_follows_the_split_content(pg19):
    source = str(pg19)
    train = source_fingerprint(source, "train")
    assert re.fullmatch(r"[0-9a-f]{64}", train)
    assert source_fingerprint(source, "train") == train  # stable
    assert source_fingerprint(source, "validation") not in (train, None)
    assert source_fingerprint(source, "val") == source_fingerprint(source, "validation")
    rewrite_same_size(pg19 / "validation" / "v.txt")  # another split: train unchanged
    assert source_fingerprint(source, "train") == train
    rewrite_same_size(pg19 / "train" / "b.txt")
    changed = source_fingerprint(source, "train")
    assert changed != train
    os.utime(pg19 / "train" / "b.txt", ns=(1, 1))  # a touch alone changes it too (mtime is in it)
    assert source_fingerprint(source, "train") != changed
    write(pg19 / "train" / "d.txt", "new book")
    assert source_fingerprint(source, "train") not in (train, changed)
    write(pg19 / "train" / "notes.md", "not a document, not in the fingerprint")
    assert source_fingerprint(source, "train") == source_fingerprint(source, "train")


def test_fingerprint_of_a_folder_and_a_single_file(tmp_path):
    a, b = write(tmp_path / "a.txt", "first"), write(tmp_path / "b.txt", "second")
    folder, single = source_fingerprint(str(tmp_path), None), source_fingerprint(str(a), None)
    assert folder != single
    rewrite_same_size(b)
    assert source_fingerprint(str(tmp_path), None) != folder and source_fingerprint(str(a), None) == single
    b.rename(tmp_path / "c.txt")  # a renamed file: another name in the folder
    assert len({folder, source_fingerprint(str(tmp_path), None)}) == 2


def test_fingerprint_of_books_and_wikitext(tmp_path, fake_books):
    books = f"books:{fake_books}"
    train, test = source_fingerprint(books, "train"), source_fingerprint(books, "test")
    assert source_fingerprint(str(fake_books), None) not in (train, test)  # same files, another reader
    rewrite_same_size(fake_books / "frankenstein_pg84.txt")
    assert source_fingerprint(books, "train") == train and source_fingerprint(books, "test") != test
    write(fake_books / "SOURCES.txt", "not a book")
    assert source_fingerprint(books, "train") == train
    wiki_dir = tmp_path / "wiki"
    raw = write(wiki_dir / "wiki.valid.raw", WIKITEXT)
    wiki, single = source_fingerprint(f"wikitext:{wiki_dir}", "valid"), source_fingerprint(f"wikitext:{raw}", None)
    write(wiki_dir / "wiki.train.raw", WIKITEXT)  # another split
    assert source_fingerprint(f"wikitext:{wiki_dir}", "validation") == wiki
    rewrite_same_size(raw)
    assert source_fingerprint(f"wikitext:{wiki_dir}", "validation") != wiki
    assert source_fingerprint(f"wikitext:{raw}", None) != single


def test_fingerprint_errors_are_the_loaders_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "nowhere"))):
        source_fingerprint(str(tmp_path / "nowhere"), "train")
    with pytest.raises(ValueError, match="split is required"):
        source_fingerprint(f"books:{tmp_path}", None)


def test_fingerprint_of_a_hugging_face_dataset(monkeypatch):
    def load_dataset(name, config, split):
        dataset = FakeDataset([{"text": "one", "label": 0}])
        if name == "versioned":
            dataset._fingerprint = f"{config}-{split}-v{version}"
        return dataset

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    version = 1
    first = source_fingerprint("hf:versioned:cfg", "train")
    assert source_fingerprint("hf:versioned:cfg", "train") == first
    assert source_fingerprint("hf:versioned:other", "train") != first
    assert source_fingerprint("hf:versioned:cfg", "test") != first
    version = 2  # the dataset's own fingerprint changed: a new version of its files
    assert source_fingerprint("hf:versioned:cfg", "train") != first
    plain = source_fingerprint("hf:plain", "train")  # no fingerprint of its own: the name, config and split
    assert plain == source_fingerprint("hf:plain", "train") != source_fingerprint("hf:plain:cfg", "train")


def test_invalid_byte_offset_across_read_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(text, "_CHUNK", 4)
    ok = write(tmp_path / "ok.txt", "abc日本語é" * 3)  # characters cut at every chunk boundary: valid
    assert text._first_invalid_utf8(ok) is None
    for data, offset in [("abc日".encode() + b"\xff", 6), ("ab日".encode()[:4] + b"zz", 2), (b"abcd\xc3", 4)]:
        bad = write(tmp_path / "bad.txt", data)
        assert text._first_invalid_utf8(bad)[0] == offset


def test_a_single_file_splits_90_5_5_by_contiguous_bytes(tmp_path):
    body = "".join(f"line {i:03d}\n" for i in range(100))  # 900 bytes
    file = write(tmp_path / "my.txt", body)
    parts = {split: "".join(load_documents(str(file), split)) for split in ("train", "validation", "test")}
    assert parts["train"] + parts["validation"] + parts["test"] == body
    assert [len(parts[s].encode()) for s in ("train", "validation", "test")] == [810, 45, 45]
    assert parts["train"] == body[:810] and parts["test"] == body[855:]
    assert list(load_documents(str(file), "val")) == [parts["validation"]]  # the same, deterministically
    note = text.split_plan(file).note(str(file))
    assert "\n" not in note and "90/5/5" in note
    assert "validation 45 bytes (my.txt bytes 810-855)" in note and "test 45 bytes (my.txt bytes 855-900)" in note


def test_a_folder_of_any_text_files_splits_their_concatenation_in_name_order(tmp_path):
    folder = tmp_path / "corpus"
    write(folder / "b.md", "b" * 100)
    write(folder / "a.py", "a" * 880)
    write(folder / "c", "é" * 10)  # 20 bytes, no suffix: still text
    write(folder / ".hidden", b"\0\0")
    (folder / "sub").mkdir()
    assert text.auto_split_files(folder) == [folder / "a.py", folder / "b.md", folder / "c"]
    assert list(load_documents(str(folder), "train")) == ["a" * 880, "b" * 20]
    assert list(load_documents(str(folder), "validation")) == ["b" * 50]
    assert list(load_documents(str(folder), "test")) == ["b" * 30, "é" * 10]
    note = text.split_plan(folder).note(str(folder))
    assert "3 file(s) in name order" in note and "test 50 bytes (b.md bytes 70-100, c bytes 0-20)" in note
    # the fingerprint follows the content and the split
    before = source_fingerprint(str(folder), "test")
    assert before != source_fingerprint(str(folder), "validation")
    write(folder / "c", "e" * 20)
    assert source_fingerprint(str(folder), "test") != before


def test_a_byte_split_never_cuts_a_character(tmp_path):
    file = write(tmp_path / "u.txt", "é" * 55)  # 110 bytes; 90 % is byte 99, inside a character
    parts = [list(load_documents(str(file), split)) for split in ("train", "validation", "test")]
    assert "".join(doc for part in parts for doc in part) == "é" * 55
    assert all(part for part in parts)


def test_the_split_folders_layout_keeps_working(tmp_path):
    write(tmp_path / "train" / "a.txt", "train text")
    write(tmp_path / "valid" / "a.txt", "validation text")
    write(tmp_path / "test" / "a.txt", "test text")
    write(tmp_path / "README.md", "not a split")
    assert not text.is_auto_split(tmp_path)
    assert list(load_documents(str(tmp_path), "validation")) == ["validation text"]
    assert list(load_documents(str(tmp_path), "test")) == ["test text"]


@pytest.mark.parametrize("content, says", [
    (b"", "empty file; expected UTF-8 text"),
    (b"text\0\x01\x02 more", "binary file (NUL byte at byte offset 4); expected UTF-8 text"),
    (b"caf\xe9 latin-1", "binary or not UTF-8 (invalid byte 0xe9 at byte offset 3); expected UTF-8 text"),
])
def test_empty_or_binary_files_are_refused_in_one_line_naming_them(tmp_path, content, says):
    file = write(tmp_path / "data.bin", content)
    for source in (file, tmp_path):
        with pytest.raises(ValueError) as err:
            load_documents(str(source), "train")
        assert str(err.value).startswith(f"{file}: ") and says in str(err.value) and "\n" not in str(err.value)


def test_too_short_to_split_and_empty_folder(tmp_path):
    file = write(tmp_path / "tiny.txt", "abc")
    with pytest.raises(ValueError, match=r"3 bytes are too few to split 90/5/5 \(validation, test would be empty\)"):
        load_documents(str(file), "test")
    (tmp_path / "none").mkdir()
    with pytest.raises(ValueError, match="no files in .*none: expected text files"):
        load_documents(str(tmp_path / "none"), "train")
