"""Reachability with sinks: the stated rule and the matrix powers against breadth-first search."""

import pytest
import torch

from piattn.analysis import reachability_mask, reachability_with_sinks, sink_reach_depth


def keys_of(i, n, window, period, sinks, causal):
    """The keys query i reads, written from the definition (not from piattn.masks)."""
    offsets = set(range(-window, 1 if causal else window + 1))
    if period is not None:
        offsets |= {-period} if causal else {-period, period}
    keys = {i + o for o in offsets if 0 <= i + o < n}
    keys |= {s for s in range(min(sinks, n)) if not causal or s <= i}
    return keys


def bfs(n, window, period, layers, sinks, causal):
    """bool [n, n]: [i, j] = j reaches i, by one breadth-first pass per source j over `layers` steps."""
    readers = [set() for _ in range(n)]  # readers[m]: the queries that read key m
    for i in range(n):
        for m in keys_of(i, n, window, period, sinks, causal):
            readers[m].add(i)
    out = torch.zeros(n, n, dtype=torch.bool)
    for j in range(n):
        reached = {j}
        for _ in range(layers):
            reached = reached | {i for m in reached for i in readers[m]}
        out[sorted(reached), j] = True
    return out


CASES = [(n, w, p, s, c) for n in (13, 30) for w, p in ((1, 4), (2, 5), (3, 3), (0, 7), (2, None))
         for s in (1, 3) for c in (True, False)]


@pytest.mark.parametrize("n,window,period,sinks,causal", CASES)
def test_rule_and_matrix_powers_agree_with_breadth_first_search(n, window, period, sinks, causal):
    for layers in (0, 1, 2, 3, 5):
        expected = bfs(n, window, period, layers, sinks, causal)
        assert torch.equal(reachability_mask(n, window, period, layers, causal, sinks=sinks), expected)
        assert torch.equal(reachability_with_sinks(n, window, period, layers, sinks, causal), expected), layers


def test_causal_sinks_are_hubs_for_the_first_tokens_only():
    n, w, p, s = 40, 2, 5, 3
    plain = reachability_mask(n, w, p, 1, causal=True)
    with_sinks = reachability_mask(n, w, p, 1, causal=True, sinks=s)
    assert with_sinks[:, :s].equal(torch.ones(n, s, dtype=torch.bool).tril())  # one layer: every later query
    assert with_sinks[:, s:].equal(plain[:, s:])  # later tokens: exactly what they reached without sinks
    assert sink_reach_depth(n, w, p, s, causal=True) == [1] * s + [None] * (n - s)


def test_bidirectional_sinks_connect_everything_after_two_layers_near_them():
    n, w, p, s = 60, 1, 30, 2
    depth = sink_reach_depth(n, w, p, s, causal=False)
    assert depth[:s] == [1] * s and depth[s] == 2 and depth[p] == 2  # in a sink's window, at a sink's +π
    assert reachability_mask(n, w, p, max(depth), causal=False, sinks=s).all()
    two = reachability_mask(n, w, p, 2, causal=False, sinks=s)
    assert two[:, s].all() and two[:, p].all()  # the far end included, which without sinks is far away
    assert not reachability_mask(n, w, p, 2, causal=False)[n - 1, s]


def test_sinks_must_be_a_count():
    with pytest.raises(ValueError, match="sinks"):
        reachability_mask(10, 2, 5, 1, sinks=-1)


def test_the_report_and_the_command_show_the_sinks(capsys, tmp_path):
    from piattn.analysis.report import reach_summary
    from piattn.cli import main

    causal = reach_summary(48, 4, 16, 6, sinks=2)["with_sinks"]
    assert causal["tokens_through_sinks"] == {"local": 2, "pi": 2} and causal["hub_depth"]["pi"] is None
    bidirectional = reach_summary(48, 4, 16, 6, causal=False, sinks=2)["with_sinks"]
    assert bidirectional["coverage"]["pi"] == 1.0 and bidirectional["hub_depth"]["pi"] <= 6
    assert "with_sinks" not in reach_summary(48, 4, 16, 6)
    main(["reach", "--sinks", "2", "--bidirectional", "--out", str(tmp_path / "rf.png")])
    assert "with 2 sink key(s)" in capsys.readouterr().out
