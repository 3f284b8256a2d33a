"""No host sync in a forward or backward on the path a CUDA call takes: dispatch, argument checks, the
layer's gate and the "triton" launchers read no tensor value on the host (which on a GPU waits for the
device, and stops a CUDA graph's capture).

Every way a tensor's values reach Python (`item`, `tolist`, `bool`, `int`, `float`, `index`, `numpy`, `cpu`,
`__array__`) raises `HostRead` during the call. Without a GPU the kernels run in Triton's interpreter, which
itself reads its arguments on the host; the guard is lifted for the launch alone (on a GPU a launch reads
pointers, not values). The gate's value check, a user's opt-in, is shown to be such a read.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

import piattn
import piattn.ops.pi.triton as triton_backend
from piattn.layers.pi import PiAttention

pytestmark = [
    pytest.mark.skipif("triton" not in piattn.BACKENDS,
                       reason="backend 'triton' needs CUDA or TRITON_INTERPRET=1 set before import"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # the interpreter evaluates both sides of tl.where
]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu", "__array__")


class HostRead(RuntimeError):
    """A tensor's values were read on the host during a guarded call."""


class _Guard:
    def __init__(self):
        self.lifted = 0

    @contextlib.contextmanager
    def lifted_for(self):
        self.lifted += 1
        try:
            yield
        finally:
            self.lifted -= 1


@pytest.fixture
def no_host_reads(monkeypatch):
    """A context manager: inside it, reading a tensor's values on the host raises HostRead (outside the
    interpreter's kernel launches)."""
    guard = _Guard()
    active = [False]

    def guarded(name, original):
        def method(self, *args, **kwargs):
            if active[0] and not guard.lifted:
                raise HostRead(f"Tensor.{name} called during a forward or backward")
            return original(self, *args, **kwargs)

        return method

    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, guarded(name, getattr(torch.Tensor, name)))

    if os.environ.get("TRITON_INTERPRET") == "1" and DEVICE == "cpu":
        class Unguarded:
            def __init__(self, kernel):
                self.kernel = kernel

            def __getitem__(self, grid):
                launch = self.kernel[grid]

                def run(*args, **kwargs):
                    with guard.lifted_for():
                        return launch(*args, **kwargs)

                return run

        for name in ("pi_fwd_kernel", "pi_bwd_dq_kernel", "pi_bwd_dkdv_kernel"):
            monkeypatch.setattr(triton_backend, name, Unguarded(getattr(triton_backend, name)))

    @contextlib.contextmanager
    def reads_raise():
        active[0] = True
        try:
            yield
        finally:
            active[0] = False

    return reads_raise


def _layer(variant: str, period) -> PiAttention:
    torch.manual_seed(0)
    return PiAttention(32, 2, window=3, period=period, variant=variant, backend="triton").to(DEVICE)


@pytest.mark.parametrize(("variant", "period"), [("adaptive", 5), ("separate", (5, 9)), ("union", 5)])
def test_layer_forward_backward_reads_no_value(no_host_reads, variant, period):
    """A PiAttention layer's forward and backward on backend "triton" (its own gate: no value check; the
    backward: no finiteness check), one period and per-head periods (one launch)."""
    layer = _layer(variant, period)
    x = torch.randn(2, 16, 32, device=DEVICE, requires_grad=True)
    with no_host_reads():
        y = layer(x)
        y.square().sum().backward()
    grads = [x.grad, *(p.grad for p in layer.parameters())]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_a_user_gate_is_checked_unless_vouched_for(no_host_reads):
    """pi_attention's gate check reads the values (a host sync on a GPU); check_gate=False skips it."""
    q, k, v = (torch.randn(1, 2, 16, 16, device=DEVICE, requires_grad=True) for _ in range(3))
    gate = torch.full((1, 2, 16), 0.3, device=DEVICE)
    kw = dict(window=3, period=5, backend="triton")
    with no_host_reads(), pytest.raises(HostRead):
        piattn.pi_attention(q, k, v, gate, **kw)
    with no_host_reads():
        piattn.pi_attention(q, k, v, gate, check_gate=False, **kw).sum().backward()
    with pytest.raises(ValueError, match="gate values must lie in the open interval"):
        piattn.pi_attention(q, k, v, gate + 1, **kw)


def test_a_hooked_gate_is_checked():
    """A hook may change the gate MLP's output: the layer's gate is then checked like a user's."""
    layer = _layer("adaptive", 5)
    assert layer.gate_in_range()
    handle = layer.gate.register_forward_hook(lambda module, args, out: out + 2.0)
    assert not layer.gate_in_range()
    with pytest.raises(ValueError, match="gate values must lie in the open interval"):
        layer(torch.randn(1, 8, 32, device=DEVICE))
    handle.remove()
    assert layer.gate_in_range()


def test_clip_stays_open():
    from piattn.layers.gate import clip_stays_open

    assert clip_stays_open(1e-4) and clip_stays_open(1e-6)
    assert not clip_stays_open(1e-9)  # fl(1e-9 + fl(1 − 2e-9)) = 1 in fp32


def test_a_gpt_training_step_reads_no_value(no_host_reads):
    """A whole π GPT's forward, loss and backward on backend "triton" (embeddings, rotary tables, layers,
    cross-entropy): what a CUDA graph captures of a training step, besides the optimizer (AdamW reads its
    step count on the host unless made with capturable=True, as the GPU run's capture does)."""
    from piattn.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("tiny", attention="pi", vocab_size=32, block_size=16, dropout=0.0,
                                    backend="triton")).to(DEVICE)
    idx = torch.randint(32, (2, 17), device=DEVICE)
    with no_host_reads():
        logits = model(idx[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())
        loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
