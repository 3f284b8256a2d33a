"""The reach task: the answer sits exactly `lag` back, nothing else informs it, and `reachable` agrees with
the boolean powers of the attention pattern (`reachability_mask`) on a real sequence."""

from __future__ import annotations

import itertools

import pytest
import torch

from piattn.analysis import reachability_mask
from piattn.data import reach


def test_layout_and_target():
    tokens, targets, query_pos = reach.generate(64, seq_len=40, lag=13, vocab=8, seed=0)
    assert tokens.shape == (64, 40) and tokens.dtype == torch.int64
    assert targets.shape == (64,) and targets.dtype == torch.int64
    assert query_pos == 39
    assert (tokens[:, query_pos] == 8).all()  # the query marker
    assert tokens[:, :query_pos].min() >= 0 and tokens[:, :query_pos].max() < 8
    for row in range(64):
        assert targets[row] == tokens[row, query_pos - 13]


def test_deterministic_per_seed():
    a = reach.generate(4, 20, 5, seed=3)
    b = reach.generate(4, 20, 5, seed=3)
    c = reach.generate(4, 20, 5, seed=4)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def best_lookup_accuracy(column: torch.Tensor, targets: torch.Tensor, vocab: int) -> float:
    """Accuracy of the best map token -> answer fitted on the data itself (optimistic for the map)."""
    counts = torch.zeros(vocab + 1, vocab, dtype=torch.int64)
    counts.index_put_((column, targets), torch.ones_like(targets), accumulate=True)
    return counts.max(dim=1).values.sum().item() / len(targets)


def test_only_the_lagged_position_informs_the_target():
    vocab, lag = 4, 9
    tokens, targets, query_pos = reach.generate(4000, seq_len=24, lag=lag, vocab=vocab, seed=1)
    assert torch.bincount(targets, minlength=vocab).min() > 0.9 * 4000 / vocab  # chance is 1/vocab
    for pos in range(24):
        accuracy = best_lookup_accuracy(tokens[:, pos], targets, vocab)
        if pos == query_pos - lag:
            assert accuracy == 1.0
        else:
            assert accuracy < 1 / vocab + 0.05, f"position {pos} predicts the target ({accuracy:.3f})"


@pytest.mark.parametrize("causal", [True, False])
def test_reachable_matches_the_reachability_mask(causal):
    for window, period, lag, layers in itertools.product([0, 1, 3], [None, 1, 2, 5, 8], range(1, 20), range(5)):
        # The query is the last position; leave period - 1 positions before the answer (see `reachable`).
        n = lag + (period or 1)
        mask = reachability_mask(n, window, period, layers, causal=causal)
        expected = bool(mask[n - 1, n - 1 - lag])
        assert reach.reachable(lag, window, period, layers, causal=causal) == expected, (window, period, lag, layers)


def test_reachable_examples():
    assert reach.reachable(16, window=4, period=16, layers=1)
    assert not reach.reachable(15, window=4, period=16, layers=3)  # b·π may not overshoot causally: 4 layers
    assert reach.reachable(15, window=4, period=16, layers=4)
    assert reach.reachable(15, window=4, period=16, layers=2, causal=False)  # back 16, forward 1
    assert reach.reachable(12, window=4, period=None, layers=3)
    assert not reach.reachable(13, window=4, period=None, layers=3)


@pytest.mark.parametrize("kwargs", [dict(lag=0), dict(lag=10), dict(seq_len=1, lag=1), dict(vocab=1),
                                    dict(n=-1), dict(lag=2.0)])
def test_bad_arguments_raise(kwargs):
    args = dict(n=2, seq_len=10, lag=3) | kwargs
    with pytest.raises(ValueError):
        reach.generate(**args)
    with pytest.raises(ValueError, match="layers"):
        reach.reachable(3, window=2, period=4, layers=-1)
