"""The exchange plan, in one process: which rows each rank receives and how its extended array is laid out.

The layout test runs the ordinary operator on each rank's extended array built from the whole sequence
(no communication), so a wrong offset, a missing row or a wrong period' fails here before any process
group is involved.
"""

from __future__ import annotations

import random

import pytest
import torch
from sp_jobs import needed_positions

from piattn import pi_attention
from piattn.config.pi import GATED_VARIANTS, VARIANTS
from piattn.parallel import HaloPlan


def random_geometries(n: int, seed: int = 0):
    rng = random.Random(seed)
    for _ in range(n):
        P, S = rng.randint(2, 5), rng.randint(1, 7)
        yield P, S, rng.randint(0, 8), rng.randint(1, 2 * P * S), rng.random() < 0.5


EDGE_GEOMETRIES = [  # (P, S, k, π, causal): both modes, their boundary, windows longer than a shard, π ≤ k
    (4, 8, 2, 5, True), (4, 5, 2, 7, False), (4, 5, 2, 8, False), (4, 5, 2, 8, True), (4, 4, 1, 11, False),
    (4, 3, 5, 7, False), (4, 3, 4, 9, True), (4, 3, 4, 9, False), (4, 4, 5, 3, False), (2, 5, 2, 8, False),
    (3, 1, 0, 2, False), (5, 2, 7, 12, False), (4, 6, 0, 30, False),
]


@pytest.mark.parametrize("geometry", EDGE_GEOMETRIES + list(random_geometries(150)))
def test_each_rank_receives_exactly_the_rows_its_queries_read(geometry):
    P, S, k, p, causal = geometry
    plan = HaloPlan(P, S, k, p, causal)
    for r in range(P):
        received = [pos for t in plan.receives(r) for pos in range(t.start, t.end)]
        assert len(received) == len(set(received)), "a row is received twice"
        assert set(received) == needed_positions(P, S, k, p, causal, r)
        assert all(t.src == t.start // S == (t.end - 1) // S and t.dst == r for t in plan.receives(r))
        assert [t.at for t in plan.receives(r)] == [sum(u.rows for u in plan.receives(r)[:i])
                                                   for i in range(len(plan.receives(r)))]
    # what r sends is what the others receive from r
    for r in range(P):
        assert plan.sends(r) == tuple(t for d in range(P) for t in plan.receives(d) if t.src == r)


LAYOUT_CASES = [(g, v) for g in EDGE_GEOMETRIES for v in VARIANTS] + [
    (g, v) for g, v in zip(random_geometries(40, seed=1), list(GATED_VARIANTS) * 20, strict=True)]


@pytest.mark.parametrize("geometry, variant", LAYOUT_CASES)
def test_the_operator_on_each_extended_array_gives_that_ranks_rows(geometry, variant):
    """Simulated in one process: build rank r's extended array from the whole sequence, zero the queries
    of the rows it does not own (gate 0.5 there), run pi_attention with the plan's period'."""
    P, S, k, p, causal = geometry
    torch.manual_seed(0)
    T = P * S
    q, key, v = (torch.randn(1, 2, T, 3, dtype=torch.float64) for _ in range(3))
    gate = 0.05 + 0.9 * torch.rand(1, 2, T, dtype=torch.float64) if variant in GATED_VARIANTS else None
    kw = dict(window=k, causal=causal, variant=variant, prior=0.3, backend="reference")
    full = pi_attention(q, key, v, gate, period=p, **kw)
    plan = HaloPlan(P, S, k, p, causal)
    for r in range(P):
        idx = torch.cat([torch.arange(s, e) for s, e in plan.segments(r)])
        assert torch.all(idx[1:] > idx[:-1])
        a, b = plan.own(r)
        owned = (idx >= a) & (idx < b)
        q_ext = q[:, :, idx] * owned[:, None]
        g_ext = None if gate is None else torch.where(owned, gate[:, :, idx], 0.5)
        y = pi_attention(q_ext, key[:, :, idx], v[:, :, idx], g_ext, period=plan.ext_period, **kw)
        o = plan.own_offset(r)
        torch.testing.assert_close(y[:, :, o:o + S], full[:, :, a:b], rtol=0, atol=1e-12)


def test_modes_and_the_period_they_run_with():
    assert not HaloPlan(4, 8, 2, 10, True).gapped  # π = S + k: halo and skip block touch
    assert HaloPlan(4, 8, 2, 10, True).ext_period == 10
    gapped = HaloPlan(4, 8, 2, 11, False)
    assert gapped.gapped and gapped.ext_period == 10
    # rank 2 of 4 (positions 16..23), bidirectional: skip 5..12, halo 14..15, own, halo 24..25, skip 27..31
    assert gapped.segments(2) == ((5, 13), (14, 16), (16, 24), (24, 26), (27, 32))
    assert gapped.own_offset(2) == 10
    assert HaloPlan(4, 8, 2, 5, True).segments(1) == ((3, 8), (8, 16), (16, 16))


def test_rows_received_do_not_grow_with_the_sequence():
    for S in (64, 256, 4096):
        assert HaloPlan(8, S, 4, 16, True).max_rows_received() == 16  # contiguous: the 16 rows before
        assert HaloPlan(8, S, 4, 1000, False).max_rows_received() <= 2 * 4 + 2 * S  # never more than halos + blocks
    assert HaloPlan(8, 512, 4, 1000, True).max_rows_received() == 4 + 512  # gapped: halo + one skip block
    big = HaloPlan(64, 16384, 4, 16, True).bytes_per_rank(batch=1, heads=16, head_dim=128, dtype_bytes=2)
    assert big["forward_recv"] == 16 * 2 * 16 * 128 * 2


@pytest.mark.parametrize("bad, message", [
    (dict(world=0), "world"), (dict(shard=0), "shard"), (dict(window=-1), "window"), (dict(period=0), "period"),
    (dict(causal=1), "causal"), (dict(shard=2.0), "shard"),
])
def test_bad_plans_raise_naming_the_argument(bad, message):
    args = dict(world=2, shard=4, window=1, period=3, causal=True) | bad
    with pytest.raises(ValueError, match=message):
        HaloPlan(**args)
    with pytest.raises(ValueError, match="rank"):
        HaloPlan(2, 4, 1, 3, True).receives(2)
