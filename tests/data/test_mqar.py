import pytest
import torch

from piattn.data.mqar import IGNORE, check, mqar_batch, mqar_mix, vocab_size


def batch(seed: int, n_examples: int = 4, **kwargs) -> dict:
    return mqar_batch(n_examples, generator=torch.Generator().manual_seed(seed), **kwargs)


def test_hand_checked_layout_with_explicit_distances():
    # key_vocab 2, value_vocab 1: keys are {0, 1} in some order, the value is always 2, the filler 3
    out = batch(0, n_examples=3, seq_len=12, n_pairs=2, key_vocab=2, value_vocab=1, distances=[5, 6])
    for row in range(3):
        a, b = out["tokens"][row, 0].item(), out["tokens"][row, 2].item()
        assert {a, b} == {0, 1}
        # pair 0 at 0–1, pair 1 at 2–3; query 0 at 0 + 5 = 5, query 1 at 2 + 6 = 8, the answer never written
        # after a query (filler there: a later query must not see which pairs were answered)
        assert out["tokens"][row].tolist() == [a, 2, b, 2, 3, a, 3, 3, b, 3, 3, 3]
        assert out["targets"][row].tolist() == [IGNORE] * 5 + [2, IGNORE, IGNORE, 2, IGNORE, IGNORE, IGNORE]
        assert out["distance"][row].tolist() == [-1] * 5 + [5, -1, -1, 6, -1, -1, -1]
    assert out["n_pairs"] == 2 and vocab_size(2, 1) == 4


def test_hand_checked_queries_in_the_other_order():
    # pair 1 queried first (2 + 2 = 4), pair 0 last (0 + 8 = 8); values 3 and 4 tell the pairs apart here
    out = batch(1, n_examples=50, seq_len=12, n_pairs=2, key_vocab=2, value_vocab=3, distances=[8, 2])
    tokens, targets = out["tokens"], out["targets"]
    for row in range(50):
        a, va, b, vb = tokens[row, :4].tolist()
        assert tokens[row].tolist() == [a, va, b, vb, b, 5, 5, 5, a, 5, 5, 5]
        assert targets[row].tolist() == [IGNORE] * 4 + [vb] + [IGNORE] * 3 + [va] + [IGNORE] * 3
    assert out["distance"][0].tolist() == [-1] * 4 + [2] + [-1] * 3 + [8] + [-1] * 3
    assert (tokens[:, 1] != tokens[:, 3]).any()  # values are drawn per pair, not one per sequence


def test_hand_checked_bin_that_leaves_one_placement():
    # seq_len 8, 2 pairs, bin (4, 4): pair 0 queried at 4, pair 1 at 6, nothing else fits
    out = batch(2, n_examples=2, seq_len=8, n_pairs=2, key_vocab=5, value_vocab=5, distance_bin=(4, 4))
    for row in out["tokens"].tolist():
        assert row[4:] == [row[0], 10, row[2], 10]  # the keys again, the filler (5 + 5) after each
    assert out["distance"][0].tolist() == [-1, -1, -1, -1, 4, -1, 4, -1]
    assert out["targets"][0].tolist() == [IGNORE] * 4 + [out["tokens"][0, 1].item(), IGNORE,
                                                         out["tokens"][0, 3].item(), IGNORE]


def check_example(tokens: list[int], targets: list[int], distance: list[int], n_pairs: int, key_vocab: int,
                  value_vocab: int, bin_: tuple[int, int]) -> None:
    """Every property of one example, decoded from the tokens alone."""
    keys, values = tokens[0:2 * n_pairs:2], tokens[1:2 * n_pairs:2]
    assert len(set(keys)) == n_pairs and all(0 <= k < key_vocab for k in keys)
    assert all(key_vocab <= v < key_vocab + value_vocab for v in values)
    scored = [p for p, t in enumerate(targets) if t != IGNORE]
    assert scored == [p for p, d in enumerate(distance) if d != -1]
    assert sorted(tokens[p] for p in scored) == sorted(keys)  # each key queried exactly once
    query_cells = set()
    for p in scored:
        pair = keys.index(tokens[p])
        assert p >= 2 * n_pairs and targets[p] == values[pair]
        assert tokens[p + 1] == key_vocab + value_vocab  # the answer is never written after its query
        assert distance[p] == p - 2 * pair and bin_[0] <= distance[p] <= bin_[1]
        assert not query_cells & {p, p + 1}  # queries do not overlap
        query_cells |= {p, p + 1}
    filler = key_vocab + value_vocab
    rest = [t for p, t in enumerate(tokens[2 * n_pairs:], 2 * n_pairs) if p not in query_cells]
    assert rest == [filler] * (len(tokens) - 4 * n_pairs)


@pytest.mark.parametrize("settings", [
    dict(seq_len=40, n_pairs=5, key_vocab=6, value_vocab=3),  # anywhere
    dict(seq_len=40, n_pairs=5, key_vocab=20, value_vocab=20, distance_bin=(10, 14)),
    dict(seq_len=12, n_pairs=3, key_vocab=3, value_vocab=2, distance_bin=(2, 10)),  # fills the sequence exactly
    dict(seq_len=30, n_pairs=4, key_vocab=9, value_vocab=7, distance_bin=(9, 9)),  # a single distance, odd
])
def test_properties_over_many_seeds(settings):
    bin_ = settings.get("distance_bin", (1, settings["seq_len"] - 2))
    for seed in range(40):
        out = batch(seed, **settings)
        assert all(out[k].shape == (4, settings["seq_len"]) and out[k].dtype == torch.int64
                   for k in ("tokens", "targets", "distance"))
        for row in range(4):
            check_example(out["tokens"][row].tolist(), out["targets"][row].tolist(), out["distance"][row].tolist(),
                          settings["n_pairs"], settings["key_vocab"], settings["value_vocab"], bin_)


def test_explicit_distances_per_example():
    distances = torch.tensor([[4, 5], [9, 2]])
    out = batch(3, n_examples=2, seq_len=12, n_pairs=2, key_vocab=4, value_vocab=4, distances=distances)
    assert out["distance"][0].tolist() == [-1] * 4 + [4, -1, -1, 5] + [-1] * 4
    assert out["distance"][1].tolist() == [-1] * 4 + [2, -1, -1, -1, -1, 9, -1, -1]


def test_every_distance_of_the_bin_is_drawn():
    out = batch(0, n_examples=400, seq_len=24, n_pairs=2, key_vocab=4, value_vocab=4, distance_bin=(4, 12))
    drawn = torch.bincount(out["distance"][out["distance"] >= 0], minlength=13)[4:]
    assert drawn.min() > 40  # 800 distances over 9 values: 89 each if uniform


def test_deterministic_for_a_seed():
    settings = dict(seq_len=32, n_pairs=4, key_vocab=10, value_vocab=10, distance_bin=(8, 16))
    a, b, c = (batch(seed, n_examples=16, **settings) for seed in (7, 7, 8))
    assert all(torch.equal(a[k], b[k]) for k in ("tokens", "targets", "distance"))
    assert not torch.equal(a["tokens"], c["tokens"]) and not torch.equal(a["distance"], c["distance"])


@pytest.mark.parametrize("settings, name", [
    (dict(seq_len=15, n_pairs=4), "n_pairs"),  # 4 pairs need 16 positions
    (dict(n_pairs=0), "n_pairs"),
    (dict(seq_len=3), "seq_len"),
    (dict(n_examples=-1), "n_examples"),
    (dict(key_vocab=2), "key_vocab"),  # fewer keys than pairs
    (dict(value_vocab=0), "value_vocab"),
    (dict(distance_bin=(4, 31)), "distance_bin"),  # hi beyond the sequence (seq_len - 2 = 30)
    (dict(distance_bin=(5, 4)), "distance_bin"),
    (dict(distance_bin=(0, 4)), "distance_bin"),
    (dict(distance_bin=(1, 5)), "distance_bin"),  # pair 0's query must be at >= 6 (after 3 pairs)
    (dict(distance_bin=(28, 30)), "distance_bin"),  # pair 2's key sits at 4: its query would be past 30
    (dict(distances=[6, 6, 1]), "distances"),  # pair 2 queried at 5, among the pairs
    (dict(distances=[31, 6, 6]), "distances"),  # pair 0 past the end
    (dict(distances=[8, 7, 8]), "distances"),  # pairs 0 and 1 at 8 and 9: overlap
    (dict(distances=[6, 6]), "distances"),  # one per pair
    (dict(distances=[6.0, 6.0, 6.0]), "distances"),
    (dict(distances=[6, 6, 6], distance_bin=(6, 6)), "distances"),
])
def test_value_errors_name_the_argument(settings, name):
    args = dict(dict(n_examples=2, seq_len=32, n_pairs=3, key_vocab=3, value_vocab=2), **settings)
    with pytest.raises(ValueError, match=name):
        mqar_batch(**args, generator=torch.Generator().manual_seed(0))


def test_check_raises_what_the_generator_raises_without_drawing():
    check(32, 3, key_vocab=3, value_vocab=2, distance_bin=(6, 30))  # fits
    for settings, name in [(dict(n_pairs=9), "n_pairs"), (dict(key_vocab=2), "key_vocab"),
                           (dict(distance_bin=(1, 5)), "distance_bin")]:
        args = dict(dict(n_pairs=3, key_vocab=3, value_vocab=2), **settings)
        with pytest.raises(ValueError, match=name):
            check(32, **args)
        with pytest.raises(ValueError, match=name):
            mqar_batch(2, 32, **args, generator=torch.Generator().manual_seed(0))


def test_mix_of_one_combination_is_the_generators_batch():
    settings = dict(key_vocab=10, value_vocab=7)
    mix = mqar_mix(20, 40, [5], distance_bins=[(10, 20)], generator=torch.Generator().manual_seed(4), **settings)
    one = mqar_batch(20, 40, 5, distance_bin=(10, 20), generator=torch.Generator().manual_seed(4), **settings)
    assert all(torch.equal(mix[k], one[k]) for k in ("tokens", "targets", "distance"))
    assert mix["n_pairs"].tolist() == [5] * 20


@pytest.mark.parametrize("stratified", [False, True])
def test_mix_rows_are_the_generators_batches_per_combination(stratified):
    counts, bins, n = [2, 3], [None, (8, 12)], 30
    mix = mqar_mix(n, 24, counts, key_vocab=4, value_vocab=5, distance_bins=bins, stratified=stratified,
                   generator=torch.Generator().manual_seed(9))
    # the same draws by hand: the combination of each example, then one mqar_batch per combination in order
    g = torch.Generator().manual_seed(9)
    which = torch.randperm(n, generator=g) % 4 if stratified else torch.randint(0, 4, (n,), generator=g)
    for c, (pairs, bin_) in enumerate((p, b) for p in counts for b in bins):
        rows = (which == c).nonzero().flatten()
        part = mqar_batch(len(rows), 24, pairs, key_vocab=4, value_vocab=5, distance_bin=bin_, generator=g)
        assert all(torch.equal(mix[k][rows], part[k]) for k in ("tokens", "targets", "distance"))
        assert (mix["n_pairs"][rows] == pairs).all()
        for row in rows.tolist():
            check_example(mix["tokens"][row].tolist(), mix["targets"][row].tolist(), mix["distance"][row].tolist(),
                          pairs, 4, 5, bin_ or (1, 22))
    if stratified:  # 30 examples over 4 combinations: 8, 8, 7, 7
        assert sorted(torch.bincount(which, minlength=4).tolist()) == [7, 7, 8, 8]


def test_mix_names_the_argument_of_a_combination_that_cannot_fit():
    with pytest.raises(ValueError, match="distance_bin"):  # 2 pairs fit the bin, 3 do not (pair 0's query >= 6)
        mqar_mix(4, 32, [2, 3], key_vocab=3, value_vocab=2, distance_bins=[(4, 5)],
                 generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="pair_counts"):
        mqar_mix(4, 32, [], key_vocab=3, value_vocab=2, generator=torch.Generator().manual_seed(0))
