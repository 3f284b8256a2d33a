"""`piattn.output_pool`: the fused CPU backend's large outputs handed out again once nothing holds them. Memory is
reused only when the pool is its storage's only holder (never under a live tensor, view, slice, numpy array,
autograd saved tensor or gradient), results computed into reused memory are the reference's, idle memory is
bounded and can be released, and the switch and the refusals say what they mean."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import piattn
from piattn import output_pool

SHAPE = (4, 8)


@pytest.fixture(autouse=True)
def small_pool(monkeypatch):
    """Every size pooled (the threshold at 0), the pool empty before and after, its settings restored."""
    monkeypatch.setattr(output_pool, "REUSE_THRESHOLD", 0)
    enabled = output_pool.reuse_outputs(True, max_idle_bytes=output_pool.DEFAULT_MAX_IDLE_BYTES)
    output_pool._buffers.clear()
    yield
    output_pool._buffers.clear()
    output_pool.reuse_outputs(enabled, max_idle_bytes=output_pool.DEFAULT_MAX_IDLE_BYTES)


def test_a_released_output_is_handed_out_again():
    a = output_pool.empty(SHAPE, torch.float32)
    address = a.data_ptr()
    del a
    b = output_pool.empty((8, 4), torch.float32)  # the same number of elements, another shape
    assert b.data_ptr() == address and b.shape == (8, 4) and b.is_contiguous()
    c = output_pool.empty(SHAPE, torch.float32)  # b is held: a new buffer
    assert c.data_ptr() != address
    assert output_pool.empty(SHAPE, torch.float64).dtype == torch.float64  # another dtype: never the same buffer


HOLDERS = {
    "the tensor": lambda t: t,
    "a view": lambda t: t.view(-1),
    "a slice": lambda t: t[1:2],
    "a numpy array": lambda t: t.numpy(),
    "an autograd saved tensor": lambda t: torch.ones(SHAPE, requires_grad=True) * t,
    "a gradient": lambda t: setattr(p := torch.zeros(SHAPE, requires_grad=True), "grad", t) or p,
    "its storage object": lambda t: t.untyped_storage(),
}


@pytest.mark.parametrize("holder", list(HOLDERS))
def test_memory_still_held_anywhere_is_never_handed_out(holder):
    t = output_pool.empty(SHAPE, torch.float32)
    t.fill_(7.0)
    address = t.data_ptr()
    kept = HOLDERS[holder](t)
    del t
    other = output_pool.empty(SHAPE, torch.float32)
    other.fill_(-1.0)
    assert other.data_ptr() != address, f"handed out while {holder} holds it"
    del kept
    assert output_pool.empty(SHAPE, torch.float32).data_ptr() == address  # released now: reused


def test_the_fused_backend_computes_into_reused_memory_what_the_reference_computes():
    """Outputs land in buffers that still hold NaN from their last use: every element must be written again."""
    for _ in range(3):  # NaN-filled buffers of the fused outputs' sizes, released into the pool
        held = [output_pool.empty(shape, dtype).fill_(float("nan")) for shape, dtype in
                (((2, 3, 37, 8), torch.float64),) * 4 + (((2, 3, 37), torch.float64), ((2, 3, 37, 1), torch.float64))]
        del held
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        q, k, v = (torch.randn(2, 3, 37, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
        gate = torch.rand(2, 3, 37, generator=g, dtype=torch.float64).requires_grad_()
        dy = torch.randn(2, 3, 37, 8, generator=g, dtype=torch.float64)
        kw = dict(window=3, period=7, variant="adaptive", sinks=1)
        results = []
        for backend in ("fused", "reference"):
            y = piattn.pi_attention(q, k, v, gate, **kw, backend=backend)
            results.append((y.detach(), *torch.autograd.grad(y, (q, k, v, gate), dy)))
        for got, want in zip(*results, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=lambda m, s=step: f"step {s}: {m}")
    assert output_pool._buffers, "the fused outputs did not come from the pool"


def test_idle_memory_is_bounded_and_can_be_released():
    element = 4 * 32  # bytes of one SHAPE fp32 buffer
    output_pool.reuse_outputs(max_idle_bytes=2 * element)
    held = [output_pool.empty(SHAPE, torch.float32) for _ in range(5)]
    assert output_pool.idle_bytes() == 0
    del held
    output_pool.empty((2, 2), torch.float32)  # a call trims what was released beyond the bound
    assert output_pool.idle_bytes() <= 2 * element + 16
    assert output_pool.release() > 0 and output_pool.idle_bytes() == 0


def test_switched_off_or_without_a_use_count_nothing_is_kept(monkeypatch):
    output_pool.empty(SHAPE, torch.float32)
    assert output_pool.reuse_outputs(False) is True and not output_pool._buffers  # off drops the idle buffers
    output_pool.empty(SHAPE, torch.float32)
    assert not output_pool._buffers
    output_pool.reuse_outputs(True)
    monkeypatch.setattr(output_pool, "_use_count", None)
    output_pool.empty(SHAPE, torch.float32)
    assert not output_pool._buffers


def test_a_torch_without_a_use_count_says_so_once(monkeypatch):
    monkeypatch.delattr(torch._C, "_storage_Use_Count")
    with pytest.warns(RuntimeWarning, match="cannot say whether an output's memory is still held"):
        assert output_pool._storage_use_count() is None


@pytest.mark.parametrize("kwargs, match", [
    (dict(enabled="yes"), r"^enabled must be a bool or None, got 'yes'$"),
    (dict(max_idle_bytes=-1), r"^max_idle_bytes must be an int >= 0 \(bytes\), got -1$"),
    (dict(max_idle_bytes=1.5), r"^max_idle_bytes must be an int >= 0 \(bytes\), got 1.5$"),
])
def test_bad_settings_are_refused_naming_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        output_pool.reuse_outputs(**kwargs)


def test_the_environment_switch():
    code = "from piattn import output_pool; print(output_pool.reuse_outputs())"
    for value, expected in (("0", "False"), ("1", "True")):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env={**os.environ, "PIATTN_REUSE_OUTPUTS": value})
        assert done.stdout.strip() == expected
