"""Opt-in: let glibc keep freed memory in the process, so that a call's fresh outputs reuse mapped pages.

Why. Each π-Attention call on the CPU returns new tensors of megabytes (y, and in training dq, dk, dv): 16
MiB each for B 1, H 8, T 8192, D 64, fp32. glibc serves an allocation that large with a fresh mmap and
unmaps it when freed (or trims the top of its heap), so every call's first write to each 4 KiB page of its
outputs takes a page fault in which the kernel zeroes the page. Measured at that shape on this project's
CPU (`benchmarks/results/cpu_bench.md`, the `outputs` row), those first touches cost 0.33–0.41 × the
operator's memory floor: as much as a third of the fused kernels' own time. With freed memory kept
(`benchmarks/results/cpu_bench_kept_pages.md`) the fused fwd+bwd goes from 2.8× to 1.95× its floor.

What it changes, and why it is opt-in. `keep_freed_pages` calls glibc's `mallopt` for the whole process:
blocks up to `mmap_threshold` come from the heap instead of their own mapping, and the heap is trimmed
(pages returned to the system) only when more than `trim_threshold` is free at its top. The price is
resident memory: up to trim_threshold of freed memory stays mapped. That is a decision about the whole
program, not piattn's to take silently, hence a function to call (or the environment variables
MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_, which set the same before the program starts). Where the
C library is not glibc (musl, macOS, Windows) it raises, saying so, instead of doing nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util

# glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc caps M_MMAP_THRESHOLD at HEAP_MAX_SIZE / 2 (32 MiB on 64-bit); mallopt refuses more.
MMAP_THRESHOLD_MAX = 32 << 20


def _glibc() -> ctypes.CDLL:
    """The process's C library, when it is glibc (it has gnu_get_libc_version)."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        raise RuntimeError("keep_freed_pages needs glibc (Linux): this process's C library is not glibc, whose "
                           "allocator has its own policy; nothing was changed")
    return libc


def glibc_version() -> str:
    """The version of glibc this process runs on (RuntimeError where it is not glibc)."""
    libc = _glibc()
    libc.gnu_get_libc_version.restype = ctypes.c_char_p
    return libc.gnu_get_libc_version().decode()


def keep_freed_pages(mmap_threshold: int = MMAP_THRESHOLD_MAX, trim_threshold: int = 1 << 30) -> None:
    """Make glibc serve blocks up to `mmap_threshold` bytes from its heap and keep up to `trim_threshold` bytes
    of freed heap mapped, for the rest of the process (module docstring: why, and the memory it costs).

    mmap_threshold: 0 … 32 MiB (glibc's limit); trim_threshold: >= 0 bytes. Raises ValueError for values out
    of range and RuntimeError where the C library is not glibc or refuses a setting."""
    for name, value, high in (("mmap_threshold", mmap_threshold, MMAP_THRESHOLD_MAX),
                              ("trim_threshold", trim_threshold, (1 << 31) - 1)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
            raise ValueError(f"{name} must be an int in 0 … {high} bytes, got {value!r}")
    libc = _glibc()
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    for name, option, value in (("mmap_threshold", _M_MMAP_THRESHOLD, mmap_threshold),
                                ("trim_threshold", _M_TRIM_THRESHOLD, trim_threshold)):
        if libc.mallopt(option, value) != 1:
            raise RuntimeError(f"glibc's mallopt refused {name} = {value}")
