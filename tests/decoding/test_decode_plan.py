"""The decoding plan and its registry of steps (`decode_plan.py`, `decode_steps.py`): a plan is built once from the
settings, the heads and the ring, holds one slot table per query head (one period: H equal rows), and runs the
first registered step that declares and takes the call; a step refuses what it does not declare with its reason;
a new step is its module and one line of the registry."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import sys
import types

import pytest
import torch

import piattn.ops.pi.decode_native as decode_native
import piattn.ops.pi.decode_torch as decode_torch
import piattn.ops.pi.native as native
from piattn.config import PI_DEFAULTS
from piattn.config.pi import VARIANTS
from piattn.decoding.cache import RingCache
from piattn.ops.pi.decode_plan import DecodePlan, decode_plan, decode_settings
from piattn.ops.pi.decode_slots import block_slots
from piattn.ops.pi.decode_steps import ORDER, REGISTRY, DecodeStep, steps_for

CPU = torch.device("cpu")


def _settings(**pi):
    return decode_settings(PI_DEFAULTS, 8 ** -0.5)._replace(**{"window": 3, "period": 7, **pi})


def _calls(monkeypatch) -> list[str]:
    """The steps that ran each row call ("compiled" or "torch"), by spies on their modules' `run`."""
    ran = []
    for name, module in (("compiled", decode_native), ("torch", decode_torch)):
        real = module.run

        def spy(*args, real=real, name=name, **kwargs):
            y = real(*args, **kwargs)
            if y is not None:
                ran.append(name)
            return y

        monkeypatch.setattr(module, "run", spy)
    return ran


# ---------------------------------------------------------------------------------------------------------------
# The registry.

def test_the_registry_declares_each_step_and_the_order_is_its_own():
    assert ORDER == ("compiled", "torch") == tuple(REGISTRY)
    compiled, torch_ops = REGISTRY["compiled"], REGISTRY["torch"]
    assert compiled.variants == frozenset(native.PRIOR_MODES) == {"union", "fixed", "adaptive"}
    assert torch_ops.variants == decode_torch.TORCH_OPS_VARIANTS == set(VARIANTS)
    assert compiled.gate_in_step and compiled.per_head_periods and compiled.token and not compiled.gradients
    assert compiled.dtypes == {torch.float32, torch.float64} and compiled.devices == {"cpu"}
    assert torch_ops.gate_in_step and torch_ops.per_head_periods and not torch_ops.token
    assert torch_ops.dtypes is None and torch_ops.devices is None and torch_ops.gradients
    assert [step.name for step in steps_for("auto")] == ["compiled", "torch"]
    assert [step.name for step in steps_for("fused")] == ["compiled"]
    assert steps_for("torch") is None and steps_for("reference") is None  # the operator runs those


@pytest.mark.parametrize("call, reason", [
    (dict(variant="separate"), "the compiled step runs variants adaptive, fixed, union, not 'separate'"),
    (dict(variant="union", dtype=torch.bfloat16), "the compiled step runs torch.float32, torch.float64, not "
                                                  "torch.bfloat16"),
    (dict(variant="union", device="cuda"), "the compiled step runs on cpu, not cuda"),
    (dict(variant="union", needs_grad=True), "the compiled step computes no gradient"),
])
def test_a_step_refuses_what_it_does_not_declare_with_its_reason(call, reason):
    assert REGISTRY["compiled"].refusal(**call) == reason
    assert REGISTRY["compiled"].refusal("union", dtype=torch.float64, device="cpu", batch=64) is None


def test_a_step_without_per_head_periods_is_not_planned_for_them():
    torch_ops = REGISTRY["torch"]
    assert torch_ops.refusal("union", per_head=True) is None  # one pass per period, over every head
    assert decode_plan(_settings(period=(3, 7)), 2).steps == (REGISTRY["compiled"], REGISTRY["torch"])
    one_table = dataclasses.replace(REGISTRY["compiled"], per_head_periods=False, max_batch=4)
    assert one_table.refusal("union", per_head=True) == ("the compiled step reads one slot table for every head, "
                                                         "not one period per head")
    assert one_table.refusal("union", batch=5) == "the compiled step runs batches of at most 4, not 5"
    assert _plan_of(one_table, period=(3, 7)) == ("torch",)  # passed over for per-head periods
    assert _plan_of(one_table, period=7) == ("compiled", "torch")


def _plan_of(compiled: DecodeStep, **settings) -> tuple[str, ...]:
    """The steps of the plan of `settings` with `compiled` in the registry's place of the compiled step."""
    from piattn.ops.pi import decode_steps

    saved = decode_steps.REGISTRY["compiled"]
    decode_steps.REGISTRY["compiled"] = compiled
    try:
        return tuple(step.name for step in decode_plan(_settings(**settings), 2).steps)
    finally:
        decode_steps.REGISTRY["compiled"] = saved


def test_a_variant_no_step_declares_is_refused_with_every_reason():
    with pytest.raises(ValueError, match=r"^no decoding step runs variant 'novel': the compiled step runs variants "
                                         r"adaptive, fixed, union, not 'novel'; the torch step runs variants "):
        decode_plan(_settings(variant="novel"), 4)
    assert decode_plan(_settings(variant="novel"), 4, backend="fused") is None  # the operator then says why


def test_a_new_step_is_its_module_and_one_registry_line(monkeypatch):
    """A step registered first (as a CUDA step would be) runs the calls it takes; those it declines go on to the
    next step, as a plan tries them in the registry's order."""
    seen = []
    module = types.ModuleType("piattn_test_step")
    module.unavailable = lambda: None

    def run(plan, q, kv, slot, valid, gate, gate_layers, **kwargs):
        seen.append(q.shape[2])
        return torch.zeros_like(q) if q.shape[2] == 1 else None  # takes one query, declines more

    module.run = run
    monkeypatch.setitem(sys.modules, "piattn_test_step.step", module)
    monkeypatch.setattr("piattn.ops.pi.decode_steps.REGISTRY",
                        {"test": DecodeStep("test", "piattn_test_step.step", frozenset({"union"})), **REGISTRY})
    plan = decode_plan(_settings(variant="union"), 2)
    assert [step.name for step in plan.steps] == ["test", "compiled", "torch"]
    assert plan.token_module is decode_native  # the first step that declares the whole one-token step
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 2, 10, 8, generator=g), torch.randn(1, 2, 10, 8, generator=g)
    assert bool((plan.rows(torch.randn(1, 2, 1, 8, generator=g), (k, v), None) == 0).all())
    three = plan.rows(torch.randn(1, 2, 3, 8, generator=g), (k, v), None)
    assert seen == [1, 3] and not bool((three == 0).all())


# ---------------------------------------------------------------------------------------------------------------
# Which step a plan runs.

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_plan_runs_the_compiled_step_where_it_takes_the_call_else_torch_ops(dtype, monkeypatch):
    if native.unavailable() is not None:
        pytest.skip(f"the compiled step is not available here: {native.unavailable()}")
    ran = _calls(monkeypatch)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, n, 8, generator=g, dtype=dtype) for n in (3, 12, 12))
    gate = torch.rand(2, 4, 3, generator=g, dtype=dtype)
    plan = decode_plan(_settings(), 4)
    assert [step.name for step in plan.steps] == ["compiled", "torch"] and plan.gate_in_step
    compiled = plan.rows(q, (k, v), gate)
    q.requires_grad_(True)  # declared: no gradient in the compiled step
    with_grad = plan.rows(q, (k, v), gate)
    q.requires_grad_(False)
    monkeypatch.setattr(native, "_state", {"functions": None, "reason": "switched off by the test"})
    switched_off = plan.rows(q, (k, v), gate)  # the same plan: the library is asked at each call
    assert ran == ["compiled", "torch", "torch"]
    assert with_grad.requires_grad
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(switched_off, compiled, **tol)
    torch.testing.assert_close(with_grad.detach(), compiled, **tol)
    assert decode_plan(_settings(variant="separate"), 4).steps == (REGISTRY["torch"],)
    assert decode_plan(_settings(variant="separate"), 4, backend="fused") is None
    fused = decode_plan(_settings(), 4, backend="fused")
    assert fused.steps == (REGISTRY["compiled"],) and fused.rows(q, (k, v), gate) is None  # never torch ops


# ---------------------------------------------------------------------------------------------------------------
# What a plan holds.

@pytest.mark.parametrize("sinks", [0, 2])
def test_one_period_is_H_equal_tables(sinks):
    plan = decode_plan(_settings(sinks=sinks), 4, capacity=8)
    assert plan.settings.period == (7, 7, 7, 7) and len(plan.groups) == 1 and plan.groups[0][1] is None
    for position in (0, 3, 9, 30, 31):
        slot, valid = plan.ring_slots(position)
        assert slot.shape == (4, plan.kind.shape[0])
        assert all(torch.equal(slot[h], slot[0]) for h in range(4))
        assert valid is None or all(torch.equal(valid[h], valid[0]) for h in range(4))
    idx, valid = block_slots(3, (7,) * 4, sinks, 3, 20, CPU)
    assert idx.shape == (4, 3 * plan.kind.shape[0]) and all(torch.equal(idx[h], idx[0]) for h in range(4))


def test_per_head_tables_are_each_periods_own():
    periods = (5, 2, 9, 5)  # 2 folds into the window: no skip slot of its own
    plan = decode_plan(_settings(period=periods, sinks=1), 4, capacity=10)
    assert [(periods[row], None if heads is None else heads.flatten().tolist()) for row, heads in plan.groups] == [
        (2, [False, True, False, False]), (5, [True, False, False, True]), (9, [False, False, True, False])]
    for position in (0, 4, 12, 40):
        slot, valid = plan.ring_slots(position)
        for h, period in enumerate(periods):
            alone, alone_valid = decode_plan(_settings(period=period, sinks=1), 1, capacity=10).ring_slots(position)
            own = slot[h] if valid is None else slot[h][valid[h, 0]]
            mine = alone[0] if alone_valid is None else alone[0][alone_valid[0, 0]]
            assert sorted(own.tolist()) == sorted(mine.tolist()), (position, h)


def test_a_plan_is_built_once_and_shared_by_copies():
    settings = _settings(period=(3, 7))
    plan = decode_plan(settings, 2, capacity=8)
    assert decode_plan(settings, 2, capacity=8) is plan
    assert copy.deepcopy(plan) is plan  # a copied layer shares its plans
    assert pickle.loads(pickle.dumps(plan)).settings == plan.settings
    assert isinstance(plan, DecodePlan) and plan.phases is not None and len(plan.phases) == 8


def test_the_ring_read_and_the_block_read_agree():
    """The same query read from a ring cache (`rows` with its position) and from a block of the same keys."""
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(1, 2, 25, 8, generator=g, dtype=torch.float64), torch.randn(1, 2, 25, 8, generator=g,
                                                                                   dtype=torch.float64)
    cache = RingCache(1, 2, 8, 10, sinks=1, dtype=torch.float64)
    cache.append(k, v)
    q = torch.randn(1, 4, 1, 8, generator=g, dtype=torch.float64)
    settings = _settings(variant="union", period=(5, 2, 9, 5), sinks=1)
    ring = decode_plan(settings, 4, capacity=cache.capacity).rows(q, cache.kv, None, None, cache.seen - 1)
    block = decode_plan(settings, 4).rows(q, (k, v), None)
    torch.testing.assert_close(ring, block, rtol=1e-12, atol=1e-12)
