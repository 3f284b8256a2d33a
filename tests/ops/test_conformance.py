"""Every backend against "reference", over one set of cases: forward and every gradient (dq, dk, dv,
dgate), all four variants, causal and bidirectional, edge shapes, dtypes, head dims, clamp, dropout and
random shapes.

A case a backend declares it cannot run (`piattn.ops.pi.backends`) is skipped with the declared reason:
flex on CPU runs the forward passes only, triton and flex have no fp64, flex no dropout.

Two backends are costly on a CPU: triton runs in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), and flex compiles a kernel for each shape, dtype and pattern (seconds each). They
run a core of each set of cases by default; the rest of the set is marked slow (`make test-slow`).
Outputs are NaN-poisoned (tests/conftest.py) so that an element a backend forgets to write cannot pass.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import piattn
from piattn.config.pi import GATED_VARIANTS, VARIANTS
from piattn.ops.pi.backends import REGISTRY
from utils import compare, forward_backward, make_inputs

pytestmark = [
    # Triton's interpreter evaluates both sides of tl.where: exp overflows and 0/0 in masked lanes are
    # computed, then discarded.
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:.*torch.jit.script_method.*:DeprecationWarning"),
]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
UNDER_TEST = tuple(name for name in REGISTRY if name != "reference")
COSTLY = ("flex",) if DEVICE == "cuda" else ("triton", "flex")
PASSES = ("forward", "backward")  # forward alone (under no_grad), or forward and every gradient

# id: (T, window, period)
SHAPES = {
    "odd": (37, 4, 16),
    "T64": (64, 4, 16),  # whole 16-row torch blocks, one whole 64-row triton tile
    "blocks": (301, 4, 16),  # flex: three 128-row blocks, the last partial; triton: five 64-row tiles
    "short": (10, 4, 16),  # T < period: no skip key anywhere
    "T1": (1, 4, 16),
    "window0": (33, 0, 5),
    "period1": (17, 2, 1),
    "period<window": (40, 5, 3),  # the skip offsets are local already
    "period=T-1": (29, 3, 28),
    "beyond-T": (30, 40, 45),  # window and period both longer than the sequence
    "wide": (75, 20, 7),  # windows wider than torch's 16-row blocks
    "wider": (130, 40, 50),
    "widest": (150, 70, 100),  # triton's wide-band chunks (BLOCK_K = 64)
}


def _id(x) -> str:
    if isinstance(x, torch.dtype):
        return str(x).removeprefix("torch.")
    if isinstance(x, bool):
        return "causal" if x else "bidir"
    return str(x)


def matrix(core=None, **axes):
    """Parametrize (backend, *axes) over every backend and the product of the axes' values.

    core(backend, *values) -> bool: whether a costly backend runs that case by default; its other cases
    are marked slow. Without core, costly backends run every case.
    """
    params = []
    for backend in UNDER_TEST:
        for values in itertools.product(*axes.values()):
            slow = backend in COSTLY and core is not None and not core(backend, *values)
            params.append(pytest.param(backend, *values, id="-".join(map(_id, (backend, *values))),
                                       marks=[pytest.mark.slow] if slow else []))
    return ",".join(("backend", *axes)), params


def exact(backend: str) -> torch.dtype:
    """The most precise dtype a backend runs: fp64 where declared, else fp32."""
    return torch.float64 if torch.float64 in REGISTRY[backend].dtypes else torch.float32


def require(backend: str, dtype: torch.dtype, D: int, *, grad: bool, dropout_p: float = 0.0) -> None:
    """Skip, with the backend's declared reason, a case it does not run."""
    reason = REGISTRY[backend].refusal(device=DEVICE, dtype=dtype, head_dim=D, needs_grad=grad, dropout_p=dropout_p)
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")


# fp32 sums run in another order than the reference's (blocked dots vs. per-offset sums; 3xTF32 dots on a
# GPU), and dα divides Σ dlogit by α or 1 - α (down to 0.02 in make_inputs), which scales that error up:
# 1e-4 instead of utils.TOLERANCES' 2e-5 for triton's fp32.
LOOSER = {("triton", torch.float32): dict(atol=1e-4, rtol=1e-4)}


def check(backend: str, inputs, *, grad: bool, seed: int = 0, **kwargs):
    """Run "reference" and `backend` on the same inputs (same torch seed, so the same dropout mask) and
    compare y, and with grad every gradient, at utils.TOLERANCES of their dtype (or LOOSER's)."""
    q = inputs[0]
    require(backend, q.dtype, q.shape[-1], grad=grad, dropout_p=kwargs.get("dropout_p", 0.0))
    results = []
    for b in ("reference", backend):
        torch.manual_seed(seed)
        if grad:
            results.append(forward_backward(*inputs, backend=b, **kwargs))
        else:
            with torch.no_grad():  # inputs may require grad: flex on CPU takes them under no_grad
                results.append((piattn.pi_attention(*inputs, backend=b, **kwargs),))
    compare(*results, q.dtype, LOOSER.get((backend, q.dtype)))
    return results


def _shape_core(backend, shape, variant, causal, pass_):
    if backend == "triton":  # "backward" compares the forward too
        return (pass_ == "backward") == (variant in GATED_VARIANTS or shape == "odd")
    # flex: a compile per shape, pattern and kind of variant ("fixed" reuses "adaptive"'s); every variant on
    # the multi-block shape causal, a skip in both directions, and "separate" with no skip branch.
    return shape == "blocks" and (causal or variant in ("adaptive", "fixed")) or (
        shape == "period<window" and variant == "separate" and not causal)


@pytest.mark.parametrize(*matrix(_shape_core, shape=SHAPES, variant=VARIANTS, causal=(True, False), pass_=PASSES))
def test_matches_reference(backend, shape, variant, causal, pass_, nan_poison):
    """The backend's most precise dtype: fp64 at 1e-10, or fp32 at 2e-5 (utils.TOLERANCES)."""
    T, window, period = SHAPES[shape]
    inputs = make_inputs(1, 2, T, 16, variant=variant, dtype=exact(backend), device=DEVICE)
    check(backend, inputs, grad=pass_ == "backward", window=window, period=period, causal=causal,
          variant=variant, prior=0.3, logit_clamp=1.5)


def _dtype_core(backend, dtype, variant, causal, pass_):
    if backend == "triton":
        return pass_ == "forward" or variant != "fixed"
    return dtype == torch.bfloat16 and variant == "adaptive" and causal


@pytest.mark.parametrize(*matrix(_dtype_core, dtype=(torch.float32, torch.bfloat16, torch.float16),
                                 variant=VARIANTS, causal=(True, False), pass_=PASSES))
def test_dtypes(backend, dtype, variant, causal, pass_, nan_poison):
    """Within utils.TOLERANCES of the reference on the same rounded inputs (which accumulates in fp32 too).
    Scores z ≈ 7.5·N(0, 1): a few cross the clamp at 20."""
    q, k, v, gate = make_inputs(1, 2, 70, 32, variant=variant, dtype=dtype, device=DEVICE, seed=3)
    q = (q.detach() * 7.5).requires_grad_()
    results = check(backend, (q, k, v, gate), grad=pass_ == "backward", window=4, period=16, causal=causal,
                    variant=variant)
    assert all(t.dtype == dtype for t in results[1][:4] if t is not None)


@pytest.mark.parametrize(*matrix(lambda backend, D: backend == "triton", D=(1, 3, 8, 16, 48, 64, 128, 256, 320)))
def test_head_dims(backend, D, nan_poison):
    """Any D up to the declared maximum: triton zero-pads D to a power of two of at least 16 inside."""
    inputs = make_inputs(1, 2, 21, D, dtype=exact(backend), device=DEVICE)
    check(backend, inputs, grad=True, window=3, period=11, causal=False)


@pytest.mark.parametrize(*matrix(lambda backend, clamp, variant: backend == "triton",
                                 clamp=(2.0, None), variant=("adaptive", "separate")))
def test_logit_clamp(backend, clamp, variant, nan_poison):
    """Large scores: many logits beyond the clamp, where no gradient passes, or none clamped (None)."""
    q, k, v, gate = make_inputs(1, 2, 70, 32, variant=variant, dtype=exact(backend), device=DEVICE)
    q = (q.detach() * 3).requires_grad_()
    grad = REGISTRY[backend].refusal(device=DEVICE, dtype=q.dtype, head_dim=32, needs_grad=True, dropout_p=0) is None
    check(backend, (q, k, v, gate), grad=grad, window=4, period=16, causal=False, variant=variant,
          logit_clamp=clamp)


@pytest.mark.parametrize(*matrix(lambda *_: True, variant=VARIANTS, causal=(True, False)))
def test_dropout_same_mask(backend, variant, causal, nan_poison):
    """pi_attention draws one keep mask [B, H, T, |U|] for every backend: equal seeds, equal results."""
    inputs = make_inputs(1, 2, 45, 16, variant=variant, dtype=exact(backend), device=DEVICE, seed=5)
    kw = dict(window=4, period=16, causal=causal, variant=variant)
    (y, *_), _ = check(backend, inputs, grad=True, seed=5, dropout_p=0.3, **kw)
    with torch.no_grad():
        plain = piattn.pi_attention(*inputs, backend=backend, **kw)
    assert (y - plain).abs().max() > 1e-3, "dropout must change the output"


@pytest.mark.parametrize(*matrix(lambda backend: backend == "triton"))
def test_scale_eps_and_prior(backend, nan_poison):
    """eps = 0.1 floors the priors of gates below 0.1 or above 0.9 (their gradient is then zero)."""
    grad = REGISTRY[backend].refusal(device=DEVICE, dtype=exact(backend), head_dim=16, needs_grad=True,
                                     dropout_p=0) is None
    for variant, causal, kw in (("adaptive", True, dict(eps=0.1)), ("fixed", False, dict(prior=0.9))):
        inputs = make_inputs(1, 2, 50, 16, variant=variant, dtype=exact(backend), device=DEVICE)
        check(backend, inputs, grad=grad, window=3, period=9, causal=causal, variant=variant, scale=0.3, **kw)


@pytest.mark.parametrize(*matrix(lambda backend: backend == "triton"))
def test_noncontiguous_inputs(backend, nan_poison):
    """[B, T, H, D] projections viewed as [B, H, T, D], and a transposed gate, work as contiguous ones do."""
    base = make_inputs(2, 3, 41, 16, dtype=exact(backend), device=DEVICE)
    q, k, v = (t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in base[:3])
    gate = base[3].detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()
    assert not q.is_contiguous() and not gate.is_contiguous()
    grad = REGISTRY[backend].refusal(device=DEVICE, dtype=q.dtype, head_dim=16, needs_grad=True, dropout_p=0) is None
    check(backend, (q, k, v, gate), grad=grad, window=4, period=16, causal=True)


EXAMPLES = {"torch": 40, "triton": 8, "flex": 3}


@pytest.mark.parametrize(*matrix(lambda backend: backend == "triton"))
def test_random_shapes(backend):
    """Random batch, heads, length, head dim, window, period, variant and direction; forward and gradients
    where the backend has a backward here, else the forward."""
    grad = REGISTRY[backend].refusal(device=DEVICE, dtype=exact(backend), head_dim=16, needs_grad=True,
                                     dropout_p=0) is None

    @settings(max_examples=EXAMPLES.get(backend, 10), deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        B=st.integers(1, 2), H=st.integers(1, 3), T=st.integers(1, 80), D=st.sampled_from([1, 3, 8, 16]),
        window=st.integers(0, 9), period=st.integers(1, 40), causal=st.booleans(),
        variant=st.sampled_from(VARIANTS), seed=st.integers(0, 2**16),
    )
    def run(B, H, T, D, window, period, causal, variant, seed):
        inputs = make_inputs(B, H, T, D, variant=variant, dtype=exact(backend), device=DEVICE, seed=seed)
        check(backend, inputs, grad=grad, window=window, period=period, causal=causal, variant=variant,
              logit_clamp=3.0)

    run()
