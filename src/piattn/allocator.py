"""Opt-in: let glibc serve large tensors from its heap and keep freed memory mapped, instead of mapping every
call's outputs afresh.

Why. Each π-Attention call on the CPU returns new tensors of megabytes (y, and in training dq, dk, dv): 16
MiB each for B 1, H 8, T 8192, D 64, fp32, 32 MiB at T 16384. By default glibc serves a block that large
with a fresh mmap and unmaps it when freed (its dynamic threshold never exceeds 32 MiB, so 32 MiB blocks
are mapped afresh every time), and every first write to each 4 KiB page of a fresh mapping is a page fault
in which the kernel zeroes the page. Measured on this project's CPU (`benchmarks/results/cpu_bench.md`, the
`outputs` row) those first touches cost 1.0× the operator's whole memory floor at T 8192 fwd+bwd and 3.6×
at T 16384; with this setting (`benchmarks/results/cpu_bench_kept_pages.md`) the fused fwd+bwd goes from
2.5× to 1.7× its floor at 8192 and from 5.0× to 1.7× at 16384. What it does not promise: that a given call
lands on pages touched before. glibc cannot always fit an aligned block into a freed block of the same
size, and the heap may then grow by another block (measured with mallinfo2: a 16 MiB tensor allocated
and freed in a loop grows the heap by 16 MiB a round until freed blocks coalesce). The gain is measured,
not guaranteed.

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
