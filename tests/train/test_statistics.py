"""Paired differences and their t-intervals (`piattn.train.statistics`); `piattn eval --compare` end to end
is tests/train/test_eval_positions.py."""

from __future__ import annotations

import pytest
import torch

from piattn.train.statistics import paired_differences, paired_interval, t_quantile_975


@pytest.mark.parametrize(("df", "table"), [(1, 12.7062), (2, 4.3027), (3, 3.1824), (5, 2.5706), (10, 2.2281),
                                           (30, 2.0423), (120, 1.9799)])
def test_t_quantile_matches_the_table(df, table):
    assert t_quantile_975(df) == pytest.approx(table, rel=2e-3)


def test_interval_is_the_mean_plus_minus_t_times_the_standard_error():
    d = torch.tensor([1.0, 2.0, 3.0, 6.0], dtype=torch.float64)
    half = t_quantile_975(3) * d.std().item() / 2
    assert paired_interval(d) == pytest.approx({"difference": 3.0, "low": 3.0 - half, "high": 3.0 + half})


def test_the_whole_difference_weighs_each_bin_by_its_positions():
    a = torch.tensor([[1.0, 4.0], [2.0, 2.0], [0.0, 3.0]], dtype=torch.float64)
    b = torch.zeros_like(a)
    total, by_bin = paired_differences(a, b, torch.tensor([1.0, 3.0], dtype=torch.float64))
    assert [d["difference"] for d in by_bin] == pytest.approx([1.0, 3.0])
    assert total["difference"] == pytest.approx((13 / 4 + 8 / 4 + 9 / 4) / 3)
    same, _ = paired_differences(a, a, torch.ones(2, dtype=torch.float64))
    assert same == {"difference": 0.0, "low": 0.0, "high": 0.0}
