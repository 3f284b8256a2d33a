"""Sinks, grouped-query attention and packed documents (`document_ids`): every backend that declares them,
forward and every gradient, against an independent dense oracle and against "reference".

The oracle builds the [T, T] class of every (query, key) pair straight from the contract's words (which
document, the band, ±period, the document's first `sinks` keys; precedence local > skip > sink) and runs one
dense softmax; it shares no code with the operator. Documents are also checked by running each document
alone. A backend that does not declare a feature (`backends.Backend.features`) is skipped with that reason.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import piattn
from piattn.config.pi import GATED_VARIANTS, VARIANTS
from piattn.ops.pi.backends import REGISTRY
from utils import (
    DEVICE,
    against_reference,
    assert_close,
    backend_matrix,
    forward_backward,
    most_exact_dtype,
    require_backend,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:.*torch.jit.script_method.*:DeprecationWarning"),
]

NONE, LOCAL, SKIP, SINK = 0, 1, 2, 3


def documents_of(ids: list[int]) -> list[int]:
    """The document index of each position: a new one wherever the id changes."""
    out, d = [], 0
    for t, x in enumerate(ids):
        if t and x != ids[t - 1]:
            d += 1
        out.append(d)
    return out


def classes(T, window, period, causal, sinks, ids, device) -> torch.Tensor:
    """long [T, T] on `device`: the class of key j for query i, by the contract's words."""
    doc = documents_of(ids)
    first = {}
    for t, d in enumerate(doc):
        first.setdefault(d, t)
    c = torch.zeros(T, T, dtype=torch.long)
    for i in range(T):
        for j in range(T):
            if doc[i] != doc[j] or (causal and j > i):
                continue
            if abs(i - j) <= window:
                c[i, j] = LOCAL
            elif (i - j == period) or (not causal and j - i == period):
                c[i, j] = SKIP
            elif j - first[doc[j]] < sinks:
                c[i, j] = SINK
    return c.to(device)


def oracle(q, k, v, gate, *, window, period, causal, variant, prior, eps, sinks, ids, logit_clamp=None):
    """Dense masked π-attention, one batch row of ids per batch element; q [B, H, T, D], k, v [B, Hk, T, D]."""
    B, H, T, D = q.shape
    group = H // k.shape[1]
    out = torch.empty_like(q)
    for b in range(B):
        c = classes(T, window, period, causal, sinks, ids[b], q.device)
        for h in range(H):
            kk, vv = k[b, h // group], v[b, h // group]
            z = q[b, h] @ kk.T * D**-0.5
            if logit_clamp is not None:
                z = z.clamp(-logit_clamp, logit_clamp)
            local = (c == LOCAL) | (c == SINK)
            skip = c == SKIP
            if variant == "separate":
                a = gate[b, h][:, None]
                has_skip = skip.any(1, keepdim=True)
                pl = torch.softmax(z.masked_fill(~local, -math.inf), 1)
                ps = torch.softmax(z.masked_fill(~skip, -math.inf), 1).nan_to_num(0.0)
                w = torch.where(has_skip, a * pl + (1 - a) * ps, pl)
            else:
                if variant == "adaptive":
                    la, ls = gate[b, h].clamp_min(eps).log()[:, None], (1 - gate[b, h]).clamp_min(eps).log()[:, None]
                elif variant == "fixed":
                    la, ls = math.log(max(prior, eps)), math.log(max(1 - prior, eps))
                else:
                    la = ls = 0.0
                z = torch.where(local, z + la, torch.where(skip, z + ls, -math.inf))
                w = torch.softmax(z, 1)
            out[b, h] = w @ vv
    return out


def inputs(B, H, Hk, T, D, variant, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, Hk, T, D, generator=g, dtype=torch.float64) for _ in range(2))
    gate = (0.02 + 0.96 * torch.rand(B, H, T, generator=g, dtype=torch.float64)) if variant in GATED_VARIANTS else None
    ts = [t.to(DEVICE, dtype).requires_grad_() if t is not None else None for t in (q, k, v, gate)]
    return tuple(ts)


IDS = {
    "one": lambda B, T: [[0] * T for _ in range(B)],
    "three": lambda B, T: [[0] * (T // 3) + [1] * (T // 3) + [0] * (T - 2 * (T // 3)) for _ in range(B)],
    "ragged": lambda B, T: [[(t * 7 + b) // 11 for t in range(T)] for b in range(B)],
    "singletons": lambda B, T: [[t % 2 if t < 6 else 9 for t in range(T)] for b in range(B)],
}

# (T, window, period, sinks)
CASES = {
    "sinks4": (37, 3, 8, 4),
    "sinks-in-window": (20, 5, 9, 2),
    "sinks>T": (9, 2, 4, 12),
    "no-skip": (30, 4, 40, 3),
    "sinks0": (33, 2, 7, 0),
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("docs", IDS)
def test_reference_matches_dense_oracle(variant, causal, case, docs):
    T, window, period, sinks = CASES[case]
    B, H, Hk = 2, 4, 2
    q, k, v, gate = inputs(B, H, Hk, T, 8, variant)
    ids = IDS[docs](B, T)
    kw = dict(window=window, period=period, causal=causal, variant=variant, prior=0.3, eps=1e-4, sinks=sinks)
    with torch.no_grad():
        y = piattn.pi_attention(q, k, v, gate, **kw, document_ids=torch.tensor(ids, device=DEVICE),
                                logit_clamp=None, backend="reference")
        expected = oracle(q, k, v, gate, **kw, ids=ids)
    assert_close("y", expected, y)


BACKENDS = tuple(name for name in REGISTRY if name != "reference")
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (3, 1)}


def _matches_core(backend, variant, causal, case, docs, heads):
    """triton: two cases with every feature at once; flex runs no gradients on a CPU (skipped anyway)."""
    return backend == "triton" and (variant, causal, case, docs, heads) in (
        ("adaptive", True, "sinks-in-window", "ragged", "gqa"),
        ("separate", False, "sinks-in-window", "ragged", "mqa"))


@pytest.mark.parametrize(*backend_matrix(BACKENDS, _matches_core, variant=VARIANTS, causal=(True, False),
                                 case=("sinks4", "sinks-in-window", "no-skip"), docs=("one", "ragged"), heads=HEADS))
def test_backend_matches_reference(backend, variant, causal, case, docs, heads):
    T, window, period, sinks = CASES[case]
    H, Hk = HEADS[heads]
    features = {"sinks"} | ({"documents"} if docs != "one" else set()) | ({"gqa"} if Hk != H else set())
    dtype = most_exact_dtype(backend)
    require_backend(backend, dtype, 8, grad=True, features=features)
    q, k, v, gate = inputs(2, H, Hk, T, 8, variant, dtype)
    ids = torch.tensor(IDS[docs](2, T), device=DEVICE) if docs != "one" else None
    kw = dict(window=window, period=period, causal=causal, variant=variant, sinks=sinks, document_ids=ids)
    against_reference(backend, (q, k, v, gate), grad=True, **kw)


@pytest.mark.parametrize(*backend_matrix(("reference", *BACKENDS), lambda b, variant, causal: False,
                                 variant=("adaptive", "separate"), causal=(True, False)))
def test_each_document_as_if_alone(backend, variant, causal):
    """Packed documents give, forward and backward, what each document gives alone."""
    lengths = [5, 17, 1, 24]
    T = sum(lengths)
    dtype = most_exact_dtype(backend)
    require_backend(backend, dtype, 8, grad=True, features={"documents", "sinks"})
    q, k, v, gate = inputs(1, 2, 2, T, 8, variant, dtype)
    ids = torch.repeat_interleave(torch.tensor([3, 1, 3, 2]), torch.tensor(lengths))[None].to(DEVICE)
    kw = dict(window=3, period=6, causal=causal, variant=variant, sinks=2, backend=backend)
    packed = forward_backward(q, k, v, gate, **kw, document_ids=ids)
    start = 0
    for n in lengths:
        part = slice(start, start + n)
        pieces = [t[:, :, part].detach().requires_grad_() if t is not None else None for t in (q, k, v)]
        g = None if gate is None else gate[:, :, part].detach().requires_grad_()
        dy = torch.randn(packed[0].shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        y = piattn.pi_attention(*pieces, g, **kw)
        grads = torch.autograd.grad(y, [t for t in (*pieces, g) if t is not None],
                                    dy[:, :, part].to(y.device, y.dtype))
        assert_close("y", y, packed[0][:, :, part], dtype)
        for name, alone, whole in zip(("dq", "dk", "dv", "dgate"), grads, packed[1:], strict=False):
            assert_close(name, alone, whole[..., part, :] if whole.dim() == 4 else whole[..., part], dtype)
        start += n


@pytest.mark.parametrize(*backend_matrix(BACKENDS, lambda b: b == "triton"))
def test_sinks_zero_unchanged(backend):
    """sinks=0 and document_ids of one document change nothing, bit for bit."""
    dtype = most_exact_dtype(backend)
    require_backend(backend, dtype, 8, grad=False, features={"documents"})
    q, k, v, gate = inputs(2, 2, 2, 40, 8, "adaptive", dtype)
    with torch.no_grad():
        plain = piattn.pi_attention(q, k, v, gate, backend=backend)
        same = piattn.pi_attention(q, k, v, gate, sinks=0, document_ids=torch.zeros(2, 40, dtype=torch.long,
                                                                                      device=DEVICE),
                                   backend=backend)
    assert torch.equal(plain, same)


@pytest.mark.parametrize(*backend_matrix(("reference", *BACKENDS), lambda b: False))
def test_gqa_equals_repeated_heads(backend):
    """H_kv heads read by groups of query heads = the same heads repeated (repeat_kv), gradients summed."""
    dtype = most_exact_dtype(backend)
    require_backend(backend, dtype, 8, grad=True, features={"gqa"})
    q, k, v, gate = inputs(2, 6, 2, 30, 8, "adaptive", dtype)
    grouped = forward_backward(q, k, v, gate, backend=backend)
    kr, vr = (t.detach().repeat_interleave(3, 1).requires_grad_() for t in (k, v))
    repeated = forward_backward(q, kr, vr, gate, backend=backend)
    assert_close("y", repeated[0], grouped[0], dtype)
    assert_close("dq", repeated[1], grouped[1], dtype)
    for name, rep, grp in (("dk", repeated[2], grouped[2]), ("dv", repeated[3], grouped[3])):
        assert_close(name, rep.unflatten(1, (2, 3)).sum(2), grp, dtype)


def _mixed_documents(T: int) -> torch.Tensor:
    """[2, T]: three documents whose first and last share an id (still two documents), and ragged runs."""
    return torch.tensor([IDS["three"](1, T)[0], IDS["ragged"](1, T)[0]], device=DEVICE)


def _all_features_core(backend, variant, causal):
    return backend == "triton" and variant == "adaptive"


@pytest.mark.parametrize(*backend_matrix(BACKENDS, _all_features_core, variant=VARIANTS, causal=(True, False)))
def test_forward_all_features(backend, variant, causal, nan_poison):
    """Forward only (under no_grad, so that flex runs on a CPU too), sinks + documents + grouped-query
    attention at once, in the backend's most exact dtype, against the reference at utils.TOLERANCES;
    outputs NaN-poisoned, so an element a backend forgets to write fails."""
    dtype = most_exact_dtype(backend)
    require_backend(backend, dtype, 16, grad=False, features={"sinks", "documents", "gqa"})
    q, k, v, gate = inputs(2, 4, 2, 45, 16, variant, dtype, seed=3)
    kw = dict(window=3, period=8, causal=causal, variant=variant, prior=0.3, sinks=3,
              document_ids=_mixed_documents(45))
    with torch.no_grad():
        expected = piattn.pi_attention(q, k, v, gate, **kw, backend="reference")
        actual = piattn.pi_attention(q, k, v, gate, **kw, backend=backend)
    assert_close("y", expected, actual, dtype)


def _low_precision_core(backend, dtype, variant, pass_):
    return backend == "triton" and variant == "adaptive" and (dtype == torch.bfloat16) == (pass_ == "backward")


@pytest.mark.parametrize(*backend_matrix(BACKENDS, _low_precision_core, dtype=(torch.bfloat16, torch.float16),
                                 variant=VARIANTS, pass_=("forward", "backward")))
def test_low_precision_all_features(backend, dtype, variant, pass_, nan_poison):
    """bf16 and fp16 with sinks + documents + grouped-query attention, against the reference run on the same
    rounded inputs (it accumulates in fp32 too), by the reference-error rule (`utils.compare_to_exact`).
    Scores ≈ 4·N(0, 1), so a few cross the clamp of 5. Outputs NaN-poisoned; results in the input dtype."""
    grad = pass_ == "backward"
    require_backend(backend, dtype, 32, grad=grad, features={"sinks", "documents", "gqa"})
    q, k, v, gate = inputs(2, 6, 2, 50, 32, variant, dtype, seed=4)
    q = (q.detach() * 4).requires_grad_()
    kw = dict(window=4, period=9, causal=True, variant=variant, sinks=2, logit_clamp=5.0,
              document_ids=_mixed_documents(50))
    _, actual = against_reference(backend, (q, k, v, gate), grad=grad, **kw)
    assert all(t.dtype == dtype for t in actual if t is not None)


@pytest.mark.parametrize(*backend_matrix(BACKENDS, lambda b, causal: b == "triton" and causal, causal=(True, False)))
def test_dropout_all_features(backend, causal, nan_poison):
    """Dropout with sinks + documents + grouped-query attention: one keep mask [B, H, T, |U|], sink slots
    last, drawn by pi_attention; equal seeds give the reference's forward and gradients."""
    dtype = most_exact_dtype(backend)
    reason = REGISTRY[backend].refusal(device=DEVICE, dtype=dtype, head_dim=16, needs_grad=True, dropout_p=0.3,
                                       features=frozenset({"sinks", "documents", "gqa"}))
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")
    q, k, v, gate = inputs(2, 4, 2, 40, 16, "adaptive", dtype, seed=5)
    kw = dict(window=3, period=8, causal=causal, sinks=3, dropout_p=0.3, document_ids=_mixed_documents(40))
    against_reference(backend, (q, k, v, gate), grad=True, seed=7, **kw)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    T=st.integers(1, 40), window=st.integers(0, 8), period=st.integers(1, 45), sinks=st.integers(0, 6),
    causal=st.booleans(), variant=st.sampled_from(VARIANTS), cuts=st.lists(st.integers(1, 39), max_size=4),
    group=st.sampled_from([1, 2, 3]), seed=st.integers(0, 1000),
)
def test_random_against_oracle(T, window, period, sinks, causal, variant, cuts, group, seed):
    ids = [sum(t >= c for c in cuts) for t in range(T)]
    q, k, v, gate = inputs(1, 3 * group, 3, T, 4, variant, seed=seed)
    kw = dict(window=window, period=period, causal=causal, variant=variant, prior=0.5, eps=1e-4, sinks=sinks)
    with torch.no_grad():
        y = piattn.pi_attention(q, k, v, gate, **kw, document_ids=torch.tensor([ids], device=DEVICE),
                                logit_clamp=None, backend="reference")
        expected = oracle(q, k, v, gate, **kw, ids=[ids])
    assert_close("y", expected, y)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(sinks=-1), "sinks must be an int >= 0"),
        (dict(sinks=1.5), "sinks must be an int >= 0"),
        (dict(sinks=True), "sinks must be an int >= 0"),
        (dict(document_ids=torch.zeros(2, 5, dtype=torch.long)), r"document_ids must have shape \[B, T\]"),
        (dict(document_ids=torch.zeros(2, 10)), "document_ids must have an integer dtype"),
        (dict(document_ids=torch.zeros(2, 10, dtype=torch.bool)), "document_ids must have an integer dtype"),
        (dict(document_ids=[0] * 10), "document_ids must be None or an integer torch.Tensor"),
    ],
)
def test_bad_feature_arguments(kwargs, match):
    q = torch.randn(2, 4, 10, 8)
    with pytest.raises(ValueError, match=match):
        piattn.pi_attention(q, q, q, torch.full((2, 4, 10), 0.5), **kwargs)


@pytest.mark.parametrize(
    "k_heads, v_heads, match",
    [(3, 3, "must divide the 4 query heads"), (2, 4, "k and v must share one shape"),
     (0, 0, "must divide the 4 query heads")],
)
def test_bad_kv_heads(k_heads, v_heads, match):
    q = torch.randn(2, 4, 10, 8)
    with pytest.raises(ValueError, match=match):
        piattn.pi_attention(q, torch.randn(2, k_heads, 10, 8), torch.randn(2, v_heads, 10, 8),
                            torch.full((2, 4, 10), 0.5))
