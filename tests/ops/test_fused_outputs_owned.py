"""Every output of the fused CPU backend is a tensor of its own: fresh memory that nothing else holds, not a view,
never an inference tensor made under another mode. Each case below once went wrong while a pool handed large
outputs (4 MiB and up) the memory of earlier ones it believed released (issue: "the output pool made safe or
removed"): it was removed, and these cases guard against any reuse coming back.

The outputs here are 4 MiB each (B 1, H 8, T 2048, D 64, fp32), the size at which the pool took over.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import piattn
from piattn.ops.pi import fused

SHAPE = (1, 8, 2048, 64)  # 4 MiB of fp32
# Calls of the same size made (and held) after an output is dropped: enough that a pool of released outputs,
# whatever order it hands them out in, would have given one of them the dropped output's memory.
REUSE_TRIES = 8


@pytest.fixture(autouse=True)
def compiled_kernels():
    if os.environ.get("PIATTN_NATIVE") == "0" or shutil.which(os.environ.get("CC") or "cc") is None:
        pytest.skip("no compiled kernels here (PIATTN_NATIVE=0 or no C compiler)")
    if fused.unavailable() is not None:
        pytest.fail(f"fused_cpu.c must build where a compiler exists: {fused.unavailable()}")


def inputs(seed: int, grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(SHAPE, generator=g).requires_grad_(grad) for _ in range(3))
    gate = (0.05 + 0.9 * torch.rand(SHAPE[:3], generator=g)).requires_grad_(grad)
    return q, k, v, gate


def call(q, k, v, gate):
    return piattn.pi_attention(q, k, v, gate, backend="fused")


def test_outputs_and_gradients_own_their_storage():
    q, k, v, gate = inputs(0, grad=True)
    y = call(q, k, v, gate)
    y.backward(torch.ones_like(y))
    for t in (y, q.grad, k.grad, v.grad):
        assert t._base is None
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
        assert t.untyped_storage().data_ptr() == t.data_ptr()


def test_a_storage_resized_away_then_freed_does_not_reach_the_next_call():
    """FSDP frees memory by resizing a storage to 0 bytes: the next call of that size must get whole memory."""
    for nbytes in (0, 16, 4096):
        y = call(*inputs(0))
        y.untyped_storage().resize_(nbytes)
        del y
        expected = piattn.pi_attention(*inputs(1), backend="torch")
        torch.testing.assert_close(call(*inputs(1)), expected, atol=2e-5, rtol=2e-5)


def test_holding_what_backs_an_output_keeps_its_values():
    """Whatever holds an output's memory (the output, or the tensor it is a view of) keeps it from later calls."""
    y = call(*inputs(0))
    backing, kept = (y if y._base is None else y._base), y.clone()
    del y
    later = [call(*inputs(1)) for _ in range(REUSE_TRIES)]
    assert torch.equal(backing.view(SHAPE), kept) and len(later) == REUSE_TRIES


def test_inference_mode_first_then_training():
    """A first call under inference_mode must not make later training calls of that size fail."""
    with torch.inference_mode():
        call(*inputs(0))
    q, k, v, gate = inputs(1, grad=True)
    y = call(q, k, v, gate)
    assert not y.is_inference()
    weight = torch.ones(SHAPE[-1], requires_grad=True)
    (y * weight).sum().backward()  # the product saves y for weight's gradient
    assert q.grad is not None and torch.isfinite(q.grad).all() and weight.grad is not None


def test_an_output_that_requires_grad_can_be_changed_in_place():
    q, k, v, gate = inputs(0, grad=True)
    y = call(q, k, v, gate)
    y.mul_(2.0)  # a view of a pooled buffer refused this
    y.sum().backward()
    torch.testing.assert_close(q.grad, 2 * torch.autograd.grad(call(q, k, v, gate).sum(), q)[0])


def _receive(queue, answers):
    """In a child process: take a tensor, copy it, wait for the sender's next call, then say whether it changed."""
    received = queue.get()
    copy = received.clone()
    answers.put("got")
    assert queue.get() == "check"
    answers.put(bool(torch.equal(received, copy)))


def test_an_output_sent_to_another_process_is_not_rewritten():
    """torch.multiprocessing moves a sent tensor's storage to shared memory in place; dropping it on the sending
    side must not hand that shared memory to the next call."""
    context = torch.multiprocessing.get_context("spawn")
    queue, answers = context.Queue(), context.Queue()
    child = context.Process(target=_receive, args=(queue, answers))
    child.start()
    try:
        y = call(*inputs(0))
        queue.put(y)
        assert answers.get(timeout=120) == "got"
        del y
        later = [call(*inputs(1)) for _ in range(REUSE_TRIES)]
        queue.put("check")
        assert answers.get(timeout=60) is True, "the receiver's tensor changed under it"
        assert len(later) == REUSE_TRIES
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
