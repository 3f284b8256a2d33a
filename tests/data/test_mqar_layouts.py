"""MQAR's distances that no single offset serves (issue 59): a packed bin that leaves one distance is refused, the
scattered layout draws the whole bin, the lags control draws only the lags it is given."""

import pytest
import torch

from piattn.data.mqar import IGNORE, _windows, check, distance_spread, mqar_batch, mqar_mix, single_distance, spans


def batch(seed: int, n_examples: int = 4, **kwargs) -> dict:
    return mqar_batch(n_examples, generator=torch.Generator().manual_seed(seed), **kwargs)


def decode(tokens: list[int], targets: list[int], distance: list[int], n_pairs: int, key_vocab: int,
           value_vocab: int) -> list[int]:
    """Every property of one example of either layout, decoded from the tokens alone; its distances."""
    filler = key_vocab + value_vocab
    scored = [p for p, t in enumerate(targets) if t != IGNORE]
    assert scored == [p for p, d in enumerate(distance) if d != -1] and len(scored) == n_pairs
    used: set[int] = set()
    keys, drawn = [], []
    for q in scored:
        key = tokens[q]
        assert 0 <= key < key_vocab
        p = tokens.index(key)  # the pair: the key's first occurrence, its value after it
        assert p < q and tokens[q + 1] == filler  # the answer is never written after its query
        assert key_vocab <= tokens[p + 1] < filler and targets[q] == tokens[p + 1]
        assert distance[q] == q - p
        assert not used & {p, p + 1, q, q + 1}  # no position used twice
        used |= {p, p + 1, q, q + 1}
        keys.append(key)
        drawn.append(q - p)
    assert len(set(keys)) == n_pairs  # keys distinct, each queried once
    assert [t for p, t in enumerate(tokens) if p not in used] == [filler] * (len(tokens) - 4 * n_pairs)
    return drawn


def all_distances(out: dict) -> list[int]:
    return out["distance"][out["distance"] >= 0].tolist()


# --- the packed layout: a bin that leaves one distance -------------------------------------------------

def test_packed_bin_of_short_distances_that_leaves_one_distance_is_refused():
    # 4 pairs fill [0, 8): pair 0's query is at >= 8, and the bin 2-8 then leaves every pair at distance 8
    assert single_distance(64, 4, (2, 8)) == 8
    for call in (lambda: check(64, 4, key_vocab=16, value_vocab=16, distance_bin=(2, 8)),
                 lambda: batch(0, seq_len=64, n_pairs=4, key_vocab=16, value_vocab=16, distance_bin=(2, 8))):
        with pytest.raises(ValueError, match=r"^distance_bin \(2, 8\) puts every query at distance 8") as err:
            call()
        assert "\n" not in str(err.value) and "layout='scattered'" in str(err.value)
    # a full sequence: the queries fill [6, 12) in pair order
    with pytest.raises(ValueError, match="distance_bin"):
        check(12, 3, key_vocab=3, value_vocab=3, distance_bin=(6, 10))


def test_packed_bins_that_leave_two_distances_or_ask_for_one_are_kept():
    assert single_distance(64, 4, (2, 9)) is None  # pair 0 at 8 or 9
    assert single_distance(8, 2, (4, 4)) is None  # lo = hi asks for one distance
    assert single_distance(64, 4, None) is None
    assert sorted(set(all_distances(batch(0, 200, seq_len=64, n_pairs=4, key_vocab=16, value_vocab=16,
                                          distance_bin=(2, 9))))) == [8, 9]


def placements(seq_len: int, n_pairs: int, distance_bin) -> set[tuple[int, ...]]:
    """Every packed placement's distances, by enumeration."""
    first, last = _windows(seq_len, n_pairs, distance_bin)
    found = set()

    def extend(i: int, taken: frozenset, queries: tuple):
        if i == n_pairs:
            found.add(tuple(q - 2 * j for j, q in enumerate(queries)))
            return
        for q in range(first[i], last[i] + 1):
            if q not in taken and q + 1 not in taken:
                extend(i + 1, taken | {q, q + 1}, (*queries, q))

    extend(0, frozenset(), ())
    return found


def test_single_distance_is_exact_against_every_placement():
    cases = 0
    for seq_len in range(4, 17):
        for n_pairs in range(1, seq_len // 4 + 1):
            bins = [(lo, hi) for lo in range(1, seq_len - 1) for hi in range(lo + 1, seq_len - 1)]
            for distance_bin in [None, *bins]:
                found = placements(seq_len, n_pairs, distance_bin)
                if not found:
                    continue
                distances = {d for p in found for d in p}
                assert single_distance(seq_len, n_pairs, distance_bin) == (
                    distances.pop() if len(distances) == 1 else None), (seq_len, n_pairs, distance_bin)
                cases += 1
    assert cases > 1000


# --- the scattered layout ------------------------------------------------------------------------------

@pytest.mark.parametrize("settings", [
    dict(seq_len=64, n_pairs=4, distance_bin=(2, 8)),  # the bin that packed puts at 8 only
    dict(seq_len=64, n_pairs=8, distance_bin=(2, 8)),
    dict(seq_len=32, n_pairs=4, distance_bin=(3, 5)),
    dict(seq_len=64, n_pairs=4, distance_bin=(9, 16)),
    dict(seq_len=128, n_pairs=4, distance_bin=(33, 56)),
    dict(seq_len=64, n_pairs=14),  # anywhere, 8 positions of filler left
    dict(seq_len=64, n_pairs=4),
])
def test_scattered_draws_the_whole_bin_and_no_distance_dominates(settings):
    lo, hi = settings.get("distance_bin", (2, settings["seq_len"] - 2))
    out = batch(0, 400, key_vocab=16, value_vocab=16, layout="scattered", **settings)
    drawn = []
    for row in range(400):
        drawn += decode(out["tokens"][row].tolist(), out["targets"][row].tolist(), out["distance"][row].tolist(),
                        settings["n_pairs"], 16, 16)
    assert all(lo <= d <= hi for d in drawn)
    spread = distance_spread(out)
    assert spread["queries"] == len(drawn) and sum(spread["counts"].values()) == len(drawn)
    assert spread["commonest_share"] <= 0.6 and spread["distinct"] >= 2
    if hi - lo < 20:  # a narrow bin: every distance of it drawn, none far from its uniform share
        assert sorted(spread["counts"]) == list(range(max(lo, 2), hi + 1))
        assert spread["commonest_share"] <= 2 / (hi - max(lo, 2) + 1)


def test_scattered_draws_distances_per_pair_within_a_sequence():
    out = batch(1, 200, seq_len=64, n_pairs=4, key_vocab=16, value_vocab=16, layout="scattered",
                distance_bin=(2, 8))
    per_row = [len(set(out["distance"][row][out["distance"][row] >= 0].tolist())) for row in range(200)]
    assert sum(n >= 2 for n in per_row) > 150  # one distance for all 4 pairs: (1/7)^3 of the rows if uniform


def test_scattered_is_deterministic_for_a_seed_and_leaves_packed_alone():
    settings = dict(seq_len=48, n_pairs=4, key_vocab=10, value_vocab=10, distance_bin=(2, 12))
    a, b, c = (batch(seed, 16, layout="scattered", **settings) for seed in (7, 7, 8))
    assert all(torch.equal(a[k], b[k]) for k in ("tokens", "targets", "distance"))
    assert not torch.equal(a["tokens"], c["tokens"])
    packed = batch(7, 16, **settings)
    assert torch.equal(batch(7, 16, layout="packed", **settings)["tokens"], packed["tokens"])
    assert not torch.equal(a["distance"], packed["distance"])


def test_distance_spread_on_a_hand_checked_batch():
    # pairs at 0-1 and 2-3, queries at 5 (pair 0, distance 5) and 8 (pair 1, distance 6): the latest value before
    # 5 is pair 1's (at 3), before 8 it is pair 1's own
    out = batch(0, 1, seq_len=12, n_pairs=2, key_vocab=2, value_vocab=1, distances=[5, 6])
    assert distance_spread(out) == {"queries": 2, "counts": {5: 1, 6: 1}, "distinct": 2, "commonest": 5,
                                    "commonest_share": 0.5, "latest_value_share": 0.5}
    # packed, anywhere: all values precede all queries, so the latest value is always the last pair's: 1 / N
    packed = batch(0, 300, seq_len=64, n_pairs=4, key_vocab=16, value_vocab=16)
    assert distance_spread(packed)["latest_value_share"] == 0.25
    empty = batch(0, 0, seq_len=12, n_pairs=2, key_vocab=2, value_vocab=1)
    assert distance_spread(empty)["commonest_share"] is None


def test_scattered_mix_of_pair_counts():
    out = mqar_mix(40, 64, [2, 4], key_vocab=8, value_vocab=8, distance_bins=[(2, 8), (9, 16)], stratified=True,
                   layout="scattered", generator=torch.Generator().manual_seed(3))
    for row in range(40):
        drawn = decode(out["tokens"][row].tolist(), out["targets"][row].tolist(), out["distance"][row].tolist(),
                       int(out["n_pairs"][row]), 8, 8)
        assert all(2 <= d <= 8 for d in drawn) or all(9 <= d <= 16 for d in drawn)


# --- the lags control ----------------------------------------------------------------------------------

@pytest.mark.parametrize("lags", [[2, 3, 4, 17, 18, 19, 20], {5, 9, 40}, range(2, 9), torch.tensor([3, 31])])
def test_lags_draw_only_the_lags_given_and_every_one_of_them(lags):
    allowed = set(torch.as_tensor(list(lags)).tolist())
    out = batch(2, 300, seq_len=64, n_pairs=4, key_vocab=16, value_vocab=16, layout="scattered", lags=lags)
    for row in range(300):
        decode(out["tokens"][row].tolist(), out["targets"][row].tolist(), out["distance"][row].tolist(), 4, 16, 16)
    assert set(all_distances(out)) == allowed


def test_lags_in_a_mix_and_in_check():
    check(64, 4, key_vocab=16, value_vocab=16, layout="scattered", lags=[2, 3, 17])
    out = mqar_mix(20, 64, [2, 4], key_vocab=16, value_vocab=16, layout="scattered", lags=[2, 3, 17],
                   generator=torch.Generator().manual_seed(0))
    assert set(all_distances(out)) == {2, 3, 17}


@pytest.mark.parametrize("settings, name", [
    (dict(lags=[]), "lags"),  # empty
    (dict(lags=[1, 5]), "lags"),  # 1 is the value's position
    (dict(lags=[5, 63]), "lags"),  # past seq_len - 2 = 62
    (dict(lags=[4, 2.5]), "lags"),
    (dict(lags="2-8"), "lags"),  # text is the flag's business
    (dict(lags=5), "lags"),
    (dict(seq_len=16, n_pairs=4, lags=[12, 13]), "lags"),  # cannot fit: only one pair at 12 or 13 in 16
    (dict(seq_len=24, n_pairs=6), "n_pairs"),  # the pairs fill the sequence: too crowded to draw
    (dict(seq_len=64, n_pairs=15, lags=[3, 5, 7, 9]), "lags"),  # odd distances waste a position: none fits
    (dict(layout="packed", lags=[2, 3]), "lags"),  # packed: pair 0's query is at >= 8
    (dict(distance_bin=(2, 8), lags=[2, 3]), "lags"),
    (dict(layout="random"), "layout"),
    (dict(distances=[2, 4, 6, 8]), "distances"),  # explicit distances are packed only
    (dict(distance_bin=(1, 2)), "distance_bin"),  # asks for two distances, 1 cannot be one: one left
    (dict(distance_bin=(1, 1)), "distance_bin"),  # none left
    (dict(distance_bin=(2, 63)), "distance_bin"),
])
def test_scattered_and_lags_refusals_are_one_line_naming_the_argument(settings, name):
    args = dict(dict(n_examples=2, seq_len=64, n_pairs=4, key_vocab=16, value_vocab=16, layout="scattered"),
                **settings)
    with pytest.raises(ValueError, match=name) as err:
        mqar_batch(**args, generator=torch.Generator().manual_seed(0))
    assert "\n" not in str(err.value)
    if "distances" not in settings:
        with pytest.raises(ValueError, match=name):
            check(args["seq_len"], args["n_pairs"], key_vocab=16, value_vocab=16, layout=args["layout"],
                  **{k: v for k, v in settings.items() if k not in ("seq_len", "n_pairs", "layout")})


def test_a_single_lag_or_a_bin_of_one_is_an_explicit_request():
    assert set(all_distances(batch(0, 20, seq_len=64, n_pairs=4, key_vocab=16, value_vocab=16,
                                   layout="scattered", lags=[7]))) == {7}
    assert set(all_distances(batch(0, 20, seq_len=64, n_pairs=4, key_vocab=16, value_vocab=16,
                                   layout="scattered", distance_bin=(5, 5)))) == {5}


def test_spans_text():
    assert spans([2, 3, 4, 9, 17, 18]) == "2-4,9,17-18" and spans([]) == ""
