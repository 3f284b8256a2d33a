"""The compiled decoding step (`decode_native.py`, through `native.py`'s binding): equal to the full operator
and to the torch-ops step for every variant it takes, NaN-poisoned outputs fully written, non-finite values
kept in the rows that read them, the same refusals as documented, and the models' steps actually going
through it."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import piattn.ops.pi.decode_native as decode_native
import piattn.ops.pi.native as native
from piattn.config import PI_DEFAULTS
from piattn.decoding.cache import RingCache
from piattn.models import GPT, GPTConfig
from piattn.ops.pi import cbuild, pi_attention
from piattn.ops.pi.decode import decode_ring, decode_settings
from piattn.ops.pi.decode_plan import decode_plan

TOL = {torch.float32: dict(rtol=2e-5, atol=2e-6), torch.float64: dict(rtol=1e-12, atol=1e-12)}
EPS = 1e-3  # large enough that the clip of the gate changes the rows


@pytest.fixture(autouse=True)
def compiled_step():
    """Skip where there is no C compiler (decoding then runs in torch ops, tested elsewhere); where there is
    one, the step must build."""
    if shutil.which(os.environ.get("CC") or "cc") is None:
        pytest.skip("no C compiler ($CC or cc) to build the compiled decoding step")
    if native.unavailable() is not None:
        pytest.fail(f"the compiled step must build where a compiler exists: {native.unavailable()}")


def _gate_from_hidden(hidden, weight, bias, eps):
    """α̃ [B, H, 1] of the gate MLP's last layers, written out in fp64 as Eq. app_gate says."""
    h = hidden.double()
    u = (0.5 * h * (1 + torch.erf(h / math.sqrt(2)))) @ weight.double().T + bias.double()
    return (eps + (1 - 2 * eps) * torch.sigmoid(u)).transpose(1, 2)


def _case(B, H, H_kv, D, N, window, period, sinks, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = 3 * torch.randn(B, H, N, D, generator=g, dtype=dtype)  # scores beyond the clamp
    k = 3 * torch.randn(B, H_kv, N, D, generator=g, dtype=dtype)
    v = torch.randn(B, H_kv, N, D, generator=g, dtype=dtype)
    cache = RingCache(B, H_kv, D, max(window, period) + 1, sinks=sinks, dtype=dtype)
    cache.append(k, v)
    hidden = 2 * torch.randn(B, 1, 6, generator=g, dtype=dtype)
    weight, bias = torch.randn(H, 6, generator=g, dtype=dtype), torch.randn(H, generator=g, dtype=dtype)
    gate = 0.01 + 0.98 * torch.rand(B, H, N, generator=g, dtype=dtype)
    return q, k, v, cache, gate, (hidden, weight, bias)


def _step(q, cache, gate, head, *, variant, form, scale, **kw):
    """decode_ring of the last query; form "alpha" passes α, "hidden" the gate MLP's hidden layer; kw the other
    settings (`pi_attention`'s keywords, the defaults for the rest)."""
    op = decode_settings(PI_DEFAULTS, scale)._replace(variant=variant, **kw)  # (`settings` is hypothesis')
    if form == "hidden":
        return decode_ring(q[:, :, -1:], cache.kv, head[0], op, capacity=cache.capacity, position=cache.seen - 1,
                           gate_head=head[1:])
    gated = variant in ("adaptive", "separate")
    return decode_ring(q[:, :, -1:], cache.kv, gate[:, :, -1:] if gated else None, op, capacity=cache.capacity,
                       position=cache.seen - 1)


FORMS = [("union", "alpha"), ("fixed", "alpha"), ("adaptive", "alpha"), ("adaptive", "hidden")]


@settings(max_examples=60, deadline=None)
@given(B=st.integers(1, 3), H_kv=st.sampled_from([1, 2]), group=st.sampled_from([1, 2, 3]),
       D=st.sampled_from([1, 4, 7, 16]), window=st.integers(0, 6), period=st.integers(1, 12),
       sinks=st.integers(0, 3), N=st.integers(1, 40), form=st.sampled_from(FORMS),
       dtype=st.sampled_from([torch.float32, torch.float64]), clamp=st.sampled_from([None, 4.0]),
       seed=st.integers(0, 10_000))
def test_compiled_step_equals_the_full_operator(B, H_kv, group, D, window, period, sinks, N, form, dtype, clamp,
                                                seed):
    """Random shapes, grouped heads, sinks, texts shorter than the period and the ring, all four forms."""
    variant, how = form
    H = H_kv * group
    q, k, v, cache, gate, head = _case(B, H, H_kv, D, N, window, period, sinks, dtype, seed)
    if how == "hidden":
        gate = torch.cat([gate[:, :, :-1], _gate_from_hidden(*head, EPS).to(dtype)], 2)
    kw = dict(window=window, period=period, prior=0.3, logit_clamp=clamp, eps=EPS, sinks=sinks)
    full = pi_attention(q, k, v, gate if variant == "adaptive" else None, causal=True, variant=variant,
                        backend="reference", **kw)[:, :, -1:]
    step = _step(q, cache, gate, head, variant=variant, form=how, scale=D**-0.5, **kw)
    assert step.dtype == dtype
    # In fp32 the step computes 1 − α as (1 − ε) − (1 − 2ε)·σ and the operator from α rounded to fp32: near
    # α = 1 that cancellation alone moves log(1 − α) by ~1e-4 relative.
    loose = how == "hidden" and dtype == torch.float32
    torch.testing.assert_close(step, full, **(dict(rtol=1e-4, atol=1e-4) if loose else TOL[dtype]))


@pytest.mark.parametrize("variant,form", FORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compiled_step_equals_the_torch_ops_step_and_writes_every_element(variant, form, dtype, nan_poison,
                                                                          monkeypatch):
    q, _, _, cache, gate, head = _case(2, 4, 2, 8, 30, 3, 8, 2, dtype, seed=7)
    kw = dict(variant=variant, form=form, window=3, period=8, prior=0.3, logit_clamp=4.0, eps=EPS, sinks=2,
              scale=8**-0.5)
    compiled = _step(q, cache, gate, head, **kw)  # torch.empty is NaN-filled: every element must be written
    monkeypatch.setattr(native, "_state", {"functions": None})
    torch.testing.assert_close(compiled, _step(q, cache, gate, head, **kw), **TOL[dtype])


def test_the_comparison_sees_the_gate_the_clamp_and_the_sinks():
    """Dropping a term changes the compiled step's rows (so the tests above can fail)."""
    q, _, _, cache, gate, head = _case(1, 2, 2, 8, 30, 3, 8, 2, torch.float64, seed=3)
    kw = dict(window=3, period=8, prior=0.3, eps=EPS, scale=8**-0.5)
    base = _step(q, cache, gate, head, variant="adaptive", form="hidden", logit_clamp=4.0, sinks=2, **kw)
    other_gate = (head[0], head[1], head[2] + 1.0)
    for changed in (_step(q, cache, gate, other_gate, variant="adaptive", form="hidden", logit_clamp=4.0, sinks=2,
                          **kw),
                    _step(q, cache, gate, head, variant="adaptive", form="hidden", logit_clamp=None, sinks=2, **kw),
                    _step(q, cache, gate, head, variant="union", form="alpha", logit_clamp=4.0, sinks=2, **kw)):
        assert not torch.allclose(base, changed)


# Rows (batch · 4 heads + head) that go non-finite; a +inf key is bounded by the clamp and a +inf in the
# gate's hidden layer saturates σ, so those stay finite in both steps.
NON_FINITE_ROWS = {"read key": [2, 3], "read value": [2, 3], "unread key": [], "unread value": [],
                   "gate": [4, 5, 6, 7]}


@pytest.mark.parametrize("mode", ["hidden", "input"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_tokens_gate_is_the_same_bits_alone_and_in_any_batch(mode, dtype):
    """The C step runs the gate MLP for up to 8 tokens at once (fp32: several tokens in vector lanes, one token
    alone by itself): 19 sequences (chunks of 8, 8 and 3), 5 heads (four side by side, then one) and a
    13-wide gate give each sequence's row the bits it gets alone, and the rows agree with the gate written out
    in fp64. "hidden": the gate's last layers from its hidden layer (a ring read); "input": its whole MLP from
    the layer input, in the one-token step that also stores the token (`DecodePlan.token`'s call)."""
    B, H, H_kv, D, n_hidden, n_in, window, period = 19, 5, 1, 8, 13, 11, 3, 7
    g = torch.Generator().manual_seed(5)
    kv = torch.randn(2, B, H_kv, period + 1, D, generator=g, dtype=dtype)
    fresh = torch.randn(B, 1, (H + 2 * H_kv) * D, generator=g, dtype=dtype)  # q, then the new key and value
    x = 2 * torch.randn(B, 1, n_in, generator=g, dtype=dtype)
    w_in, b_in = torch.randn(n_hidden, n_in, generator=g, dtype=dtype) / 2, torch.randn(n_hidden, generator=g,
                                                                                       dtype=dtype)
    w, b = torch.randn(H, n_hidden, generator=g, dtype=dtype), torch.randn(H, generator=g, dtype=dtype)
    hidden = x @ w_in.T + b_in
    settings = decode_settings(PI_DEFAULTS, 0.5)._replace(window=window, period=period, variant="adaptive",
                                                          logit_clamp=None, eps=EPS, sinks=0)
    plan = decode_plan(settings, H, capacity=period + 1)
    slot, valid = plan.ring_slots(20)
    kind = plan.kind

    def step(rows):
        store = kv[:, rows].clone()
        if mode == "hidden":
            q = fresh[rows, :, :H * D].reshape(-1, 1, H, D).transpose(1, 2)
            y = decode_native.run(plan, q, store, slot, valid, hidden[rows], (w, b))
        else:
            y = decode_native.run(plan, fresh[rows], store, slot, valid, x[rows], (w_in, b_in, w, b),
                                  fresh_slot=int(slot[0, 0]))
        assert y is not None
        return y, store

    together, store = step(slice(None))
    for i in range(B):
        alone, alone_store = step(slice(i, i + 1))
        assert torch.equal(together[i], alone[0]), f"sequence {i}"
        assert torch.equal(store[:, i], alone_store[:, 0])
    alpha = _gate_from_hidden(hidden.double(), w, b, EPS)  # [B, H, 1]
    store = store.double()
    q = fresh[:, 0, :H * D].reshape(B, H, D).double()
    keys, values = store[0, :, 0][:, slot[0]], store[1, :, 0][:, slot[0]]  # [B, S, D] (every head's table)
    prior = torch.where(kind.bool(), (1 - alpha).clamp_min(EPS).log(), alpha.clamp_min(EPS).log())  # [B, H, S]
    scores = torch.einsum("bhd,bsd->bhs", q, keys) * 0.5 + prior
    assert valid is None  # a full ring: every slot reads a key
    expected = torch.einsum("bhs,bsd->bhd", scores.softmax(-1), values)
    # fp32: the gate's rounding (GELU, sums, σ, log) moves rows of size 1 by up to about 1e-5
    tol = TOL[dtype] if dtype == torch.float64 else dict(rtol=1e-4, atol=2e-5)
    torch.testing.assert_close(together[:, :, 0].double(), expected, **tol)


@pytest.mark.parametrize("where", list(NON_FINITE_ROWS))
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_values_reach_only_the_rows_that_read_them(where, bad, monkeypatch):
    """The same rows are non-finite in the compiled and the torch-ops step, and an unread slot of the ring
    (an old position the step does not read) never reaches the output."""
    q, _, _, cache, gate, head = _case(2, 4, 2, 8, 30, 3, 8, 0, torch.float64, seed=11)
    hidden = head[0].clone()
    # position 29 reads 26 … 29 and 21; the ring (capacity 9) holds 21 … 29, so 22 … 25 are unread
    if where == "read key":
        cache.k[0, 1, 29 % 9, 0] = bad  # batch 0, key head 1: query heads 2, 3 read it
    elif where == "read value":
        cache.v[0, 1, 21 % 9, 0] = bad  # the skip slot of the same heads
    elif where == "unread key":
        cache.k[0, 1, 23 % 9, 0] = bad
    elif where == "unread value":
        cache.v[1, 0, 24 % 9, 0] = bad
    else:
        hidden[1, 0, 2] = bad  # every head of sequence 1
    head = (hidden, *head[1:])
    kw = dict(variant="adaptive", form="hidden", window=3, period=8, prior=0.3, logit_clamp=4.0, eps=EPS, sinks=0,
              scale=8**-0.5)
    compiled = _step(q, cache, gate, head, **kw)
    monkeypatch.setattr(native, "_state", {"functions": None})
    reference = _step(q, cache, gate, head, **kw)
    bad_rows = ~compiled.isfinite().all(-1).flatten()
    assert torch.equal(bad_rows, ~reference.isfinite().all(-1).flatten())
    bounded = math.isinf(bad) and where in ("read key", "gate")
    assert bad_rows.nonzero().flatten().tolist() == ([] if bounded else NON_FINITE_ROWS[where])
    finite = compiled.isfinite()
    torch.testing.assert_close(compiled[finite], reference[finite], **TOL[torch.float64])


@pytest.mark.parametrize("why", ["bf16", "autograd", "separate"])
def test_what_the_compiled_step_does_not_take_runs_in_torch_ops(why, monkeypatch):
    calls = []
    real = decode_native.run  # what decode_ring's plan calls (its own checks come first)

    def spy(*args, **kwargs):
        calls.append(real(*args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(decode_native, "run", spy)
    dtype = torch.bfloat16 if why == "bf16" else torch.float32
    q, k, v, cache, gate, _ = _case(1, 2, 2, 8, 20, 3, 8, 0, dtype, seed=5)
    variant = "separate" if why == "separate" else "adaptive"
    if why == "autograd":
        q.requires_grad_(True)
    y = _step(q, cache, gate, None, variant=variant, form="alpha", window=3, period=8, prior=0.3, logit_clamp=4.0,
              eps=EPS, scale=8**-0.5)
    assert calls in ([], [None])
    full = pi_attention(q.detach().float(), k.float(), v.float(), gate.float(), causal=True, variant=variant,
                        window=3, period=8, logit_clamp=4.0, eps=EPS)[:, :, -1:]
    torch.testing.assert_close(y.detach().float(), full, **({} if dtype == torch.float32 else
                                                            dict(rtol=2e-2, atol=2e-2)))
    if why == "autograd":
        y.sum().backward()  # the torch-ops step keeps the graph
        assert q.grad is not None and q.grad.abs().sum() > 0


def _model(attention, **extra):
    cfg = GPTConfig.from_name("tiny", attention=attention, vocab_size=50, dropout=0.0, n_layer=2, d_model=32,
                              n_head=4, window=2, period=5, **extra)
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    for block in model.blocks:  # gates that vary per token
        if getattr(block.attn, "gate", None) is not None:
            torch.nn.init.normal_(block.attn.gate[2].weight, std=1.0)
    return model


@pytest.mark.parametrize("attention,extra", [("pi", {}), ("pi", dict(variant="fixed")), ("pi", dict(sinks=2)),
                                             ("pi", dict(n_kv_head=2)), ("local", {})])
def test_model_steps_go_through_the_compiled_step_and_match_the_full_forward(attention, extra, monkeypatch):
    model = _model(attention, **extra)
    taken = []
    # The compiled step's calls: the layers' whole one-token step (RoPE and the cache's store included), and the
    # ring read of the first positions of a cache with sinks, which do not take that.
    real = decode_native.run

    def spy(*args, **kwargs):
        y = real(*args, **kwargs)
        taken.append(y is not None)
        return y

    monkeypatch.setattr(decode_native, "run", spy)
    idx = torch.randint(0, 50, (2, 24), generator=torch.Generator().manual_seed(1))
    cache = model.init_cache(2)
    with torch.no_grad():
        steps = torch.cat([model(idx[:, t:t + 1], cache) for t in range(idx.shape[1])], 1)
        full = model(idx)
    assert taken and all(taken) and len(taken) == idx.shape[1] * len(model.blocks)
    torch.testing.assert_close(steps, full, rtol=0, atol=2e-5)


def test_an_observed_gate_still_decodes_the_same(monkeypatch):
    """A gate observer (training statistics, `piattn inspect`) sees every step's α̃; the rows are unchanged."""
    model = _model("pi")
    idx = torch.randint(0, 50, (1, 12), generator=torch.Generator().manual_seed(2))
    seen = []
    with torch.no_grad():
        plain = torch.cat([model(idx[:, t:t + 1], c) for c in [model.init_cache(1)] for t in range(12)], 1)
        model.blocks[0].attn.observe_gate(seen.append)
        observed = torch.cat([model(idx[:, t:t + 1], c) for c in [model.init_cache(1)] for t in range(12)], 1)
    assert len(seen) == 12 and seen[0].shape == (1, 4, 1)
    torch.testing.assert_close(observed, plain, rtol=0, atol=1e-6)


def _build_in(tmp_path, **env):
    """Load the compiled step in a fresh interpreter with `env`; returns (its stdout, its stderr)."""
    code = ("import warnings, piattn.ops.pi.native as n; warnings.simplefilter('always'); "
            "print(n.unavailable())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, "PIATTN_CACHE": str(tmp_path), **env})
    return done.stdout.strip(), done.stderr


def test_the_library_is_built_once_per_cache_and_reused(tmp_path, monkeypatch):
    out, _ = _build_in(tmp_path)
    assert out == "None"
    built = list((tmp_path / "native").glob("decode_step-*.so"))
    assert len(built) == 1 and not list((tmp_path / "native").glob("tmp*"))
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setenv("PIATTN_CACHE", str(tmp_path))  # a second load, in this process: the same file
    monkeypatch.delenv("PIATTN_NATIVE", raising=False)
    monkeypatch.setattr(native, "_state", {})
    assert native.unavailable() is None
    assert built[0].stat().st_mtime_ns == stamp



def test_the_step_is_built_for_this_cpu_first_or_for_the_pinned_level_alone(monkeypatch):
    """`-march=native` first (the GELU's erf eight lanes wide with AVX), the step's own flags where the compiler
    refuses it; with PIATTN_MARCH a level, that level alone (no fallback to another instruction set)."""
    monkeypatch.delenv("PIATTN_MARCH", raising=False)
    assert native.flag_sets() == (("-march=native",), ())
    monkeypatch.setattr(cbuild, "march", lambda: "x86-64-v3")
    assert native.flag_sets() == (("-march=x86-64-v3",),)
    assert "march" not in " ".join(native._FLAGS)  # the instruction set comes from the flag sets alone


def test_without_a_compiler_decoding_warns_once_and_falls_back(tmp_path, monkeypatch):
    monkeypatch.setenv("PIATTN_CACHE", str(tmp_path))  # in this process, its library state set aside
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.delenv("PIATTN_NATIVE", raising=False)
    monkeypatch.setattr(native, "_state", {})
    with pytest.warns(RuntimeWarning, match="PIATTN_NATIVE=0") as caught:
        assert native.unavailable().startswith("could not build decode_step.c with '/nonexistent/cc'")
        assert native.unavailable().startswith("could not build")  # asked again: no second warning
    assert len(caught) == 1
    monkeypatch.setenv("PIATTN_NATIVE", "0")
    monkeypatch.setattr(native, "_state", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.unavailable() == "disabled by PIATTN_NATIVE=0"


def test_decoding_without_the_compiled_step_gives_the_same_tokens(monkeypatch):
    model = _model("pi")
    prompt = torch.randint(0, 50, (1, 5), generator=torch.Generator().manual_seed(3))
    fast = model.generate(prompt, max_new_tokens=16, top_k=1)
    monkeypatch.setattr(native, "_state", {"functions": None, "reason": "switched off by the test"})
    slow = model.generate(prompt, max_new_tokens=16, top_k=1)
    assert torch.equal(slow, fast)
