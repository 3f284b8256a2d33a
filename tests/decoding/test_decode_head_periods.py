"""The decoding plans with per-head periods (multi-scale π): `DecodePlan.rows` (a few new rows) and
`decode_ring` (one new row read from a ring cache) take one period per query head themselves, every head over
its own slot table in `ops/pi` (not in the layers), with grouped-query heads, sinks, every variant and the gate's
last layer; their rows equal the full operator's, and bad per-head periods are a one-line ValueError."""

from __future__ import annotations

import pytest
import torch

from piattn.config import PI_DEFAULTS
from piattn.config.pi import GATED_VARIANTS, VARIANTS
from piattn.decoding.cache import RingCache
from piattn.ops.pi import pi_attention
from piattn.ops.pi.decode import decode_ring, decode_settings, gate_tail
from piattn.ops.pi.settings import OpSettings
from utils import decode_rows

PERIODS = (5, 2, 9, 5)  # 2 folds into the window; heads 0 and 3 share a period across key/value groups
SETTINGS = dict(window=3, prior=0.3, logit_clamp=4.0, eps=1e-4)


def _inputs(N: int, H_kv: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = 3 * torch.randn(2, 4, N, 8, generator=g, dtype=torch.float64)
    k = 3 * torch.randn(2, H_kv, N, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, H_kv, N, 8, generator=g, dtype=torch.float64)
    gate = 0.01 + 0.98 * torch.rand(2, 4, N, generator=g, dtype=torch.float64)
    return q, k, v, gate


def _settings(*, scale, **pi) -> OpSettings:
    """The decoding functions' settings for `pi_attention`'s keywords `pi` (the defaults for the rest), built
    as-is: the functions check them."""
    return decode_settings(PI_DEFAULTS, scale)._replace(**pi)


def _ring(k: torch.Tensor, v: torch.Tensor, sinks: int) -> RingCache:
    cache = RingCache(k.shape[0], k.shape[1], k.shape[3], max(SETTINGS["window"], *PERIODS) + 1, sinks=sinks,
                      dtype=k.dtype)
    cache.append(k, v)
    return cache


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("H_kv", [1, 2, 4])
@pytest.mark.parametrize("sinks", [0, 2])
def test_per_head_periods_equal_the_full_operator(variant, H_kv, sinks):
    kw = dict(SETTINGS, variant=variant, sinks=sinks)
    gated = variant in GATED_VARIANTS
    for N in (1, 4, 11, 30):
        q, k, v, gate = _inputs(N, H_kv, seed=N + 10 * H_kv)
        full = pi_attention(q, k, v, gate if gated else None, causal=True, period=PERIODS, **kw)
        for t in {1, min(3, N)}:
            rows = decode_rows(q[:, :, -t:], k, v, gate[:, :, -t:] if gated else None,
                                _settings(period=PERIODS, scale=8**-0.5, **kw))
            torch.testing.assert_close(rows, full[:, :, -t:], rtol=1e-12, atol=1e-12, msg=f"rows t={t} N={N}")
        cache = _ring(k, v, sinks)
        ring = decode_ring(q[:, :, -1:], cache.kv, gate[:, :, -1:] if gated else None,
                           _settings(period=PERIODS, scale=8**-0.5, **kw), capacity=cache.capacity, position=N - 1)
        torch.testing.assert_close(ring, full[:, :, -1:], rtol=1e-12, atol=1e-12, msg=f"ring N={N}")


def test_per_head_periods_cut_the_gate_head_per_period():
    """With gate_head the gate is the MLP's hidden layer, shared by all heads, and its last layer's rows are cut
    per period: equal to handing the α it gives."""
    q, k, v, _ = _inputs(20, 2, seed=3)
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 3, 6, generator=g, dtype=torch.float64)
    weight, bias = torch.randn(4, 6, generator=g, dtype=torch.float64), torch.randn(4, generator=g, dtype=torch.float64)
    eps = SETTINGS["eps"]
    alpha = eps + (1 - 2 * eps) * gate_tail(hidden, weight, bias).transpose(1, 2)  # α as the step computes it
    settings = _settings(**SETTINGS, variant="adaptive", period=PERIODS, scale=8**-0.5)
    rows = decode_rows(q[:, :, -3:], k, v, hidden, settings, gate_head=(weight, bias))
    torch.testing.assert_close(rows, decode_rows(q[:, :, -3:], k, v, alpha, settings), rtol=1e-12, atol=1e-12)
    cache = _ring(k, v, 0)
    ring = dict(capacity=cache.capacity, position=19)
    torch.testing.assert_close(decode_ring(q[:, :, -1:], cache.kv, hidden[:, -1:], settings, gate_head=(weight, bias),
                                           **ring),
                               decode_ring(q[:, :, -1:], cache.kv, alpha[:, :, -1:], settings, **ring), rtol=1e-12,
                               atol=1e-12)


@pytest.mark.parametrize("period, message", [
    ((5, 2, 9), r"^period has 3 entries; per-head periods need one per query head, H=4$"),
    ((5, 0, 9, 5), r"^period\[1\] must be an int >= 1, got 0; period must be an int >= 1 or a sequence"),
    ((5, 2, 30, 5), r"^capacity must be an int >= max\(window, period\) \+ 1 = 31"),
])
def test_bad_per_head_periods_are_a_one_line_value_error(period, message):
    q, k, v, _ = _inputs(40, 2, seed=0)
    cache = _ring(k, v, 0)
    with pytest.raises(ValueError, match=message):
        decode_ring(q[:, :, -1:], cache.kv, None, _settings(period=period, variant="union", scale=1.0, **SETTINGS),
                    capacity=cache.capacity, position=39)
