"""pi_attention(layout="bthd"): FlashAttention's [B, T, H, D] gives the "bhtd" result on transposed inputs,
forward and gradients, on every backend this machine runs; bad layouts and shapes name the layout."""

from __future__ import annotations

import pytest
import torch

import piattn
import piattn.ops.pi as pi_ops
from utils import make_inputs


def bthd(t):
    """A [B, H, T, …] tensor as its contiguous [B, T, H, …] copy (what model code holds)."""
    return None if t is None else t.detach().transpose(1, 2).contiguous().requires_grad_(t.requires_grad)


def run(q, k, v, gate, dy, **kwargs):
    """(y, gradients): forward only for "flex", whose CPU backward does not exist."""
    if kwargs["backend"] == "flex":
        with torch.no_grad():
            return (piattn.pi_attention(q, k, v, gate, **kwargs),)
    y = piattn.pi_attention(q, k, v, gate, **kwargs)
    inputs = [t for t in (q, k, v, gate) if t is not None]
    return (y, *torch.autograd.grad(y, inputs, dy))


CPU_BACKENDS = [b for b in ("reference", "torch", "fused", "flex") if b in piattn.BACKENDS]


@pytest.mark.filterwarnings("ignore:backend .flex. runs FlexAttention uncompiled")
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("setting", [
    dict(variant="adaptive"), dict(variant="separate", causal=False), dict(variant="union", sinks=2),
    dict(variant="adaptive", gqa=True), dict(variant="fixed", period=[3, 5, 3, 7]),
], ids=["adaptive", "separate-bidir", "union-sinks", "gqa", "head-periods"])
def test_bthd_equals_bhtd_on_transposed_inputs_forward_and_gradients(backend, setting):
    setting = dict(setting)
    gqa = setting.pop("gqa", False)
    dtype = torch.float64 if backend != "flex" else torch.float32
    q, k, v, gate = make_inputs(2, 4, 23, 8, variant=setting["variant"], dtype=dtype)
    if gqa:
        k, v = (t.detach()[:, :2].requires_grad_() for t in (k, v))
    kwargs = dict(window=3, period=setting.pop("period", 6), backend=backend, **setting)
    dy = torch.randn(2, 4, 23, 8, dtype=dtype, generator=torch.Generator().manual_seed(1))
    try:
        expected = run(q, k, v, gate, dy, **kwargs)
    except ValueError as err:
        pytest.skip(f"{backend} does not run this call: {err}")
    actual = run(*(bthd(t) for t in (q, k, v, gate)), bthd(dy), layout="bthd", **kwargs)
    assert actual[0].shape == (2, 23, 4, 8)
    for e, a in zip(expected, actual, strict=True):
        torch.testing.assert_close(a, e.transpose(1, 2), rtol=0, atol=0)


def test_bthd_needs_no_copy_of_its_inputs_and_returns_a_view():
    q, k, v, gate = (bthd(t) for t in make_inputs(1, 2, 9, 4, requires_grad=False))
    seen = {}

    def reference(qq, kk, vv, gg, *args):
        seen.update(q=qq, gate=gg)
        return original(qq, kk, vv, gg, *args)

    original = pi_ops._backend_function("reference", q)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pi_ops, "_backend_function", lambda name, q: reference)
        y = piattn.pi_attention(q, k, v, gate, backend="reference", layout="bthd")
    assert seen["q"].data_ptr() == q.data_ptr() and seen["gate"].data_ptr() == gate.data_ptr()
    assert y.shape == q.shape and y.transpose(1, 2).is_contiguous()


def test_bad_layout_is_refused_naming_the_allowed_values():
    q, k, v, gate = make_inputs(1, 2, 8, 4, requires_grad=False)
    for bad in ("bshd", "BHTD", None):
        with pytest.raises(ValueError, match=r"^layout must be one of 'bhtd' \(q, k, v \[B, H, T, D\]\), "
                                             r"'bthd' \(q, k, v \[B, T, H, D\]\); got"):
            piattn.pi_attention(q, k, v, gate, layout=bad)


def test_shape_errors_name_the_layout():
    q, k, v, gate = make_inputs(1, 2, 8, 4, requires_grad=False)  # [B=1, H=2, T=8, D=4]
    # a bhtd gate passed with bthd tensors
    with pytest.raises(ValueError, match=r"^gate must have shape \[B, T, H\] = \(1, 8, 2\) for q of shape "
                                         r"\[B, T, H, D\] \(layout='bthd'\) \(1, 8, 2, 4\), got \(1, 2, 8\)"):
        piattn.pi_attention(bthd(q), bthd(k), bthd(v), gate, layout="bthd")
    # a bthd gate passed with the default layout
    with pytest.raises(ValueError, match=r"^gate must have shape \[B, H, T\] = \(1, 2, 8\) .*layout='bhtd'"):
        piattn.pi_attention(q, k, v, bthd(gate))
    with pytest.raises(ValueError, match=r"^k and v must have shape \[B, T, H_kv, D\] \(layout='bthd'\)"):
        piattn.pi_attention(bthd(q), k, v, bthd(gate), layout="bthd")
    with pytest.raises(ValueError, match=r"^q must have shape \[B, T, H, D\] \(layout='bthd'\) \(4 dims\)"):
        piattn.pi_attention(q[0], k, v, gate, layout="bthd")


def test_bthd_compiles_whole():
    """The layout's transposes trace into one graph (torch.compile, fullgraph) with the same gradients."""
    q, k, v, gate = (bthd(t) for t in make_inputs(1, 4, 20, 8))

    def f(q, k, v, gate):
        return piattn.pi_attention(q, k, v, gate, window=3, period=8, backend="reference",
                                   layout="bthd").square().sum()

    want = torch.autograd.grad(f(q, k, v, gate), (q, k, v, gate))
    got = torch.autograd.grad(torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v, gate), (q, k, v, gate))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
