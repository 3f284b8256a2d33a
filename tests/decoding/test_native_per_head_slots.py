"""Per-head periods in one call of the compiled step (a plan's tables, `DecodePlan.ring_slots` over a ring,
`decode_slots.block_slots` over a block of keys; `slot_sh` in decode_step.c): each head over its own slot table
gives, bit for bit, the rows that head gets from the call of its own period alone; heads whose period lies within
the window (no skip slot of their own) and skips not yet reached included, for every prior form, fp64 and fp32,
with grouped heads, sinks and a ring still growing."""

from __future__ import annotations

import pytest
import torch

import piattn.ops.pi.decode_native as decode_native
import piattn.ops.pi.decode_plan as plans
from piattn.config import PI_DEFAULTS
from piattn.ops.pi.decode_plan import decode_plan, decode_settings
from utils import compiled_rows

pytestmark = pytest.mark.usefixtures("native_step_built")

EPS = 1e-3
CASES = [  # B, H, H_kv, D, window, periods, sinks, capacity, positions
    (2, 4, 2, 8, 3, (5, 8, 2, 13), 0, 14, (0, 2, 6, 12, 13, 40, 41)),
    (1, 6, 3, 5, 2, (3, 3, 7, 1, 9, 4), 2, 12, (0, 1, 3, 8, 11, 30)),
    (3, 2, 1, 4, 4, (6, 10), 1, 11, (0, 5, 9, 10, 25)),
    (1, 3, 3, 8, 3, (2, 3, 1), 2, 5, (0, 4, 9)),  # every period within the window: no skip slot at all
]


def _inputs(B, H, H_kv, D, N, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = 3 * torch.randn(B, H, 1, D, generator=g, dtype=dtype)  # scores beyond the clamp
    kv = torch.randn(2, B, H_kv, N, D, generator=g, dtype=dtype)
    kv[0] *= 3
    alpha = 0.01 + 0.98 * torch.rand(B, H, 1, generator=g, dtype=dtype)
    hidden = 2 * torch.randn(B, 1, 6, generator=g, dtype=dtype)
    head = torch.randn(H, 6, generator=g, dtype=dtype), torch.randn(H, generator=g, dtype=dtype)
    return q, kv, alpha, hidden, head


VARIANT = {"alpha": "adaptive", "hidden": "adaptive", "fixed": "fixed", "union": "union"}


def _plan(window, periods, sinks, capacity, H, form, D):
    """The ring plan of these settings for the prior form `form` (one period, or one per query head)."""
    settings = decode_settings(PI_DEFAULTS, D ** -0.5)._replace(window=window, period=periods, sinks=sinks,
                                                                variant=VARIANT[form], prior=0.3, logit_clamp=4.0,
                                                                eps=EPS)
    return decode_plan(settings, H, capacity=capacity)


def _gate(form, alpha, hidden, head, rows=slice(None)):
    """The gate and gate layers of the compiled step for the prior form `form`, for the query heads `rows`."""
    if form == "alpha":
        return alpha[:, rows].contiguous(), None
    if form == "hidden":
        return hidden, (head[0][rows].contiguous(), head[1][rows].contiguous())
    return None, None


@pytest.fixture(params=["tables by phase", "arithmetic"])
def steady_slots(request, monkeypatch):
    """Both ways a ring plan gives a long generation's tables: a table per phase of the ring (`DecodePlan.phases`),
    or the tensor ops of a ring too large for that (here forced, by a limit of 0 bytes)."""
    if request.param == "arithmetic":
        monkeypatch.setattr(plans, "STEADY_SLOTS_BYTES", 0)
    plans._plan.cache_clear()
    yield request.param
    plans._plan.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("form", ["alpha", "hidden", "fixed", "union"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_one_call_over_per_head_slots_is_each_head_alone_bit_for_bit(case, form, dtype, steady_slots):
    B, H, H_kv, D, window, periods, sinks, capacity, positions = CASES[case]
    N = sinks + capacity
    q, kv, alpha, hidden, head = _inputs(B, H, H_kv, D, N, dtype, seed=case)
    group = H // H_kv
    plan = _plan(window, periods, sinks, capacity, H, form, D)
    assert (plan.phases is None) == (steady_slots == "arithmetic")
    for position in positions:
        # a ring still growing holds only the rows up to the position (as a Hugging Face PiCache's does)
        rows = kv[:, :, :, :sinks + min(capacity, position + 1)].contiguous()
        slot, valid = plan.ring_slots(position)
        assert slot.shape[0] == H and slot.shape[1] == plan.kind.shape[0]
        y = decode_native.run(plan, q, rows, slot, valid, *_gate(form, alpha, hidden, head))
        assert y is not None and y.shape == (B, H, 1, D)
        for h, period in enumerate(periods):
            # head h alone: its own period's slots, over its own key/value head, as a call of one head
            alone_plan = _plan(window, period, sinks, capacity, 1, form, D)
            s_h, v_h = alone_plan.ring_slots(position)
            kv_h = rows[:, :, h // group:h // group + 1].contiguous()
            alone = decode_native.run(alone_plan, q[:, h:h + 1], kv_h, s_h, v_h,
                                      *_gate(form, alpha, hidden, head, slice(h, h + 1)))
            assert torch.equal(y[:, h], alone[:, 0]), (position, h, period)


def test_per_head_slots_refuse_a_table_of_the_wrong_number_of_heads():
    q, kv, alpha, _, _ = _inputs(1, 4, 2, 8, 14, torch.float64, seed=0)
    plan = _plan(3, (5, 8, 6), 0, 14, 3, "union", 8)  # three tables, four heads
    slot, valid = plan.ring_slots(20)
    with pytest.raises(ValueError, match="per-head slot tables must be"):
        decode_native.run(plan, q, kv, slot, valid, None, None)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("t", [1, 2, 4])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_a_few_queries_over_per_head_slots_are_each_head_alone_bit_for_bit(case, t, dtype):
    """The same for steps of t tokens over a block of keys (`DecodePlan.rows`, `decode_slots.block_slots`): one
    call, each head's rows those of its own period's call (a plan of one period)."""
    B, H, H_kv, D, window, periods, sinks, _, _ = CASES[case]
    q, kv, alpha, _, _ = _inputs(B, H, H_kv, D, 23, dtype, seed=case)
    q = q.expand(B, H, t, D).contiguous() + torch.arange(t, dtype=dtype)[:, None]  # t different queries
    gate = alpha.expand(B, H, t).contiguous()
    k, v = kv[0], kv[1]
    settings = decode_settings(PI_DEFAULTS, D ** -0.5)._replace(window=window, period=periods, sinks=sinks,
                                                                logit_clamp=4.0, eps=EPS)
    y = compiled_rows(q, k, v, gate, settings)
    assert y is not None and y.shape == (B, H, t, D)
    group = H // H_kv
    for h, period in enumerate(periods):
        alone = compiled_rows(q[:, h:h + 1], k[:, h // group:h // group + 1], v[:, h // group:h // group + 1],
                              gate[:, h:h + 1], settings._replace(period=period))
        assert torch.equal(y[:, h], alone[:, 0]), (h, period)
