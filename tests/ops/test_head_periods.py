"""Per-head periods (multi-scale π): `pi_attention(..., period=[π_0, …, π_{H−1}])`, head h skipping π_h.

Checked against an oracle written here from the definition (a dense [B, H, T, T] mask per head, masked
softmax attention with the priors, fp64) and against "reference" run one head at a time: forward and every
gradient, every variant, causal and bidirectional, grouped-query heads whose query heads differ in period,
sinks, documents, dropout, random shapes; a period sequence with one value equals the int call bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import piattn
from piattn.config.pi import VARIANTS
from piattn.ops.pi.backends import REGISTRY
from utils import DEVICE, compare, forward_backward, make_inputs, param_id, require_backend

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

KW = dict(window=3, prior=0.3, logit_clamp=2.5, eps=1e-4)


def dense_oracle(q, k, v, gate, *, periods, window, causal, variant, prior, logit_clamp, eps, sinks=0,
                 document_ids=None):
    """The definition, densely: q [B, H, T, D], k, v [B, H_kv, T, D], gate [B, H, T] or None, periods H ints
    -> [B, H, T, D] in fp64. Query i of head h reads the keys of its document at i − window … i (… i + window
    bidirectional: local), i ∓ π_h when π_h > window (skip), and the document's first `sinks` keys (at or
    before i when causal) not already read; local and sink keys take log α, skip keys log(1 − α)."""
    B, H, T, D = q.shape
    G = H // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    docs = torch.zeros(B, T, dtype=torch.long) if document_ids is None else document_ids.cpu()
    # A document is a run of equal ids: number the runs, and find where each position's run starts.
    run = torch.cat([torch.zeros(B, 1, dtype=torch.long), (docs[:, 1:] != docs[:, :-1]).long().cumsum(1)], 1)
    pos = torch.arange(T)
    start = torch.stack([torch.stack([(run[b] == run[b, i]).nonzero()[0, 0] for i in range(T)]) for b in range(B)])
    i, j = pos[:, None], pos[None, :]
    same = (run[:, :, None] == run[:, None, :])[:, None]  # [B, 1, T, T]
    local = (j - i >= -window) & (j - i <= (0 if causal else window))
    period = torch.tensor(periods)[:, None, None]  # [H, 1, 1]
    skip = ((j - i == -period) | (~torch.tensor(causal) & (j - i == period))) & (period > window) & ~local
    sink = (j[None] - start[:, :, None] < sinks) & ((j <= i) | (not causal))[None]  # [B, T, T]
    local = local[None, None] & same
    skip = skip[None] & same & ~local
    sink = sink[:, None] & same & ~local & ~skip
    z = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(D)
    if logit_clamp is not None:
        z = z.clamp(-logit_clamp, logit_clamp)
    if variant in ("fixed", "adaptive"):
        a = torch.full((B, H, T), prior, dtype=torch.float64) if variant == "fixed" else gate.double()
        a = a[..., None]
        z = torch.where(skip, z + (1 - a).clamp_min(eps).log(), z + a.clamp_min(eps).log())
    near = local | sink
    if variant != "separate":
        return torch.softmax(z.masked_fill(~(near | skip), -math.inf), -1) @ v
    has_skip = skip.any(-1, keepdim=True)
    a = torch.where(has_skip, gate.double()[..., None], 1.0)
    # Rows without a skip key softmax over finite zeros instead of all −inf, then drop them.
    w_skip = torch.softmax(torch.where(has_skip, z.masked_fill(~skip, -math.inf), 0.0), -1) * skip
    w = a * torch.softmax(z.masked_fill(~near, -math.inf), -1) + (1 - a) * w_skip
    return w @ v


def oracle_backward(inputs, periods, dy_seed=1, **kwargs):
    """(y, dq, dk, dv, dgate or None) of `dense_oracle`, like `utils.forward_backward`."""
    y = dense_oracle(*inputs, periods=periods, **kwargs)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(dy_seed), dtype=torch.float64)
    used = [t for t in inputs if t is not None]
    grads = list(torch.autograd.grad(y, used, dy)) + ([None] if inputs[3] is None else [])
    return (y, *grads)


def per_head_reference(q, k, v, gate, periods, **kwargs):
    """"reference" one query head at a time (head h with its key/value head and period π_h), stacked."""
    G = q.shape[1] // k.shape[1]
    heads = [piattn.pi_attention(q[:, h:h + 1], k[:, h // G:h // G + 1], v[:, h // G:h // G + 1],
                                 None if gate is None else gate[:, h:h + 1], period=p, backend="reference",
                                 **kwargs) for h, p in enumerate(periods)]
    return torch.cat(heads, 1)


def grouped_inputs(B, H, H_kv, T, D, variant, dtype=torch.float64, seed=0):
    q, _, _, gate = make_inputs(B, H, T, D, variant=variant, dtype=dtype, seed=seed)
    _, k, v, _ = make_inputs(B, H_kv, T, D, variant=variant, dtype=dtype, seed=seed + 1)
    return q, k, v, gate


# GQA: 4 query heads on 2 key/value heads; heads 0 and 1 share key/value head 0 and differ in period, heads
# 1 and 3 share period 6 across key/value heads; 2 (<= window) folds into the window; 40 >= T never reaches.
PERIODS = (2, 6, 40, 6)


@pytest.mark.parametrize("backend", ["reference", "torch", "fused"])
@pytest.mark.parametrize("causal", [True, False], ids=param_id)
@pytest.mark.parametrize("variant", VARIANTS)
def test_dense_oracle(backend, variant, causal):
    """Forward and every gradient, fp64, against the dense definition; GQA, sinks and documents at once."""
    require_backend(backend, torch.float64, 8, grad=True, features=("gqa", "sinks", "documents"))
    inputs = grouped_inputs(2, 4, 2, 23, 8, variant)
    docs = torch.tensor([[0] * 9 + [1] * 14, [3] * 23])
    kw = dict(KW, causal=causal, variant=variant, sinks=2, document_ids=docs)
    compare(oracle_backward(inputs, PERIODS, **kw), forward_backward(*inputs, period=PERIODS, backend=backend, **kw))


@pytest.mark.parametrize("causal", [True, False], ids=param_id)
@pytest.mark.parametrize("variant", VARIANTS)
def test_per_head_reference(variant, causal):
    """"torch" with per-head periods, fp64, against "reference" run head by head (forward, every gradient)."""
    q, k, v, gate = grouped_inputs(1, 6, 3, 41, 8, variant)
    periods = (9, 5, 17, 9, 1, 30)
    kw = dict(KW, causal=causal, variant=variant, sinks=1)
    per_head = forward_backward_of(lambda *t: per_head_reference(*t, periods, **kw), q, k, v, gate)
    compare(per_head, forward_backward(q, k, v, gate, period=periods, backend="torch", **kw))


def forward_backward_of(fn, q, k, v, gate, dy_seed=1):
    """`utils.forward_backward` of any fn(q, k, v, gate)."""
    y = fn(q, k, v, gate)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(dy_seed), dtype=torch.float64)
    used = [t for t in (q, k, v, gate) if t is not None]
    return (y, *torch.autograd.grad(y, used, dy.to(y.dtype)), *([None] if gate is None else []))


# Low precision against the fp64 oracle of the same rounded inputs: the torch backend accumulates in fp32
# and rounds y and each gradient once to the input dtype (bf16 keeps 8 bits, fp16 11).
LOW = {torch.bfloat16: dict(atol=3e-2, rtol=3e-2), torch.float16: dict(atol=5e-3, rtol=5e-3)}


@pytest.mark.parametrize("dtype", list(LOW), ids=param_id)
@pytest.mark.parametrize("variant", ["separate", "adaptive"])
def test_low_precision(variant, dtype):
    inputs = grouped_inputs(1, 4, 2, 37, 16, variant, dtype=dtype)
    kw = dict(KW, causal=True, variant=variant)
    exact = oracle_backward([None if t is None else t.detach().double().requires_grad_() for t in inputs], PERIODS,
                            **kw)
    got = forward_backward(*inputs, period=PERIODS, backend="torch", **kw)
    compare(tuple(None if e is None else e.to(dtype) for e in exact), got, tol=LOW[dtype])


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_equal_periods_are_the_int_call(backend, variant):
    """A period sequence (or tensor) with one value is the int call: equal bit for bit, gradients too."""
    inputs = grouped_inputs(1, 4, 2, 30, 8, variant, dtype=torch.float32)
    kw = dict(KW, variant=variant, backend=backend)
    want = forward_backward(*inputs, period=7, **kw)
    for period in ([7] * 4, (7, 7, 7, 7), torch.tensor([7] * 4)):
        got = forward_backward(*inputs, period=period, **kw)
        for name, e, a in zip(("y", "dq", "dk", "dv", "dgate"), want, got, strict=True):
            assert (e is None and a is None) or torch.equal(e, a), f"{name} differs for period={period!r}"


def test_gqa_heads_of_one_kv_head_differ():
    """Two query heads of one key/value head with different periods: each reads that head at its own skip."""
    q, k, v, gate = grouped_inputs(1, 2, 1, 20, 4, "union")
    y = piattn.pi_attention(q, k, v, period=(4, 11), variant="union", window=1, backend="torch")
    for h, p in enumerate((4, 11)):
        alone = piattn.pi_attention(q[:, h:h + 1], k, v, period=p, variant="union", window=1, backend="torch")
        assert torch.equal(y[:, h:h + 1], alone)


def test_dropout_same_across_backends():
    """Equal seeds draw equal keep masks (one per period group): "torch" equals "reference", forward and
    gradients, and dropout changes the result."""
    inputs = grouped_inputs(1, 4, 2, 33, 8, "adaptive")
    kw = dict(KW, variant="adaptive", sinks=1, dropout_p=0.3, period=PERIODS)
    torch.manual_seed(5)
    ref = forward_backward(*inputs, backend="reference", **kw)
    torch.manual_seed(5)
    compare(ref, forward_backward(*inputs, backend="torch", **kw))
    plain = piattn.pi_attention(*inputs, **{**kw, "dropout_p": 0.0})
    assert (ref[0] - plain).abs().max() > 1e-3


@pytest.mark.parametrize("backend", ["flex", "triton"])
def test_blocked_backends_forward(backend):
    """The blocked backends (flex: forward only on a CPU; triton: its interpreter there) against the oracle,
    fp32, on DEVICE (the oracle runs on the CPU)."""
    if not REGISTRY[backend].available():
        pytest.skip(f"{backend} is not available in this install")
    require_backend(backend, torch.float32, 16, grad=False, features=("gqa", "sinks"))
    inputs = grouped_inputs(1, 4, 2, 40, 16, "adaptive", dtype=torch.float32)
    kw = dict(KW, causal=True, variant="adaptive", sinks=1)
    with torch.no_grad():
        y = piattn.pi_attention(*(t.to(DEVICE) for t in inputs), period=PERIODS, backend=backend, **kw)
    exact = dense_oracle(*inputs, periods=PERIODS, **kw)
    torch.testing.assert_close(y.double().cpu(), exact, atol=2e-5, rtol=2e-5)


# The backends the fuzz draws from: those that run fp64 with gradients, GQA, sinks and documents here.
FUZZED = [name for name in ("torch", "fused", "reference")
          if REGISTRY[name].refusal(device="cpu", dtype=torch.float64, head_dim=4, needs_grad=True, dropout_p=0.0,
                                    features=frozenset({"gqa", "sinks", "documents"})) is None]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz(data):
    """Random H, H_kv, T, window, periods (equal across heads, <= window, >= T), sinks, documents and backend
    (each that runs them), both directions, against the oracle, forward and gradients, fp64."""
    H_kv = data.draw(st.integers(1, 3), "H_kv")
    H = H_kv * data.draw(st.integers(1, 3), "group")
    T = data.draw(st.integers(1, 24), "T")
    window = data.draw(st.integers(0, 5), "window")
    periods = tuple(data.draw(st.lists(st.integers(1, T + 3), min_size=H, max_size=H), "periods"))
    variant = data.draw(st.sampled_from(VARIANTS), "variant")
    causal = data.draw(st.booleans(), "causal")
    sinks = data.draw(st.integers(0, 2), "sinks")
    # documents: runs of equal ids, cut at random places
    cuts = data.draw(st.lists(st.booleans(), min_size=T, max_size=T), "document starts")
    docs = torch.tensor([0] + cuts[1:]).cumsum(0)[None]
    backend = data.draw(st.sampled_from(FUZZED), "backend")
    inputs = grouped_inputs(1, H, H_kv, T, 4, variant, seed=data.draw(st.integers(0, 99), "seed"))
    kw = dict(KW, window=window, causal=causal, variant=variant, sinks=sinks, document_ids=docs)
    compare(oracle_backward(inputs, periods, **kw), forward_backward(*inputs, period=periods, backend=backend, **kw))


@pytest.mark.parametrize("period, message", [
    ((4, 8, 16), "period has 3 entries; per-head periods need one per query head, H=4"),
    ((4, 0, 8, 16), r"period\[1\] must be an int >= 1, got 0"),
    ((4, -2, 8, 16), r"period\[1\] must be an int >= 1, got -2"),
    ((4, 8.0, 8, 16), r"period\[1\] must be an int >= 1, got 8.0"),
    ((4, True, 8, 16), r"period\[1\] must be an int >= 1, got True"),
    (torch.tensor([[4, 8], [8, 16]]), r"period must be an int >= 1 or one int >= 1 per query head .* shape \(2, 2\)"),
    (torch.tensor([4.0, 8, 8, 16]), r"period must be .* dtype torch.float32"),
    (torch.tensor([True] * 4), r"period must be .* dtype torch.bool"),
    (torch.tensor([4, 8, 8, 16], device="meta"), r"period must be on the device of q \(cpu\), got meta"),
    ("16", r"period must be an int >= 1 or a sequence of ints >= 1, one per query head; got '16'"),
    (2.5, r"period must be an int >= 1 or a sequence of ints >= 1, one per query head; got 2.5"),
    ((), r"period must be an int >= 1 or a sequence of ints >= 1, one per query head; got \(\)"),
    (0, r"period must be an int >= 1, got 0"),
])
def test_bad_periods(period, message):
    q, k, v, gate = grouped_inputs(1, 4, 2, 8, 4, "union")
    with pytest.raises(ValueError, match=message):
        piattn.pi_attention(q, k, v, period=period, variant="union")


@pytest.mark.skipif(DEVICE != "cuda", reason="a tensor on another device needs a GPU")
def test_period_tensor_on_another_device():
    q, k, v, _ = grouped_inputs(1, 2, 2, 8, 4, "union")
    with pytest.raises(ValueError, match="period must be on the device of q"):
        piattn.pi_attention(q.cuda(), k.cuda(), v.cuda(), period=torch.tensor([3, 5]), variant="union")
