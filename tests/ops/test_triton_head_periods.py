"""Backend "triton" with per-head periods (multi-scale π) in one launch of each kernel: forward and every
gradient (dq, dk, dv, dgate) against "reference" (which `pi_attention` runs once per period group), by the
reference-error rule of `utils.compare_to_exact` (fp32, bf16, fp16: the backend's largest error at most 8× the
reference's own against the fp64 result, plus 16 ulps), in Triton's CPU interpreter without a GPU.

The periods mix heads whose period lies in the window (no skip slot; their sink slots follow the local ones,
and their dropout masks are one or two slots shorter), periods >= T (made no skip by `pi_attention`),
query heads of one key/value head that differ, causal and bidirectional, sinks, documents and dropout.
Outputs are NaN-poisoned (tests/conftest.py), so an element the kernels do not write cannot pass. `pi_attention`
launches each kernel once (a spy on the launches), never once per period group.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import piattn
from piattn.config.pi import VARIANTS
from piattn.ops.pi.backends import REGISTRY, by_keywords
from piattn.ops.pi.settings import OpSettings
from utils import (
    DEVICE,
    OUTPUT_NAMES,
    against_reference,
    compare_to_exact,
    exact_run,
    forward_backward,
    make_inputs,
    param_id,
    poisoned_input,
)

pytestmark = [
    pytest.mark.skipif("triton" not in piattn.BACKENDS,
                       reason="backend 'triton' needs CUDA or TRITON_INTERPRET=1 set before import"),
    # The interpreter evaluates both sides of tl.where: exp overflows and 0/0 in masked lanes are discarded.
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]

T = 37
# 6 query heads on 2 key/value heads (groups of 3), window 3: key/value head 0 is read by periods 2 (in the
# window: no skip slot), 6 and 9; key/value head 1 by 40 (>= T: no skip), 11 and 6 (6 again, across groups).
PERIODS = (2, 6, 9, 40, 11, 6)
DOCS = [0] * 10 + [1] * 20 + [2] * 7
KW = dict(window=3, prior=0.3, logit_clamp=2.5, eps=1e-4)


def inputs_of(H: int, H_kv: int, T: int, D: int, variant: str, dtype=torch.float32, seed: int = 0, B: int = 1):
    """q, gate [B, H, T, ·] and k, v [B, H_kv, T, D] on DEVICE."""
    q, _, _, gate = make_inputs(B, H, T, D, variant=variant, dtype=dtype, device=DEVICE, seed=seed)
    _, k, v, _ = make_inputs(B, H_kv, T, D, variant=variant, dtype=dtype, device=DEVICE, seed=seed + 1)
    return q, k, v, gate


def documents(ids) -> torch.Tensor:
    return torch.tensor([ids], device=DEVICE)


def cases(names: str, values, core) -> tuple:
    """parametrize's arguments over the product of `values` (one tuple per name); on a CPU the cases `core(*case)`
    rejects are marked slow: each takes seconds in Triton's interpreter, and `make test` runs a core (a GPU
    runs every case)."""
    params = [pytest.param(*case, id="-".join(map(param_id, case)),
                           marks=[pytest.mark.slow] if DEVICE == "cpu" and not core(*case) else [])
              for case in itertools.product(*values)]
    return names, params


@pytest.mark.parametrize(*cases("variant,causal,features", (VARIANTS, (True, False), ("plain", "sinks+documents")),
                                lambda variant, causal, features: (variant, causal, features) in (
                                    ("adaptive", True, "plain"), ("separate", False, "sinks+documents"),
                                    ("union", True, "sinks+documents"), ("fixed", False, "plain"))))
def test_matches_reference(variant, causal, features, nan_poison):
    """fp32, grouped heads whose periods differ inside each group; two batch rows, or one with two sinks and
    three documents."""
    extra = dict(sinks=2, document_ids=documents(DOCS)) if features != "plain" else {}
    B = 2 if features == "plain" else 1
    against_reference("triton", inputs_of(6, 2, T, 16, variant, B=B), grad=True, period=PERIODS, causal=causal,
                      variant=variant, **KW, **extra)


# (T, window, periods) for 4 query heads on 2 key/value heads.
EDGES = {
    "in-window": (29, 3, (1, 2, 3, 2)),  # no head has a skip slot: the one-period kernels, N_SKIP = 0
    "beyond-T": (29, 3, (50, 5, 29, 70)),  # periods >= T: no skip (1 after `usable_pattern`) beside 5
    "window0": (29, 0, (1, 40, 3, 29)),  # window 0: periods >= T become T, a skip slot no query can use
    "short": (10, 4, (4, 16, 9, 12)),  # T shorter than most periods
    "T1": (1, 2, (3, 1, 2, 5)),
    "wide": (70, 20, (7, 50, 30, 21)),  # a band of several chunks; 7 in the window, 21 just beyond
}


@pytest.mark.parametrize(*cases("edge,causal", (EDGES, (True, False)),
                                lambda edge, causal: (edge, causal) in (("in-window", True), ("beyond-T", False),
                                                                        ("window0", True), ("T1", False))))
def test_edge_periods(edge, causal, nan_poison):
    """Periods in the window, at and beyond T, window 0, T shorter than the periods, with a sink; two batch
    rows."""
    T_, window, periods = EDGES[edge]
    against_reference("triton", inputs_of(4, 2, T_, 16, "adaptive", seed=2, B=2), grad=True, period=periods,
                      causal=causal, variant="adaptive", **{**KW, "window": window}, sinks=1)


@pytest.mark.parametrize(*cases("variant,causal", (VARIANTS, (True, False)),
                                lambda variant, causal: (variant, causal) == ("separate", False)))
def test_dropout_same_mask(variant, causal, nan_poison):
    """Equal seeds draw equal masks (`pi_attention` draws one per period group and hands the heads' masks
    over in one [B, H, T, S] tensor, head h's in its first slots): the triton call equals the reference,
    forward and every gradient, with sinks and documents (whose keep slots follow each head's own skip
    slots); and dropout changes the output."""
    inputs = inputs_of(6, 2, T, 16, variant, seed=5)
    kw = dict(KW, period=PERIODS, causal=causal, variant=variant, sinks=2, document_ids=documents(DOCS))
    (y, *_), _ = against_reference("triton", inputs, grad=True, seed=5, dropout_p=0.3, **kw)
    with torch.no_grad():
        plain = piattn.pi_attention(*inputs, backend="triton", **kw)
    assert (y - plain).abs().max() > 1e-3, "dropout must change the output"


@pytest.mark.parametrize(*cases("variant,causal,dtype", (("adaptive", "separate"), (True, False),
                                                         (torch.bfloat16, torch.float16)),
                                lambda variant, causal, dtype: (variant, causal, dtype) == (
                                    "adaptive", True, torch.bfloat16)))
def test_low_precision(variant, causal, dtype, nan_poison):
    """bf16 and fp16, D = 32, scores ≈ 4·N(0, 1) (some beyond the clamp of 5): the reference-error rule
    against the fp64 result of the same rounded inputs; results in the input dtype."""
    q, k, v, gate = inputs_of(6, 2, T, 32, variant, dtype=dtype, seed=3)
    q = (q.detach() * 4).requires_grad_()
    results = against_reference("triton", (q, k, v, gate), grad=True, period=PERIODS, causal=causal,
                                variant=variant, **{**KW, "logit_clamp": 5.0}, sinks=1,
                                document_ids=documents(DOCS))
    assert all(t.dtype == dtype for t in results[1][:4] if t is not None)


def test_equal_periods_are_the_int_launch(nan_poison):
    """The backend function given a tuple of equal periods launches the one-period kernels: bit for bit the
    int call, forward and every gradient."""
    inputs = inputs_of(4, 2, 30, 16, "adaptive")
    fn = by_keywords(REGISTRY["triton"].load())
    kw = dict(KW, window=3, causal=False, variant="adaptive", scale=0.25, dropout_keep=None, dropout_p=0.0, sinks=1)
    dy = torch.randn(1, 4, 30, 16, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    runs = []
    for period in (7, (7, 7, 7, 7)):
        y = fn(*inputs, period=period, **kw)
        runs.append((y, *torch.autograd.grad(y, inputs, dy)))
    for name, a, b in zip(OUTPUT_NAMES, *runs, strict=True):
        assert torch.equal(a, b), name


class _Spy:
    """Stands in for a kernel: `kernel[grid](*args, **meta)` is recorded (its PER_HEAD flag), then launched."""

    def __init__(self, kernel, launches: list, name: str):
        self.kernel, self.launches, self.name = kernel, launches, name

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.launches.append((self.name, meta["PER_HEAD"]))
            return self.kernel[grid](*args, **meta)

        return launch


def test_one_launch_per_kernel(monkeypatch, nan_poison):
    """`pi_attention` with 4 distinct periods on "triton": one forward launch and one launch of each backward
    kernel, all PER_HEAD, never once per period group (`by_period` is not called)."""
    from piattn.ops.pi import triton as tri

    def no_groups(*args, **kwargs):
        raise AssertionError("by_period called for a backend that takes per-head periods")

    launches = []
    monkeypatch.setattr(piattn.ops.pi, "by_period", no_groups)
    for name in ("pi_fwd_kernel", "pi_bwd_dq_kernel", "pi_bwd_dkdv_kernel"):
        monkeypatch.setattr(tri, name, _Spy(getattr(tri, name), launches, name))
    assert REGISTRY["triton"].per_head_periods
    inputs = inputs_of(6, 2, T, 16, "adaptive")
    got = forward_backward(*inputs, backend="triton", period=PERIODS, causal=True, variant="adaptive", **KW)
    assert launches == [("pi_fwd_kernel", True), ("pi_bwd_dq_kernel", True), ("pi_bwd_dkdv_kernel", True)]
    monkeypatch.undo()  # the reference runs per period group
    ref = forward_backward(*inputs, backend="reference", period=PERIODS, causal=True, variant="adaptive", **KW)
    compare_to_exact(ref, got, exact_run(inputs, grad=True, period=PERIODS, causal=True, variant="adaptive", **KW))


@pytest.mark.parametrize(*cases("dropout_p", ((0.0, 0.3),), lambda dropout_p: dropout_p > 0))
def test_nonfinite_gradients_fall_back_per_period_group(dropout_p):
    """A NaN in v: the forward kernel keeps it in the rows that read it, and the gradients come from "torch",
    run per period group on the group's heads (with each head's dropout mask): equal, NaN for NaN, to
    "torch" through `pi_attention` (which runs it per period group too) for the same seed."""
    q, k, v, gate = inputs_of(6, 2, T, 16, "separate", seed=7)
    v = poisoned_input(v, 20, "nan")
    kw = dict(KW, period=PERIODS, causal=False, variant="separate", sinks=1, document_ids=documents(DOCS),
              dropout_p=dropout_p)
    runs = []
    for backend in ("torch", "triton"):
        torch.manual_seed(3)
        y = piattn.pi_attention(q, k, v, gate, backend=backend, **kw)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
        runs.append((y, *torch.autograd.grad(y, (q, k, v, gate), dy)))
    assert runs[1][0].isnan().any() and not runs[1][0].isnan().all()
    for name, want, got in zip(OUTPUT_NAMES, *runs, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, equal_nan=True, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize(*cases("variant,dropout_p", (("adaptive", "separate"), (0.0, 0.2)),
                                lambda variant, dropout_p: (variant, dropout_p) == ("separate", 0.2)))
def test_compiles_to_one_operator_call(variant, dropout_p):
    """Under torch.compile the periods cross as the operators' `periods`: one piattn::pi_triton_fwd and one
    _bwd in the graphs for every head, and eager's numbers exactly."""
    from test_compile import recording_backend

    q, k, v, gate = inputs_of(6, 2, 24, 8, variant)
    docs = documents([0] * 9 + [1] * 15)

    def f(q, k, v, gate):
        return piattn.pi_attention(q, k, v, gate, period=PERIODS, causal=False, variant=variant, sinks=1,
                                   document_ids=docs, dropout_p=dropout_p, backend="triton", **KW)

    dy = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    torch.manual_seed(3)
    want_y = f(q, k, v, gate)
    want = torch.autograd.grad(want_y, (q, k, v, gate), dy)
    graphs = {}
    torch.manual_seed(3)
    got_y = torch.compile(f, backend=recording_backend(graphs), fullgraph=True)(q, k, v, gate)
    got = torch.autograd.grad(got_y, (q, k, v, gate), dy)
    assert torch.equal(got_y, want_y)
    for name, a, b in zip(OUTPUT_NAMES[1:], got, want, strict=True):
        assert torch.equal(a, b), name
    assert graphs["forward"][0].count("piattn.pi_triton_fwd") == 1
    assert graphs["backward"][0].count("piattn.pi_triton_bwd") == 1


def test_opcheck_with_periods():
    """Schema, fake implementations and autograd registration of the operators, with per-head periods."""
    from piattn.ops.pi.triton import pi_triton_bwd, pi_triton_fwd

    q, k, v, gate = inputs_of(4, 2, 16, 16, "adaptive")
    settings = OpSettings(window=3, period=2, causal=True, variant="adaptive", prior=0.3, logit_clamp=2.0, eps=1e-4,
                          scale=0.25, dropout_p=0.0, sinks=1)
    args = (q, k, v, gate, None, None, [2, 6, 9, 5], *settings)
    torch.library.opcheck(pi_triton_fwd, args, test_utils=("test_schema", "test_autograd_registration",
                                                            "test_faketensor"))
    y, stats = pi_triton_fwd(*args)
    detached = [t.detach() for t in (q, k, v, gate)]
    torch.library.opcheck(pi_triton_bwd, (torch.randn_like(y), *detached, None, None, stats.detach(), True,
                                          [2, 6, 9, 5], *settings), test_utils=("test_schema", "test_faketensor"))
