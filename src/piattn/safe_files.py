"""Writing into folders someone else may have made, without ever writing through a symbolic link.

A run folder can come from anyone (copied, downloaded, shared on a cluster), and so can the names in it.
Opening an existing name for writing follows a link there and overwrites whatever it points at, so the
writers of piattn never do that:

    atomic_write_text(path, text)       # also atomic_write_bytes, atomic_save_npy
    with atomic_writer(path) as f: ...  # a new temporary file beside `path`, renamed onto it when complete
    open_append(path)                   # append to a log, refusing a link at its name
    fd = open_dir(folder)               # a folder that is not a link, to write in by name (dir_fd=fd)
    with Folder.open(path) as folder:   # the same, with every write, rename and removal made in it by name
        folder.write_text(name, text); folder.rename(a, b); folder.remove(name); folder.local(name)

A temporary file gets a fresh, unpredictable name created exclusively (O_CREAT | O_EXCL | O_NOFOLLOW), and
`os.replace` puts it in place: a link at the final name is itself replaced, never written through. Writing by
name relative to a folder opened once (`dir_fd`) means a folder swapped for a link after it was checked
changes nothing. A library that writes by path (safetensors, torch.save, matplotlib) is handed
`Folder.local(name)`, the name reached through the folder's descriptor (`/proc/self/fd/N/name` on Linux), so
it too writes in the folder that was opened. `link_refusal` is the one-line error for a link where a run
folder must hold its own file or folder; `foreign_owner` tells whether a folder belongs to another user, for a warning.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import numpy as np

# The hidden temporaries' prefix: `piattn.train.checkpoint.clean_incomplete` removes those a killed save left.
TEMP_PREFIX = ".tmp-"


class LinkRefused(OSError):
    """A symbolic link where a writer needs the file or folder itself; its strerror says so for a message."""

    def __init__(self, path: str | os.PathLike):
        super().__init__(errno.ELOOP, f"{path} is a symbolic link, not followed", os.fspath(path))


def open_dir(path: str | os.PathLike, *, follow_links: bool = False, dir_fd: int | None = None) -> int:
    """A descriptor of the folder `path` (a name in the folder `dir_fd` when given; close it), to create files
    in by name with `dir_fd`.

    Without `follow_links` a link at `path` itself is refused (LinkRefused): the folder
    is the one checked, whatever replaces its name later. A folder the user named may be a link.
    """
    flags = os.O_RDONLY | os.O_DIRECTORY | (0 if follow_links else os.O_NOFOLLOW)
    try:
        return os.open(path, flags, dir_fd=dir_fd)
    except OSError as err:
        if err.errno == errno.ELOOP or (err.errno == errno.ENOTDIR and _is_link(path, dir_fd)):
            raise LinkRefused(path) from None
        raise


def _is_link(path: str | os.PathLike, dir_fd: int | None = None) -> bool:
    """Whether `path` (a name in the folder `dir_fd` when given) is a symbolic link; False when nothing is there."""
    try:
        return stat.S_ISLNK(os.stat(path, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return False


class Folder:
    """A folder opened once (`open`, `child`), in which every entry is created, renamed and removed by name
    relative to its descriptor: a name swapped for a link meanwhile is never followed. Close it (or use it as a
    context manager)."""

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd

    @classmethod
    def open(cls, path: str | os.PathLike, *, create: bool = False, follow_links: bool = False) -> Folder:
        """The folder `path` (created with its parents when `create`); LinkRefused for a link at `path`
        itself unless `follow_links` (a folder the user named may be a link; one a run folder holds may not)."""
        path = Path(path)
        if create:
            path.mkdir(parents=True, exist_ok=True)
        return cls(path, open_dir(path, follow_links=follow_links))

    def child(self, name: str, *, create: bool = False, private: bool = False) -> Folder:
        """The subfolder `name`, never through a link (LinkRefused); `create`: made if missing; `private`: made
        afresh with mode 0700 (FileExistsError when the name is taken), for a temporary nobody else writes in."""
        if create or private:
            try:
                os.mkdir(name, 0o700 if private else 0o777, dir_fd=self.fd)
            except FileExistsError:
                if private:
                    raise
        try:
            fd = open_dir(name, dir_fd=self.fd)
        except LinkRefused:
            raise LinkRefused(self.path / name) from None  # the whole path, for the message
        return Folder(self.path / name, fd)

    def exists(self, name: str) -> bool:
        try:
            os.stat(name, dir_fd=self.fd, follow_symlinks=False)
            return True
        except FileNotFoundError:
            return False

    def entries(self) -> list[os.DirEntry]:
        """The folder's entries, sorted by name (links reported as links: `entry.is_dir(follow_symlinks=False)`)."""
        with os.scandir(self.fd) as it:
            return sorted(it, key=lambda e: e.name)

    def local(self, name: str) -> str:
        """A path to `name` in this folder for code that opens files by path: through the descriptor where the
        system has /proc/self/fd (Linux), so it reaches this folder whatever its name now points at; else the
        folder's path (checked when opened, not after)."""
        through = f"/proc/self/fd/{self.fd}"
        return os.path.join(through, name) if os.path.isdir(through) else str(self.path / name)

    def write_text(self, name: str, text: str) -> None:
        """Replace `name` by a file holding `text` (atomic; a link there is replaced, not followed)."""
        atomic_write_text(name, text, dir_fd=self.fd)

    def rename(self, source: str, target: str) -> None:
        os.rename(source, target, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def remove(self, name: str) -> None:
        """Remove the entry `name` if there is one: a file or link unlinked (a link never followed), a folder
        with everything in it, walked through descriptors."""
        try:
            mode = os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(mode):
            os.unlink(name, dir_fd=self.fd)
            return
        with self.child(name) as sub:
            for entry in sub.entries():
                sub.remove(entry.name)
        os.rmdir(name, dir_fd=self.fd)

    def fsync(self) -> None:
        os.fsync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Folder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def save_figure(fig, path: str | os.PathLike, *, dpi: int = 120) -> Path:
    """Save a matplotlib figure to `path` atomically (a link at its name is replaced, not written through),
    in the format its suffix names, its folder created if missing; returns `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_writer(path) as f:
        fig.savefig(f, format=path.suffix.lstrip(".") or "png", dpi=dpi)
    return path


def create_new(path: str | os.PathLike, dir_fd: int | None = None) -> int:
    """A write descriptor of a new file `path` (a name in the folder `dir_fd` when given); FileExistsError
    when anything, a link included, has that name (never followed, never truncated). Permissions as `open`
    gives them."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666, dir_fd=dir_fd)


def _create_temporary(path: Path, dir_fd: int | None) -> tuple[Path, int]:
    """(path, write descriptor) of a new hidden file beside `path`, under a name no one could plant."""
    while True:
        temporary = path.with_name(f"{TEMP_PREFIX}{path.name}-{secrets.token_hex(8)}")
        with contextlib.suppress(FileExistsError):  # 2⁶⁴ names: a clash is a freak, try another
            return temporary, create_new(temporary, dir_fd)


def fsync_path(path: str | os.PathLike) -> None:
    """Make the file or folder at `path` durable (a folder: its entries, e.g. a rename into it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_folder(folder: Path, dir_fd: int | None) -> None:
    """Make the entries of `folder` (the one `dir_fd` is open on, when given) durable."""
    if dir_fd is None:
        fsync_path(folder)
    else:
        os.fsync(dir_fd)


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike, mode: str = "wb", *, dir_fd: int | None = None) -> Iterator[IO]:
    """A file object whose content becomes `path` when the block ends without an error (fsynced, then
    renamed over `path`: readers see the old file or the complete new one, and a link at `path` is replaced,
    not written through). On an error the old file stays and the temporary is removed. `path`: a file name
    in the folder `dir_fd` when that is given, else a path whose folder is taken as it is (links on the way
    followed: the caller chose it)."""
    path = Path(path)
    temporary, fd = _create_temporary(path, dir_fd)
    # keywords only with a folder descriptor: a plain rename stays os.replace(a, b), which tests patch
    in_folder = {} if dir_fd is None else {"src_dir_fd": dir_fd, "dst_dir_fd": dir_fd}
    try:
        with os.fdopen(fd, mode, encoding=None if "b" in mode else "utf-8") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())  # the content on disk before the name points at it
        os.replace(temporary, path, **in_folder)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary, dir_fd=dir_fd)
        raise
    _fsync_folder(path.parent, dir_fd)  # the rename itself survives a crash


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, dir_fd: int | None = None) -> None:
    """Replace `path` by a file holding `data` (see `atomic_writer`)."""
    with atomic_writer(path, "wb", dir_fd=dir_fd) as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike, text: str, *, dir_fd: int | None = None) -> None:
    """Replace `path` by a file holding `text` in UTF-8 (see `atomic_writer`)."""
    atomic_write_bytes(path, text.encode("utf-8"), dir_fd=dir_fd)


def atomic_save_npy(path: str | os.PathLike, array: np.ndarray) -> None:
    """Replace `path` by the .npy file of `array` (`np.save` to a file object adds no suffix)."""
    with atomic_writer(path) as f:
        np.save(f, array, allow_pickle=False)


def open_append(path: str | os.PathLike) -> IO[str]:
    """`path` opened to append text, created if missing; LinkRefused for a link there (appending would
    follow it, and create the file it names when that is missing)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise LinkRefused(path) from None
        raise
    return os.fdopen(fd, "a", encoding="utf-8")


def link_refusal(path: Path, writer: str, instead: str | None = None) -> ValueError:
    """The one-line error for a symbolic link at `path` in a run folder, where `writer` ("training", "eval")
    writes; `instead`: the flag that avoids writing there."""
    try:
        shown = f"{path} is a symbolic link (to {os.readlink(path)})"
    except OSError:  # removed again meanwhile: nothing to show but the name
        shown = f"{path} is a symbolic link"
    fix = f"remove the link or pass {instead}" if instead else "remove the link"
    return ValueError(f"{shown}; {writer} writes only inside the run folder: {fix}")


def run_subfolder(run_dir: Path, name: str, writer: str, instead: str) -> Path:
    """RUN/`name`, a folder `writer` ("training", "eval") may create or write in: ValueError when a run folder
    made elsewhere has put a symbolic link there (the writer would write, or delete, wherever it points) or a
    file. `instead`: the flag that avoids it."""
    path = run_dir / name
    if path.is_symlink():
        raise link_refusal(path, writer, instead)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} is a file, not a folder; move it or pass {instead}")
    return path


def foreign_owner(folder: str | os.PathLike) -> str | None:
    """The owner of `folder` (user name, else uid) when that is not this process's user, else None."""
    uid = os.stat(folder).st_uid
    if uid == os.getuid():
        return None
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:  # a uid with no account here (a copied or mounted folder)
        return f"uid {uid}"
