"""Multi-scale π (one period per query head) under sequence parallelism, on 4 real processes (Gloo, fp64).

The operator: each rank's output shard and gradients against the single-process `pi_attention` with the same
per-head periods (contiguous and gapped exchanges in one call, a period folded into the window, grouped-query
heads split across periods), and the traffic: one exchange per distinct period, each moving exactly the rows
that period's heads read, on the key/value heads that group reads; one all-reduce per call. The model: a GPT
with per-head and per-layer periods inside `sequence_parallel` against its unsharded forward and gradients.
Bad per-head periods raise the same one-line ValueError naming `period` on every rank, without hanging.
"""

from __future__ import annotations

import pytest
import torch
from sp_harness import run_ranks
from sp_jobs import needed_positions

from piattn.ops.pi.heads import period_groups
from piattn.parallel import HaloPlan, plan_for

pytestmark = [pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed"),
              # one pytest worker runs this file (make test: --dist loadgroup), so that its module fixture's
              # process group is started once, not once per worker
              pytest.mark.xdist_group("test_sequence_parallel_head_periods")]

OPERATOR_CASES = [
    # S = 4, k = 1: π = 2 and 5 contiguous (π <= S + k), π = 11 gapped, in one call
    dict(name="mixed_modes-causal", ranks=None, shard=4, window=1, period=(2, 11, 5, 11), causal=True,
         variant="adaptive", seed=101, H=4),
    dict(name="mixed_modes-bidir", ranks=None, shard=4, window=1, period=(11, 2, 5, 2), causal=False,
         variant="separate", seed=102, H=4),
    # a period inside the window (no skip slot) beside a gapped one, on a subgroup of two ranks
    dict(name="folded-pair", ranks=[0, 1], shard=5, window=2, period=(1, 9), causal=True, variant="fixed",
         seed=103),
    # grouped-query: π = 3 covers key/value head 0's whole group, π = 9 and 12 split key/value head 1's
    dict(name="gqa-torch", ranks=None, shard=4, window=1, period=(3, 3, 9, 12), causal=True, variant="adaptive",
         seed=104, H=4, H_kv=2, backend="torch", logit_clamp=None),
]
MODEL_CASES = [
    dict(name="per_head", size=2, shard=8, seed=11, model=dict(attention="pi", window=2, n_head=4, d_model=32,
                                                              period=[3, 6, 12, 12])),
    dict(name="per_layer_gqa", size=2, shard=8, seed=12, model=dict(attention="pi", window=1, n_head=4,
                                                                   n_kv_head=2, d_model=32,
                                                                   period=[[2, 2, 5, 11], [11, 4, 4, 2]])),
]


@pytest.fixture(scope="module")
def four_ranks():
    return run_ranks(4, "head_periods", {"cases": OPERATOR_CASES, "models": MODEL_CASES}, deadline=150)


def operator_results(name, four_ranks):
    return [res for rank in four_ranks for res in rank["operator"] if res["case"] == name]


@pytest.mark.parametrize("case", OPERATOR_CASES, ids=lambda c: c["name"])
def test_output_and_every_gradient_match_the_unsharded_operator(case, four_ranks):
    results = operator_results(case["name"], four_ranks)
    P = 4 if case["ranks"] is None else len(case["ranks"])
    assert sorted(r["rank"] for r in results) == list(range(P))
    for res in results:
        assert res["grad_scale"] > 1e-3
        for what, err in res["errors"].items():
            assert err <= 1e-12, f"rank {res['rank']}: {what} differs by {err}"


@pytest.mark.parametrize("case", OPERATOR_CASES, ids=lambda c: c["name"])
def test_each_period_moves_only_the_rows_its_heads_read(case, four_ranks):
    P, S = 4 if case["ranks"] is None else len(case["ranks"]), case["shard"]
    B, D = case.get("B", 1), case.get("D", 4)
    H_kv = case.get("H_kv", case.get("H", 2))
    groups = period_groups(tuple(case["period"]), H_kv)
    for res in operator_results(case["name"], four_ranks):
        r, t = res["rank"], res["traffic"]
        need = {p: needed_positions(P, S, case["window"], p, case["causal"], r) for p, _, _ in groups}
        rows = sum(len(need[p]) for p, _, _ in groups)
        assert t.get("fwd_recv_rows", 0) == rows and t.get("bwd_send_rows", 0) == rows
        assert t.get("fwd_recv_bytes", 0) == sum(len(need[p]) * B * len(kv) * 2 * D * 8 for p, _, kv in groups)
        assert t["all_reduce"] == 1
        assert not [k for k in t if k.startswith("forbidden:")]


@pytest.mark.parametrize("name", [c["name"] for c in MODEL_CASES])
def test_a_multiscale_model_sharded_gives_the_unsharded_logits_and_gradients(name, four_ranks):
    for global_rank, rank in enumerate(four_ranks):
        result = rank["models"][name]
        assert "error" not in result, result
        assert result["group_rank"] == global_rank % 2 and result["grad_scale"] > 1e-3
        for what, error in result["errors"].items():
            assert error < 1e-10 * max(1.0, result["grad_scale"]), f"rank {global_rank}: {what} off by {error}"


@pytest.mark.parametrize("call, message", [
    ("differ_across_ranks", "pi_attention_kwargs differ across the ranks"),
    ("wrong_length", "period has 3 entries; per-head periods need one per query head, H=2"),
    ("zero", "period[1] must be an int >= 1, got 0"),
    ("float", "period[1] must be an int >= 1, got 5.0"),
    ("float_tensor", "period must be an int >= 1 or one int >= 1 per query head"),
    ("tensor_on_another_device", "period must be on the device of q (cpu), got meta"),
])
def test_bad_per_head_periods_raise_on_every_rank(call, message, four_ranks):
    for rank in four_ranks:
        got = rank["errors"][call]
        assert got.startswith("ValueError: ") and message in got and "\n" not in got, got
    for rank in four_ranks:
        assert rank["errors"]["after"] <= 1e-12  # still in step: a tensor of periods then runs exactly


def test_plan_for_gives_one_plan_per_distinct_period(monkeypatch):
    import piattn.parallel.sequence as sequence

    monkeypatch.setattr(sequence, "_resolve_group", lambda group: ("group", 0, 4))
    q = torch.zeros(1, 3, 4, 2)
    plans = plan_for(q, window=1, period=(11, 2, 11), causal=True)
    assert plans == (HaloPlan(4, 4, 1, 2, True), HaloPlan(4, 4, 1, 11, True))
    assert [p.gapped for p in plans] == [False, True]
    assert plan_for(q, window=1, period=(5, 5, 5)) == (HaloPlan(4, 4, 1, 5, True),)  # equal entries: one period
    assert plan_for(q, window=1, period=5) == (HaloPlan(4, 4, 1, 5, True),)
    with pytest.raises(ValueError, match="period has 2 entries"):
        plan_for(q, period=(2, 5))
