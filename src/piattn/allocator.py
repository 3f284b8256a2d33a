"""Memory for the large CPU outputs of π-Attention, two ways to keep their first touches cheap. (A third, a pool
that handed out the memory of released outputs again, was removed: it could not see every holder of that
memory, and in a training loop that allocates its cotangent it bought nothing,
`benchmarks/results/cpu_bench/output_pool_decision.md`.)

By default (`huge_pages`, the second half of this file): the fused CPU backend marks each output of 4 MiB
or more for transparent huge pages before its kernel first writes it, so that a first write faults in 2
MiB instead of 4 KiB; where the system does not allow it, one warning says so and nothing else changes.

Opt-in (`keep_freed_pages`): let glibc serve large tensors from its heap and keep freed memory mapped,
instead of mapping every call's outputs afresh.

Why. Each π-Attention call on the CPU returns new tensors of megabytes (y, and in training dq, dk, dv): 16
MiB each for B 1, H 8, T 8192, D 64, fp32, 32 MiB at T 16384. By default glibc serves a block that large
with a fresh mmap and unmaps it when freed (its dynamic threshold never exceeds 32 MiB, so 32 MiB blocks
are mapped afresh every time), and every first write to each 4 KiB page of a fresh mapping is a page fault
in which the kernel zeroes the page. Measured on this project's CPU (`benchmarks/results/cpu_bench/cpu_bench.md`, the
`outputs` row) those first touches cost 1.0× the operator's whole memory floor at T 8192 fwd+bwd and 3.6×
at T 16384; with this setting (`benchmarks/results/cpu_bench/cpu_bench_kept_pages.md`) the fused fwd+bwd goes from
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
import os
import sys
import threading
import warnings

from .checks import env_switch, is_int

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
        if not is_int(value) or not 0 <= value <= high:
            raise ValueError(f"{name} must be an int in 0 … {high} bytes, got {value!r}")
    libc = _glibc()
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    for name, option, value in (("mmap_threshold", _M_MMAP_THRESHOLD, mmap_threshold),
                                ("trim_threshold", _M_TRIM_THRESHOLD, trim_threshold)):
        if libc.mallopt(option, value) != 1:
            raise RuntimeError(f"glibc's mallopt refused {name} = {value}")


# ---------------------------------------------------------------------------------------------------------
# Huge pages for large outputs, on by default.
#
# Why. The same first touches are the cost of a fresh output of megabytes whatever the allocator does with
# freed memory: one page fault per 4 KiB page, each entering the kernel to zero the page. On a transparent
# huge page (THP) one fault maps and zeroes 2 MiB: 512 times fewer faults for the same bytes. With THP in
# the common "madvise" mode (`/sys/kernel/mm/transparent_hugepage/enabled`) the kernel gives huge pages only
# to ranges a program marks with madvise(MADV_HUGEPAGE), which is what `advise_huge_pages` does to an output
# of the fused CPU backend (`fused.py`'s `_outputs`) before its kernel first writes it: the whole huge pages
# inside the tensor's bytes (its "2 MiB-aligned interior"; the head and tail, less than a huge page each,
# stay on small pages). Only the tensor's own range is marked, so nothing else of the process changes, and
# only tensors of at least HUGE_PAGE_THRESHOLD bytes (smaller ones have at most a huge page inside them).
# What it costs: memory is taken 2 MiB at a time inside that range (never beyond it), and a fault that finds
# no free huge page may compact memory first (the `defrag` setting) or fall back to small pages.
#
# Where it cannot work (not Linux, no THP in this kernel, THP set to "never", madvise refused) nothing
# fails: one RuntimeWarning per process says why and what it costs, and outputs stay on small pages.
# `huge_pages(False)` (or PIATTN_HUGE_PAGES=0 in the environment) switches it off, e.g. to measure the
# difference (benchmarks/cpu_bench.py --huge-pages on off).

HUGE_PAGE_THRESHOLD = 4 << 20  # bytes: outputs at least this large are placed on huge pages
_MADV_HUGEPAGE = 14  # Linux's asm-generic/mman-common.h (the same on every architecture)
_THP = "/sys/kernel/mm/transparent_hugepage"
_huge: dict = {}  # "enabled": read from PIATTN_HUGE_PAGES on first use (`_enabled`), so a bad value is an
# error of the call that reads it, not of `import piattn`
_huge_lock = threading.Lock()


def _enabled() -> bool:
    if "enabled" not in _huge:
        _huge["enabled"] = env_switch("PIATTN_HUGE_PAGES")
    return _huge["enabled"]


def huge_pages(enabled: bool | None = None) -> bool:
    """Whether the fused CPU backend places its large outputs on transparent huge pages (on by default;
    PIATTN_HUGE_PAGES=0 in the environment starts it off). With `enabled` given, switch it for the rest of
    the process (e.g. to measure with and without) and return the previous setting."""
    previous = _enabled()
    if enabled is not None:
        if not isinstance(enabled, bool):
            raise ValueError(f"enabled must be a bool or None, got {enabled!r}")
        _huge["enabled"] = enabled
    return previous


def thp_mode(root: str = _THP) -> str | None:
    """The kernel's THP mode ("always", "madvise", "never": the bracketed word of `root`/enabled), or None
    where there is no such file (not Linux, or a kernel without THP)."""
    try:
        with open(os.path.join(root, "enabled")) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def huge_page_size(root: str = _THP) -> int:
    """The size of a transparent huge page in bytes (`hpage_pmd_size`; 2 MiB where the file says nothing)."""
    try:
        with open(os.path.join(root, "hpage_pmd_size")) as f:
            return int(f.read())
    except (OSError, ValueError):
        return 2 << 20


def huge_page_range(address: int, nbytes: int, page: int = 2 << 20) -> tuple[int, int] | None:
    """(start, length) of the whole pages of `page` bytes inside [address, address + nbytes), or None when
    none fits."""
    start = -(-address // page) * page
    end = (address + nbytes) // page * page
    return (start, end - start) if end > start else None


def _unavailable() -> str | None:
    """Why huge pages cannot be asked for here (None when they can), worked out once."""
    if "reason" not in _huge:
        reason = None
        if not sys.platform.startswith("linux"):
            reason = f"not Linux ({sys.platform})"
        else:
            mode = thp_mode()
            if mode is None:
                reason = f"this kernel has no transparent huge pages ({_THP} is missing)"
            elif mode == "never":
                reason = f"transparent huge pages are switched off ({_THP}/enabled is 'never')"
            else:
                try:
                    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
                    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                    libc.madvise.restype = ctypes.c_int
                    _huge["madvise"], _huge["page"] = libc.madvise, huge_page_size()
                except (OSError, AttributeError) as err:
                    reason = f"the C library's madvise cannot be called ({err})"
        _huge["reason"] = reason
        if reason is not None:
            _warn_once(reason)
    return _huge["reason"]


def _warn_once(reason: str) -> None:
    if _huge.get("warned"):
        return
    _huge["warned"] = True
    warnings.warn(f"piattn: large CPU outputs stay on 4 KiB pages: {reason}. Each first write to a page of a fresh "
                  f"output is then a page fault (at T 16K, fwd+bwd, several times the kernels' own time: "
                  f"benchmarks/results/cpu_bench/cpu_bench_hugepages.md); piattn.allocator.huge_pages(False) or "
                  f"PIATTN_HUGE_PAGES=0 silences this", RuntimeWarning, stacklevel=4)


def advise_huge_pages(tensor) -> tuple[int, int] | None:
    """Mark the whole huge pages inside `tensor`'s bytes with madvise(MADV_HUGEPAGE), so that their first
    writes fault in a huge page each (see above); call it before anything writes the tensor. Returns the
    (start address, length) advised, or None where nothing was: huge pages switched off, a tensor below
    HUGE_PAGE_THRESHOLD bytes or not on the CPU, no huge page inside it, or THP unavailable here (said once
    per process, by a RuntimeWarning), or a tensor that is not contiguous (an expanded or strided view: its
    numel · element size is not the memory it spans). Never raises for the system's reasons."""
    if not _enabled() or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    # the bytes from the tensor's first element to its storage's end bound what may be advised
    storage = tensor.untyped_storage()
    nbytes = min(tensor.numel() * tensor.element_size(), storage.data_ptr() + storage.nbytes() - tensor.data_ptr())
    if nbytes < HUGE_PAGE_THRESHOLD:
        return None
    with _huge_lock:
        if _unavailable() is not None:
            return None
    span = huge_page_range(tensor.data_ptr(), nbytes, _huge["page"])
    if span is None:
        return None
    if _huge["madvise"](span[0], span[1], _MADV_HUGEPAGE) != 0:
        err = ctypes.get_errno()
        with _huge_lock:
            _huge["reason"] = f"madvise(MADV_HUGEPAGE) failed: {os.strerror(err)} (errno {err})"
            _warn_once(_huge["reason"])
        return None
    return span
