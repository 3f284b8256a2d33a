"""Build a C file into a shared library and load it, verified: the one builder of `native.py` (the decoding
step, `decode_step.c`) and `fused.py` (the CPU backend, `fused_cpu.c`).

Loading a library runs its code, so what is loaded is checked first:

- it lives in `$PIATTN_CACHE/native` (default `~/.cache/piattn/native`), a folder made with mode 0o700;
  one owned by another user or writable by group or others is refused (`Unsafe`): someone else could put
  a library and its hash there;
- its name is keyed by the source, the compiler, the flags, the machine and the CPU (`-march=native`
  compiles for this CPU's model and flags), so that a cache shared between machines never hands one CPU's
  instructions to another;
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
import stat
import subprocess
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


def private_folder(folder: Path) -> None:
    """Make `folder` (mode 0o700), or check that the existing one is this user's alone; raises Unsafe if not.

    Loading a library runs its code: a folder another user owns or can write to (a shared PIATTN_CACHE)
    would let them run theirs in this process, whatever hash sits next to it.
    """
    folder.parent.mkdir(parents=True, exist_ok=True)
    folder.mkdir(mode=0o700, exist_ok=True)  # an existing folder keeps its mode: checked below
    info = os.stat(folder)  # follows a link: what matters is the folder the library is read from
    if not stat.S_ISDIR(info.st_mode):
        raise Unsafe(f"{folder} is not a folder")
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise Unsafe(f"{folder} belongs to user id {info.st_uid}, not to this user ({os.getuid()})")
    if info.st_mode & 0o022:
        raise Unsafe(f"{folder} can be written by group or others (mode {stat.S_IMODE(info.st_mode):o}); "
                     f"make it private with chmod 700")


def verified(path: Path) -> bool:
    """Whether `path` holds exactly the bytes whose hash its sidecar recorded when it was built."""
    try:
        recorded = digest_path(path).read_text().strip()
        data = path.read_bytes()
    except OSError:
        return False
    return hashlib.sha256(data).hexdigest() == recorded


def cpu_identity() -> bytes:
    """What -march=native compiles for: the CPU's model and flags (Linux)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor().encode()
    return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))})).encode()


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
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return frozenset()
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


def library_path(source: Path, compiler: str, flags: Sequence[str]) -> Path:
    """Where `source` built by `compiler` with `flags` lives: `<stem>-<key>.so` in `library_folder()`."""
    key = hashlib.sha256(b"\0".join([source.read_bytes(), compiler.encode(), " ".join(flags).encode(),
                                     platform.machine().encode(), cpu_identity()])).hexdigest()[:16]
    return library_folder() / f"{source.stem}-{key}.so"


def build(source: Path, path: Path, compiler: str, flags: Sequence[str], *, timeout: float = 300) -> None:
    """Compile `source` into `path` and record its hash beside it, each written to a temporary name and renamed
    into place. BuildError (the compiler's last line of error) when it fails."""
    made = []
    try:
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
        made.append(tmp)
        done = subprocess.run([compiler, *flags, str(source), "-o", tmp, "-lm"], capture_output=True, text=True,
                              timeout=timeout)
        if done.returncode:
            raise BuildError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "compiler failed")
        fd, tmp_digest = tempfile.mkstemp(suffix=".sha256", dir=path.parent)
        made.append(tmp_digest)
        with os.fdopen(fd, "w") as f:
            f.write(hashlib.sha256(Path(tmp).read_bytes()).hexdigest() + "\n")
        os.replace(tmp, path)
        os.replace(tmp_digest, digest_path(path))
    except (OSError, subprocess.SubprocessError) as err:
        raise BuildError(str(err)) from err
    finally:
        for name in made:
            if os.path.exists(name):
                os.unlink(name)


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
        private_folder(path.parent)
        if verified(path):
            try:
                return opener(path), tuple(extra)
            except (OSError, AttributeError):
                pass  # built for something else after all: rebuilt below
        label = f"{' '.join(extra) or 'no extra flags'}: " if len(flag_sets) > 1 else ""
        try:
            build(source, path, compiler, flags, timeout=timeout)
        except BuildError as err:
            failures.append(f"{label}{err}")
            continue
        try:
            return opener(path), tuple(extra)
        except (OSError, AttributeError) as err:
            loads.append(f"{label}could not load {path}, even rebuilt: {err}")
    if loads and not failures:
        raise LoadError("; ".join(loads))
    raise BuildError(f"could not build {source.name} with {compiler!r}: {'; '.join(failures + loads)}")
