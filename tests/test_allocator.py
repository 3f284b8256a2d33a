"""piattn.allocator.keep_freed_pages: glibc serves a large tensor from its heap, not a fresh mapping, and keeps
its pages mapped once it is freed. Measured with glibc's own accounting (mallinfo2) in a child process (the
setting is process-wide, so the test process keeps its own)."""

import subprocess
import sys

import pytest

from piattn import allocator

# The child allocates and fills a 16 MiB tensor and frees it, and prints what glibc's accounting says of it:
# bytes newly mmapped for it, and the heap's free bytes after freeing it.
_CHILD = """
import ctypes, ctypes.util, sys, torch
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = Info
if sys.argv[1] == "keep":
    from piattn.allocator import keep_freed_pages
    keep_freed_pages()
before = libc.mallinfo2()
t = torch.empty(4 << 20).fill_(1.0)
during = libc.mallinfo2()
del t
after = libc.mallinfo2()
print(during.hblkhd - before.hblkhd, after.fordblks)
"""
MIB = 1 << 20


def _child(mode: str) -> tuple[int, int]:
    done = subprocess.run([sys.executable, "-c", _CHILD, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    mmapped, free = done.stdout.split()[-2:]
    return int(mmapped), int(free)


def _has_mallinfo2() -> bool:
    try:
        return hasattr(allocator._glibc(), "mallinfo2")
    except RuntimeError:
        return False


@pytest.mark.skipif(not _has_mallinfo2(), reason="needs glibc >= 2.33 (mallinfo2)")
def test_keep_freed_pages_serves_large_tensors_from_the_heap_and_keeps_them():
    mmapped, _ = _child("default")
    assert mmapped >= 16 * MIB  # by default glibc maps a 16 MiB block afresh (and unmaps it when freed)
    mmapped, free = _child("keep")
    assert mmapped == 0  # from the heap
    assert free >= 16 * MIB  # freed, and still mapped in the heap for the next allocation


@pytest.mark.parametrize("kwargs, match", [
    (dict(mmap_threshold=(32 << 20) + 1), "mmap_threshold must be an int in 0"),
    (dict(mmap_threshold=-1), "mmap_threshold must be an int in 0"),
    (dict(trim_threshold=1.5), "trim_threshold must be an int in 0"),
    (dict(trim_threshold=True), "trim_threshold must be an int in 0"),
])
def test_keep_freed_pages_rejects_bad_thresholds(kwargs, match):
    with pytest.raises(ValueError, match=match):
        allocator.keep_freed_pages(**kwargs)


def test_keep_freed_pages_refuses_without_glibc(monkeypatch):
    monkeypatch.setattr(allocator.ctypes.util, "find_library", lambda name: None)
    with pytest.raises(RuntimeError, match="needs glibc"):
        allocator.keep_freed_pages()
