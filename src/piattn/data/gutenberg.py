"""The fixed book corpus (`books:DIR`), fetched by Project Gutenberg number and checked byte for byte.

The corpus is 15 public-domain Project Gutenberg books (licence header and footer kept, CRLF line ends, some
with a UTF-8 byte-order mark), the loaders' layout is one folder of `<title>_pg<number>.txt` files, and four
of them are held out (`text.BOOK_SPLITS`). Gutenberg's own files change as it re-edits them, so the books are
pinned to the GITenberg mirror's commits: `BOOKS` holds, per book, the repository, commit and file, its size
and its SHA-256. `fetch_books` downloads each (or copies it from a folder that has them, `source=DIR`),
refuses a file whose checksum differs, and writes it into the folder atomically; a book already there with
the right checksum is kept, one there with another content is never overwritten.

    piattn data books data/books                      # from the internet (15.7 MB)
    piattn data books data/books --from /mnt/books    # from a copy you have
"""

from __future__ import annotations

import hashlib
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ..progress import progress_bar
from ..safe_files import Folder, atomic_writer
from .text import file_sha256

MIRROR = "https://raw.githubusercontent.com/GITenberg"
CHUNK = 1 << 16


@dataclass(frozen=True)
class Book:
    """One book of the corpus: its file name in the folder, Gutenberg number, and where the pinned bytes are."""

    file: str
    number: int
    repository: str  # under github.com/GITenberg
    commit: str
    path: str  # the file in that repository
    size: int
    sha256: str

    def url(self, mirror: str = MIRROR) -> str:
        return f"{mirror.rstrip('/')}/{self.repository}/{self.commit}/{self.path}"


BOOKS = (
    Book("a_tale_of_two_cities_pg98.txt", 98, "A-Tale-of-Two-Cities_98", "0f6111bc7237af7375295ec1754c2e57e19f67f1",
         "98-0.txt", 804335, "2fcfa071498b30724bd1bd714ba89e38477d632b86d74e87559f6259d3917e36"),
    Book("adventures_of_sherlock_holmes_pg1661.txt", 1661, "The-Adventures-of-Sherlock-Holmes_1661",
         "7e5dd2703fbf503c004063e96ab7c61262375e5f", "1661.txt", 594941,
         "2a0ce5568625a304f54fbb6bfdeeadf527a1437254b5f0e06b5a9e233d4784a2"),
    Book("anna_karenina_pg1399.txt", 1399, "Anna-Karenina_1399", "cb3b12d5db852936e5a3abc05ef02939c9dcfd6e",
         "1399-0.txt", 2068089, "ed44f47853a75d27009a011ae6d243fa89b8e03806b1dfcc66c1a80658d6b0c4"),
    Book("dracula_pg345.txt", 345, "Dracula_345", "5216d6ea255fbf8966426a160b68251b18f16907", "345.txt", 883158,
         "c802711470ddb2aaca81432fc101ed29c154e7c3d32df4172478695c33f68eae"),
    Book("emma_pg158.txt", 158, "Emma_158", "9943f6422b9246e7ad37625d6bd014b035fbfdea", "158-0.txt", 927445,
         "89b601ce13c21eca31766bdd1a554842fc9ecb7d3638cc769f41712a523e24cf"),
    Book("frankenstein_pg84.txt", 84, "Frankenstein_84", "c98a483bd1f34e7366126b81bcedd1a6faee636e", "84-0.txt",
         450783, "c29a4f56dd91aa894a3f17d5f96b356ccb499e3e2c5a27964de911845e39efab"),
    Book("great_expectations_pg1400.txt", 1400, "Great-Expectations_1400",
         "889db0e100928a957f469bf834c564d04065c8e6", "1400-0.txt", 1049619,
         "b58ce42c630e06314f2442d5937fa8a8556b6e3c5c16f4713c7332a4bb50b420"),
    Book("huckleberry_finn_pg76.txt", 76, "Adventures-of-Huckleberry-Finn_76",
         "8494afff3a26f95f37376f7a79a014cf818ccaba", "76-0.txt", 616320,
         "cd9931183257a850178225bd5e25e4f2df0cbac544dfe9a49cd0ea5a210c24d9"),
    Book("jack_sheppard_pg16215.txt", 16215, "Jack-Sheppard--A-Romance_16215",
         "53c2275d68a942a3c29d037179f8b89c9b094c3f", "16215.txt", 934286,
         "c1b00a72015340f131da3b139b4f28dc686d0c944536175c6442159bb2be6869"),
    Book("middlemarch_pg145.txt", 145, "Middlemarch_145", "39add53d31f10ba5cecdcbe8c095f90b25fd4b3f", "145.txt",
         1847708, "f499b77eb0e4e34edc3bae6b968e3241c8327384631bd26e8eec76b726915a7d"),
    Book("moby_dick_pg2701.txt", 2701, "Moby-Dick--Or-The-Whale_2701", "bdf1948e6cd00963730971e5624e764a35f238c3",
         "2701-0.txt", 1276201, "baf9b04fcf6e0008f30eaaa6697277751448c1070b20175e0082f28cbb161fd3"),
    Book("pride_and_prejudice_pg1342.txt", 1342, "Pride-and-Prejudice_1342",
         "81db45c9c48c592f0b77f01fc59e677ad0a5634e", "1342-0.txt", 724725,
         "48e0522844402a86a3ea98f0947ba85ea54838db3c59022299298ed968a5a163"),
    Book("three_musketeers_pg1257.txt", 1257, "The-Three-Musketeers_1257",
         "27952bed3a61e6f3b9f7aa6b45634ee49b073568", "1257-0.txt", 1385830,
         "b18b774113402504f1fa833ea9f6810430346815a4503f12418a1cb4ef251729"),
    Book("treasure_island_pg120.txt", 120, "Treasure-Island_120", "46f38f7b63dbda34415ce29ef5548023a8ba8dda",
         "120-0.txt", 396596, "0fee2fef1b2ffde22e2c962bd8bc2b75ea1ae9b02b3fe85ef08d44f4cc1bb2de"),
    Book("vanity_fair_pg599.txt", 599, "Vanity-Fair_599", "bcc3c8e2c447def9eb19cd74bf877617719b7ec4", "599.txt",
         1765734, "f87d4d8827cae32ddd94bea0558baaf48af26885a35777b5cb88c7aecf1297a9"),
)


def _open_source(book: Book, mirror: str, source: Path | None, timeout: float) -> BinaryIO:
    """A readable stream of `book`'s bytes: the file in `source`, or its pinned URL on `mirror`."""
    if source is not None:
        path = source / book.file
        if not path.is_file():
            raise ValueError(f"--from: {source} has no {book.file} (Gutenberg #{book.number})")
        return open(path, "rb")
    url = book.url(mirror)
    try:
        return urllib.request.urlopen(url, timeout=timeout)  # noqa: S310 (an https URL of ours, or --mirror's)
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise ValueError(f"could not download {book.file} (Gutenberg #{book.number}) from {url}: {reason}. "
                         "This needs internet access; with a copy of the books at hand, use --from DIR") from None


def fetch_books(folder: str | Path, *, mirror: str = MIRROR, source: str | Path | None = None,
                timeout: float = 60.0, progress: bool = True) -> dict[str, list[str]]:
    """Put every book of `BOOKS` into `folder` (created if missing), each checked against its size and SHA-256
    before it takes its name: downloaded from `mirror`, or copied from the folder `source`.

    Returns {"fetched": [file, …], "kept": [file, …]} (kept: already there with the right checksum). ValueError,
    with the file's name and what to do, for an unreachable source, a checksum that differs (the partial file
    is removed) or a file already in `folder` with other content (left as it is).
    """
    source = Path(source) if source is not None else None
    done: dict[str, list[str]] = {"fetched": [], "kept": []}
    with Folder.open(folder, create=True, follow_links=True) as out:
        todo = []
        for book in BOOKS:
            if out.exists(book.file):
                if file_sha256(Path(out.local(book.file))).hex() != book.sha256:
                    raise ValueError(f"{Path(folder) / book.file} exists with other content than Gutenberg "
                                     f"#{book.number} at GITenberg {book.commit[:8]}; move it away and run again")
                done["kept"].append(book.file)
            else:
                todo.append(book)
        with progress_bar(sum(b.size for b in todo), desc="books", unit="B", enabled=progress and bool(todo),
                          unit_scale=True) as bar:
            for book in todo:
                _fetch_one(book, out, mirror, source, timeout, bar)
                done["fetched"].append(book.file)
    return done


def _fetch_one(book: Book, out: Folder, mirror: str, source: Path | None, timeout: float, bar) -> None:
    digest, size = hashlib.sha256(), 0
    with _open_source(book, mirror, source, timeout) as stream, atomic_writer(book.file, dir_fd=out.fd) as f:
        while chunk := stream.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
            f.write(chunk)
            bar.update(len(chunk))
        if size != book.size or digest.hexdigest() != book.sha256:
            where = source / book.file if source is not None else book.url(mirror)
            raise ValueError(f"{book.file} (Gutenberg #{book.number}) from {where} is {size:,} bytes with SHA-256 "
                             f"{digest.hexdigest()[:16]}…, not the pinned {book.size:,} bytes "
                             f"{book.sha256[:16]}…; nothing was written for it")


def copy_note() -> str:
    """What the corpus is, for --help."""
    total = sum(b.size for b in BOOKS)
    return (f"{len(BOOKS)} Project Gutenberg books, {total / 1e6:.1f} MB, pinned to GITenberg commits and "
            "checked by SHA-256")


__all__ = ["BOOKS", "MIRROR", "Book", "copy_note", "fetch_books"]
