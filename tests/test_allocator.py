"""piattn.allocator.keep_freed_pages: the page faults it exists to remove, measured in a child process (the
setting is process-wide, so the test process keeps its own)."""

import subprocess
import sys

import pytest

from piattn import allocator

# The child allocates and fills a 16 MiB tensor, frees it, and counts the minor page faults of doing it again.
_CHILD = """
import resource, sys, torch
if sys.argv[1] == "keep":
    from piattn.allocator import keep_freed_pages
    keep_freed_pages()
def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.empty(4 << 20).fill_(1.0)
    del t
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults()
print(faults())
"""


def _second_round_faults(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", _CHILD, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


def _is_glibc() -> bool:
    try:
        allocator.glibc_version()
    except RuntimeError:
        return False
    return True


@pytest.mark.skipif(not _is_glibc(), reason="keep_freed_pages is glibc's; this C library is another")
def test_keep_freed_pages_removes_the_first_touch_faults():
    pages = (16 << 20) // 4096
    assert _second_round_faults("default") > pages // 2  # glibc maps a 16 MiB block afresh each time
    assert _second_round_faults("keep") < pages // 16  # the freed block's pages are reused


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
