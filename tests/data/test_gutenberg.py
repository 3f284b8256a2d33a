"""`piattn data books`: the pinned books downloaded from a mirror (a local HTTP server here: these machines have
no internet) or copied from a folder, every one checked by size and SHA-256 before it takes its name."""

from __future__ import annotations

import hashlib
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from piattn.cli import main
from piattn.data import gutenberg
from piattn.data.text import BOOK_SPLITS, book_files

SHARED_BOOKS = Path(__file__).resolve().parents[3] / "shared" / "data" / "books"


def fake_book(name: str, number: int, text: bytes) -> tuple[gutenberg.Book, bytes]:
    return gutenberg.Book(name, number, f"Book_{number}", "ab" * 20, f"{number}-0.txt", len(text),
                          hashlib.sha256(text).hexdigest()), text


@pytest.fixture
def books(monkeypatch):
    """Two small books in place of the corpus: {Book: bytes}."""
    pairs = [fake_book("one_pg1.txt", 1, b"first book\r\n" * 50),
             fake_book("two_pg2.txt", 2, b"\xef\xbb\xbfsecond\r\n")]
    monkeypatch.setattr(gutenberg, "BOOKS", tuple(book for book, _ in pairs))
    return dict(pairs)


@pytest.fixture
def mirror(tmp_path):
    """(root folder, base URL) of a local HTTP server laid out as the mirror is: REPOSITORY/COMMIT/FILE."""
    root = tmp_path / "mirror"
    root.mkdir()
    handler = partial(type("Quiet", (SimpleHTTPRequestHandler,), {"log_message": lambda *a: None}),
                      directory=str(root))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def serve(root: Path, book: gutenberg.Book, data: bytes) -> None:
    path = root / book.repository / book.commit / book.path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def test_downloads_every_book_checked_and_keeps_them_on_a_second_run(tmp_path, books, mirror):
    root, url = mirror
    for book, data in books.items():
        serve(root, book, data)
    out = tmp_path / "books"
    assert gutenberg.fetch_books(out, mirror=url, progress=False) == {"fetched": ["one_pg1.txt", "two_pg2.txt"],
                                                                      "kept": []}
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {b.file: d for b, d in books.items()}
    (root / "Book_1").rename(root / "gone")  # the mirror loses one: nothing is fetched again
    assert gutenberg.fetch_books(out, mirror=url, progress=False) == {"fetched": [],
                                                                      "kept": ["one_pg1.txt", "two_pg2.txt"]}


def test_a_book_with_other_bytes_is_refused_and_not_written(tmp_path, books, mirror):
    root, url = mirror
    (first, data_1), (second, data_2) = books.items()
    serve(root, first, data_1)
    serve(root, second, data_2[:-1] + b"?")  # same size, one byte off
    out = tmp_path / "books"
    with pytest.raises(ValueError, match=r"two_pg2\.txt \(Gutenberg #2\) from http://.* not the pinned"):
        gutenberg.fetch_books(out, mirror=url, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["one_pg1.txt"]  # no partial file, the good one kept


def test_a_different_file_already_there_is_never_overwritten(tmp_path, books, mirror):
    root, url = mirror
    for book, data in books.items():
        serve(root, book, data)
    out = tmp_path / "books"
    out.mkdir()
    (out / "two_pg2.txt").write_bytes(b"my own notes")
    with pytest.raises(ValueError, match=r"two_pg2\.txt exists with other content .* move it away"):
        gutenberg.fetch_books(out, mirror=url, progress=False)
    assert (out / "two_pg2.txt").read_bytes() == b"my own notes"


def test_offline_is_one_line_that_says_what_to_do(tmp_path, books, capsys):
    # a port nobody listens on: connection refused, as offline
    assert main(["data", "books", str(tmp_path / "b"), "--mirror", "http://127.0.0.1:9", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert "could not download one_pg1.txt (Gutenberg #1)" in err and "use --from DIR" in err


def test_copied_from_a_folder_through_the_command(tmp_path, books, capsys):
    copy = tmp_path / "copy"
    copy.mkdir()
    for book, data in books.items():
        (copy / book.file).write_bytes(data)
    assert main(["data", "books", str(tmp_path / "b"), "--from", str(copy), "--no-progress"]) == 0
    assert "2 books fetched" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["one_pg1.txt", "two_pg2.txt"]
    (copy / "one_pg1.txt").unlink()
    assert main(["data", "books", str(tmp_path / "c"), "--from", str(copy), "--no-progress"]) == 2
    assert "--from: " in capsys.readouterr().err


def test_the_corpus_holds_the_held_out_books_once_each():
    files = [b.file for b in gutenberg.BOOKS]
    assert len(set(files)) == len(files) == 15
    assert {name for names in BOOK_SPLITS.values() for name in names} <= set(files)
    for book in gutenberg.BOOKS:
        assert book.file.endswith(f"_pg{book.number}.txt") and len(book.commit) == 40 and len(book.sha256) == 64


@pytest.mark.skipif(not SHARED_BOOKS.is_dir(), reason="the project's copy of the books is not on this machine")
def test_the_pinned_checksums_are_those_of_the_projects_copy(tmp_path):
    out = tmp_path / "books"
    assert len(gutenberg.fetch_books(out, source=SHARED_BOOKS, progress=False)["fetched"]) == 15
    assert book_files(out, "test") == [out / name for name in sorted(BOOK_SPLITS["test"])]
