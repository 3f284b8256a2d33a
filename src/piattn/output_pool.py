"""Large outputs of the fused CPU backend handed out again once nothing holds them: fresh memory without its
first-touch cost, on by default.

Why. Every fused call returns new tensors of megabytes (y; in training dq, dk, dv), and the first write to
each page of fresh memory is a page fault in which the kernel zeroes the page. Huge pages (`allocator`) make
the faults 512 times fewer, but the zeroing stays: at T 16K, fwd+bwd, B 1, H 8, D 64, fp32, it is about a
third of the call at one thread and half at two, where the kernels scale and the zeroing, bound by memory,
does not (`benchmarks/results/cpu_bench_reuse.md`). A training step frees those outputs as soon as autograd
has used them, and the next call asks for the same shapes: this pool gives it the same memory back.

How. `empty(shape, dtype)` for a size of at least REUSE_THRESHOLD bytes returns a view of a buffer the pool
keeps. A later request of the same dtype and element count takes a buffer whose only holder is the pool: its
storage's use count (`torch._C._storage_Use_Count`) and the references to its storage object are what they
were when the pool alone held it, so no tensor, view, slice, autograd saved tensor, gradient, numpy array,
DLPack capsule or kept `untyped_storage()` can see it change. Otherwise a new buffer is allocated (placed on
huge pages, `allocator.advise_huge_pages`) and kept. A reused buffer holds the values of its last use: the
fused kernels write every element of their outputs (the conformance suite checks it on NaN-filled ones).

What it costs. Released outputs stay allocated: at most `max_idle_bytes` of them (1 GiB by default), the
least recently handed out dropped first; `release()` drops them all. `reuse_outputs(False)` or
PIATTN_REUSE_OUTPUTS=0 in the environment switches it off. Where torch has no way to read a storage's use
count, nothing is reused, and one RuntimeWarning says so.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import warnings
from collections.abc import Sequence

import torch

from .allocator import HUGE_PAGE_THRESHOLD, advise_huge_pages
from .checks import is_int

# bytes: the same "large output" as the huge pages' (smaller ones come from torch's allocator as before)
REUSE_THRESHOLD = HUGE_PAGE_THRESHOLD
DEFAULT_MAX_IDLE_BYTES = 1 << 30
_settings = {"enabled": os.environ.get("PIATTN_REUSE_OUTPUTS", "1") != "0", "max_idle_bytes": DEFAULT_MAX_IDLE_BYTES}


class _Buffer:
    """A flat buffer the pool keeps, and how many hold it when nothing but the pool does (`idle`)."""

    __slots__ = ("tensor", "storage", "base")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        # Made once and kept: torch keeps a storage's Python object once made, and it counts as a holder.
        self.storage = tensor.untyped_storage()
        self.base = self.holders()

    def holders(self) -> tuple[int, int]:
        """(the C++ holders of the storage: tensors, views, saved tensors, numpy arrays; the Python references
        to its storage object, which someone who kept `t.untyped_storage()` holds)."""
        return _use_count(self.storage._cdata), sys.getrefcount(self.storage)

    def idle(self) -> bool:
        """Whether nothing but the pool holds the buffer: no more holders of either kind than it had alone."""
        cpp, py = self.holders()
        return cpp <= self.base[0] and py <= self.base[1]

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


_buffers: list[_Buffer] = []  # the most recently handed out last
_lock = threading.Lock()


def reuse_outputs(enabled: bool | None = None, *, max_idle_bytes: int | None = None) -> bool:
    """Whether the fused CPU backend reuses its released large outputs (on by default; PIATTN_REUSE_OUTPUTS=0
    starts it off). With `enabled` given, switch it for the rest of the process (off also drops the idle
    buffers); with `max_idle_bytes` (an int >= 0), the most released memory the pool keeps. Returns the
    previous setting."""
    if enabled is not None and not isinstance(enabled, bool):
        raise ValueError(f"enabled must be a bool or None, got {enabled!r}")
    if max_idle_bytes is not None and not (is_int(max_idle_bytes) and max_idle_bytes >= 0):
        raise ValueError(f"max_idle_bytes must be an int >= 0 (bytes), got {max_idle_bytes!r}")
    with _lock:
        previous = _settings["enabled"]
        if enabled is not None:
            _settings["enabled"] = enabled
        if max_idle_bytes is not None:
            _settings["max_idle_bytes"] = max_idle_bytes
        if not _settings["enabled"]:
            _buffers.clear()
        else:
            _trim()
    return previous


def release() -> int:
    """Drop every buffer the pool keeps that nothing else holds; returns the bytes released to torch."""
    with _lock:
        idle = [b for b in _buffers if b.idle()]
        _buffers[:] = [b for b in _buffers if b not in idle]
    return sum(b.nbytes for b in idle)


def idle_bytes() -> int:
    """The bytes of the buffers the pool keeps that nothing else holds (memory it costs now)."""
    with _lock:
        return sum(b.nbytes for b in _buffers if b.idle())


def empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor of `shape` and `dtype` (what torch.empty gives), from a released
    buffer of the same size where the pool has one; large fresh ones on huge pages."""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if not _settings["enabled"] or nbytes < REUSE_THRESHOLD or _use_count is None:
        fresh = torch.empty(shape, dtype=dtype)
        advise_huge_pages(fresh)
        return fresh
    with _lock:
        for i, buffer in enumerate(_buffers):
            if buffer.tensor.dtype == dtype and buffer.tensor.numel() == numel and buffer.idle():
                _buffers.append(_buffers.pop(i))
                return buffer.tensor.view(shape)
        tensor = torch.empty(numel, dtype=dtype)
        advise_huge_pages(tensor)
        _buffers.append(_Buffer(tensor))
        _trim()
        return tensor.view(shape)


def _trim() -> None:
    """Drop the least recently handed out idle buffers until at most max_idle_bytes of them remain (under _lock)."""
    idle = [b for b in _buffers if b.idle()]
    excess = sum(b.nbytes for b in idle) - _settings["max_idle_bytes"]
    for buffer in idle:  # oldest first
        if excess <= 0:
            break
        _buffers.remove(buffer)
        excess -= buffer.nbytes


def _storage_use_count():
    """torch's reader of a storage's use count, or None (said once) where this torch has none."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        warnings.warn(f"piattn: this torch ({torch.__version__}) cannot say whether an output's memory is still "
                      f"held, so the fused CPU backend allocates every output afresh (its first writes then zero "
                      f"fresh pages: benchmarks/results/cpu_bench_reuse.md)", RuntimeWarning, stacklevel=2)
    return count


_use_count = _storage_use_count()
