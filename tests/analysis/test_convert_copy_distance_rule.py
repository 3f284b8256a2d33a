"""experiments/convert_copy_distance.py: the two-hop classes and the decision rule of docs/results.md §8b,
checked against hand-worked cases."""

import argparse
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))
ccd = pytest.importorskip("convert_copy_distance")


def _args(**overrides):
    args = argparse.Namespace(window=64, period=128, hops=2, context=1024)
    vars(args).update(overrides)
    return args


def test_two_hop_reach_of_single_pi_is_the_window_sums():
    # one hop reaches 0 … 64 and 128; two hops: 0 … 128, 128 … 192 and 256
    lags = ccd.arm_reach("pi", _args(), n_head=9, max_lag=1022).reachable.nonzero().flatten().tolist()
    assert lags == [*range(0, 193), 256]
    local = ccd.arm_reach("local", _args(), n_head=9, max_lag=1022).reachable.nonzero().flatten().tolist()
    assert local == list(range(0, 129))


def test_multiscale_periods_alternate_and_reach_every_lag_in_two_hops():
    periods = ccd.arm_period("multiscale", _args(), n_layer=30, n_head=9)
    assert len(periods) == 30 and periods[0] == periods[2] != periods[1] == periods[3]
    assert bool(ccd.arm_reach("multiscale", _args(), n_head=9, max_lag=1022).reachable.all())
    assert ccd.arm_period("local", _args(), 30, 9) == 1024 and ccd.arm_period("pi", _args(), 30, 9) == 128


def _row(diff, low, high):
    return {"diff": diff, "low": low, "high": high}


@pytest.mark.parametrize("dense_bcd, dense_b, kind_b, expected", [
    (_row(-0.4, -0.5, -0.3), _row(-0.4, -0.5, -0.3), _row(-0.2, -0.3, -0.1), "supported"),  # 50 %, below 0
    (_row(-0.4, -0.5, -0.3), _row(-0.4, -0.5, -0.3), _row(-0.05, -0.08, -0.01), "inconclusive"),  # 12.5 %
    (_row(-0.4, -0.5, -0.3), _row(-0.4, -0.5, -0.3), _row(-0.2, -0.3, +0.01), "refuted"),  # across 0
    (_row(-0.4, -0.5, -0.3), _row(-0.4, -0.5, -0.3), _row(+0.1, +0.05, +0.2), "refuted"),  # worse
    (_row(-0.1, -0.3, +0.1), _row(-0.4, -0.5, -0.3), _row(-0.2, -0.3, -0.1), "invalid"),  # dense across 0
])
def test_rule(dense_bcd, dense_b, kind_b, expected):
    v = ccd.verdict(dense_bcd, dense_b, kind_b)
    assert v["verdict"] == expected
    assert math.isclose(v["recovered"], -kind_b["diff"] / -dense_b["diff"])
