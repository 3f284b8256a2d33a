"""Per-head periods in one call of the compiled step (`decode.per_head_ring_slots` over a ring,
`decode._per_head_slots` over a block of keys; `slot_sh` in decode_step.c): each head over its own slot table
gives, bit for bit, the rows that head gets from the call of its own period alone; heads whose period lies within
the window (no skip slot of their own) and skips not yet reached included, for every prior form, fp64 and fp32,
with grouped heads, sinks and a ring still growing."""

from __future__ import annotations

import pytest
import torch

import piattn.ops.pi.decode as decode
import piattn.ops.pi.native as native
from piattn.config import PI_DEFAULTS
from piattn.ops.pi.decode import (
    _compiled_per_head_rows,
    _compiled_rows,
    decode_settings,
    per_head_ring_slots,
    ring_slots,
)

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


def _prior(form, alpha, hidden, head, rows=slice(None)):
    """The prior mode and its arguments of `native._rows_step_unchecked` for the query heads `rows`."""
    if form == "alpha":
        return dict(prior_mode=native.PRIOR_ALPHA, gate=alpha[:, rows].contiguous())
    if form == "hidden":
        return dict(prior_mode=native.PRIOR_HIDDEN, gate=hidden, gate_weight=head[0][rows].contiguous(),
                    gate_bias=head[1][rows].contiguous())
    if form == "fixed":
        return dict(prior_mode=native.PRIOR_CONST, log_priors=(-0.2, -1.7))
    return dict(prior_mode=native.PRIOR_NONE)


@pytest.fixture(params=["tables by phase", "arithmetic"])
def steady_slots(request, monkeypatch):
    """Both ways `per_head_ring_slots` gives a long generation's tables: a table per phase of the ring
    (`_steady_slots`), or the tensor ops of a ring too large for that (here forced, by a limit of 0 bytes)."""
    if request.param == "arithmetic":
        monkeypatch.setattr(decode, "STEADY_SLOTS_BYTES", 0)
    decode._steady_slots.cache_clear()
    yield request.param
    decode._steady_slots.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("form", ["alpha", "hidden", "fixed", "union"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_one_call_over_per_head_slots_is_each_head_alone_bit_for_bit(case, form, dtype, steady_slots):
    B, H, H_kv, D, window, periods, sinks, capacity, positions = CASES[case]
    N = sinks + capacity
    q, kv, alpha, hidden, head = _inputs(B, H, H_kv, D, N, dtype, seed=case)
    common = dict(logit_clamp=4.0, eps=EPS, scale=D ** -0.5)
    group = H // H_kv
    for position in positions:
        # a ring still growing holds only the rows up to the position (as a Hugging Face PiCache's does)
        rows = kv[:, :, :, :sinks + min(capacity, position + 1)].contiguous()
        slot, valid, kind, _, _ = per_head_ring_slots(window, periods, sinks, capacity, position, q.device)
        assert slot.shape[0] == H and slot.shape[1] == kind.shape[0]
        y = native._rows_step_unchecked(q, rows, slot, valid, kind, **_prior(form, alpha, hidden, head), **common)
        assert y is not None and y.shape == (B, H, 1, D)
        for h, period in enumerate(periods):
            # head h alone: its own period's slots, over its own key/value head, as a call of one head
            s_h, v_h, k_h, _, _ = ring_slots(window, period, sinks, capacity, position, q.device)
            kv_h = rows[:, :, h // group:h // group + 1].contiguous()
            alone = native._rows_step_unchecked(q[:, h:h + 1], kv_h, s_h, v_h, k_h,
                                                **_prior(form, alpha, hidden, head, slice(h, h + 1)), **common)
            assert torch.equal(y[:, h], alone[:, 0]), (position, h, period)


def test_per_head_slots_refuse_a_table_of_the_wrong_number_of_heads():
    q, kv, alpha, _, _ = _inputs(1, 4, 2, 8, 14, torch.float64, seed=0)
    slot, valid, kind, _, _ = per_head_ring_slots(3, (5, 8, 6), 0, 14, 20, q.device)  # three tables, four heads
    with pytest.raises(ValueError, match="per-head slot tables must be"):
        native._rows_step_unchecked(q, kv, slot, valid, kind, prior_mode=native.PRIOR_NONE, logit_clamp=None,
                                    eps=EPS, scale=1.0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("t", [1, 2, 4])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_a_few_queries_over_per_head_slots_are_each_head_alone_bit_for_bit(case, t, dtype):
    """The same for steps of t tokens over a block of keys (`_compiled_per_head_rows`, `_per_head_slots`): one
    call, each head's rows those of its own period's call (`_compiled_rows` with one period)."""
    B, H, H_kv, D, window, periods, sinks, _, _ = CASES[case]
    q, kv, alpha, _, _ = _inputs(B, H, H_kv, D, 23, dtype, seed=case)
    q = q.expand(B, H, t, D).contiguous() + torch.arange(t, dtype=dtype)[:, None]  # t different queries
    gate = alpha.expand(B, H, t).contiguous()
    k, v = kv[0], kv[1]
    settings = decode_settings(PI_DEFAULTS, D ** -0.5)._replace(window=window, period=periods, sinks=sinks,
                                                                logit_clamp=4.0, eps=EPS)
    y = _compiled_per_head_rows(q, k, v, gate, None, settings)
    assert y is not None and y.shape == (B, H, t, D)
    group = H // H_kv
    for h, period in enumerate(periods):
        alone = _compiled_rows(q[:, h:h + 1], k[:, h // group:h // group + 1], v[:, h // group:h // group + 1],
                               gate[:, h:h + 1], settings._replace(period=period))
        assert torch.equal(y[:, h], alone[:, 0]), (h, period)
