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

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import piattn
from piattn.config.pi import GATED_VARIANTS, VARIANTS
from piattn.ops.pi.backends import REGISTRY, by_keywords
from utils import (
    DEVICE,
    LOOSER,
    against_reference,
    assert_close,
    backend_matrix,
    compare,
    forward_backward,
    make_inputs,
    most_exact_dtype,
    param_id,
    poisoned_input,
    require_backend,
)

pytestmark = [
    # Triton's interpreter evaluates both sides of tl.where: exp overflows and 0/0 in masked lanes are
    # computed, then discarded.
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:.*torch.jit.script_method.*:DeprecationWarning"),
    # flex says once that it runs uncompiled on a CPU (tests/ops/test_flex.py checks that it says so)
    pytest.mark.filterwarnings("ignore:backend 'flex' runs FlexAttention uncompiled on CPU:UserWarning"),
]

UNDER_TEST = tuple(name for name in REGISTRY if name != "reference")
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
    "period=window": (40, 4, 4),
    "period=T-1": (29, 3, 28),
    "beyond-T": (30, 40, 45),  # window and period both longer than the sequence
    "wide": (75, 20, 7),  # windows wider than torch's 16-row blocks
    "wider": (130, 40, 50),
    "widest": (150, 70, 100),  # triton's wide-band chunks (BLOCK_K = 64)
}


def check(backend: str, inputs, *, grad: bool, seed: int = 0, **kwargs):
    """`utils.against_reference` for a backend that can run the call on DEVICE (else the test skips)."""
    q = inputs[0]
    require_backend(backend, q.dtype, q.shape[-1], grad=grad, dropout_p=kwargs.get("dropout_p", 0.0))
    return against_reference(backend, inputs, grad=grad, seed=seed, **kwargs)


# Triton's bidirectional core (make test): partial tiles, a skip inside the window, its wide band.
TRITON_BIDIR_CORE = ("odd", "period<window", "widest")
# Triton's backward core: every variant on the partial tiles, both gated variants where the tiles of the
# bidirectional core differ, one gated variant on each other shape (the two take turns); the rest forward.
TRITON_BACKWARD_CORE = {"odd": VARIANTS, "period<window": GATED_VARIANTS, "widest": GATED_VARIANTS}
TRITON_GATED_BY_SHAPE = {shape: GATED_VARIANTS[i % 2] for i, shape in enumerate(SHAPES)}


def _shape_core(backend, shape, variant, causal, pass_):
    if backend == "triton":  # "backward" compares the forward too; bidirectional on the shapes whose tiles differ
        backward = variant in TRITON_BACKWARD_CORE.get(shape, (TRITON_GATED_BY_SHAPE[shape],))
        return (pass_ == "backward") == backward and (causal or shape in TRITON_BIDIR_CORE)
    # flex: a compile per shape, pattern and kind of variant ("fixed" reuses "adaptive"'s); every variant on
    # the multi-block shape causal, a skip in both directions, and "separate" with no skip branch.
    return shape == "blocks" and (causal or variant in ("adaptive", "fixed")) or (
        shape == "period<window" and variant == "separate" and not causal)


@pytest.mark.parametrize(*backend_matrix(UNDER_TEST, _shape_core, shape=SHAPES, variant=VARIANTS, causal=(True, False),
                                         pass_=PASSES))
def test_matches_reference(backend, shape, variant, causal, pass_, nan_poison):
    """The backend's most precise dtype: fp64 at 1e-10, or fp32 at 2e-5 (utils.TOLERANCES)."""
    T, window, period = SHAPES[shape]
    inputs = make_inputs(1, 2, T, 16, variant=variant, dtype=most_exact_dtype(backend), device=DEVICE)
    check(backend, inputs, grad=pass_ == "backward", window=window, period=period, causal=causal,
          variant=variant, prior=0.3, logit_clamp=1.5)


def _dtype_core(backend, dtype, variant, causal, pass_):
    if backend == "triton":  # causal only: bidirectional tiles are test_matches_reference's
        return (pass_ == "forward" or variant != "fixed") and causal
    return dtype == torch.bfloat16 and variant == "adaptive" and causal


@pytest.mark.parametrize(*backend_matrix(UNDER_TEST, _dtype_core, dtype=(torch.float32, torch.bfloat16, torch.float16),
                                 variant=VARIANTS, causal=(True, False), pass_=PASSES))
def test_dtypes(backend, dtype, variant, causal, pass_, nan_poison):
    """Within utils.TOLERANCES of the reference on the same rounded inputs (which accumulates in fp32 too).
    Scores z ≈ 7.5·N(0, 1): a few cross the clamp at 20."""
    q, k, v, gate = make_inputs(1, 2, 70, 32, variant=variant, dtype=dtype, device=DEVICE, seed=3)
    q = (q.detach() * 7.5).requires_grad_()
    results = check(backend, (q, k, v, gate), grad=pass_ == "backward", window=4, period=16, causal=causal,
                    variant=variant)
    assert all(t.dtype == dtype for t in results[1][:4] if t is not None)


@pytest.mark.parametrize(*backend_matrix(UNDER_TEST, lambda backend, D: backend == "triton",
                                         D=(1, 3, 8, 16, 48, 64, 128, 256, 320)))
def test_head_dims(backend, D, nan_poison):
    """Any D up to the declared maximum: triton zero-pads D to a power of two of at least 16 inside."""
    inputs = make_inputs(1, 2, 21, D, dtype=most_exact_dtype(backend), device=DEVICE)
    check(backend, inputs, grad=True, window=3, period=11, causal=False)


@pytest.mark.parametrize(*backend_matrix(UNDER_TEST, lambda backend, clamp, variant: backend == "triton",
                                 clamp=(2.0, None), variant=("adaptive", "separate")))
def test_logit_clamp(backend, clamp, variant, nan_poison):
    """Large scores: many logits beyond the clamp, where no gradient passes, or none clamped (None)."""
    q, k, v, gate = make_inputs(1, 2, 70, 32, variant=variant, dtype=most_exact_dtype(backend), device=DEVICE)
    q = (q.detach() * 3).requires_grad_()
    grad = REGISTRY[backend].refusal(device=DEVICE, dtype=q.dtype, head_dim=32, needs_grad=True, dropout_p=0) is None
    check(backend, (q, k, v, gate), grad=grad, window=4, period=16, causal=False, variant=variant,
          logit_clamp=clamp)


@pytest.mark.parametrize(*backend_matrix(UNDER_TEST, lambda *_: True, variant=VARIANTS, causal=(True, False)))
def test_dropout_same_mask(backend, variant, causal, nan_poison):
    """pi_attention draws one keep mask [B, H, T, |U|] for every backend: equal seeds, equal results."""
    inputs = make_inputs(1, 2, 45, 16, variant=variant, dtype=most_exact_dtype(backend), device=DEVICE, seed=5)
    kw = dict(window=4, period=16, causal=causal, variant=variant)
    (y, *_), _ = check(backend, inputs, grad=True, seed=5, dropout_p=0.3, **kw)
    with torch.no_grad():
        plain = piattn.pi_attention(*inputs, backend=backend, **kw)
    assert (y - plain).abs().max() > 1e-3, "dropout must change the output"


@pytest.mark.parametrize(*backend_matrix(UNDER_TEST, lambda backend: backend == "triton"))
def test_scale_eps_and_prior(backend, nan_poison):
    """eps = 0.1 floors the priors of gates below 0.1 or above 0.9 (their gradient is then zero)."""
    grad = REGISTRY[backend].refusal(device=DEVICE, dtype=most_exact_dtype(backend), head_dim=16, needs_grad=True,
                                     dropout_p=0) is None
    for variant, causal, kw in (("adaptive", True, dict(eps=0.1)), ("fixed", False, dict(prior=0.9))):
        inputs = make_inputs(1, 2, 50, 16, variant=variant, dtype=most_exact_dtype(backend), device=DEVICE)
        check(backend, inputs, grad=grad, window=3, period=9, causal=causal, variant=variant, scale=0.3, **kw)


@pytest.mark.parametrize(*backend_matrix(UNDER_TEST, lambda backend: backend == "triton"))
def test_noncontiguous_inputs(backend, nan_poison):
    """[B, T, H, D] projections viewed as [B, H, T, D], and a transposed gate, work as contiguous ones do."""
    base = make_inputs(2, 3, 41, 16, dtype=most_exact_dtype(backend), device=DEVICE)
    q, k, v = (t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in base[:3])
    gate = base[3].detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()
    assert not q.is_contiguous() and not gate.is_contiguous()
    grad = REGISTRY[backend].refusal(device=DEVICE, dtype=q.dtype, head_dim=16, needs_grad=True, dropout_p=0) is None
    check(backend, (q, k, v, gate), grad=grad, window=4, period=16, causal=True)


EXAMPLES = {"torch": 40, "triton": 8, "flex": 3}


@pytest.mark.parametrize(*backend_matrix(UNDER_TEST, lambda backend: backend == "triton"))
def test_random_shapes(backend):
    """Random batch, heads, length, head dim, window, period, variant and direction; forward and gradients
    where the backend has a backward here, else the forward."""
    grad = REGISTRY[backend].refusal(device=DEVICE, dtype=most_exact_dtype(backend), head_dim=16, needs_grad=True,
                                     dropout_p=0) is None

    @settings(max_examples=EXAMPLES.get(backend, 10), deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        B=st.integers(1, 2), H=st.integers(1, 3), T=st.integers(1, 80), D=st.sampled_from([1, 3, 8, 16]),
        window=st.integers(0, 9), period=st.integers(1, 40), causal=st.booleans(),
        variant=st.sampled_from(VARIANTS), seed=st.integers(0, 2**16),
    )
    def run(B, H, T, D, window, period, causal, variant, seed):
        inputs = make_inputs(B, H, T, D, variant=variant, dtype=most_exact_dtype(backend), device=DEVICE, seed=seed)
        check(backend, inputs, grad=grad, window=window, period=period, causal=causal, variant=variant,
              logit_clamp=3.0)

    run()


# ---------------------------------------------------------------------------------------------------------
# A non-finite input value may only reach the outputs that read it (docs/design.md).

NONFINITE_SHAPES = {"T40": (40, 4, 16), "wide": (70, 20, 30)}  # (T, window, period): a skip; windows > 16 rows
# Triton's core (make test): each variant once and each poisoned input once; the other pairs are slow.
TRITON_NONFINITE_CORE = {"adaptive": "k", "separate": "gate", "fixed": "q", "union": "v"}
# Backends whose calls keep a bad value in the rows that read it; flex's kernels alone do not (see below).
CONTAINED = tuple(name for name, b in REGISTRY.items() if b.contains_nonfinite)  # all but flex


def readers(p: int, T: int, window: int, period: int, causal: bool) -> set[int]:
    """The queries i whose neighbourhood U(i) holds key p, from the definition (Eqs. Nr, Npi, U)."""
    out = set()
    for i in range(T):
        local = i - window <= p <= (i if causal else i + window)
        skip = p == i - period or (not causal and p == i + period)
        if local or skip:
            out.add(i)
    return out


def neighbourhood(i: int, T: int, window: int, period: int, causal: bool) -> set[int]:
    """U(i): the keys query i reads."""
    return {p for p in range(T) if i in readers(p, T, window, period, causal)}


def _bad_rows(x: torch.Tensor) -> set[int]:
    """Positions (dim 2 of [B, H, T, D], dim 2 of a [B, H, T] gate) of head 0 holding a non-finite value."""
    x = x[0, 0]
    bad = ~torch.isfinite(x)
    return set((bad.any(-1) if bad.dim() == 2 else bad).nonzero().flatten().tolist())


def _call(backend, q, k, v, gate, **kw):
    """The backend function itself: `pi_attention` rejects a NaN gate before any backend sees it."""
    D = q.shape[-1]
    return by_keywords(REGISTRY[backend].load())(q, k, v, gate, prior=0.3, eps=1e-6, scale=D**-0.5,
                                                 dropout_keep=None, dropout_p=0.0, **kw)




@pytest.mark.parametrize(*backend_matrix(
    CONTAINED, lambda backend, shape, variant, causal, which, value: (
        shape == "T40" and value == "nan" and causal and TRITON_NONFINITE_CORE[variant] == which),
    shape=tuple(NONFINITE_SHAPES), variant=VARIANTS, causal=(True, False), which=("q", "k", "v", "gate"),
    value=("nan", "inf")))
def test_nonfinite_stays_local(backend, shape, variant, causal, which, value):
    """NaN or ±inf in q, k, v or the gate at position p (first, middle, last, a skip target) of one head:
    y is non-finite in exactly the rows that read p (q, gate: row p; k, v: the readers of key p), and with
    a finite cotangent dq and dgate at most in those rows, dk and dv only within their neighbourhoods
    (dv nowhere for a bad v: it does not depend on v); every other row, and the other head, equals the
    clean run's."""
    if which == "gate" and variant not in GATED_VARIANTS:
        pytest.skip("no gate")
    dtype = most_exact_dtype(backend)
    require_backend(backend, dtype, 16, grad=True)
    T, window, period = NONFINITE_SHAPES[shape]
    kw = dict(window=window, period=period, causal=causal, variant=variant, logit_clamp=1.5)
    clean = make_inputs(1, 2, T, 16, variant=variant, dtype=dtype, device=DEVICE, seed=7)
    dy = torch.randn(1, 2, T, 16, generator=torch.Generator().manual_seed(8), dtype=dtype).to(DEVICE)
    names = ("q", "k", "v", "gate")
    live = [t for t in clean if t is not None]
    y0 = _call(backend, *clean, **kw)
    g0 = torch.autograd.grad(y0, live, dy)
    for p in (0, T // 2, T - 1, T - 1 - period):  # the last: key of the skip of query T - 1
        inputs = list(clean)
        inputs[names.index(which)] = poisoned_input(clean[names.index(which)], p, value)
        y = _call(backend, *inputs, **kw)
        present = [n for n, t in zip(names, clean, strict=True) if t is not None]
        grads = dict(zip(present, torch.autograd.grad(y, [t for t in inputs if t is not None], dy), strict=True))
        tainted = {p} if which in ("q", "gate") else readers(p, T, window, period, causal)
        if which == "gate" and variant == "separate" and not (neighbourhood(p, T, window, period, causal)
                                                               - neighbourhood(p, T, window, 0, causal)):
            tainted = set()  # "separate" reads α only to mix in skip keys: a query without one ignores it
        near = set().union(*(neighbourhood(i, T, window, period, causal) for i in tainted))
        # y exactly; gradients within (the clamp's gradient is 0 at a NaN logit, which may stop it).
        exact = {"y": tainted}
        within = {"q": tainted, "gate": tainted, "k": near, "v": set() if which == "v" else near}
        results = {"y": (y, y0), **{n: (grads[n], g0[i]) for i, n in enumerate(grads)}}
        for name, (got, ref) in results.items():
            bad = _bad_rows(got)
            where = f"{which}[{p}]={value}: {name}"
            if name in exact:
                assert bad == exact[name], f"{where}: non-finite rows {sorted(bad)}, expected {sorted(exact[name])}"
            else:
                extra = sorted(bad - within[name])
                assert not extra, f"{where}: non-finite rows {extra} beyond {sorted(within[name])}"
            allowed = exact.get(name, within.get(name))
            keep = [i for i in range(T) if i not in allowed]
            # triton: the poisoned call's gradients come from "torch", the clean call's from its kernels
            tol = LOOSER.get((backend, dtype))
            assert_close(f"{where} (head 0, other rows)", ref[0, 0, keep], got[0, 0, keep], tol=tol)
            assert_close(f"{where} (head 1)", ref[0, 1], got[0, 1], tol=tol)


@pytest.mark.parametrize("backend", [pytest.param(b, marks=pytest.mark.xfail(
    strict=True, reason="its tiles multiply a bad key or value by a weight of 0 (0·NaN = NaN)"))
    for b in UNDER_TEST if b not in CONTAINED])
def test_nonfinite_in_the_kernels_alone(backend):
    """The backend function itself (not through `pi_attention`), a NaN in v: flex's tiles carry it to
    rows that do not read it (recorded by the strict xfail; `pi_attention` reroutes, next test)."""
    require_backend(backend, torch.float32, 16, grad=False)
    T, window, period = NONFINITE_SHAPES["T40"]
    q, k, v, _ = make_inputs(1, 1, T, 16, variant="union", dtype=torch.float32, device=DEVICE, seed=7,
                             requires_grad=False)
    v[0, 0, 20] = float("nan")
    y = _call(backend, q, k, v, None, window=window, period=period, causal=True, variant="union", logit_clamp=20.0)
    assert _bad_rows(y) == readers(20, T, window, period, True)


@pytest.mark.parametrize("backend", [b for b in UNDER_TEST if b not in CONTAINED])
@pytest.mark.parametrize("which", ("q", "k", "v"))
def test_nonfinite_calls_are_rerouted_to_a_containing_backend(backend, which):
    """Through `pi_attention`, a backend whose kernels can spread a bad value gets no call with one: a NaN
    in q, k or v (position 20 of head 0) reaches exactly the rows that read it, the other rows and head
    equal the clean call on the backend's own kernels (fp32 tolerance), and where the backend has a
    backward here, no gradient row beyond the neighbourhoods of those rows is non-finite."""
    require_backend(backend, torch.float32, 16, grad=False)
    grad = REGISTRY[backend].refusal(device=DEVICE, dtype=torch.float32, head_dim=16, needs_grad=True,
                                     dropout_p=0.0) is None
    T, window, period = NONFINITE_SHAPES["T40"]
    kw = dict(window=window, period=period, causal=True, variant="adaptive", backend=backend)
    clean = make_inputs(1, 2, T, 16, variant="adaptive", dtype=torch.float32, device=DEVICE, seed=7,
                        requires_grad=False)
    p, i = 20, "qkv".index(which)
    inputs = list(clean)
    inputs[i] = poisoned_input(clean[i], p, "nan").requires_grad_(grad)
    with torch.no_grad():
        y0 = piattn.pi_attention(*clean, **kw)
    with torch.set_grad_enabled(grad):
        y = piattn.pi_attention(*inputs, **kw)
    tainted = {p} if which == "q" else readers(p, T, window, period, True)
    assert _bad_rows(y) == tainted
    keep = [r for r in range(T) if r not in tainted]
    assert_close(f"{which}[{p}]: other rows", y0[0, 0, keep], y.detach()[0, 0, keep])
    assert_close(f"{which}[{p}]: other head", y0[0, 1], y.detach()[0, 1])
    if grad:
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(8)).to(DEVICE)
        (g,) = torch.autograd.grad(y, [inputs[i]], dy)
        near = set().union(*(neighbourhood(r, T, window, period, True) for r in tainted))
        assert not sorted(_bad_rows(g) - near), f"d{which}: non-finite rows beyond {sorted(near)}"


# ---------------------------------------------------------------------------------------------------------
# Double backward.


def test_double_backward_reference():
    """The reference is plain autograd: second derivatives pass gradgradcheck."""
    q, k, v, gate = make_inputs(1, 1, 7, 3, variant="adaptive", dtype=torch.float64, seed=2)

    def f(q, k, v, gate):
        return piattn.pi_attention(q, k, v, gate, window=2, period=4, causal=False, backend="reference")

    assert torch.autograd.gradgradcheck(f, (q, k, v, gate))


@pytest.mark.parametrize("backend", [b for b in UNDER_TEST if b != "flex"])
def test_double_backward_refused_clearly(backend):
    """Hand-written backwards raise one clear line naming the backend and the one that can."""
    dtype = most_exact_dtype(backend)
    require_backend(backend, dtype, 4, grad=True)
    q, k, v, gate = make_inputs(1, 1, 9, 4, variant="adaptive", dtype=dtype, device=DEVICE)
    y = piattn.pi_attention(q, k, v, gate, window=2, period=4, backend=backend)
    with pytest.raises(RuntimeError, match=rf"^double backward .* not supported by backend '{backend}'; "
                                           r"backend='reference' .* supports it$"):
        torch.autograd.grad((y * y).sum(), q, create_graph=True)


# ---------------------------------------------------------------------------------------------------------
# Windows and periods beyond the sequence.


@pytest.mark.parametrize("backend", ("reference", "torch"))
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("causal", (True, False), ids=param_id)
@pytest.mark.parametrize("window,period,T", [(50, 80, 12), (3, 80, 12), (0, 12, 12), (50, 3, 12), (9, 2, 1)])
@pytest.mark.parametrize("dropout_p", (0.0, 0.3))
def test_window_clamped_same_results(backend, variant, causal, window, period, T, dropout_p):
    """pi_attention clamps the window to T - 1 and drops a period >= T: the results (forward, every
    gradient, the dropout mask for a seed) equal the reference run on the pattern as asked."""
    inputs = make_inputs(1, 2, T, 8, variant=variant, dtype=torch.float64, seed=4)
    kw = dict(window=window, period=period, causal=causal, variant=variant)
    torch.manual_seed(3)
    got = forward_backward(*inputs, backend=backend, dropout_p=dropout_p, **kw)

    def unclamped(q, k, v, gate, **kw):
        torch.manual_seed(3)
        keep = None
        if dropout_p > 0:
            n_slots = len(range(-window, (0 if causal else window) + 1)) + (
                0 if period <= window else 1 if causal else 2)
            keep = torch.rand(1, 2, T, n_slots) >= dropout_p
        return by_keywords(REGISTRY["reference"].load())(
            q, k, v, gate, prior=0.3, logit_clamp=None, eps=1e-6, scale=8**-0.5, dropout_keep=keep,
            dropout_p=dropout_p, **{**kw, "variant": variant})

    y = unclamped(*inputs, **kw)
    live = [t for t in inputs if t is not None]
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    expected = (y, *torch.autograd.grad(y, live, dy), *([None] if inputs[3] is None else []))
    compare(expected, got, torch.float64)


def test_huge_window_runs_clamped(monkeypatch):
    """A window of 8000 at T = 8 reaches the torch backend as window 7 (its blocks would hold ~window²
    scores), and a period >= T as no skip."""
    from piattn.ops.pi import torch as torch_backend

    seen = []
    apply = torch_backend.PiAttentionFunction.apply

    def spy(*args):
        seen.append((args[4].window, args[4].period))  # args[4]: the OpSettings
        return apply(*args)

    monkeypatch.setattr(torch_backend.PiAttentionFunction, "apply", spy)
    q, k, v, gate = make_inputs(1, 2, 8, 16, dtype=torch.float32)
    y = piattn.pi_attention(q, k, v, gate, window=8000, period=9000, backend="torch")
    assert seen == [(7, 1)]
    ref = piattn.pi_attention(q, k, v, gate, window=7, period=9000, backend="reference")
    assert_close("y", ref, y)
