"""The fused CPU backend (`piattn.ops.pi.fused`, `fused_cpu.c`) against "reference": the forward and every
gradient (dq, dk, dv, dgate) for all four variants, causal and bidirectional, grouped-query heads, edge
shapes, the logit clamp, any head dim and random shapes; non-finite inputs kept in the rows that read them;
the fp32 forward's rows in vector lanes (blocks of rows and single rows within a head, a NaN inside a block,
the same bits whatever the thread count, the streaming stores of a large y); the backward's window of
dk, dv rows and its streaming stores;
what it refuses (other dtypes and devices); the C entry points' own checks (sizes, buffers, periods, document
bounds, the dropout mask); per-head periods, sinks, documents and dropout: test_fused_periods.py; builds
without -march=native or OpenMP, and the fallback without a compiler.

fp64 runs at 1e-10 (utils.TOLERANCES). fp32 is compared with the fp64 reference on the same values: 2e-5
for y, dq, dk, dv, and 1e-4 for dgate, which divides Σ dlogit by α or 1 − α (down to 0.02 in
`make_inputs`): the fp32 reference itself is 4e-5 off the fp64 one there. Outputs are NaN-poisoned
(tests/conftest.py) so that an element the kernels do not write cannot pass.
"""

from __future__ import annotations

import ctypes
import inspect
import json
import os
import platform
import re
import shutil
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_conformance import SHAPES  # id: (T, window, period), the shapes every backend is checked on

import piattn
from piattn.config.pi import GATED_VARIANTS, VARIANTS
from piattn.ops.pi import cbuild, fused
from piattn.ops.pi.fused import pi_attention_fused
from piattn.ops.pi.pattern import Pattern, slot_keys
from piattn.ops.pi.reference import pi_attention_reference
from piattn.ops.pi.settings import OpSettings
from utils import TOLERANCES, against_reference, assert_close, make_inputs, param_id, poisoned_input

FP32 = dict(atol=2e-5, rtol=2e-5)
FP32_DGATE = dict(atol=1e-4, rtol=1e-4)
NAMES = ("y", "dq", "dk", "dv", "dgate")


@pytest.fixture(autouse=True)
def compiled_kernels():
    """Skip where there is no C compiler (or PIATTN_NATIVE=0); where there is one, the kernels must build."""
    if os.environ.get("PIATTN_NATIVE") == "0":
        pytest.skip("compiled kernels disabled by PIATTN_NATIVE=0")
    if shutil.which(os.environ.get("CC") or "cc") is None:
        pytest.skip("no C compiler ($CC or cc) to build fused_cpu.c")
    if fused.unavailable() is not None:
        pytest.fail(f"fused_cpu.c must build where a compiler exists: {fused.unavailable()}")


def _settings(variant, **kw):
    return dict(dict(window=4, period=16, causal=True, variant=variant, prior=0.3, logit_clamp=1.5, eps=1e-6,
                     scale=0.25, dropout_keep=None, dropout_p=0.0), **kw)


def _run(function, inputs, dy, kw):
    """(y, dq, dk, dv, dgate or None) of `function` with cotangent dy."""
    live = [t for t in inputs if t is not None]
    y = function(*inputs, **kw)
    grads = list(torch.autograd.grad(y, live, dy))
    return (y, *grads, *([None] if inputs[3] is None else []))


def _compare(inputs, kw, *, dy_seed=1):
    """The fused backend against the reference: the same dtype for fp64 (1e-10), the fp64 reference of the
    same values for fp32."""
    dtype = inputs[0].dtype
    dy = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(dy_seed), dtype=torch.float64)
    wide = [None if t is None else t.detach().double().requires_grad_() for t in inputs]
    expected = _run(pi_attention_reference, wide, dy, kw)
    actual = _run(pi_attention_fused, inputs, dy.to(dtype), kw)
    for name, e, a in zip(NAMES, expected, actual, strict=True):
        assert (e is None) == (a is None), f"{name}: expected {'no ' if e is None else ''}gradient"
        if e is None:
            continue
        assert a.dtype == dtype, f"{name}: dtype {a.dtype}, not {dtype}"
        tol = TOLERANCES[dtype] if dtype == torch.float64 else FP32_DGATE if name == "dgate" else FP32
        assert_close(name, e, a, tol=tol)
    return actual


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("causal", (True, False), ids=param_id)
def test_matches_reference_fp64(shape, variant, causal, nan_poison):
    """Two query heads per key/value head (grouped-query attention) and plain heads, batch 2."""
    T, window, period = SHAPES[shape]
    q, _, _, gate = make_inputs(2, 4, T, 16, variant=variant, seed=1)
    _, k, v, _ = make_inputs(2, 2, T, 16, variant=variant, seed=2)
    _compare((q, k, v, gate), _settings(variant, window=window, period=period, causal=causal))
    _compare(make_inputs(2, 2, T, 16, variant=variant, seed=3),
             _settings(variant, window=window, period=period, causal=causal))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("causal", (True, False), ids=param_id)
@pytest.mark.parametrize("shape", ("odd", "short", "window0", "period<window", "wide"))
def test_matches_reference_fp32(variant, causal, shape, nan_poison):
    T, window, period = SHAPES[shape]
    inputs = make_inputs(1, 4, T, 64, variant=variant, dtype=torch.float32, seed=4)
    _compare(inputs, _settings(variant, window=window, period=period, causal=causal, scale=64**-0.5))


@pytest.mark.parametrize("H_kv", (1, 2, 3, 6))
@pytest.mark.parametrize("dtype", (torch.float64, torch.float32), ids=param_id)
def test_grouped_query_heads(H_kv, dtype, nan_poison):
    """Six query heads over 1, 2, 3 or 6 key/value heads: dk, dv sum over the heads that share them."""
    q, _, _, gate = make_inputs(2, 6, 45, 8, dtype=dtype, seed=5)
    _, k, v, _ = make_inputs(2, H_kv, 45, 8, dtype=dtype, seed=6)
    _compare((q, k, v, gate), _settings("adaptive", causal=False))


@pytest.mark.parametrize("D", (1, 3, 4, 8, 17, 33, 64, 100, 128))
def test_head_dims(D, nan_poison):
    """Any D: whole vectors of four and one, then single lanes (the tails of every loop over D); 64 and 128
    run the kernels compiled for them as constants."""
    for dtype in (torch.float64, torch.float32):
        inputs = make_inputs(1, 2, 21, D, variant="separate", dtype=dtype, seed=D)
        _compare(inputs, _settings("separate", window=3, period=11, causal=False, scale=D**-0.5))


@pytest.mark.parametrize("clamp", (2.0, None), ids=("clamp2", "no-clamp"))
@pytest.mark.parametrize("variant", VARIANTS)
def test_logit_clamp(clamp, variant, nan_poison):
    """Large scores: many logits beyond the clamp, where no gradient passes, or none clamped (None)."""
    q, k, v, gate = make_inputs(1, 2, 70, 32, variant=variant, seed=7)
    q = (q.detach() * 3).requires_grad_()
    kw = _settings(variant, causal=False, logit_clamp=clamp, scale=32**-0.5)
    with torch.no_grad():
        scores = (q @ k.transpose(-1, -2)).abs() * kw["scale"]
    assert clamp is None or (scores > clamp).float().mean() > 0.1, "the case must clamp"
    _compare((q, k, v, gate), kw)


def test_logits_far_apart_fp32(nan_poison):
    """Without a clamp, logits 100 and more below the row's largest: their exp underflows to 0 (in fp32 the
    kernels' vector exp hands such lanes to libm)."""
    for variant in VARIANTS:
        q, k, v, gate = make_inputs(1, 2, 60, 16, variant=variant, dtype=torch.float32, seed=14)
        q = (q.detach() * 40).requires_grad_()
        _compare((q, k, v, gate), _settings(variant, causal=False, logit_clamp=None))


def test_scale_eps_and_prior(nan_poison):
    """eps = 0.1 floors the priors of gates below 0.1 or above 0.9 (their gradient is then zero); a fixed
    prior of 0.9."""
    for variant, causal, kw in (("adaptive", True, dict(eps=0.1)), ("fixed", False, dict(prior=0.9))):
        inputs = make_inputs(1, 2, 50, 16, variant=variant, seed=8)
        _compare(inputs, _settings(variant, window=3, period=9, causal=causal, scale=0.3, **kw))


def test_noncontiguous_inputs_and_a_gate_of_another_dtype(nan_poison):
    """[B, T, H, D] projections viewed as [B, H, T, D] and a transposed fp64 gate with fp32 q, k, v: the
    gradients come back in the callers' layout and dtype."""
    q, k, v, gate = make_inputs(2, 3, 41, 16, dtype=torch.float32, seed=9)
    q, k, v = (t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in (q, k, v))
    gate = gate.detach().double().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()
    assert not q.is_contiguous() and not gate.is_contiguous()
    dy = torch.randn(2, 3, 41, 16)
    y, dq, dk, dv, dgate = _run(pi_attention_fused, (q, k, v, gate), dy, _settings("adaptive"))
    wide = [t.detach().double().requires_grad_() for t in (q, k, v, gate)]
    expected = _run(pi_attention_reference, wide, dy.double(), _settings("adaptive"))
    assert dgate.dtype == torch.float64 and y.dtype == torch.float32
    for name, e, a in zip(NAMES, expected, (y, dq, dk, dv, dgate), strict=True):
        assert_close(name, e, a.double(), tol=FP32_DGATE if name == "dgate" else FP32)


def test_threads_give_identical_results(nan_poison):
    """Threads split (batch, key/value head) work items, and the forward's rows where there are fewer heads
    than threads: each row is computed the same way whatever the thread count, so bit for bit equal."""
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            for B, H, H_kv in ((2, 4, 2), (1, 2, 1)):
                q, _, _, gate = make_inputs(B, H, 300, 16, variant="separate", seed=10)
                _, k, v, _ = make_inputs(B, H_kv, 300, 16, seed=11)
                dy = torch.randn(B, H, 300, 16, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
                results.append(_run(pi_attention_fused, (q, k, v, gate), dy, _settings("separate", causal=False)))
    finally:
        torch.set_num_threads(threads)
    for one, many in zip(results[:2], results[2:], strict=True):
        for name, a, b in zip(NAMES, one, many, strict=True):
            assert torch.equal(a, b), f"{name} differs between 1 and 3 threads"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(B=st.integers(1, 2), H_kv=st.integers(1, 2), group=st.integers(1, 3), T=st.integers(1, 80),
       D=st.sampled_from([1, 3, 8, 16, 20]), window=st.integers(0, 9), period=st.integers(1, 40),
       causal=st.booleans(), variant=st.sampled_from(VARIANTS), clamp=st.sampled_from([None, 1.0, 3.0]),
       seed=st.integers(0, 2**16))
def test_random_shapes(B, H_kv, group, T, D, window, period, causal, variant, clamp, seed, nan_poison):
    q, _, _, gate = make_inputs(B, H_kv * group, T, D, variant=variant, seed=seed)
    _, k, v, _ = make_inputs(B, H_kv, T, D, seed=seed + 1)
    _compare((q, k, v, gate), _settings(variant, window=window, period=period, causal=causal, logit_clamp=clamp))


# ---------------------------------------------------------------------------------------------------------
# A non-finite input value may only reach the outputs that read it (docs/design.md).

def _keys_of(T, window, period, causal) -> list[set[int]]:
    """U(i), the keys query i reads, from the pattern's one definition."""
    key, valid = slot_keys(Pattern(window, period, causal), T)
    return [set(key[0, i][valid[0, i]].tolist()) for i in range(T)]


def _bad_rows(x: torch.Tensor) -> set[int]:
    """Rows (dim 2) of batch 0, head 0 holding a non-finite value."""
    bad = ~torch.isfinite(x[0, 0])
    return set((bad.any(-1) if bad.dim() == 2 else bad).nonzero().flatten().tolist())




@pytest.mark.parametrize("which", ("q", "k", "v", "gate"))
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("causal", (True, False), ids=param_id)
@pytest.mark.parametrize("value", ("nan", "inf"))
@pytest.mark.parametrize("dtype", (torch.float64, torch.float32), ids=param_id)
def test_nonfinite_stays_local(which, variant, causal, value, dtype):
    """NaN or ±inf in q, k, v or the gate at position p of one head: y is non-finite in exactly the rows that
    read p, the gradients at most in those rows (dq, dgate) or their neighbourhoods (dk, dv; dv nowhere for
    a bad v), and every other row, and the other head, equals the clean run's."""
    if which == "gate" and variant not in GATED_VARIANTS:
        pytest.skip("no gate")
    T, window, period = 40, 4, 16
    kw = _settings(variant, window=window, period=period, causal=causal)
    keys = _keys_of(T, window, period, causal)
    no_skip = _keys_of(T, window, T + 1, causal)
    clean = make_inputs(1, 2, T, 16, variant=variant, dtype=dtype, seed=12)
    dy = torch.randn(1, 2, T, 16, generator=torch.Generator().manual_seed(13), dtype=dtype)
    names = ("q", "k", "v", "gate")
    reference = dict(zip(NAMES, _run(pi_attention_fused, clean, dy, kw), strict=True))
    for p in (0, T // 2, T - 1, T - 1 - period):
        inputs = list(clean)
        inputs[names.index(which)] = poisoned_input(clean[names.index(which)], p, value)
        got = dict(zip(NAMES, _run(pi_attention_fused, inputs, dy, kw), strict=True))
        readers = {i for i in range(T) if p in keys[i]}
        tainted = {p} if which in ("q", "gate") else readers
        if which == "gate" and variant == "separate" and keys[p] == no_skip[p]:
            tainted = set()  # "separate" reads α only to mix in skip keys: a query without one ignores it
        near = set().union(*(keys[i] for i in tainted))
        within = {"y": tainted, "dq": tainted, "dgate": tainted, "dk": near, "dv": set() if which == "v" else near}
        for name, allowed in within.items():
            if got[name] is None:
                continue
            bad = _bad_rows(got[name])
            where = f"{which}[{p}]={value}: {name}"
            if name == "y":
                assert bad == allowed, f"{where}: non-finite rows {sorted(bad)}, expected {sorted(allowed)}"
            else:
                assert bad <= allowed, f"{where}: non-finite rows {sorted(bad - allowed)} beyond {sorted(allowed)}"
            keep = [i for i in range(T) if i not in allowed]
            assert_close(f"{where} (head 0, other rows)", reference[name][0, 0, keep], got[name][0, 0, keep])
            assert_close(f"{where} (head 1)", reference[name][0, 1], got[name][0, 1])


# ---------------------------------------------------------------------------------------------------------
# fp32 forward: blocks of consecutive rows (8 with AVX, 4 with SSE) of a head at once where their slots have
# the same structure, every other row alone (the sequence's and documents' edges, sinks that fold into a
# row's window or skip, "separate", the last rows of a work item); a row's outputs are the same bits either
# way.

def _documents(T, cuts):
    """Document ids [2, T]: batch 0 cut at `cuts`, batch 1 one document."""
    ids = torch.zeros(2, T, dtype=torch.long)
    for cut in cuts:
        ids[0, cut:] += 1
    return ids


# id: (T, window, period, D, sinks, document cuts). Window 2 and period 5: rows 0 … 4 have no skip, and
# bidirectional rows from T − 5 on none ahead, so the first and last blocks take the rows one by one.
BLOCK_CASES = {
    **{f"T{T}": (T, 2, 5, 64, 0, ()) for T in (7, 8, 9, 15, 16, 17, 33)},
    "D12": (33, 2, 5, 12, 0, ()),  # D not a multiple of the vector: the block's dots one by one
    "D16": (33, 3, 7, 16, 0, ()),
    "documents": (50, 2, 5, 64, 0, (5, 12, 21)),  # cuts inside blocks; the last document spans whole blocks
    "documents-window0": (41, 0, 7, 64, 0, (3, 13, 19, 30)),  # one slot or two: blocks across documents
    "sinks": (33, 2, 5, 64, 1, ()),  # sink key 0 folds into row 5's skip
    "sinks+documents": (50, 2, 5, 64, 2, (5, 12, 21)),
    # rows 8 … 15 all have two slots, row 15 (sink 5 = its skip) one of them local, the others two
    "sink-is-skip": (33, 0, 10, 64, 1, (5,)),
}


@pytest.mark.parametrize("case", BLOCK_CASES)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("causal", (True, False), ids=param_id)
def test_row_blocks_fp32(case, variant, causal, nan_poison):
    """Forward and every gradient against the fp64 reference, on shapes whose rows switch between blocks and
    single rows within a head: T around multiples of the block, documents cut inside blocks, sinks; two query
    heads per key/value head, batch 2."""
    T, window, period, D, sinks, cuts = BLOCK_CASES[case]
    q, _, _, gate = make_inputs(2, 4, T, D, variant=variant, dtype=torch.float32, seed=T)
    _, k, v, _ = make_inputs(2, 2, T, D, variant=variant, dtype=torch.float32, seed=T + 1)
    kw = _settings(variant, window=window, period=period, causal=causal, scale=D**-0.5, sinks=sinks,
                   document_ids=_documents(T, cuts) if cuts else None)
    _compare((q, k, v, gate), kw)


@pytest.mark.parametrize("causal", (True, False), ids=param_id)
def test_row_blocks_per_head_periods_and_dropout_fp32(causal, nan_poison):
    """Per-head periods (each head its own blocks and single rows) and dropout (each row's multipliers after
    normalising), with sinks and documents: "fused" in fp32 against "reference" in fp64 with the same masks."""
    inputs = make_inputs(2, 4, 37, 64, dtype=torch.float32, seed=16)
    kw = dict(window=3, prior=0.3, logit_clamp=2.5, eps=1e-6, causal=causal, variant="adaptive", sinks=2,
              document_ids=_documents(37, (6, 17)), period=(2, 6, 11, 40), dropout_p=0.3)
    dy = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    results = []
    for backend, dtype in (("reference", torch.float64), ("fused", torch.float32)):
        used = [t.detach().to(dtype).requires_grad_() for t in inputs]
        torch.manual_seed(7)
        y = piattn.pi_attention(*used, backend=backend, **kw)
        results.append((y, *torch.autograd.grad(y, used, dy.to(dtype))))
    for name, e, a in zip(NAMES, *results, strict=True):
        assert a.dtype == torch.float32, name
        assert_close(name, e, a, tol=FP32_DGATE if name == "dgate" else FP32)


@pytest.mark.parametrize("variant", ("union", "adaptive"))
@pytest.mark.parametrize("causal", (True, False), ids=param_id)
def test_row_blocks_keep_a_nan_in_its_rows_fp32(variant, causal, nan_poison):
    """A NaN in one row's q, or in one key, inside a block and in the last rows: y is NaN in exactly the rows
    that read it, and every other row (of every head) is the fp64 reference's."""
    T, window, period = 33, 2, 5
    kw = _settings(variant, window=window, period=period, causal=causal, scale=0.125)
    keys = _keys_of(T, window, period, causal)
    clean = make_inputs(1, 2, T, 64, variant=variant, dtype=torch.float32, seed=17, requires_grad=False)
    for which, p in (("q", 19), ("q", 32), ("k", 13), ("k", 24)):
        inputs = list(clean)
        inputs["qk".index(which)] = poisoned_input(clean["qk".index(which)], p, "nan").detach()
        with torch.no_grad():
            got = pi_attention_fused(*inputs, **kw)
            expected = pi_attention_reference(*[None if t is None else t.double() for t in inputs], **kw)
        readers = {p} if which == "q" else {i for i in range(T) if p in keys[i]}
        assert _bad_rows(got) == readers, f"{which}[{p}]: non-finite rows {sorted(_bad_rows(got))}"
        assert torch.isnan(got[0, 0, sorted(readers)]).all(), f"{which}[{p}]: a reader's y is not all NaN"
        rest = [i for i in range(T) if i not in readers]
        assert_close(f"{which}[{p}] (head 0, other rows)", expected[0, 0, rest], got[0, 0, rest], tol=FP32)
        assert_close(f"{which}[{p}] (head 1)", expected[0, 1], got[0, 1], tol=FP32)


def test_row_blocks_same_bits_whatever_the_threads_fp32(nan_poison):
    """Three threads split a head's rows at other places than one thread does (so a row may be in a block in one
    run and alone in the other): the same bits, forward and gradients."""
    threads = torch.get_num_threads()
    results = []
    inputs = make_inputs(1, 2, 300, 64, variant="adaptive", dtype=torch.float32, seed=18)
    _, k, v, _ = make_inputs(1, 1, 300, 64, dtype=torch.float32, seed=19)
    dy = torch.randn(1, 2, 300, 64, generator=torch.Generator().manual_seed(20))
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            results.append(_run(pi_attention_fused, (inputs[0], k, v, inputs[3]), dy,
                                _settings("adaptive", scale=0.125)))
    finally:
        torch.set_num_threads(threads)
    for name, a, b in zip(NAMES, *results, strict=True):
        assert torch.equal(a, b), f"{name} differs between 1 and 3 threads"


def test_a_forward_larger_than_the_cache_fp32(nan_poison):
    """A call whose forward moves more than 16 MiB writes y by streaming stores (fused_cpu.c: pi_streaming):
    every element written, the reference's values."""
    q, k, v, gate = make_inputs(1, 1, 33_000, 64, dtype=torch.float32, seed=21, requires_grad=False)
    kw = _settings("adaptive", scale=0.125)
    with torch.no_grad():
        got = pi_attention_fused(q, k, v, gate, **kw)
        expected = pi_attention_reference(q.double(), k.double(), v.double(), gate.double(), **kw)
    assert_close("y", expected, got, tol=FP32)


@pytest.mark.parametrize("dtype", (torch.float64, torch.float32, torch.bfloat16), ids=param_id)
@pytest.mark.parametrize("causal", (True, False), ids=param_id)
def test_the_backwards_window_of_key_rows_moves_on(dtype, causal, nan_poison):
    """T 1,000: the backward sums dk and dv in a window of key rows (fused_cpu.c: backward, PI_WINDOW_ROWS 256
    beyond a key's readers) that moves on several times; one period per query head up to 300 (a key's last
    reader 300 queries on), grouped heads, packed documents, dropout. Every gradient, the reference's."""
    q, _, _, gate = make_inputs(1, 4, 1000, 16, variant="adaptive", dtype=dtype, seed=31)
    _, k, v, _ = make_inputs(1, 2, 1000, 16, variant="adaptive", dtype=dtype, seed=32)
    documents = torch.tensor([0] * 380 + [1] * 500 + [2] * 120).expand(1, 1000)
    for kw in (dict(period=(5, 300, 40, 16)), dict(period=(300, 7, 9, 100), document_ids=documents),
               dict(period=(16, 16, 250, 16), dropout_p=0.2)):
        against_reference("fused", (q, k, v, gate), grad=True, seed=4, window=3, causal=causal, variant="adaptive",
                          **kw)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=param_id)
def test_a_backward_larger_than_the_cache(dtype, nan_poison):
    """A call whose forward moves more than 16 MiB writes dq, dk and dv by streaming stores (fused_cpu.c: pi_streaming):
    every element written, the reference's values."""
    T = 33_000 * 4 // dtype.itemsize
    inputs = make_inputs(1, 1, T, 64, variant="adaptive", dtype=dtype, seed=22)
    against_reference("fused", inputs, grad=True, window=4, period=16, causal=True, variant="adaptive")


# ---------------------------------------------------------------------------------------------------------
# bf16 and fp16: read and written in their dtype, computed in fp32 (the conformance suite covers them too, at
# D 32: tests/ops/test_conformance.py::test_dtypes).

LOW = (torch.bfloat16, torch.float16)


def low_precision_exact(function, dtype) -> dict[str, bool]:
    """Two checks of the conversions with outputs torch's own rounding fixes, on every bit pattern of `dtype`
    (as values of v, D 64): "round trip", each query attending to itself alone (window 0, no skip): y = v
    (NaN stays NaN); "rounding", each query attending to itself and the row before it, q = k = 0 (weights ½
    exactly): y_i = v_{i−1}·½ + v_i·½ summed in fp32 and rounded as torch rounds fp32 to `dtype` (ties to
    even, subnormals; finite patterns only)."""
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    every = bits.view(dtype).reshape(1, 1, 1024, 64)
    kw = dict(causal=True, variant="union", prior=0.5, logit_clamp=None, eps=1e-6, scale=1.0, dropout_keep=None,
              dropout_p=0.0)
    with torch.no_grad():
        zero = torch.zeros_like(every)
        y = function(zero, zero, every, None, window=0, period=5000, **kw)
        nan = every.isnan()
        trip = torch.equal(y.isnan(), nan) and torch.equal(y[~nan], every[~nan])
        finite = bits.view(dtype)[bits.view(dtype).isfinite()]
        v = finite[torch.randperm(finite.numel(), generator=torch.Generator().manual_seed(0))][:64 * 1024]
        v = v.reshape(1, 1, -1, 64)
        y = function(torch.zeros_like(v), torch.zeros_like(v), v, None, window=1, period=5000, **kw)
        wide = v.float()
        expected = torch.cat([wide[:, :, :1], wide[:, :, :-1] * 0.5 + wide[:, :, 1:] * 0.5], dim=2).to(dtype)
        rounding = torch.equal(y.view(torch.int16), expected.view(torch.int16))
    return {"round trip": trip, "rounding": rounding}


@pytest.mark.parametrize("dtype", LOW, ids=param_id)
def test_low_precision_conversions_are_torchs(dtype, nan_poison):
    assert low_precision_exact(pi_attention_fused, dtype) == {"round trip": True, "rounding": True}


@pytest.mark.parametrize("dtype", LOW, ids=param_id)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("causal", (True, False), ids=param_id)
@pytest.mark.parametrize("D", (64, 20))
def test_low_precision_matches_reference(dtype, variant, causal, D, nan_poison):
    """Grouped heads (4 query heads on 2 key/value heads), T 150: rows in vector lanes and alone (D 64), tails
    of D (20); against the exact result within the reference-error rule (utils.compare_to_exact), outputs
    and gradients in `dtype`."""
    q, _, _, gate = make_inputs(2, 4, 150, D, variant=variant, dtype=dtype, seed=11)
    _, k, v, _ = make_inputs(2, 2, 150, D, variant=variant, dtype=dtype, seed=12)
    results = against_reference("fused", (q, k, v, gate), grad=True, window=4, period=16, causal=causal,
                                variant=variant, logit_clamp=5.0)
    assert all(t.dtype == dtype for t in results[1] if t is not None)


@pytest.mark.parametrize("dtype", LOW, ids=param_id)
@pytest.mark.parametrize("causal", (True, False), ids=param_id)
def test_low_precision_sinks_documents_periods_dropout(dtype, causal, nan_poison):
    """Sinks (a key read to its document's end: dk, dv written at the head's end), packed documents, one period
    per query head, dropout: the reference-error rule, outputs and gradients."""
    q, k, v, gate = make_inputs(2, 4, 120, 16, variant="adaptive", dtype=dtype, seed=13)
    documents = torch.tensor([0] * 50 + [1] * 40 + [2] * 30).expand(2, 120)
    for kw in (dict(sinks=2, document_ids=documents), dict(period=(5, 8, 16, 16)), dict(dropout_p=0.2, sinks=1)):
        against_reference("fused", (q, k, v, gate), grad=True, seed=3, window=3, causal=causal, variant="adaptive",
                          **{"period": 8, **kw})


@pytest.mark.parametrize("dtype", LOW, ids=param_id)
@pytest.mark.parametrize("variant", ("union", "fixed", "adaptive"))
def test_low_precision_backward_rows_in_lanes_are_the_bits_of_rows_alone(dtype, variant, nan_poison):
    """The bf16 / fp16 backward takes rows in vector lanes where as many rows are left (fused_cpu.c:
    backward_block_d), each row's dq and dgate the bits it gets alone: causal, so row 16's gradients do not
    depend on T; at T 24 it is in a block of rows, at T 17 the last row, alone. The logit clamp acts on some
    slots (scale 1)."""
    q, k, v, gate = make_inputs(1, 2, 24, 64, variant=variant, dtype=dtype, seed=41)
    dy = torch.randn(q.shape, generator=torch.Generator().manual_seed(42)).to(dtype)
    kw = _settings(variant, scale=1.0, logit_clamp=3.0)
    grads = {}
    for T in (24, 17):
        inputs = [None if t is None else t[:, :, :T].detach().requires_grad_() for t in (q, k, v, gate)]
        grads[T] = _run(pi_attention_fused, inputs, dy[:, :, :T], kw)
    assert torch.equal(grads[24][1][:, :, 16], grads[17][1][:, :, 16]), "dq of row 16"
    if variant == "adaptive":
        assert torch.equal(grads[24][4][:, :, 16], grads[17][4][:, :, 16]), "dgate of row 16"


@pytest.mark.parametrize("dtype", LOW, ids=param_id)
def test_low_precision_is_what_auto_picks(dtype):
    assert piattn.ops.pi.backends.select("auto", device="cpu", dtype=dtype, head_dim=64, needs_grad=True,
                                         dropout_p=0.0).name == "fused"


# ---------------------------------------------------------------------------------------------------------
# What it refuses, and the C entry points' own checks.

@pytest.mark.parametrize("case", ("complex64", "meta"))
def test_refuses_what_it_does_not_implement(case):
    """Declared in backends.py (fp32, fp64, bf16, fp16 on the CPU), and refused here too when called directly:
    never silently wrong."""
    q, k, v, gate = make_inputs(1, 2, 20, 8, requires_grad=False)
    kw = _settings("adaptive")
    if case == "complex64":
        q, k, v, gate = (t.to(torch.complex64) for t in (q, k, v, gate))
    else:
        q, k, v, gate = (t.to("meta") for t in (q, k, v, gate))
    match = {"complex64": r"no complex64 \(runs float32, float64, bfloat16, float16\)", "meta": "CPU"}[case]
    with pytest.raises(ValueError, match=match):
        pi_attention_fused(q, k, v, gate, **kw)


def test_refuses_double_backward():
    q, k, v, gate = make_inputs(1, 2, 20, 8)
    y = pi_attention_fused(q, k, v, gate, **_settings("adaptive"))
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(y.sum(), q, create_graph=True)


PERIODS = torch.tensor([16, 16])


def _raw_call(direction, tensors, periods=PERIODS, bounds=(None, None), keep=None, **change):
    """The C entry point itself, on these tensors (then the periods, the document bounds and the dropout keep
    mask), with the sizes of a [1, 2, 20, 8] call changed by `change`: its return code."""
    call = dict(B=1, H=2, H_kv=2, T=20, D=8, window=4, sinks=0, causal=1, variant=fused.VARIANT_CODES["adaptive"],
                has_clamp=1, threads=1, clamp=1.5, prior=0.3, eps=1e-6, scale=0.25,
                keep_slots=0 if keep is None else keep.shape[-1], keep_scale=1.25)
    call.update(change)
    tensors = [*tensors, periods, *bounds, keep]
    buffers = (fused._Buffer * len(tensors))(*map(fused._buffer, tensors))
    function = fused._load()[torch.float64, direction]
    return function(ctypes.byref(fused._Call(**call)), buffers, len(tensors))


def test_c_entry_points_check_sizes_and_buffers():
    """Each bad size or buffer gets its error code, with nothing written (y stays NaN)."""
    q, k, v, gate = make_inputs(1, 2, 20, 8, requires_grad=False)
    y, stat = torch.full_like(q, float("nan")), torch.empty(1, 2, 20, 1, dtype=torch.float64)
    ok = [q, k, v, gate, y, stat]
    assert _raw_call("forward", ok) == 0 and torch.isfinite(y).all()
    y.fill_(float("nan"))
    cases = {
        "H_kv does not divide H": (ok, dict(H_kv=3), 1),
        "D larger than the buffers": (ok, dict(D=9), 3),
        "T larger than the buffers": (ok, dict(T=21), 3),
        "negative window": (ok, dict(window=-1), 2),
        "unknown variant": (ok, dict(variant=7), 2),
        "scale 0": (ok, dict(scale=0.0), 2),
        "no gate for a gated variant": ([q, k, v, None, y, stat], {}, 3),
        "a gate for an ungated variant": (ok, dict(variant=fused.VARIANT_CODES["union"]), 3),
        "short stat": ([q, k, v, gate, y, stat[..., :0]], {}, 3),
        "too few buffers": (ok[:5], {}, 3),
        "negative sinks": (ok, dict(sinks=-1), 2),
    }
    for name, (tensors, change, code) in cases.items():
        assert _raw_call("forward", tensors, **change) == code, name
        assert torch.isnan(y).all(), f"{name}: written before refusing"
    start, end = fused.document_bounds(torch.tensor([[0] * 7 + [1] * 13]))
    layouts = {
        "a period 0": (dict(periods=torch.tensor([16, 0])), 2),
        "one period for two heads": (dict(periods=torch.tensor([16])), 3),
        "a start without an end": (dict(bounds=(start, None)), 3),
        "short bounds": (dict(bounds=(start[:, :19], end[:, :19])), 3),
        "a start after its query": (dict(bounds=(start + 1, end)), 2),
        "an end past T": (dict(bounds=(start, end + 1)), 2),
        "an end at its query": (dict(bounds=(start, end.clamp_max(torch.arange(20)))), 2),
        "a keep mask narrower than the slots": (dict(keep=torch.ones(1, 2, 20, 5, dtype=torch.uint8)), 3),
        "a keep mask of another length": (dict(keep=torch.ones(1, 2, 19, 6, dtype=torch.uint8)), 3),
        "keep slots without a mask": (dict(keep_slots=6), 3),
        "a dropout scale below 1": (dict(keep=torch.ones(1, 2, 20, 6, dtype=torch.uint8), keep_scale=0.5), 2),
    }
    for name, (change, code) in layouts.items():
        assert _raw_call("forward", ok, **change) == code, name
        assert torch.isnan(y).all(), f"{name}: written before refusing"
    assert _raw_call("forward", ok, bounds=(start, end)) == 0 and torch.isfinite(y).all()
    y.fill_(float("nan"))
    assert _raw_call("forward", ok, keep=torch.ones(1, 2, 20, 7, dtype=torch.uint8)) == 0 and torch.isfinite(y).all()
    y.fill_(float("nan"))
    dq, dk, dv, dgate = (torch.full_like(t, float("nan")) for t in (q, k, v, gate))
    backward = [q, k, v, gate, q, stat, dq, dk, dv, dgate]
    assert _raw_call("backward", backward[:6] + [dq, dk[..., :4], dv, dgate]) == 3
    assert _raw_call("backward", backward, variant=fused.VARIANT_CODES["fixed"]) == 3  # no gate, no dgate
    assert torch.isnan(dq).all()


def test_the_python_side_reports_a_refusal():
    """An error code becomes a RuntimeError that says what was refused."""
    q, k, v, gate = make_inputs(1, 2, 20, 8, requires_grad=False)
    settings = OpSettings(window=4, period=16, causal=True, variant="adaptive", prior=0.3, logit_clamp=None,
                          eps=1e-6, scale=0.25, dropout_p=0.0, sinks=0)
    with pytest.raises(RuntimeError, match="buffer's length"):
        fused._run("forward", q, k, settings, [q, k, v, gate, torch.empty_like(q), torch.empty(3)])
    with pytest.raises(ValueError, match="one per query head"):
        fused._run("forward", q, k, settings._replace(period=(4, 8, 16)), [q, k, v, gate, torch.empty_like(q),
                                                                          torch.empty(1, 2, 20, 1)])


def test_out_writes_into_the_given_tensors(nan_poison):
    """fused_forward / fused_backward with out=: the same numbers, written into the tensors given (every
    element: they start as NaN); outputs of another dtype, shape or layout are refused."""
    q, k, v, gate = make_inputs(1, 2, 30, 8, variant="separate", requires_grad=False)
    settings = OpSettings(window=4, period=16, causal=False, variant="separate", prior=0.3, logit_clamp=1.5,
                          eps=1e-6, scale=0.25, dropout_p=0.0, sinks=0)
    y, stat = fused.fused_forward(q, k, v, gate, settings)
    given = (torch.full_like(y, float("nan")), torch.full_like(stat, float("nan")))
    assert all(a is b for a, b in zip(fused.fused_forward(q, k, v, gate, settings, out=given), given, strict=True))
    assert torch.equal(given[0], y) and torch.equal(given[1], stat)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(15), dtype=y.dtype)
    grads = fused.fused_backward(dy, q, k, v, gate, stat, settings, want_dgate=True)
    given = [torch.full_like(t, float("nan")) for t in grads]
    got = fused.fused_backward(dy, q, k, v, gate, stat, settings, want_dgate=True, out=given)
    assert all(a is b and torch.equal(a, e) for a, b, e in zip(got, given, grads, strict=True))
    with pytest.raises(ValueError, match="out= must be"):
        fused.fused_forward(q, k, v, gate, settings, out=(y.float(), stat))
    with pytest.raises(ValueError, match="out= must be"):
        fused.fused_forward(q, k, v, gate, settings, out=(y.transpose(1, 2).contiguous().transpose(1, 2), stat))
    with pytest.raises(ValueError, match="out= must be"):
        fused.fused_backward(dy, q, k, v, gate, stat, settings, want_dgate=False, out=given)


def test_empty_batch():
    q, k, v, gate = make_inputs(0, 2, 20, 8)
    y = pi_attention_fused(q, k, v, gate, **_settings("adaptive"))
    assert y.shape == (0, 2, 20, 8)
    y.sum().backward()
    assert q.grad.shape == q.shape and gate.grad.shape == gate.shape


# ---------------------------------------------------------------------------------------------------------
# Building: the flag sets below -march=native, and no compiler at all (fresh interpreters, own caches).

CHECK = """
import json, warnings, torch
warnings.simplefilter("always")
from piattn.ops.pi import cbuild, fused
{setup}
from piattn.ops.pi.reference import pi_attention_reference
torch.manual_seed(0)
q, k, v = (torch.randn(1, 2, 50, 13, dtype=torch.float64, requires_grad=True) for _ in range(3))
gate = (0.05 + 0.9 * torch.rand(1, 2, 50, dtype=torch.float64)).requires_grad_()
kw = dict(window=3, period=9, causal=False, variant="adaptive", prior=0.5, logit_clamp=2.0, eps=1e-6,
          scale=0.3, dropout_keep=None, dropout_p=0.0)
worst = 0.0
for f in (pi_attention_reference, fused.pi_attention_fused):
    y = f(q, k, v, gate, **kw)
    got = (y, *torch.autograd.grad(y.square().sum(), (q, k, v, gate)))
    if f is pi_attention_reference:
        expected = got
worst = max((a - b).abs().max().item() for a, b in zip(expected, got))
flags = fused.build_flags()
{low}
low = None if fused.unavailable() else [low_precision_exact(fused.pi_attention_fused, d)
                                        for d in (torch.bfloat16, torch.float16)]
print(json.dumps(dict(reason=fused.unavailable(), flags=None if flags is None else list(flags), worst=worst,
                      low=low)))
"""
# bf16 and fp16 conversions exact in both dtypes (`low_precision_exact`), what CHECK reports as "low"
LOW_EXACT = [{"round trip": True, "rounding": True}] * 2


def _check_in(tmp_path, setup="", **env):
    """Run CHECK in a fresh interpreter with its own PIATTN_CACHE (tmp_path; None: the user's cache, where a
    library built before is reused): (its report, its stderr)."""
    script = CHECK.format(setup=setup, low=inspect.getsource(low_precision_exact))
    cache = {} if tmp_path is None else {"PIATTN_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True, env={**os.environ, **cache, **env})
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.mark.slow  # two extra C builds, seconds each
@pytest.mark.parametrize("flags", (("-fopenmp",), ()), ids=("no-march", "no-march-no-openmp"))
def test_builds_without_native_instructions_or_openmp(tmp_path, flags):
    """Where the compiler refuses -march=native or -fopenmp, the next flag set is built, and computes the same
    (SSE vectors and one thread: the same function)."""
    out, _ = _check_in(tmp_path, setup=f"fused.FLAG_SETS = ({flags!r},)")
    assert out == dict(reason=None, flags=list(flags), worst=out["worst"], low=LOW_EXACT) and out["worst"] < 1e-10, out
    assert len(list((tmp_path / "native").glob("fused_cpu-*.so"))) == 1


# ---------------------------------------------------------------------------------------------------------
# PIATTN_MARCH: the kernels built and tested for a named x86-64 level, refused where this CPU cannot run it.

def _runnable(level: str) -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and not cbuild.missing_features(
        level, cbuild.cpu_features())


@pytest.mark.parametrize("level", [
    "x86-64-v2",  # every x86-64 CI machine of the last decade runs it: the default suite builds one level
    pytest.param("x86-64-v3", marks=pytest.mark.slow),  # AVX2
    pytest.param("x86-64-v4", marks=pytest.mark.slow),  # AVX-512
])
def test_pinned_instruction_set_builds_and_computes_the_same(level):
    """PIATTN_MARCH=level builds that instruction set alone (its own library in the cache) and matches the
    reference, output and gradients, in fp64; its bf16 and fp16 conversions are torch's (below x86-64-v3, no
    F16C: the portable conversions). In the user's cache, as a user's pinned build is: the build (20 s of
    compiler) runs once per machine and source, and its key keeps it apart from the -march=native library."""
    if not _runnable(level):
        pytest.skip(f"this CPU cannot run {level}")
    out, _ = _check_in(None, PIATTN_MARCH=level)
    assert out["reason"] is None and out["flags"] == [f"-march={level}", "-fopenmp"], out
    assert out["worst"] < 1e-10 and out["low"] == LOW_EXACT, out


def test_march_values_refused_with_the_reason(monkeypatch):
    monkeypatch.setenv("PIATTN_MARCH", "x86-64-v9")
    with pytest.raises(ValueError, match=r"PIATTN_MARCH must be one of native, x86-64, x86-64-v2, x86-64-v3, "
                                         r"x86-64-v4; got 'x86-64-v9'"):
        cbuild.march()
    monkeypatch.setenv("PIATTN_MARCH", "x86-64-v3")
    monkeypatch.setattr(cbuild.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cbuild, "cpu_features", lambda: frozenset(cbuild.X86_64_LEVELS["x86-64-v2"]))
    with pytest.raises(ValueError, match=r"PIATTN_MARCH=x86-64-v3 needs CPU features this CPU lacks \(abm, avx, "
                                         r"avx2, .*SIGILL"):
        cbuild.march()
    monkeypatch.setattr(cbuild.platform, "machine", lambda: "aarch64")
    with pytest.raises(ValueError, match="x86-64 level; this machine is aarch64"):
        cbuild.march()
    monkeypatch.setenv("PIATTN_MARCH", "native")
    assert cbuild.march() == "native"
    monkeypatch.delenv("PIATTN_MARCH")
    assert cbuild.march() is None and fused.flag_sets() == fused.FLAG_SETS


def test_missing_features_accumulate_the_levels_below():
    v2 = frozenset(cbuild.X86_64_LEVELS["x86-64-v2"])
    assert cbuild.missing_features("x86-64", frozenset()) == []
    assert cbuild.missing_features("x86-64-v2", v2) == []
    assert cbuild.missing_features("x86-64-v4", v2 | {"avx512f"}) == sorted(
        set(cbuild.X86_64_LEVELS["x86-64-v3"]) | set(cbuild.X86_64_LEVELS["x86-64-v4"]) - {"avx512f"})


def test_a_level_this_cpu_lacks_is_the_backends_refusal(tmp_path):
    """Pinned to a level the CPU cannot run, the backend refuses every call with the reason (no build, no
    fallback to another instruction set) and "auto" runs "torch"."""
    setup = ("from piattn.ops.pi import cbuild; cbuild.cpu_features = lambda: frozenset(); "
             "cbuild.platform.machine = lambda: 'x86_64'")
    done = subprocess.run(
        [sys.executable, "-c", f"{setup}\nfrom piattn.ops.pi import fused\nprint(fused.unavailable())\n"
                               "print(fused.build_flags())"],
        capture_output=True, text=True, check=True,
        env={**os.environ, "PIATTN_CACHE": str(tmp_path), "PIATTN_MARCH": "x86-64-v2"})
    reason, flags = done.stdout.strip().splitlines()[-2:]
    assert "PIATTN_MARCH=x86-64-v2 needs CPU features this CPU lacks" in reason and "backend='torch'" in reason
    assert flags == "None" and not list(tmp_path.glob("native/*.so"))


def test_every_exported_symbol_is_written_out_in_the_source():
    """Each function the built library exports (nm -D) is defined by its own name in fused_cpu.c, not only
    through the FN() macro of the kernels, and named in the contents index at the top: grep, ctags and a reader
    find every entry point fused.py calls."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm to list the library's symbols")
    path = cbuild.library_path(fused.SOURCE, os.environ.get("CC") or "cc",
                               (*fused._BASE_FLAGS, *fused.build_flags()))  # the library fused.py loaded
    if not path.is_file():
        pytest.skip(f"the fused library is not at {path}")
    listed = subprocess.run([nm, "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True)
    exported = sorted(fields[2] for fields in map(str.split, listed.stdout.splitlines())
                      if len(fields) == 3 and fields[1] in ("T", "W", "i"))
    assert set(fused._FUNCTIONS.values()) <= set(exported), exported
    source = fused.SOURCE.read_text()
    index = source[:source.index("*/")]
    not_defined = [name for name in exported if not re.search(rf"^\w[\w\s\*]*\b{re.escape(name)}\s*\(", source, re.M)]
    not_indexed = [name for name in exported if not re.search(rf"\b{re.escape(name)}\b", index)]
    assert not not_defined, f"exported but defined only through a macro: {not_defined}"
    assert not not_indexed, f"exported but missing from the contents index: {not_indexed}"
