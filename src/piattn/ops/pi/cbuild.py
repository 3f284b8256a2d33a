"""Build a C file into a shared library and load it, verified: the one builder of `native.py` (the decoding
step, `decode_step.c`) and `fused.py` (the CPU backend, `fused_cpu.c`).

Loading a library runs its code, so what is loaded is checked first:

- it lives in `$PIATTN_CACHE/native` (default `~/.cache/piattn/native`), a folder made with mode 0o700;
  one owned by another user or writable by group or others is refused (`Unsafe`): someone else could put
  a library and its hash there. The folder is opened once and checked through its descriptor, and the
  library is hashed and handed to the loader through descriptors too (`Folder`, `_pinned`): renaming the
  folder or an ancestor after the check cannot swap in another library;
- its name is keyed by the source (with the files it includes, so that no change to one of them finds an old
  build), the compiler, the flags, the machine and the CPU (`-march=native` compiles for this CPU's model and
  flags), so that a cache shared between machines never hands one CPU's instructions to another;
- the build writes the library and its SHA-256 (a `.sha256` sidecar) each under a temporary name and
  renames them into place, so that concurrent processes never read a half-written file (a library and a
  hash of two different builds fail the check, and the reader rebuilds); a library whose bytes do not
  match its sidecar (cut short by a killed build or a full disk, written by anything but this builder) is
  never handed to dlopen (a truncated one killed the process with SIGBUS there) but rebuilt, and so is a
  verified one that does not load (another machine's, an older piattn's).

`load` tries flag sets in order (e.g. with and without -march=native, -fopenmp) until one builds and loads.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

Loaded = TypeVar("Loaded")


class Unsafe(Exception):
    """The library folder is not private to this user: nothing in it may be loaded."""


class BuildError(Exception):
    """The compiler could not build the library."""


class LoadError(Exception):
    """A library built here (and verified) still does not load."""


def library_folder() -> Path:
    """`$PIATTN_CACHE/native`, default `~/.cache/piattn/native`."""
    return Path(os.environ.get("PIATTN_CACHE") or Path.home() / ".cache" / "piattn") / "native"


def digest_path(path: Path) -> Path:
    """The sidecar holding the SHA-256 of `path`'s bytes as built."""
    return path.with_name(path.name + ".sha256")


class Folder:
    """The library folder, opened once (made with mode 0o700) and checked through its descriptor.

    Every later access (the hash check, the build's output, the load) goes through that descriptor, so that
    renaming the folder or one of its ancestors between the check and the load cannot put another folder's
    library in its place (a check by path, then a load by path, let another user's library run in this
    process). A folder another user owns or can write to (a shared PIATTN_CACHE) is refused (Unsafe): they
    could put a library and its hash in it.
    """

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir(mode=0o700, exist_ok=True)  # an existing folder keeps its mode: checked below
        self.path = path
        # Follows a link to the folder once: what counts is the folder this descriptor holds from here on.
        self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            _check_private(path, os.fstat(self.fd))
        except Unsafe:
            self.close()
            raise

    def entry(self, name: str) -> Path:
        """`name` inside the opened folder, whatever was renamed since: through the descriptor
        (/proc/self/fd/N/name, Linux), else by the folder's path (where there is no /proc: no such guarantee)."""
        through = Path(f"/proc/self/fd/{self.fd}")
        return through / name if through.is_dir() else self.path / name

    def close(self) -> None:
        os.close(self.fd)


def _check_private(path: Path, info: os.stat_result) -> None:
    if not stat.S_ISDIR(info.st_mode):
        raise Unsafe(f"{path} is not a folder")
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise Unsafe(f"{path} belongs to user id {info.st_uid}, not to this user ({os.getuid()})")
    if info.st_mode & 0o022:
        raise Unsafe(f"{path} can be written by group or others (mode {stat.S_IMODE(info.st_mode):o}); "
                     f"make it private with chmod 700")


def verified(path: Path) -> bool:
    """Whether `path` holds exactly the bytes whose hash its sidecar recorded when it was built."""
    return _pinned(path, keep=False) is not None


# Descriptors of the libraries handed to the loader through /proc/self/fd, open for the life of the process:
# the loader knows a library by its path name, so a reused descriptor number would hand back the old one.
_KEPT: list[int] = []


def _pinned(path: Path, *, keep: bool) -> Path | None:
    """Open the library at `path` (no link followed) and compare its bytes with its sidecar's hash. When they
    match: with keep, a path to that very open file (/proc/self/fd/N, the descriptor kept), so that what the
    loader maps is what was checked; else `path`. None when they differ or a file is missing."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        with open(digest_path(path), "rb", opener=lambda name, flags: os.open(name, flags | os.O_NOFOLLOW)) as f:
            recorded = f.read().decode(errors="replace").strip()
        data = b"".join(iter(lambda: os.read(fd, 1 << 20), b""))
    except OSError:
        os.close(fd)
        return None
    if hashlib.sha256(data).hexdigest() != recorded:
        os.close(fd)
        return None
    through = Path(f"/proc/self/fd/{fd}")
    if keep and through.exists():
        _KEPT.append(fd)
        return through
    os.close(fd)
    return path


def _cpuinfo_lines() -> list[str] | None:
    """The lines of /proc/cpuinfo (Linux), None where there is none."""
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None


# The /proc/cpuinfo lines that say what -march=native compiles for: x86's model and flags; aarch64's
# features and the core's identity (its cpuinfo has no "model name" or "flags" lines).
CPU_IDENTITY_FIELDS = ("model name", "flags", "Features", "CPU implementer", "CPU architecture", "CPU variant",
                       "CPU part", "CPU revision")


def cpu_identity() -> bytes:
    """What -march=native compiles for: the CPU's model and features (Linux), so that a library built for one
    CPU is never loaded on another from a shared cache folder (SIGILL)."""
    lines = _cpuinfo_lines()
    if lines is None:
        return platform.processor().encode()
    return "\n".join(sorted({line for line in lines if line.startswith(CPU_IDENTITY_FIELDS)})).encode()


# The x86-64 micro-architecture levels (the psABI's) that PIATTN_MARCH may name, each with the CPU features
# (as /proc/cpuinfo spells them) it adds to the level before it: code built for a level the CPU lacks stops
# with SIGILL, so such a level is refused up front.
X86_64_LEVELS = {
    "x86-64": (),
    "x86-64-v2": ("cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"),
    "x86-64-v3": ("abm", "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave"),
    "x86-64-v4": ("avx512bw", "avx512cd", "avx512dq", "avx512f", "avx512vl"),
}


def cpu_features() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    lines = _cpuinfo_lines() or []
    return frozenset(word for line in lines if line.startswith("flags") for word in line.split(":", 1)[1].split())


def missing_features(level: str, features: frozenset[str]) -> list[str]:
    """The features of x86-64 `level` (and the levels below it) that `features` lacks."""
    needed = []
    for name, adds in X86_64_LEVELS.items():
        needed += adds
        if name == level:
            break
    return sorted(set(needed) - features)


def march() -> str | None:
    """The instruction set that PIATTN_MARCH pins native builds to: None when unset (each builder then tries
    this CPU's own, -march=native, first), "native", or an x86-64 level. A pinned build is how the kernels
    are built and tested for another CPU's instruction set on this one (e.g. x86-64-v4's AVX-512 code
    paths on an AVX-512 machine, x86-64-v3 for AVX2). ValueError naming PIATTN_MARCH for a value that is
    not a level, a level on another architecture, or a level this CPU cannot run."""
    value = os.environ.get("PIATTN_MARCH", "").strip()
    if not value:
        return None
    if value == "native":
        return value
    allowed = ", ".join(("native", *X86_64_LEVELS))
    if value not in X86_64_LEVELS:
        raise ValueError(f"PIATTN_MARCH must be one of {allowed}; got {value!r}")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise ValueError(f"PIATTN_MARCH={value} is an x86-64 level; this machine is {platform.machine()}: "
                         f"use native or unset it")
    missing = missing_features(value, cpu_features())
    if missing:
        raise ValueError(f"PIATTN_MARCH={value} needs CPU features this CPU lacks ({', '.join(missing)}), so its "
                         f"code would stop with SIGILL here: pick a lower level or native")
    return value


# `#include "name"`: a file of the source's own (looked up beside the file that names it), not a system header.
_LOCAL_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


def includes(text: bytes) -> list[str]:
    """The names a C source's `#include "name"` lines give, in order (`#include <...>` and `#include __FILE__`,
    the self-include, name none)."""
    return [name.decode() for name in _LOCAL_INCLUDE.findall(text)]


def sources(source: Path) -> list[Path]:
    """`source`, then the files it includes by `#include "name"` (and they in turn), each once, in the order first
    named: everything the library is compiled from (decode_step.c includes decode_gate.h), so that a change to any
    of them is a change of the key (`library_path`). A name that is not a file there is left to the compiler."""
    found, pending = [source], [source]
    while pending:
        current = pending.pop(0)
        for name in includes(current.read_bytes()):
            path = current.parent / name
            if path.is_file() and path not in found:
                found.append(path)
                pending.append(path)
    return found


def library_path(source: Path, compiler: str, flags: Sequence[str]) -> Path:
    """Where `source` built by `compiler` with `flags` lives: `<stem>-<key>.so` in `library_folder()`, the key
    hashed from the bytes of every file it is compiled from (`sources`), the compiler, the flags and the machine."""
    key = hashlib.sha256(b"\0".join([*(path.read_bytes() for path in sources(source)), compiler.encode(),
                                     " ".join(flags).encode(), platform.machine().encode(),
                                     cpu_identity()])).hexdigest()[:16]
    return library_folder() / f"{source.stem}-{key}.so"


def build(source: Path, path: Path, compiler: str, flags: Sequence[str], *, timeout: float = 300) -> None:
    """Compile `source` and put the library at `path` with its hash beside it, each written to a temporary name
    in path's folder and renamed into place. The compiler writes into a fresh private folder of its own (its
    process cannot see this one's descriptors, `Folder.entry`); the bytes are hashed as they are copied.
    BuildError (the compiler's last line of error) when it fails."""
    made = []
    try:
        with tempfile.TemporaryDirectory(prefix="piattn-build-") as work:
            out = Path(work) / "library.so"
            done = subprocess.run([compiler, *flags, str(source), "-o", str(out), "-lm"], capture_output=True,
                                  text=True, timeout=timeout)
            if done.returncode:
                raise BuildError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "compiler failed")
            data = out.read_bytes()
        for suffix, content in ((".so", data), (".sha256", (hashlib.sha256(data).hexdigest() + "\n").encode())):
            fd, tmp = tempfile.mkstemp(suffix=suffix, dir=path.parent)
            made.append(tmp)
            with os.fdopen(fd, "wb") as f:
                f.write(content)
        os.replace(made[0], path)
        os.replace(made[1], digest_path(path))
    except (OSError, subprocess.SubprocessError) as err:
        raise BuildError(str(err)) from err
    finally:
        for name in made:
            if os.path.exists(name):
                os.unlink(name)


def _say_building(source: Path, flags: Sequence[str], folder: Path) -> None:
    """One line on stderr before a build: the first call that needs a library otherwise waits up to half a
    minute in silence (fused_cpu.c takes about 20 s with -O3 on a 2-core machine)."""
    print(f"piattn: compiling {source.name} ({' '.join(flags)}) into {folder}: once per machine, up to a "
          f"minute", file=sys.stderr, flush=True)


def load(source: Path, opener: Callable[[Path], Loaded], *, compiler: str, base_flags: Sequence[str],
         flag_sets: Sequence[Sequence[str]] = ((),), timeout: float = 300) -> tuple[Loaded, tuple[str, ...]]:
    """(opener(path of the library), the extra flags it was built with): for each flag set in order, a
    verified library from an earlier build, else a fresh build (rebuilt when a verified one does not load);
    the first that loads. opener raises OSError or AttributeError for a library that does not load.

    Raises Unsafe (the folder is not private), OSError (it cannot be made), BuildError (no flag set built;
    each one's reason in the message) or LoadError (some built, none loaded)."""
    failures, loads = [], []
    for extra in flag_sets:
        flags = (*base_flags, *extra)
        path = library_path(source, compiler, flags)
        folder = Folder(path.parent)
        try:
            library = folder.entry(path.name)
            pinned = _pinned(library, keep=True)
            if pinned is not None:
                try:
                    return opener(pinned), tuple(extra)
                except (OSError, AttributeError):
                    pass  # built for something else after all: rebuilt below
            label = f"{' '.join(extra) or 'no extra flags'}: " if len(flag_sets) > 1 else ""
            _say_building(source, flags, path.parent)
            try:
                build(source, library, compiler, flags, timeout=timeout)
            except BuildError as err:
                failures.append(f"{label}{err}")
                continue
            try:
                pinned = _pinned(library, keep=True)
                if pinned is None:
                    raise OSError("it no longer matches the hash recorded when it was built")
                return opener(pinned), tuple(extra)
            except (OSError, AttributeError) as err:
                loads.append(f"{label}could not load {path}, even rebuilt: {err}")
        finally:
            folder.close()
    if loads and not failures:
        raise LoadError("; ".join(loads))
    raise BuildError(f"could not build {source.name} with {compiler!r}: {'; '.join(failures + loads)}")
