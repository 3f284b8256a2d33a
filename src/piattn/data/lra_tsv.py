"""Tab-separated files in the layout of the Long Range Arena release (one example per line, no quoting).

LRA reads its TSVs with quoting off (`use_quote_delim=False`), so a field is everything between two tabs,
quotes included. Lines are split on "\\n" only and decoded as UTF-8 with "surrogateescape": a byte that is
not valid UTF-8 survives the round trip (`field.encode("utf-8", "surrogateescape")` gives it back), which
matters for byte-level tasks. Python's csv module is not used because it caps a field at 128 KiB, and
whole AAN papers (the Retrieval task) can be longer.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from os import PathLike

_ENCODING = dict(encoding="utf-8", errors="surrogateescape")
_TAB = "\t"


def write_tsv(path: str | PathLike, header: Sequence[str] | None, rows: Iterable[Sequence[object]]) -> None:
    """Write `rows` (each turned into strings with `str`) under an optional header line.

    A field holding a tab or a line break would corrupt the layout, so it raises ValueError.
    """
    with open(path, "w", newline="\n", **_ENCODING) as f:
        if header is not None:
            f.write(_join(header, "header") + "\n")
        for index, row in enumerate(rows):
            f.write(_join(row, f"row {index}") + "\n")


def _join(fields: Sequence[object], where: str) -> str:
    text = [str(x) for x in fields]
    for field in text:
        if "\t" in field or "\n" in field or "\r" in field:
            raise ValueError(f"{where}: a TSV field may not contain a tab or a line break, got {field[:60]!r}")
    return "\t".join(text)


def read_tsv(path: str | PathLike, columns: Sequence[str], header: bool | None) -> Iterator[tuple[int, list[str]]]:
    """Yield (line number from 1, fields) for each non-empty line, checking it has len(columns) fields.

    header: True requires the first line to name `columns` (case-insensitive) and skips it; False reads
    every line as data; None skips the first line only if it names `columns`. Bad rows raise ValueError
    naming the file and line. An empty file yields nothing.
    """
    names = [c.lower() for c in columns]
    with open(path, newline="\n", **_ENCODING) as f:
        for number, line in enumerate(f, start=1):
            fields = line.rstrip("\n").removesuffix("\r").split("\t")
            if number == 1 and header is not False:
                if [x.strip().lower() for x in fields] == names:
                    continue
                if header:
                    raise ValueError(f"{path}:1: expected the header {_TAB.join(columns)!r}, got {line[:80]!r}")
            if fields == [""]:
                continue  # blank line, e.g. a trailing one
            if len(fields) != len(columns):
                raise ValueError(f"{path}:{number}: expected {len(columns)} tab-separated fields "
                                 f"({', '.join(columns)}), got {len(fields)}")
            yield number, fields
