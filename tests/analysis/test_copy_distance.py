"""Copy distances, their classes against reachability, and the paired bootstrap by class.

Distances are checked on strings worked out by hand and against `brute_distances`, a direct O(T²) loop
over the definition that shares no code with piattn.analysis.copy_distance.
"""

from __future__ import annotations

import random

import pytest
import torch

from piattn.analysis.copy_distance import (
    CLASSES,
    COPY_N,
    NO_MATCH,
    Reach,
    compare_by_class,
    copy_classes,
    copy_distances,
    lag_classes,
    local_reach,
    paired_class_stats,
    reach,
)
from piattn.analysis.multiscale import periods_per_layer


def windows(*texts: str) -> torch.Tensor:
    return torch.tensor([list(t.encode()) for t in texts])


def brute_distances(row: list[int], n: int) -> list[int]:
    """d(t) = t − s for the largest n <= s < t with row[s−n:s] == row[t−n:t], else −1."""
    out = []
    for t in range(len(row)):
        d = -1
        if t >= n:
            for s in range(t - 1, n - 1, -1):
                if row[s - n:s] == row[t - n:t]:
                    d = t - s
                    break
        out.append(d)
    return out


def codes_of(letters: str) -> list[int]:
    return [CLASSES.index(c) for c in letters]


# --- copy distances --------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "n", "expected"), [
    # Y's context "abcd" was last followed by X, 5 back; X's own "abcd" is the first one.
    ("abcdXabcdY", 4, [-1] * 9 + [5]),
    # n = 2: "ab", "bc", "cd" before positions 7, 8, 9 were seen before positions 2, 3, 4.
    ("abcdXabcdY", 2, [-1] * 7 + [5, 5, 5]),
    # The most recent match wins: the context "x" of position 5 follows positions 1 and 3; 3 is nearer.
    ("xaxaxax", 1, [-1, -1, -1, 2, 2, 2, 2]),
    # Position 1's context "a" has no earlier s >= n = 1 (position 0 has no context).
    ("aaaa", 1, [-1, -1, 1, 1]),
    ("aaaa", 2, [-1, -1, -1, 1]),
    ("abcab", 2, [-1, -1, -1, -1, -1]),
    ("abcabcab", 2, [-1, -1, -1, -1, -1, 3, 3, 3]),
])
def test_hand_made_distances(text, n, expected):
    assert copy_distances(windows(text), n).tolist() == [expected]


def test_matches_stay_within_their_window():
    # The second window alone would match "abcd" 5 back; the first window's copy is not visible to it.
    got = copy_distances(windows("abcdXabcdY", "ZZZZabcdQQ"), 4)
    assert got.tolist() == [[-1] * 9 + [5], [-1] * 10]


def test_default_n_and_dtype():
    assert COPY_N == 4
    got = copy_distances(windows("abcdXabcdY").to(torch.uint8))
    assert got.dtype == torch.long and got[0, 9] == 5


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("vocab", [2, 4, 256])
def test_against_brute_force(n, vocab):
    rng = random.Random(n * 1000 + vocab)
    for _ in range(4):
        length = rng.randint(1, 200)
        rows = [[rng.randrange(vocab) for _ in range(length)] for _ in range(3)]
        got = copy_distances(torch.tensor(rows), n)
        assert got.tolist() == [brute_distances(row, n) for row in rows]


@pytest.mark.parametrize(("n", "top"), [(3, 2**40), (8, 2**20), (2, 2**62)])
def test_large_vocabularies_stay_exact(n, top):
    # The packed n-gram would overflow int64, so the keys are ranked on the way: still exact. Few distinct
    # ids (repeats are needed to match), spread over a huge range.
    rng = random.Random(n)
    ids = [rng.randrange(top) for _ in range(3)]
    rows = [[rng.choice(ids) for _ in range(120)] for _ in range(2)]
    assert copy_distances(torch.tensor(rows), n).tolist() == [brute_distances(row, n) for row in rows]


def test_short_and_empty_windows():
    assert copy_distances(windows("abc"), 3).tolist() == [[-1, -1, -1]]
    assert copy_distances(windows("ab"), 4).tolist() == [[-1, -1]]
    assert copy_distances(torch.zeros(0, 10, dtype=torch.long), 4).shape == (0, 10)


@pytest.mark.parametrize(("tokens", "n", "match"), [
    (torch.zeros(10, dtype=torch.long), 4, "tokens must be a 2-D"),
    (torch.zeros(2, 10), 4, "tokens must be a int"),
    (torch.zeros(2, 10, dtype=torch.bool), 4, "tokens must be a int"),
    (torch.full((2, 10), -3), 4, "tokens must be >= 0"),
    ([[1, 2, 3]], 1, "tokens must be a 2-D"),
    (torch.zeros(2, 10, dtype=torch.long), 0, "n must be an int >= 1"),
    (torch.zeros(2, 10, dtype=torch.long), 2.0, "n must be an int >= 1"),
    (torch.zeros(2, 10, dtype=torch.long), True, "n must be an int >= 1"),
])
def test_copy_distances_bad_input(tokens, n, match):
    with pytest.raises(ValueError, match=match):
        copy_distances(tokens, n)


# --- classes ---------------------------------------------------------------------------------------

def test_lag_classes_on_a_hand_made_reach():
    # Local reaches 0 … 2; the kind reaches 0, 1, 2, 4, 7 and no further (span 7).
    kind = Reach(torch.tensor([1, 1, 1, 0, 1, 0, 0, 1, 0, 0], dtype=torch.bool), span=7)
    local = Reach(torch.tensor([1, 1, 1, 0, 0, 0, 0, 0, 0, 0], dtype=torch.bool), span=2)
    assert lag_classes(kind, local).tolist() == codes_of("AAACBCCBDD")
    # Against itself, local attention has no B and no C: it reaches everything below its span.
    assert lag_classes(local, local).tolist() == codes_of("AAADDDDDDD")


def test_lag_classes_from_the_schedules():
    # k = 2, π = 4, L = 2: hops {0, 1, 2, 4} twice reach 0 … 6 and 8 (not 7); local k = 2 reaches 0 … 4.
    kind = reach(2, periods_per_layer(4, 2, 1), 12)
    local = local_reach(2, 2, 12)
    assert (kind.span, local.span) == (8, 4)
    assert lag_classes(kind, local).tolist() == codes_of("AAAAABBCBDDDD")


def test_a_span_beyond_max_lag_keeps_the_gaps_in_c():
    # k = 5, π = 64, L = 4 on windows of 256: lags 198 … 255 are unreachable but below the span 256.
    kind = reach(5, periods_per_layer(64, 4, 1), 255)
    table = lag_classes(kind, local_reach(5, 4, 255))
    assert kind.span == 256 and not kind.reachable[198:].any()
    assert (table[198:] == CLASSES.index("C")).all()


def test_copy_classes_maps_distances():
    kind = Reach(torch.tensor([1, 1, 1, 0, 1, 0, 0, 1, 0, 0], dtype=torch.bool), span=7)
    local = Reach(torch.tensor([1, 1, 1, 0, 0, 0, 0, 0, 0, 0], dtype=torch.bool), span=2)
    distances = torch.tensor([[NO_MATCH, 1, 2, 3, 4], [5, 7, 8, 9, NO_MATCH]])
    assert copy_classes(distances, kind, local).tolist() == [codes_of("NAACB"), codes_of("CBDDN")]


def test_copy_classes_end_to_end():
    distances = copy_distances(windows("abcdXabcdY"), 4)
    codes = copy_classes(distances, reach(2, periods_per_layer(4, 2, 1), 9), local_reach(2, 2, 9))
    assert codes.tolist() == [codes_of("NNNNNNNNNB")]  # d = 5: beyond local 0 … 4, reached by 4 + 1


@pytest.mark.parametrize(("call", "match"), [
    (lambda: Reach(torch.ones(5), 3), "reachable must be a bool"),
    (lambda: Reach(torch.ones(5, dtype=torch.bool), -1), "span must be an int >= 0"),
    (lambda: local_reach(2, -1, 5), "n_layer must be an int >= 0"),
    (lambda: local_reach(-2, 2, 5), "window must be"),
    (lambda: reach(2, [[0]], 5), "must be an int >= 1"),
    (lambda: lag_classes(local_reach(2, 2, 5), local_reach(2, 2, 6)), "same lags"),
    (lambda: copy_classes(torch.tensor([[7]]), local_reach(2, 2, 6), local_reach(2, 2, 6)), "distances must lie"),
    (lambda: copy_classes(torch.tensor([[-2]]), local_reach(2, 2, 6), local_reach(2, 2, 6)), "distances must lie"),
    (lambda: copy_classes(torch.tensor([1]), local_reach(2, 2, 6), local_reach(2, 2, 6)), "distances must be a 2-D"),
])
def test_classes_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --- statistics ------------------------------------------------------------------------------------

def constructed(rows: int, length: int, shift: float, seed: int):
    """(loss, reference, codes): reference ~ U(0, 2); loss = reference + shift + N(0, 1) noise; codes
    uniform over the classes."""
    g = torch.Generator().manual_seed(seed)
    reference = 2 * torch.rand(rows, length, generator=g, dtype=torch.float64)
    loss = reference + shift + torch.randn(rows, length, generator=g, dtype=torch.float64)
    codes = torch.randint(len(CLASSES), (rows, length), generator=g)
    return loss, reference, codes


def width(stats) -> float:
    return stats.high - stats.low


def test_counts_and_means_match_a_direct_computation():
    loss, reference, codes = constructed(30, 40, 0.3, seed=1)
    stats = paired_class_stats(loss, reference, codes, n_resamples=50)
    for c, name in enumerate(CLASSES):
        here = codes == c
        assert stats[name].count == int(here.sum())
        assert stats[name].loss == pytest.approx(float(loss[here].mean()))
        assert stats[name].reference_loss == pytest.approx(float(reference[here].mean()))
        assert stats[name].diff == pytest.approx(float((loss - reference)[here].mean()))
        assert stats[name].low <= stats[name].diff <= stats[name].high


def test_interval_contains_the_true_difference():
    loss, reference, codes = constructed(200, 50, 0.3, seed=2)
    for s in paired_class_stats(loss, reference, codes).values():
        assert s.low < 0.3 < s.high
        assert s.low > 0  # ~2,000 bytes a class: the shift is resolved


def test_interval_covers_about_95_percent():
    hits = 0
    for seed in range(100):
        loss, reference, codes = constructed(20, 10, 0.3, seed=100 + seed)
        s = paired_class_stats(loss, reference, torch.zeros_like(codes), n_resamples=400, seed=seed)["A"]
        hits += s.low <= 0.3 <= s.high
    assert 85 <= hits <= 100


def test_interval_shrinks_with_more_windows():
    few = paired_class_stats(*constructed(50, 50, 0.3, seed=3))
    many = paired_class_stats(*constructed(800, 50, 0.3, seed=3))
    for name in CLASSES:
        # Sixteen times the windows: about a quarter of the width.
        assert width(many[name]) < 0.4 * width(few[name])


def test_deterministic_given_the_seed():
    data = constructed(40, 30, 0.3, seed=4)
    assert paired_class_stats(*data, seed=7) == paired_class_stats(*data, seed=7)
    assert paired_class_stats(*data, seed=7)["A"].low != paired_class_stats(*data, seed=8)["A"].low


def test_zero_difference_is_centred_on_zero():
    # Every window comes twice, once with the noise negated: the sample difference is exactly 0 in every
    # class, so the bootstrap distribution is centred on 0.
    loss, reference, codes = constructed(100, 50, 0.0, seed=5)
    noise = loss - reference
    loss, reference, codes = torch.cat([loss, reference - noise]), torch.cat([reference] * 2), torch.cat([codes] * 2)
    for s in paired_class_stats(loss, reference, codes).values():
        assert s.diff == pytest.approx(0, abs=1e-12)
        assert s.low < 0 < s.high
        assert s.high + s.low == pytest.approx(0, abs=0.2 * width(s))
    same = paired_class_stats(reference, reference, codes)
    assert all((s.diff, s.low, s.high) == (0, 0, 0) for s in same.values())


def test_windows_not_bytes_are_resampled():
    # Each window carries one shared offset: the bytes of a window are not independent, and an interval
    # over bytes would be far too narrow. With 40 windows, the width reflects the offsets' spread (sd 1
    # over 40 windows: about 2·1.96/√40 ≈ 0.6), not the bytes' (about 0.04).
    g = torch.Generator().manual_seed(6)
    reference = torch.zeros(40, 200, dtype=torch.float64)
    loss = torch.randn(40, 1, generator=g, dtype=torch.float64).expand(40, 200)
    s = paired_class_stats(loss, reference, torch.zeros(40, 200, dtype=torch.long))["A"]
    assert 0.4 < width(s) < 0.9


def test_groups_resample_documents():
    loss, reference, codes = constructed(60, 20, 0.3, seed=7)
    by_window = paired_class_stats(loss, reference, codes)
    # One window per document is the same as windows (labels need not be 0 … G − 1).
    assert paired_class_stats(loss, reference, codes, groups=torch.arange(60) * 3 + 11) == by_window
    # Each window duplicated as a second window of the same document: the same interval by documents.
    doubled = [torch.cat([x, x]) for x in (loss, reference, codes)]
    by_document = paired_class_stats(*doubled, groups=torch.arange(60).repeat(2))
    for name in CLASSES:
        assert by_document[name].low == pytest.approx(by_window[name].low)
        assert by_document[name].high == pytest.approx(by_window[name].high)


def test_scored_leaves_bytes_out():
    loss, reference, codes = constructed(30, 20, 0.3, seed=8)
    scored = torch.ones(30, 20, dtype=torch.bool)
    scored[:, :5] = False
    got = paired_class_stats(loss, reference, codes, scored=scored)
    want = paired_class_stats(loss[:, 5:], reference[:, 5:], codes[:, 5:])
    assert got == want


def test_an_empty_class_is_nan():
    loss, reference, codes = constructed(10, 10, 0.3, seed=9)
    s = paired_class_stats(loss, reference, torch.zeros_like(codes), n_resamples=20)["C"]
    assert s.count == 0 and all(x != x for x in (s.loss, s.diff, s.low, s.high))


def test_compare_by_class_per_kind_codes():
    loss, reference, codes = constructed(30, 20, 0.3, seed=10)
    other = torch.zeros_like(codes)
    table = compare_by_class({"local": reference, "pi": loss}, {"local": other, "pi": codes}, "local",
                             n_resamples=100, seed=3)
    assert table["pi"] == paired_class_stats(loss, reference, codes, n_resamples=100, seed=3)
    assert table["local"]["A"].count == 600 and table["local"]["A"].diff == 0
    assert table["local"]["A"].loss == pytest.approx(float(reference.mean()))
    shared = compare_by_class({"local": reference, "pi": loss}, codes, "local", n_resamples=100, seed=3)
    assert shared["pi"] == table["pi"]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"loss": torch.zeros(3, 4, dtype=torch.long)}, "loss must be a float"),
    ({"loss": torch.zeros(12)}, "loss must be a 2-D"),
    ({"reference_loss": torch.zeros(3, 5)}, "reference_loss must have the shape"),
    ({"codes": torch.full((3, 4), 5)}, "codes must lie in"),
    ({"codes": torch.zeros(3, 4)}, "codes must be a int"),
    ({"scored": torch.ones(3, 4)}, "scored must be a bool"),
    ({"groups": torch.zeros(2, dtype=torch.long)}, "groups must have one entry per window"),
    ({"n_resamples": 0}, "n_resamples must be an int >= 1"),
    ({"seed": -1}, "seed must be an int >= 0"),
    ({"level": 1.0}, "level must be a number in"),
    ({"level": True}, "level must be a number in"),
])
def test_stats_bad_input(kwargs, match):
    args = {"loss": torch.zeros(3, 4), "reference_loss": torch.zeros(3, 4),
            "codes": torch.zeros(3, 4, dtype=torch.long), **kwargs}
    loss, reference_loss, codes = args.pop("loss"), args.pop("reference_loss"), args.pop("codes")
    with pytest.raises(ValueError, match=match):
        paired_class_stats(loss, reference_loss, codes, **args)


def test_compare_by_class_bad_input():
    losses = {"local": torch.zeros(2, 3), "pi": torch.zeros(2, 3)}
    codes = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="reference must name a kind"):
        compare_by_class(losses, codes, "dense")
    with pytest.raises(ValueError, match="codes must have the kinds"):
        compare_by_class(losses, {"local": codes}, "local")
