"""pi_attention: the reference against an independent dense [T, T] formulation and the seed's appendix code,
properties of the operator, the torch backend's own checks (gradcheck, chunking) and bad input.

Every backend against the reference: test_conformance.py. The choice of backend: test_backends.py.
"""

from __future__ import annotations

import importlib
import inspect
import math

import pytest
import torch

import piattn
from appendix_module import AppendixPiAttention
from piattn.config.pi import PI_DEFAULTS, VARIANTS
from utils import OUTPUT_NAMES, TOLERANCES, assert_close, compare, forward_backward, make_inputs

# (T, window, period): odd T, T < period, window 0, period 1, period <= window, period == T - 1,
# windows wider than the torch backend's 16-row blocks.
SHAPES = [(37, 4, 16), (10, 4, 16), (33, 0, 5), (40, 5, 3), (29, 3, 28), (17, 2, 1), (1, 4, 16), (64, 4, 16),
          (130, 40, 50), (75, 20, 7)]


def dense_pi_attention(q, k, v, gate, *, window, period, causal, variant, prior=0.5, logit_clamp=20.0,
                       eps=1e-4, scale=None):
    """The operator written as dense [T, T] masked attention, from the definitions in docs/design.md alone."""
    T, D = q.shape[-2:]
    scale = D**-0.5 if scale is None else scale
    i = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    lag = j - i
    local = (lag <= 0) & (lag >= -window) if causal else lag.abs() <= window
    skip = ((lag == -period) if causal else (lag.abs() == period)) & ~local
    z = (q @ k.transpose(-1, -2)) * scale
    if logit_clamp is not None:
        z = z.clamp(-logit_clamp, logit_clamp)
    if variant == "separate":
        a = gate.unsqueeze(-1)
        p_local = torch.softmax(z.masked_fill(~local, -math.inf), -1)
        has_skip = skip.any(-1, keepdim=True)
        p_skip = torch.softmax(z.masked_fill(~skip, -math.inf).masked_fill(~has_skip, 0.0), -1) * skip
        w = torch.where(has_skip, a * p_local + (1 - a) * p_skip, p_local)
        return w @ v
    if variant == "adaptive":
        a = gate.unsqueeze(-1)
        z = z + torch.where(local, a.clamp_min(eps).log(), (1 - a).clamp_min(eps).log())
    elif variant == "fixed":
        z = z + torch.where(local, math.log(prior), math.log(1 - prior))
    return torch.softmax(z.masked_fill(~(local | skip), -math.inf), -1) @ v


def _dense_forward_backward(q, k, v, gate, **kw):
    y = dense_pi_attention(q, k, v, gate, **kw)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    inputs = [t for t in (q, k, v, gate) if t is not None]
    grads = list(torch.autograd.grad(y, inputs, dy.to(y.dtype)))
    return (y, *grads, *([None] if gate is None else []))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("T,window,period", SHAPES, ids=[f"T{t}-w{w}-p{p}" for t, w, p in SHAPES])
def test_reference_matches_dense_formulation(T, window, period, causal, variant):
    kw = dict(window=window, period=period, causal=causal, variant=variant, logit_clamp=1.5)
    inputs = make_inputs(2, 3, T, 8, variant=variant)
    expected = _dense_forward_backward(*inputs, **kw)
    actual = forward_backward(*inputs, backend="reference", **kw)
    compare(expected, actual)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_close_to_fp64_truth(dtype):
    """Accumulating in fp32, the only error left is the rounding of inputs and outputs."""
    q, k, v, gate = make_inputs(1, 2, 70, 16, dtype=torch.float64, requires_grad=False)
    truth = dense_pi_attention(q, k, v, gate, window=4, period=16, causal=True, variant="adaptive")
    low = [t.to(dtype) for t in (q, k, v, gate)]
    y = piattn.pi_attention(*low, backend="torch")
    tol = {torch.bfloat16: 3e-2, torch.float16: 4e-3}[dtype]
    torch.testing.assert_close(y.double(), truth, atol=tol, rtol=tol)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_torch_gradcheck(causal, variant):
    q, k, v, gate = make_inputs(1, 1, 13, 3, variant=variant, seed=5)
    inputs = tuple(t for t in (q, k, v, gate) if t is not None)

    def fn(*xs):
        g = xs[3] if len(xs) == 4 else None
        return piattn.pi_attention(xs[0], xs[1], xs[2], g, window=2, period=5, causal=causal, variant=variant,
                                   logit_clamp=2.0, backend="torch")

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_matches_appendix_code_fp64(backend, causal):
    """The seed's own function, adaptive variant: ≤ 1e-9 in fp64, output and gradients (q, k, v, gate)."""
    torch.manual_seed(0)
    appendix = AppendixPiAttention(64, 4, k=4, pi=16, causal=causal).double()
    q, k, v, gate = make_inputs(2, 4, 77, 16, seed=11)
    y_ref = appendix.union(q, k, v, gate)
    dy = torch.randn_like(y_ref)
    g_ref = torch.autograd.grad(y_ref, (q, k, v, gate), dy)
    # No logit clamp in the appendix code; these scores stay far below it anyway.
    y = piattn.pi_attention(q, k, v, gate, window=4, period=16, causal=causal, backend=backend)
    g = torch.autograd.grad(y, (q, k, v, gate), dy)
    for name, a, b in zip(OUTPUT_NAMES, (y_ref, *g_ref), (y, *g), strict=True):
        assert (a - b).abs().max().item() <= 1e-9, name


def test_logit_clamp_bounds_scores():
    """With huge scores, clamping makes the softmax finite and equal to the dense clamped form."""
    q, k, v, _ = make_inputs(1, 1, 40, 8, variant="union", requires_grad=False)
    q = q * 100
    for clamp in (5.0, None):
        truth = dense_pi_attention(q, k, v, None, window=2, period=9, causal=True, variant="union",
                                   logit_clamp=clamp)
        for backend in ("reference", "torch"):
            y = piattn.pi_attention(q, k, v, window=2, period=9, variant="union", logit_clamp=clamp,
                                    backend=backend)
            assert_close(f"{backend} clamp={clamp}", truth, y)


def test_fixed_half_equals_union():
    """docs/design.md: α = 0.5 adds one constant to every logit, so "fixed" with prior 0.5 is "union"."""
    q, k, v, _ = make_inputs(2, 2, 50, 8, variant="union", requires_grad=False)
    a = piattn.pi_attention(q, k, v, variant="fixed", prior=0.5, backend="torch")
    b = piattn.pi_attention(q, k, v, variant="union", backend="torch")
    assert_close("fixed(0.5) vs union", b, a)
    c = piattn.pi_attention(q, k, v, variant="fixed", prior=0.9, backend="torch")
    assert (c - b).abs().max() > 1e-3, "a prior other than 0.5 must change the output"


def test_gate_extremes_select_branches():
    """α → 1 makes adaptive fusion local-window attention (the paper's limiting case)."""
    q, k, v, gate = make_inputs(1, 2, 60, 8, requires_grad=False)
    y = piattn.pi_attention(q, k, v, torch.full_like(gate, 1 - 1e-9), backend="torch", eps=1e-12)
    local = dense_pi_attention(q, k, v, None, window=4, period=10_000, causal=True, variant="union")
    torch.testing.assert_close(y, local, atol=1e-6, rtol=1e-6)


def test_dropout_is_unbiased():
    """Inverted dropout keeps the expected output: over many draws the mean is within 5 standard errors."""
    q, k, v, gate = make_inputs(1, 1, 20, 4, requires_grad=False)
    plain = piattn.pi_attention(q, k, v, gate, backend="torch")
    torch.manual_seed(0)
    n = 1000
    draws = torch.stack([piattn.pi_attention(q, k, v, gate, dropout_p=0.5, backend="torch") for _ in range(n)])
    stderr = draws.std(0) / n**0.5
    assert ((draws.mean(0) - plain).abs() <= 5 * stderr + 1e-12).all()


# ---- bad input: a ValueError that names the argument -------------------------------------------------

def _good():
    q, k, v, gate = make_inputs(1, 2, 8, 4, dtype=torch.float32, requires_grad=False)
    return dict(q=q, k=k, v=v, gate=gate)


BAD_INPUTS = [
    ("q", lambda a: a.update(q=a["q"][0])),
    ("k and v must share one shape", lambda a: a.update(k=a["k"][:, :, :5])),
    ("dtype", lambda a: a.update(v=a["v"].double())),
    ("dtype", lambda a: a.update(q=a["q"].int(), k=a["k"].int(), v=a["v"].int())),
    ("gate", lambda a: a.update(gate=a["gate"][..., :3])),
    ("gate", lambda a: a.update(gate=a["gate"] + 1)),
    ("gate", lambda a: a.update(gate=torch.zeros_like(a["gate"]))),
    ("gate", lambda a: a.update(variant="union")),
    ("window", lambda a: a.update(window=-1)),
    ("window", lambda a: a.update(window=2.5)),
    ("period", lambda a: a.update(period=0)),
    ("variant", lambda a: a.update(variant="dense")),
    ("backend", lambda a: a.update(backend="cuda-magic")),
    ("dropout_p", lambda a: a.update(dropout_p=1.0)),
    ("logit_clamp", lambda a: a.update(logit_clamp=0.0)),
    ("eps", lambda a: a.update(eps=0.0)),
    ("scale", lambda a: a.update(scale=-1.0)),
    ("prior", lambda a: a.update(variant="fixed", gate=None, prior=1.0)),
    ("prior", lambda a: a.update(prior=0.0)),  # checked for every variant (piattn.config.pi)
    ("causal", lambda a: a.update(causal="yes")),
]


@pytest.mark.parametrize("needle,mutate", BAD_INPUTS, ids=[f"{i}-{n}" for i, (n, _) in enumerate(BAD_INPUTS)])
def test_bad_input_raises_value_error_naming_argument(needle, mutate):
    args = _good()
    mutate(args)
    q, k, v, gate = args.pop("q"), args.pop("k"), args.pop("v"), args.pop("gate")
    with pytest.raises(ValueError, match=needle):
        piattn.pi_attention(q, k, v, gate, **args)


def test_mixed_devices_rejected():
    q, k, v, gate = make_inputs(1, 1, 4, 4, requires_grad=False)
    with pytest.raises(ValueError, match="device"):
        piattn.pi_attention(q, k.to("meta"), v, gate)


def test_tolerance_table_covers_supported_dtypes():
    from piattn.ops.pi.validate import SUPPORTED_DTYPES

    assert set(TOLERANCES) == set(SUPPORTED_DTYPES)


@pytest.mark.parametrize("chunk_bytes", [1, 2000, 6000, 1 << 40],
                         ids=["one-block-chunks", "row-runs", "head-pairs", "one-chunk-as-on-gpu"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("variant", ["adaptive", "separate"])
def test_torch_chunking_is_invisible(chunk_bytes, causal, variant, monkeypatch, nan_poison):
    """Long sequences run in chunks with halos crossing chunk borders; small chunks exercise that path."""
    eager = importlib.import_module("piattn.ops.pi.torch")
    monkeypatch.setattr(eager, "CHUNK_BYTES", chunk_bytes)
    kw = dict(window=5, period=21, causal=causal, variant=variant)
    inputs = make_inputs(2, 3, 83, 4, variant=variant, seed=7)
    compare(forward_backward(*inputs, backend="reference", **kw), forward_backward(*inputs, backend="torch", **kw))


def test_signature_is_the_contract():
    """The public signature is fixed; its setting defaults are piattn.config.pi.PI_DEFAULTS."""
    params = inspect.signature(piattn.pi_attention).parameters
    assert list(params) == ["q", "k", "v", "gate", "window", "period", "causal", "variant", "prior", "logit_clamp",
                            "eps", "scale", "dropout_p", "sinks", "document_ids", "backend", "check_gate", "layout"]
    assert all(params[name].kind is inspect.Parameter.KEYWORD_ONLY for name in list(params)[4:])
    defaults = {name: p.default for name, p in params.items() if p.default is not inspect.Parameter.empty}
    assert defaults == {**PI_DEFAULTS.as_kwargs(), "gate": None, "causal": True, "scale": None, "dropout_p": 0.0,
                        "document_ids": None, "backend": "auto", "check_gate": True, "layout": "bhtd"}
    assert PI_DEFAULTS.as_kwargs() == dict(window=4, period=16, variant="adaptive", prior=0.5, logit_clamp=20.0,
                                           eps=1e-4, sinks=0)


def test_defaults_run_without_a_gate():
    """pi_attention(q, k, v) runs on its defaults, as SDPA does: the gated variants take α = prior for every
    query ("adaptive" is then exactly "fixed"; "separate" mixes by a gate filled with prior)."""
    q, k, v, _ = make_inputs(1, 2, 20, 8, requires_grad=False)
    y = piattn.pi_attention(q, k, v)
    assert torch.equal(y, piattn.pi_attention(q, k, v, variant="fixed", prior=0.5))
    separate = piattn.pi_attention(q, k, v, variant="separate", prior=0.3, backend="reference")
    full = torch.full(q.shape[:3], 0.3, dtype=q.dtype)
    assert torch.equal(separate, piattn.pi_attention(q, k, v, full, variant="separate", backend="reference"))
    with pytest.raises(ValueError, match=r"variant 'separate' without a gate mixes its branches by prior, which "
                                         r"must then lie in \(0, 1\); got prior=1.0"):
        piattn.pi_attention(q, k, v, variant="separate", prior=1.0)
