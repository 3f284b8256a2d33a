"""piattn.allocator.keep_freed_pages: glibc serves a large tensor from its heap, not a fresh mapping, and keeps
its pages mapped once it is freed. Measured with glibc's own accounting (mallinfo2) in a child process (the
setting is process-wide, so the test process keeps its own)."""

import os
import subprocess
import sys

import pytest
import torch

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


# ---------------------------------------------------------------------------------------------------------
# Huge pages for the fused backend's large outputs (allocator.advise_huge_pages, on by default).

HUGE = 2 * MIB


@pytest.fixture
def fake_madvise(monkeypatch):
    """THP taken as available, madvise recorded instead of called (the checks of what is advised run on any
    host); the setting restored afterwards."""
    calls = []

    def madvise(address, length, advice):
        calls.append((address, length, advice))
        return 0

    monkeypatch.setitem(allocator._huge, "reason", None)
    monkeypatch.setitem(allocator._huge, "madvise", madvise)
    monkeypatch.setitem(allocator._huge, "page", HUGE)
    monkeypatch.setitem(allocator._huge, "enabled", True)
    return calls


@pytest.mark.parametrize("address, nbytes, expected", [
    (0, 4 * MIB, (0, 4 * MIB)),
    (16, 4 * MIB, (HUGE, HUGE)),  # the first whole huge page after 16 bytes, and no part of the last
    (HUGE - 64, 2 * HUGE + 64, (HUGE, 2 * HUGE)),
    (4096, HUGE, None),  # no whole huge page inside
    (HUGE + 1, 2 * HUGE - 2, None),
])
def test_huge_page_range_is_aligned_and_inside(address, nbytes, expected):
    span = allocator.huge_page_range(address, nbytes, HUGE)
    assert span == expected
    if span is not None:
        start, length = span
        assert start % HUGE == 0 and length % HUGE == 0 and length > 0
        assert address <= start and start + length <= address + nbytes


@pytest.mark.parametrize("numel", [allocator.HUGE_PAGE_THRESHOLD // 4, 5_000_000, 12_345_677])
def test_a_large_tensor_is_advised_on_its_aligned_interior(fake_madvise, numel):
    t = torch.empty(numel)
    span = allocator.advise_huge_pages(t)
    begin, end = t.data_ptr(), t.data_ptr() + t.numel() * 4
    assert fake_madvise == [(*span, allocator._MADV_HUGEPAGE)]
    start, length = span
    assert start % HUGE == 0 and length % HUGE == 0 and begin <= start and start + length <= end
    # the interior is all of it: no whole huge page of the tensor is left out
    assert start - begin < HUGE and end - (start + length) < HUGE


def test_small_tensors_and_a_switched_off_setting_are_left_alone(fake_madvise):
    assert allocator.advise_huge_pages(torch.empty(allocator.HUGE_PAGE_THRESHOLD // 4 - 1)) is None
    assert allocator.advise_huge_pages(torch.empty(16, dtype=torch.float64)) is None
    assert allocator.huge_pages(False) is True
    try:
        assert allocator.huge_pages() is False
        assert allocator.advise_huge_pages(torch.empty(4 * MIB)) is None
    finally:
        assert allocator.huge_pages(True) is False
    assert fake_madvise == []
    with pytest.raises(ValueError, match="must be a bool"):
        allocator.huge_pages(1)


@pytest.mark.parametrize("mode, platform, match", [
    ("never", "linux", "switched off"),
    (None, "linux", "no transparent huge pages"),
    ("madvise", "darwin", "not Linux"),
])
def test_unavailable_huge_pages_are_said_once_and_never_fail(monkeypatch, mode, platform, match):
    monkeypatch.setattr(allocator, "_huge", {"enabled": True})
    monkeypatch.setattr(allocator, "thp_mode", lambda root=allocator._THP: mode)
    monkeypatch.setattr(allocator.sys, "platform", platform)
    with pytest.warns(RuntimeWarning, match=match) as seen:
        assert allocator.advise_huge_pages(torch.empty(2 * MIB)) is None
        assert allocator.advise_huge_pages(torch.empty(2 * MIB)) is None
    assert len(seen) == 1 and "4 KiB pages" in str(seen[0].message)


def test_a_refused_madvise_is_said_once_and_never_fails(fake_madvise, monkeypatch):
    monkeypatch.setitem(allocator._huge, "madvise", lambda *args: -1)
    monkeypatch.setattr(allocator.ctypes, "get_errno", lambda: 22)
    monkeypatch.delitem(allocator._huge, "warned", raising=False)
    with pytest.warns(RuntimeWarning, match="madvise.*failed.*errno 22") as seen:
        assert allocator.advise_huge_pages(torch.empty(2 * MIB)) is None
        assert allocator.advise_huge_pages(torch.empty(2 * MIB)) is None
    assert len(seen) == 1


def test_thp_mode_reads_the_bracketed_word(tmp_path):
    (tmp_path / "enabled").write_text("always [madvise] never\n")
    (tmp_path / "hpage_pmd_size").write_text("2097152\n")
    assert allocator.thp_mode(str(tmp_path)) == "madvise"
    assert allocator.huge_page_size(str(tmp_path)) == 2097152
    assert allocator.thp_mode(str(tmp_path / "missing")) is None
    assert allocator.huge_page_size(str(tmp_path / "missing")) == HUGE


def _fused_or_skip():
    from piattn.ops.pi import fused

    if fused.unavailable() is not None:
        pytest.skip(f"fused kernels unavailable: {fused.unavailable()}")
    return fused


def _fused_call(fused, T: int):
    from piattn.ops.pi.settings import OpSettings

    g = torch.Generator().manual_seed(0)
    q, k, v, dy = (torch.randn(1, 8, T, 64, generator=g) for _ in range(4))
    gate = 0.05 + 0.9 * torch.rand(1, 8, T, generator=g)
    settings = OpSettings(window=4, period=16, causal=True, variant="adaptive", prior=0.5, logit_clamp=20.0,
                          eps=1e-4, scale=0.125, dropout_p=0.0, sinks=0)
    y, stat = fused.fused_forward(q, k, v, gate, settings)
    return (y, stat, *fused.fused_backward(dy, q, k, v, gate, stat, settings, want_dgate=True))


def test_fused_results_are_the_same_with_huge_pages_on_and_off():
    fused = _fused_or_skip()
    before = allocator.huge_pages(True)
    try:
        on = _fused_call(fused, 2048)  # y, dq, dk, dv: 4 MiB each, at the threshold
        allocator.huge_pages(False)
        off = _fused_call(fused, 2048)
    finally:
        allocator.huge_pages(before)
    for a, b in zip(on, off, strict=True):
        assert torch.equal(a, b)


def _smaps_field(address: int, field: str) -> int | None:
    """The value of `field` ("AnonHugePages:", "THPeligible:") for the mapping of this process that holds
    `address` (/proc/self/smaps), None where the kernel does not report it."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == field:
                return int(line.split()[1])
    return None


@pytest.mark.skipif(allocator.thp_mode() not in ("madvise", "always"),
                    reason=f"transparent huge pages unavailable here (mode {allocator.thp_mode()!r})")
def test_a_fresh_large_output_of_a_fused_call_is_advised_for_huge_pages():
    """The kernel marks the mapping that holds each output's interior eligible for huge pages (THPeligible, set by
    the madvise). Whether it then finds free huge pages depends on the machine's memory (fragmentation, other
    processes), and a heap block glibc hands back was touched before: so AnonHugePages is reported, not asserted."""
    fused = _fused_or_skip()
    before = allocator.huge_pages(True)
    try:
        y, _, dq, dk, dv, _ = _fused_call(fused, 8192)  # 16 MiB each: at least 7 huge pages inside
    finally:
        allocator.huge_pages(before)
    for t in (y, dq, dk, dv):
        middle = t.data_ptr() + t.numel() * 2  # half-way through an fp32 tensor
        eligible = _smaps_field(middle, "THPeligible:")
        if eligible is None:
            pytest.skip("this kernel's smaps has no THPeligible field")
        assert eligible == 1, "the output's mapping is not eligible for huge pages: no madvise reached it"


def test_an_expanded_or_strided_tensor_is_not_advised_beyond_its_memory():
    """`expand` makes numel · element size far larger than the storage: advising that span would mark memory
    the tensor does not own."""
    small = torch.empty(1024)  # 4 KiB
    assert allocator.advise_huge_pages(small.expand(4096, 1024)) is None
    assert allocator.advise_huge_pages(torch.empty(4 * MIB)[::2]) is None


@pytest.mark.parametrize("value, expected", [("0", False), ("off", False), ("False", False), (" no ", False),
                                             ("1", True), ("ON", True), ("yes", True)])
def test_switch_variables_take_the_usual_spellings(monkeypatch, value, expected):
    from piattn.checks import env_switch

    monkeypatch.setenv("PIATTN_HUGE_PAGES", value)
    assert env_switch("PIATTN_HUGE_PAGES") is expected


@pytest.mark.parametrize("value", ["", "disable", "2"])
def test_a_switch_variable_with_another_value_is_refused(monkeypatch, value):
    """Before, only the exact string '0' meant off: 'false', 'off', '' left the feature on silently."""
    from piattn.checks import env_switch

    monkeypatch.setenv("PIATTN_HUGE_PAGES", value)
    with pytest.raises(ValueError, match=f"^PIATTN_HUGE_PAGES={value!r} is not an on/off value"):
        env_switch("PIATTN_HUGE_PAGES")


@pytest.mark.parametrize("name", ["PIATTN_HUGE_PAGES", "PIATTN_NATIVE"])
def test_a_switch_variable_with_another_value_stops_the_first_call_in_one_line(name):
    """Each variable is read where its feature starts (a child process: the settings are read once)."""
    code = ("import torch, piattn\n"
            "q = torch.randn(1, 1, 1 << 16, 64)\n"
            "piattn.pi_attention(q, q, q, backend='fused')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, name: "disable"}, timeout=300)
    assert done.returncode != 0
    assert f"{name}='disable' is not an on/off value" in done.stderr
