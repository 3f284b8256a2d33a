"""Backend "triton" on its own: long bf16 sequences near the logit clamp, on a GPU. Against "reference" on
every variant, shape, dtype, head dim and dropout (in Triton's CPU interpreter without a GPU):
test_conformance.py.
"""

from __future__ import annotations

import pytest
import torch

import piattn
from piattn.config.pi import VARIANTS
from piattn.ops.pi.pattern import document_bounds
from piattn.ops.pi.settings import OpSettings
from utils import OUTPUT_NAMES, forward_backward, make_inputs

pytestmark = [
    pytest.mark.skipif("triton" not in piattn.BACKENDS,
                       reason="backend 'triton' needs CUDA or TRITON_INTERPRET=1 set before import"),
    # The interpreter evaluates both sides of tl.where: exp overflows and 0/0 in masked lanes are discarded.
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(("variant", "features", "period"), [
    ("adaptive", False, 7), ("fixed", False, (7, 11)), ("separate", True, 7), ("union", True, (2, 7))])
def test_launchers_without_autograd(variant, features, period, nan_poison):
    """The forward and backward launchers, called as plain functions (no autograd), give what
    pi_attention(backend="triton") gives: the autograd.Function adds nothing but the wiring. features:
    with sinks, documents and one key/value head for two query heads; period: one, or one per query head
    (2 lies in the window)."""
    from piattn.ops.pi import triton as tri

    q, k, v, gate = make_inputs(1, 2, 20, 16, variant=variant, dtype=torch.float32, device=DEVICE)
    kw = dict(window=3, period=period, causal=False, variant=variant, prior=0.3, logit_clamp=2.0, eps=1e-4)
    extra, more = {}, {}
    if features:
        k, v = (t.detach()[:, :1].requires_grad_() for t in (k, v))
        ids = torch.tensor([[0] * 6 + [1] * 14], device=DEVICE)
        extra = dict(sinks=2, document_ids=ids)
        more = dict(kv_heads=1, documents=True)
    y, *grads = forward_backward(q, k, v, gate, backend="triton", **kw, **extra)
    settings = OpSettings(**kw, scale=16**-0.5, dropout_p=0.0, sinks=extra.get("sinks", 0))
    launch = tri.plan(q, settings, dropout=False, **more)
    assert launch.meta["PER_HEAD"] == (not isinstance(period, int))
    bounds = document_bounds(extra.get("document_ids"), torch.int32)
    with torch.no_grad():
        y2, stats = tri.triton_forward(q, k, v, gate, None, launch, bounds)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(y)
        grads2 = tri.triton_backward(dy, q, k, v, gate, None, stats, launch, want_dgate=gate is not None,
                                     bounds=bounds)
    assert torch.equal(y, y2)
    for name, a, b in zip(OUTPUT_NAMES[1:], grads, grads2, strict=True):
        assert (a is None and b is None) or torch.equal(a, b), name


def _relative_rms(expected, actual):
    return ((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (full-size kernels)")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_long_bf16_near_clamp(variant, causal):
    """T = 4096 in bf16 with scores z ~ 19·N(0, 1), so many lie at the clamp of 20 and most near it: all
    outputs finite, and close to the fp32 reference of the same bf16-rounded inputs. Relative RMS errors,
    not elementwise bounds, since at this size a few elements near zero dominate elementwise ratios."""
    B, H, T, D = 2, 4, 4096, 64
    q, k, v, gate = make_inputs(B, H, T, D, variant=variant, dtype=torch.float32, device="cuda", seed=3,
                                requires_grad=False)
    q = q * 19
    kwargs = dict(window=64, period=256, causal=causal, variant=variant)
    low = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
    g_low = None if gate is None else gate.to(torch.bfloat16).requires_grad_()
    tri = forward_backward(*low, g_low, backend="triton", **kwargs)
    ref_in = [t.detach().float().requires_grad_() for t in low]
    g_ref = None if g_low is None else g_low.detach().float().requires_grad_()
    ref = forward_backward(*ref_in, g_ref, backend="reference", **kwargs)
    tri32 = forward_backward(*ref_in, g_ref, backend="triton", **kwargs)
    for name, e, a, a32 in zip(OUTPUT_NAMES, ref, tri, tri32, strict=True):
        if e is None:
            continue
        assert torch.isfinite(a).all(), f"{name}: non-finite values in bf16"
        # bf16 rounds the inputs of every tensor-core product (P, dlogit) and the result: ~2^-8.
        assert _relative_rms(e, a) < 2e-2, f"{name} bf16: relative RMS error {_relative_rms(e, a):.3g}"
        assert _relative_rms(e, a32) < 1e-4, f"{name} fp32: relative RMS error {_relative_rms(e, a32):.3g}"
