"""The "torch" backend's sinks, grouped-query attention and documents, beyond tests/ops/test_features.py: many
chunks (a small CHUNK_BYTES, so that documents, sinks and windows cross chunk edges), low precision,
dropout with sinks (this backend reorders slots internally), non-finite inputs with documents, and random
shapes against "reference", forward and every gradient.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import piattn
from piattn.config.pi import GATED_VARIANTS, VARIANTS
from piattn.ops.pi import torch as torch_backend
from piattn.ops.pi.pattern import Pattern, slot_keys
from utils import assert_close, compare, forward_backward

# One intra-op thread: many small chunks run many times faster than with threads competing on a busy CPU.
pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning"), pytest.mark.usefixtures("one_thread")]


def make(B, H, Hk, T, D, variant, dtype=torch.float64, seed=0):
    """q [B, H, T, D], k, v [B, Hk, T, D] ~ N(0, 1), a gate in (0.02, 0.98) or None; all requiring grad."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, Hk, T, D, generator=g, dtype=torch.float64) for _ in range(2))
    gate = 0.02 + 0.96 * torch.rand(B, H, T, generator=g, dtype=torch.float64) if variant in GATED_VARIANTS else None
    return tuple(None if t is None else t.to(dtype).requires_grad_() for t in (q, k, v, gate))


def documents(B, lengths_per_row) -> torch.Tensor:
    """[B, T] ids from document lengths per batch row (ids alternate, so equal ids may sit apart)."""
    rows = [torch.repeat_interleave(torch.arange(len(n)) % 2, torch.tensor(n)) for n in lengths_per_row]
    assert len(rows) == B
    return torch.stack(rows)


@pytest.fixture
def small_chunks(monkeypatch):
    """A chunk of 512 bytes of q: with fp64, D = 8 and G query heads per key head, 8 / G rows rounded up to
    one block, so a sequence of a few hundred rows runs as many chunks of one block."""
    monkeypatch.setattr(torch_backend, "CHUNK_BYTES", 512)


def both(inputs, dtype, **kw):
    """forward_backward of "reference" and "torch" on the same inputs and seed; compared at `dtype`."""
    results = []
    for backend in ("reference", "torch"):
        torch.manual_seed(3)
        results.append(forward_backward(*inputs, backend=backend, **kw))
    compare(*results, dtype)
    return results


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("pattern", [(3, 11, 4), (20, 45, 3)], ids=["narrow", "wider-than-block"])
def test_many_chunks(variant, causal, pattern, small_chunks, nan_poison):
    """Several chunks per key head, documents and sinks crossing their edges, GQA with 3 heads a group; fresh
    allocations NaN-filled (tests/conftest.py), so that an element left unwritten cannot pass."""
    window, period, sinks = pattern
    T = 150
    inputs = make(2, 6, 2, T, 8, variant)
    ids = documents(2, [[37, 1, 60, 52], [150]])
    chunks = torch_backend._chunks(T, window, causal, inputs[0].detach().reshape(4, 3, T, 8))
    assert len(chunks) > 4 * 2, "the chunk size must give several chunks per key head"
    both(inputs, torch.float64, window=window, period=period, causal=causal, variant=variant, sinks=sinks,
         document_ids=ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("variant", ["adaptive", "separate"])
def test_low_precision(dtype, variant, nan_poison):
    """Low precision accumulates in fp32, as the reference does: equal within TOLERANCES of the dtype."""
    inputs = make(1, 4, 2, 90, 16, variant, dtype, seed=2)
    ids = documents(1, [[20, 50, 20]])
    both(inputs, dtype, window=5, period=12, causal=True, variant=variant, sinks=3, document_ids=ids)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_dropout_with_sinks(variant, causal):
    """The keep mask [B, H, T, |U|] is in the contract's slot order (local, skip, sink): equal to the
    reference's result with the same mask, although this backend orders its slots local, sink, skip."""
    inputs = make(2, 4, 2, 60, 8, variant, seed=4)
    ids = documents(2, [[25, 35], [60]])
    kw = dict(window=3, period=9, causal=causal, variant=variant, sinks=3, document_ids=ids, dropout_p=0.3)
    (y, *_), _ = both(inputs, torch.float64, **kw)
    with torch.no_grad():
        plain = piattn.pi_attention(*inputs, **{**kw, "dropout_p": 0.0}, backend="torch")
    assert (y - plain).abs().max() > 1e-3, "dropout must change the output"


def readers(key: int, pattern: Pattern, T: int, ids: torch.Tensor | None) -> set[int]:
    """The queries (of batch row 0) with a valid slot that reads `key`, from `slot_keys`."""
    keys, valid = slot_keys(pattern, T, ids)
    return set(((keys[0] == key) & valid[0]).any(-1).nonzero().flatten().tolist())


def bad_rows(x: torch.Tensor, head: int) -> set[int]:
    """Positions of batch row 0, head `head` of x [B, H, T, D] holding a non-finite value."""
    return set((~torch.isfinite(x[0, head])).any(-1).nonzero().flatten().tolist())


@pytest.mark.parametrize("variant", ["adaptive", "separate"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("docs", [True, False], ids=["documents", "one-document"])
def test_nonfinite_with_sinks(variant, causal, which, docs):
    """A NaN key or value at p (with documents a document's first row, so also its sink; a skip target)
    reaches y only in the queries of its group's heads that read it, never across a document edge; dq
    only in those rows, dk and dv only at keys those rows read; every other value equals the clean run's."""
    T, window, period, sinks = 48, 3, 8, 2
    pattern = Pattern(window, period, causal, sinks)
    ids = documents(1, [[10, 20, 18]]) if docs else None
    kw = dict(window=window, period=period, causal=causal, variant=variant, sinks=sinks, document_ids=ids,
              backend="torch")
    clean = make(1, 4, 2, T, 8, variant, seed=6)
    base = forward_backward(*clean, **kw)
    keys, valid = slot_keys(pattern, T, ids)
    for p in (10, 30, T - 1 - period):
        inputs = list(clean)
        i = ("k", "v").index(which) + 1
        inputs[i] = clean[i].detach().clone()
        inputs[i][0, 0, p] = float("nan")  # key head 0, read by query heads 0 and 1
        inputs[i].requires_grad_()
        y, dq, dk, dv, *_ = forward_backward(*inputs, **kw)
        tainted = readers(p, pattern, T, ids)
        assert tainted and tainted != set(range(T))
        read = set(keys[0][sorted(tainted)][valid[0][sorted(tainted)]].tolist())
        for head in (0, 1):
            assert bad_rows(y, head) == tainted, f"{which}[{p}]: y rows {sorted(bad_rows(y, head))}"
            assert bad_rows(dq, head) <= tainted
        assert bad_rows(dk, 0) <= read and bad_rows(dv, 0) <= read
        for name, got, ref in zip(("y", "dq", "dk", "dv"), (y, dq, dk, dv), base, strict=False):
            rows = [t for t in range(T) if t not in (tainted if name in ("y", "dq") else read)]
            assert_close(f"{which}[{p}] {name} (head 0, other rows)", ref[0, 0, rows], got[0, 0, rows])
            assert_close(f"{which}[{p}] {name} (last head)", ref[0, -1], got[0, -1])


def test_gqa_reads_each_kv_head_once(monkeypatch):
    """Native GQA: no K or V tensor of H heads is ever built (repeat_interleave is never called), and the
    key windows of a key head are built once per chunk, not once per query head."""
    def refuse(*args, **kwargs):
        pytest.fail("K or V repeated to the query heads")

    monkeypatch.setattr(torch.Tensor, "repeat_interleave", refuse)
    monkeypatch.setattr(torch, "repeat_interleave", refuse)
    windows = torch_backend._Chunk.windows
    shapes = []
    monkeypatch.setattr(torch_backend._Chunk, "windows", lambda self, x: shapes.append(x.shape) or windows(self, x))
    inputs = make(1, 6, 2, 40, 8, "adaptive")
    y = piattn.pi_attention(*inputs, window=4, period=9, sinks=2, backend="torch")
    y.sum().backward()
    assert shapes and all(s[0] == 2 for s in shapes), f"key windows of {sorted(set(shapes))}"


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    B=st.integers(1, 2), Hk=st.integers(1, 2), group=st.sampled_from([1, 2, 3]), T=st.integers(1, 70),
    D=st.sampled_from([1, 4, 8]), window=st.integers(0, 20), period=st.integers(1, 50), sinks=st.integers(0, 5),
    causal=st.booleans(), variant=st.sampled_from(VARIANTS), cuts=st.lists(st.integers(1, 69), max_size=5),
    clamp=st.sampled_from([None, 2.0]), chunk=st.sampled_from([256, torch_backend.CHUNK_BYTES]),
    seed=st.integers(0, 2**16),
)
def test_random_against_reference(B, Hk, group, T, D, window, period, sinks, causal, variant, cuts, clamp,
                                  chunk, seed):
    """Random shapes, documents, sinks and groups, one chunk or many: forward and every gradient."""
    ids = torch.tensor([[sum(t >= c + b for c in cuts) for t in range(T)] for b in range(B)])
    inputs = make(B, Hk * group, Hk, T, D, variant, seed=seed)
    kw = dict(window=window, period=period, causal=causal, variant=variant, sinks=sinks, document_ids=ids,
              logit_clamp=clamp)
    saved = torch_backend.CHUNK_BYTES
    torch_backend.CHUNK_BYTES = chunk
    try:
        both(inputs, torch.float64, **kw)
    finally:
        torch_backend.CHUNK_BYTES = saved

