"""`piattn data`: fetch the data the README's examples read that the project cannot ship.

    piattn data books DIR [--from COPY] [--mirror URL]

`books`: the fixed book corpus of `books:DIR` (`piattn.data.gutenberg`), downloaded by Gutenberg number
from pinned commits and checked by SHA-256, or copied from a folder that has it (`--from`), and checked the
same way. Run again, it keeps the books already there and fetches the rest.
"""

from __future__ import annotations

import argparse
import sys

from ..data import gutenberg


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", choices=["books"], help=f"books: {gutenberg.copy_note()}")
    parser.add_argument("folder", help="where to put them (created if missing); then use --data books:FOLDER")
    parser.add_argument("--from", dest="source", metavar="COPY",
                        help="copy them from this folder instead of downloading (checked the same way)")
    parser.add_argument("--mirror", default=gutenberg.MIRROR,
                        help="base URL of the GITenberg files (REPOSITORY/COMMIT/FILE under it)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    done = gutenberg.fetch_books(args.folder, mirror=args.mirror, source=args.source,
                                 progress=not args.no_progress)
    kept = f", {len(done['kept'])} already there" if done["kept"] else ""
    print(f"{len(done['fetched'])} books fetched into {args.folder}{kept}, every one checked by SHA-256; "
          f"use --data books:{args.folder}", file=sys.stderr)
    return 0
