"""Where a command may write: output folders and files checked before any work starts.

    output_folder(args.out, "--out")      # piattn train --out: a run directory
    output_file(args.out, "--out")        # a file to write, e.g. a figure

Both take the user's string as given (an empty one is refused: `Path("")` would silently mean the current
folder) and create nothing, so a command refused later leaves no trace. Writability is tested by creating
and removing a hidden folder in the nearest existing folder rather than by `os.access`: for root,
`os.access` says yes to /proc, /sys and read-only mounts, where creating anything fails later.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

PROBE_PREFIX = ".piattn-write-test-"


def _text(path: str | Path, flag: str, what: str) -> str:
    text = os.fspath(path)
    if not text.strip():
        raise ValueError(f"{flag} must name {what}, got {text!r} (an empty name would mean the current folder)")
    return text


def _creatable_in(folder: Path, shown: str, flag: str) -> None:
    """ValueError naming `flag` and `shown` unless `folder` exists as a folder or can be created, and this
    process can create entries in it (or in the nearest folder above it that exists)."""
    existing = next(p for p in (folder, *folder.absolute().parents) if p.exists() or p.is_symlink())
    if not existing.is_dir():
        kind = "a broken link" if existing.is_symlink() and not existing.exists() else "a file, not a folder"
        raise ValueError(f"{flag} {shown}: {existing} is {kind}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=PROBE_PREFIX, dir=existing))
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise ValueError(f"{flag} {shown}: cannot create anything in {existing} ({reason})") from None


def output_folder(path: str | Path, flag: str = "--out") -> Path:
    """`path` as a folder the command may write into: an existing folder or one it can create (not created
    here). ValueError naming `flag`: an empty name, an existing file, a file or broken link on the way, or
    a place where nothing can be created (read-only, /proc, no permission)."""
    text = _text(path, flag, "a folder")
    folder = Path(text)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{flag} {text} is a file, not a folder")
    _creatable_in(folder, text, flag)
    return folder


def output_file(path: str | Path, flag: str = "--out") -> Path:
    """`path` as a file the command may write: not an existing folder, in a folder that exists or can be
    created (not created here) and where files can be created. ValueError naming `flag` otherwise."""
    text = _text(path, flag, "a file")
    file = Path(text)
    if file.is_dir() or text.endswith(("/", os.sep)):
        raise ValueError(f"{flag} {text} is a folder; name a file")
    _creatable_in(file.parent, text, flag)
    return file
