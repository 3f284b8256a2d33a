"""Model-level sequence parallelism (`piattn.layers.sequence_parallel`) on 4 real processes (Gloo, fp64).

The world is split into sequence groups of 2 consecutive ranks (global ranks 2 and 3 are ranks 0 and 1 of
their group, so a shard offset taken from the global rank would be wrong). Each rank runs a tiny GPT on
its half of every sequence; its logits must be its rows of the unsharded forward, and the parameter
gradients summed over its group the unsharded gradients: RoPE at the global positions, the halo exchange
of keys and values, and the gradients flowing back across shards are all exercised.
"""

from __future__ import annotations

import pytest
import torch
from sp_harness import run_ranks

from piattn.config import PiSettings
from piattn.layers.sharding import active_shard, pi_operator, sequence_parallel

pytestmark = [pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed"),
              # one pytest worker runs this file (make test: --dist loadgroup), so that its module fixture's
              # process group is started once, not once per worker
              pytest.mark.xdist_group("test_sequence_parallel_model")]

CASES = [
    # contiguous exchange (π <= S + k), gapped exchange (π > S + k), local attention
    dict(name="pi_contiguous", size=2, shard=16, seed=0, model=dict(attention="pi", window=2, period=8)),
    dict(name="pi_gapped", size=2, shard=8, seed=1, model=dict(attention="pi", window=2, period=12)),
    dict(name="pi_separate", size=2, shard=8, seed=2, model=dict(attention="pi", window=3, period=5,
                                                                  variant="separate")),
    dict(name="local", size=2, shard=8, seed=3, model=dict(attention="local", window=3)),
    dict(name="pi_gqa", size=2, shard=8, seed=5, model=dict(attention="pi", window=2, period=12, n_head=4,
                                                           n_kv_head=2)),
    dict(name="dense", size=2, shard=8, seed=4, model=dict(attention="dense")),
]
SHARDED = [c["name"] for c in CASES if c["name"] != "dense"]


@pytest.fixture(scope="module")
def four_ranks():
    return run_ranks(4, "model_shards", CASES, deadline=150)


@pytest.mark.parametrize("name", SHARDED)
def test_shards_give_the_unsharded_logits_and_gradients(name, four_ranks):
    for global_rank, results in enumerate(four_ranks):
        result = results[name]
        assert "error" not in result, result
        assert result["group_rank"] == global_rank % 2
        assert result["grad_scale"] > 1e-3  # the loss reaches every parameter
        for what, error in result["errors"].items():
            assert error < 1e-10 * max(1.0, result["grad_scale"]), f"rank {global_rank}: {what} off by {error}"


@pytest.mark.parametrize("name", SHARDED)
def test_the_context_is_set_inside_and_gone_after(name, four_ranks):
    for results in four_ranks:
        assert results[name]["inside"] and results[name]["after"]


@pytest.mark.parametrize("name", SHARDED)
def test_cached_decoding_refuses_to_run_sharded(name, four_ranks):
    for results in four_ranks:
        assert results[name]["decoding"] == "ValueError: cached decoding cannot run sequence-parallel"


def test_a_kind_without_a_sharded_operator_refuses_on_every_rank(four_ranks):
    for results in four_ranks:
        assert results["dense"] == {"error": "attention kind DenseAttention cannot run sequence-parallel; "
                                             "kinds that can: local, pi"}


def test_without_a_group_the_context_changes_nothing():
    q, k, v = (torch.randn(1, 2, 12, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
               for i in range(3))
    with sequence_parallel(None) as shard:
        assert shard is None and active_shard() is None
        y = pi_operator(q, k, v, None, PiSettings(window=2, period=5, variant="union"))
    from piattn import pi_attention
    assert torch.equal(y, pi_attention(q, k, v, window=2, period=5, variant="union"))
