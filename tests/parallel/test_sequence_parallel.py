"""sequence_parallel_pi_attention on real processes (Gloo, CPU, fp64) against the single-process operator.

One 4-process job runs every case of CASES (groups of 4 = the world, 2 and 3 ranks = subgroups, whose
group ranks differ from the global ones, and 1 = fallback); each rank compares its output shard and its
gradients (dq, dk, dv, dgate) with the operator on the whole sequence, and counts what the exchange handed
to torch.distributed. A 2-process job checks the default (world) group and calls that must raise.
"""

from __future__ import annotations

import pytest
import torch
from sp_harness import run_ranks
from sp_jobs import needed_positions

from piattn import pi_attention
from piattn.config.pi import VARIANTS
from piattn.parallel import HaloPlan, plan_for, sequence_parallel_pi_attention

pytestmark = [pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed"),
              # one pytest worker runs this file (make test: --dist loadgroup), so that its module fixture's
              # process group is started once, not once per worker
              pytest.mark.xdist_group("test_sequence_parallel")]

# name: (shard S, window k, period π); the mode is gapped exactly when π > S + k
GEOMETRIES = {
    "short_period": (8, 2, 5),          # contiguous, π < S
    "period_eq_shard_plus_window": (5, 2, 7),  # contiguous, at the boundary
    "long_period": (5, 2, 8),           # gapped, just past the boundary
    "far_period": (4, 1, 11),           # gapped, skip block two shards away
    "window_over_shard": (3, 5, 7),     # contiguous, halo spans two ranks
    "window_over_shard_gapped": (3, 4, 9),  # gapped, clipped halo on rank 1
    "period_inside_window": (4, 5, 3),  # no skip slot at all
}
GROUPS = {"world4": None, "pair": [0, 1], "trio": [1, 2, 3]}


def make_cases() -> list[dict]:
    cases, seed = [], 0
    for gname, ranks in GROUPS.items():
        for geo, (S, k, p) in GEOMETRIES.items():
            for causal in (True, False):
                for variant in VARIANTS:
                    seed += 1
                    name = f"{gname}-{geo}-{'causal' if causal else 'bidir'}-{variant}"
                    cases.append(dict(name=name, ranks=ranks, shard=S, window=k, period=p, causal=causal,
                                      variant=variant, seed=seed))
    for geo in ("short_period", "far_period", "window_over_shard_gapped"):  # the blocked "torch" backend
        S, k, p = GEOMETRIES[geo]
        for causal in (True, False):
            seed += 1
            cases.append(dict(name=f"world4-{geo}-{'causal' if causal else 'bidir'}-adaptive-torch", ranks=None,
                              shard=S, window=k, period=p, causal=causal, variant="adaptive", backend="torch",
                              seed=seed, B=2, logit_clamp=None))
    for geo in ("short_period", "far_period", "window_over_shard"):  # grouped-query: 4 query heads, 2 kv heads
        S, k, p = GEOMETRIES[geo]
        for causal, backend in ((True, "reference"), (False, "reference"), (True, "torch")):
            seed += 1
            cases.append(dict(name=f"world4-{geo}-{'causal' if causal else 'bidir'}-adaptive-gqa-{backend}",
                              ranks=None, shard=S, window=k, period=p, causal=causal, variant="adaptive",
                              backend=backend, seed=seed, H=4, H_kv=2))
    for causal in (True, False):  # a group of one rank: the plain operator on the whole (local) sequence
        seed += 1
        cases.append(dict(name=f"self-{'causal' if causal else 'bidir'}", ranks="self", shard=12, window=2,
                          period=5, causal=causal, variant="adaptive", seed=seed))
    return cases


CASES = make_cases()


@pytest.fixture(scope="module")
def four_ranks():
    """{case name: [per-rank results]} of one 4-process run of every case."""
    by_case: dict[str, list[dict]] = {}
    for rank_results in run_ranks(4, "equivalence", CASES, deadline=150):
        for res in rank_results:
            by_case.setdefault(res["case"], []).append(res)
    return by_case


def group_size(case: dict) -> int:
    ranks = case["ranks"]
    return 4 if ranks is None else 1 if ranks == "self" else len(ranks)


@pytest.mark.parametrize("case", [c for c in CASES if c["ranks"] != "self"], ids=lambda c: c["name"])
def test_output_and_every_gradient_match_the_unsharded_operator(case, four_ranks):
    results = four_ranks[case["name"]]
    P = group_size(case)
    assert sorted(r["rank"] for r in results) == list(range(P))
    expected = {"out", "dq", "dk", "dv"} | ({"dgate"} if case["variant"] in ("separate", "adaptive") else set())
    for res in results:
        assert set(res["errors"]) == expected
        assert res["grad_scale"] > 1e-3  # gradients are not trivially zero
        for name, err in res["errors"].items():
            assert err <= 1e-12, f"rank {res['rank']}: {name} differs by {err}"


@pytest.mark.parametrize("case", [c for c in CASES if c["ranks"] != "self"], ids=lambda c: c["name"])
def test_each_rank_receives_only_the_rows_its_queries_read(case, four_ranks):
    """Counted at torch.distributed: forward receives exactly the needed rows (brute force from the
    operator's offsets, never the whole sequence), backward sends back exactly those rows' gradients, one
    all-reduce, no gather or broadcast."""
    P, S = group_size(case), case["shard"]
    B, H_kv, D = case.get("B", 1), case.get("H_kv", case.get("H", 2)), case.get("D", 4)
    row_bytes = B * H_kv * 2 * D * 8  # a key and a value row (only the H_kv key/value heads travel), fp64
    sent_to = {r: 0 for r in range(P)}
    for res in results_of(case, four_ranks):
        r, t = res["rank"], res["traffic"]
        need = needed_positions(P, S, case["window"], case["period"], case["causal"], r)
        assert t.get("fwd_recv_rows", 0) == len(need)
        assert t.get("fwd_recv_bytes", 0) == len(need) * row_bytes
        assert t.get("bwd_send_rows", 0) == len(need)  # the gradients of those rows go back to their owners
        assert t.get("fwd_recv_rows", 0) < (P - 1) * S or len(need) == (P - 1) * S
        assert t["all_reduce"] == 1
        assert not [k for k in t if k.startswith("forbidden:")]
        sent_to[r] = t.get("fwd_send_rows", 0)
        assert t.get("bwd_recv_rows", 0) == sent_to[r]
    assert sum(sent_to.values()) == sum(
        len(needed_positions(P, S, case["window"], case["period"], case["causal"], r)) for r in range(P))


def results_of(case, four_ranks):
    return four_ranks[case["name"]]


@pytest.mark.parametrize("case", [c for c in CASES if c["ranks"] == "self"], ids=lambda c: c["name"])
def test_a_group_of_one_rank_is_the_plain_operator(case, four_ranks):
    results = four_ranks[case["name"]]
    assert len(results) == 4  # every rank ran it in its own group of one
    for res in results:
        assert all(err == 0.0 for err in res["errors"].values()), res["errors"]
        assert res["traffic"] == {}  # no all-reduce, no exchange


def test_the_cases_cover_both_modes_and_windows_longer_than_a_shard():
    modes = {HaloPlan(4, S, k, p, True).gapped for S, k, p in GEOMETRIES.values()}
    assert modes == {True, False}
    assert any(k > S for S, k, _ in GEOMETRIES.values())
    assert any(p <= k for _, k, p in GEOMETRIES.values())


@pytest.fixture(scope="module")
def two_ranks_mismatch():
    return run_ranks(2, "mismatch", deadline=90)


@pytest.mark.parametrize("call, rank_messages", [
    ("shard_lengths", ["q: shard lengths differ"] * 2),
    ("settings", ["pi_attention_kwargs differ"] * 2),
    ("causal", ["pi_attention_kwargs differ"] * 2),
    ("invalid_on_one_rank", ["another rank of the group passed invalid arguments", "variant must be one of"]),
    ("gate_out_of_range_on_one_rank", ["another rank of the group passed invalid arguments", "gate values"]),
    ("kv_heads", ["pi_attention_kwargs differ"] * 2),
    ("sinks", ["supports neither sinks > 0 nor document_ids, got sinks=2"] * 2),
    ("document_ids", ["supports neither sinks > 0 nor document_ids, got sinks=0, document_ids of type Tensor"] * 2),
    ("group_type", ["group must be a torch.distributed ProcessGroup"] * 2),
    ("not_a_member", ["skipped", "is not a member of the group"]),
])
def test_mismatched_calls_raise_on_every_rank_without_hanging(call, rank_messages, two_ranks_mismatch):
    for rank, (res, expected) in enumerate(zip(two_ranks_mismatch, rank_messages, strict=True)):
        assert expected in res[call], f"rank {rank}: {res[call]!r}"
        assert expected == "skipped" or res[call].startswith("ValueError: ")
        assert "\n" not in res[call]


def test_ranks_stay_in_step_after_the_errors(two_ranks_mismatch):
    for res in two_ranks_mismatch:
        assert res["after"] <= 1e-12


def test_without_a_process_group_it_is_the_plain_operator():
    assert not torch.distributed.is_initialized()
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 20, 4, dtype=torch.float64) for _ in range(3))
    gate = torch.rand(1, 2, 20, dtype=torch.float64) * 0.9 + 0.05
    kw = dict(window=3, period=7, causal=False, backend="reference")
    assert torch.equal(sequence_parallel_pi_attention(q, k, v, gate, **kw), pi_attention(q, k, v, gate, **kw))
    assert plan_for(q, **kw) is None
    with pytest.raises(ValueError, match="group was given, but no torch.distributed process group"):
        sequence_parallel_pi_attention(q, k, v, gate, group=object(), **kw)
    with pytest.raises(ValueError, match=r"pi_attention_kwargs: unknown argument\(s\) \['windw'\]"):
        sequence_parallel_pi_attention(q, k, v, gate, windw=3)
    with pytest.raises(ValueError, match="window must be"):  # the operator's own checks still apply
        sequence_parallel_pi_attention(q, k, v, gate, window=-1)
