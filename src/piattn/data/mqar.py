"""Multi-query associative recall (MQAR), with control of the distance between each key and its query.

MQAR is the recall task of the Zoology study (Arora et al. 2023, "Zoology: Measuring and Improving Recall in
Efficient Language Models"): a sequence opens with n_pairs key–value pairs, later asks for every key once more,
and the model must answer each query with the value that followed that key. What we add is control of the
key–query distance (query position - key position), per pair, so that accuracy can be read per distance: the
quantity that decides whether π-attention (a local window plus one key π positions back) reaches the key.

One sequence of length T = seq_len, with N = n_pairs and pair i = (key k_i, value v_i):

    tokens[2i], tokens[2i + 1]      k_i, v_i for every i < N: the pairs fill positions [0, 2N)
    tokens[q_i]                     k_i again: pair i's query at q_i in [2N, T - 2], each key asked once;
                                    q_i + 1 is kept free (filler): no query starts there, and the answer v_i
                                    is never written into the sequence after a query, as in Zoology, where
                                    the position after a query holds its label only. (Until 2026-11-28 it
                                    held v_i: later queries then saw which pairs had been answered, and the
                                    models learned to answer with the value of a pair not yet asked, which
                                    needs no key matching and scores H_N / N = 0.52 at N = 4, 0.34 at 8 —
                                    the plateau dense attention sat on; docs/results.md §7b.)
    every other position            the filler id

Ids: keys 0 … key_vocab - 1 (distinct within a sequence), values key_vocab … key_vocab + value_vocab - 1
(independent and uniform, so they may repeat), filler key_vocab + value_vocab: a model needs
`vocab_size(key_vocab, value_vocab)` = key_vocab + value_vocab + 1 input ids.

That is the default layout, "packed". With it pair 0's query cannot be nearer than 2N (all the pairs stand
between its key and the first query), so a bin of short distances can leave one placement only: with 4 pairs,
the bin 2–8 puts every query at distance 8, and a fixed offset of 8 (key) and 7 (value) answers every query
without matching any key. `mqar_batch` refuses such a bin (`single_distance`). The layout "scattered" draws short
distances for real:

    layout="scattered"              each pair's distance is drawn uniformly from the allowed set (the bin, the
                                    `lags`, or 2 … T - 2: uniform within what still fits), pair by pair in a
                                    random order, and the pair takes the earliest start p_i whose key (p_i),
                                    value (p_i + 1), query (q_i = p_i + d_i) and free position (q_i + 1)
                                    are all free: pairs and queries interleave, filler after them.
    lags=                           (scattered only) the allowed distances as a set, e.g. the distances an
                                    attention arm serves: the control that asks only what the arm reaches.

Every other rule holds in both: keys distinct, no position used twice, q_i + 1 free, every other position the
filler, distance = q_i - p_i >= 2 (p_i = 2i when packed). `distance_spread` reports what a batch drew: the
distances, the share of the commonest one (the accuracy of the best fixed offset) and the share of queries
whose nearest earlier value is their own (what "answer with the latest value" scores: 1/N when packed, more
when scattered, since few pairs stand between a key and a near query).

Targets follow `piattn.data.recall`: targets[p] is what the logits at position p must predict, so the answer
sits at the query itself, targets[q_i] = v_i (never a token of the sequence after q_i), and every other position
holds IGNORE (-100,
the default ignore_index of `torch.nn.functional.cross_entropy`). Pair i's distance is q_i - 2i (packed), q_i - p_i
(scattered).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence

import torch

from ..analysis.report import lag_runs
from ..checks import is_int

IGNORE = -100
LAYOUTS = ("packed", "scattered")
# Draws of one scattered example (dead ends drawn again) before `mqar_batch` gives up
SCATTER_TRIES = 2000
# `check`'s dry run of the scattered layout: examples to draw, draws in all
SCATTER_DRY, SCATTER_DRY_TRIES = 16, 160


def vocab_size(key_vocab: int, value_vocab: int) -> int:
    """The number of input ids: keys, values and the filler."""
    return key_vocab + value_vocab + 1


def _check_int(name: str, value: object, low: int) -> None:
    if not is_int(value) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def _check_sizes(n_examples: int, seq_len: int, n_pairs: int, key_vocab: int, value_vocab: int) -> None:
    """ValueError naming the argument unless the sizes are integers that leave room for every pair and query."""
    _check_int("n_examples", n_examples, 0)
    _check_int("seq_len", seq_len, 4)
    _check_int("n_pairs", n_pairs, 1)
    _check_int("value_vocab", value_vocab, 1)
    if 4 * n_pairs > seq_len:
        raise ValueError(f"n_pairs must be <= seq_len / 4 = {seq_len // 4} (each pair takes two positions and its "
                         f"query two more), got {n_pairs}")
    if not is_int(key_vocab) or key_vocab < n_pairs:
        raise ValueError(f"key_vocab must be an integer >= n_pairs = {n_pairs} (keys are distinct), "
                         f"got {key_vocab!r}")


def _windows(seq_len: int, n_pairs: int, distance_bin: tuple[int, int] | None) -> tuple[list[int], list[int]]:
    """The first and last query position each pair may take, lists of n_pairs: after the pairs, before the
    end, and within the bin. Both are nondecreasing in the pair index, which `_fits` relies on."""
    lo, hi = (1, seq_len - 2) if distance_bin is None else _check_bin(distance_bin, seq_len)
    first = [max(2 * n_pairs, 2 * i + lo) for i in range(n_pairs)]
    last = [min(seq_len - 2, 2 * i + hi) for i in range(n_pairs)]
    return first, last


def _check_bin(distance_bin: object, seq_len: int) -> tuple[int, int]:
    """distance_bin as (lo, hi); ValueError naming it unless 1 <= lo <= hi <= seq_len - 2."""
    if not isinstance(distance_bin, Sequence) or len(distance_bin) != 2:
        raise ValueError(f"distance_bin must be a pair (lo, hi), got {distance_bin!r}")
    lo, hi = distance_bin
    _check_int("distance_bin lo", lo, 1)
    _check_int("distance_bin hi", hi, lo)
    if hi > seq_len - 2:
        raise ValueError(f"distance_bin hi must be <= seq_len - 2 = {seq_len - 2} (the query and the free position "
                         f"after it must fit in the sequence), got {hi}")
    return lo, hi


def _fits(first: list[int], last: list[int], occupied: list[bool], placed: list[int | None]) -> bool:
    """Whether the pairs not yet placed can still take a query each, around the occupied positions.

    Placing them in pair order, each at its earliest free start, is exact: the windows are nondecreasing in
    the pair index and all queries have the same length, so any placement can be reordered into pair order
    (swap two queries' positions) and the earliest start per pair only leaves more room for the next.
    """
    cursor = 0
    for i, position in enumerate(placed):
        if position is not None:
            continue
        start = max(first[i], cursor)
        while start <= last[i] and (occupied[start] or occupied[start + 1]):
            start += 1
        if start > last[i]:
            return False
        cursor = start + 2
    return True


def _place(first: list[int], last: list[int], seq_len: int, rng: random.Random) -> list[int]:
    """One example's query positions, a list of n_pairs: pairs in random order, each at a position drawn
    uniformly among the free ones of its window that leave room for the pairs still to place."""
    occupied = [False] * seq_len
    placed: list[int | None] = [None] * len(first)
    for i in rng.sample(range(len(first)), len(first)):
        starts = [s for s in range(first[i], last[i] + 1) if not (occupied[s] or occupied[s + 1])]
        rng.shuffle(starts)  # the first start that fits, in random order, is uniform among those that fit
        for start in starts:
            occupied[start] = occupied[start + 1] = True
            placed[i] = start
            if _fits(first, last, occupied, placed):
                break
            occupied[start] = occupied[start + 1] = False
            placed[i] = None
    return placed  # every pair placed: the state before each pair fits, so one of its starts keeps it so


def _check_fit(seq_len: int, n_pairs: int, distance_bin: tuple[int, int] | None) -> tuple[list[int], list[int]]:
    """`_windows`, ValueError naming distance_bin unless every pair can take a query in it, and unless the bin,
    of two distances or more, leaves every query one distance (`single_distance`)."""
    first, last = _windows(seq_len, n_pairs, distance_bin)
    if not _fits(first, last, [False] * seq_len, [None] * n_pairs):
        raise ValueError(f"distance_bin {distance_bin} cannot fit {n_pairs} queries in seq_len {seq_len}: pair i's "
                         f"key is at 2i and every query must sit in [2 * n_pairs, seq_len - 2] without overlap")
    only = single_distance(seq_len, n_pairs, distance_bin)
    if only is not None:
        asked = "distance_bin" if distance_bin is not None else "seq_len"
        raise ValueError(f"{asked} {distance_bin if distance_bin is not None else seq_len} puts every query at "
                         f"distance {only} with {n_pairs} pairs in seq_len {seq_len} (packed, pair 0's query cannot "
                         f"be nearer than 2 * n_pairs = {2 * n_pairs}): one fixed offset would answer them all; use "
                         f"layout='scattered' or a bin that leaves room")
    return first, last


def single_distance(seq_len: int, n_pairs: int, distance_bin: tuple[int, int] | None) -> int | None:
    """The one distance every query takes when the packed layout leaves a bin of two distances or more (None:
    anywhere) a single placement, else None. A bin lo = hi asks for one distance: None; so is a bin that does
    not fit.

    Exact: any placement can be put in pair order (`_fits`), and in pair order each query ranges from its
    earliest to its latest start (all pairs packed to the left, then to the right), so the placement in pair
    order is unique when the two agree; and if some other order were valid, its first pair out of place could
    swap with the next one, so none is when no two neighbours can swap.
    """
    lo, hi = (1, seq_len - 2) if distance_bin is None else _check_bin(distance_bin, seq_len)
    if lo == hi:
        return None
    first, last = _windows(seq_len, n_pairs, distance_bin)
    early, cursor = [], 0
    for i in range(n_pairs):
        early.append(max(first[i], cursor))
        cursor = early[-1] + 2
    late, cursor = [0] * n_pairs, seq_len
    for i in reversed(range(n_pairs)):
        late[i] = cursor = min(last[i], cursor - 2)
    distances = {q - 2 * i for i, q in enumerate(early)}
    if any(q > last[i] for i, q in enumerate(early)):  # the bin does not fit
        return None
    if early != late or len(distances) != 1:
        return None
    if any(last[i] >= early[i + 1] and first[i + 1] <= early[i] for i in range(n_pairs - 1)):
        return None
    return distances.pop()


def check(seq_len: int, n_pairs: int, *, key_vocab: int, value_vocab: int,
          distance_bin: tuple[int, int] | None = None, layout: str = "packed", lags: object = None) -> None:
    """The ValueError (naming the argument) `mqar_batch` would raise for these settings, without drawing."""
    _check_sizes(0, seq_len, n_pairs, key_vocab, value_vocab)
    _check_options(layout, distance_bin, None, lags)
    if layout == "packed":
        _check_fit(seq_len, n_pairs, distance_bin)
    else:
        _check_scatter_fit(seq_len, n_pairs, distance_bin, lags)


def _check_options(layout: object, distance_bin: object, distances: object, lags: object) -> None:
    """ValueError naming the argument unless the layout is known and the distance options go together."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if distances is not None and distance_bin is not None:
        raise ValueError("distances and distance_bin are exclusive: give explicit distances or a bin, not both")
    if lags is not None and (distances is not None or distance_bin is not None):
        raise ValueError("lags, distance_bin and distances are exclusive: lags is the set of distances to draw from")
    if layout == "packed" and lags is not None:
        raise ValueError("lags needs layout='scattered' (packed, pair 0's query cannot be nearer than 2 * n_pairs)")
    if layout == "scattered" and distances is not None:
        raise ValueError("distances apply to layout='packed' only; with layout='scattered' give a bin or lags")


def _check_lags(lags: object, seq_len: int) -> list[int]:
    """lags as a sorted list of distinct distances; ValueError naming it unless a nonempty collection of
    integers in [2, seq_len - 2]."""
    if isinstance(lags, torch.Tensor):
        lags = lags.flatten().tolist()
    if isinstance(lags, (str, bytes)) or not isinstance(lags, Iterable):
        raise ValueError(f"lags must be a collection of integer distances, got {lags!r}")
    lags = list(lags)
    if not lags:
        raise ValueError("lags must hold at least one distance, got none")
    bad = [d for d in lags if not is_int(d) or not 2 <= d <= seq_len - 2]
    if bad:
        raise ValueError(f"lags must be integers in [2, seq_len - 2 = {seq_len - 2}] (the value sits at distance 1 "
                         f"from its key; the query and the free position after it must fit), got {bad[:5]}")
    return sorted(set(int(d) for d in lags))


def _allowed(seq_len: int, distance_bin: tuple[int, int] | None, lags: object) -> tuple[str, list[int]]:
    """(the argument's name, the distances a scattered draw takes): the lags, the bin's from 2 up, or 2 …
    seq_len - 2. ValueError naming the argument when none is left, or one where the bin asked for more."""
    if lags is not None:
        return "lags", _check_lags(lags, seq_len)
    if distance_bin is None:
        return "seq_len", list(range(2, seq_len - 1))
    lo, hi = _check_bin(distance_bin, seq_len)
    allowed = list(range(max(lo, 2), hi + 1))
    if not allowed or (hi > lo and len(allowed) == 1):
        raise ValueError(f"distance_bin {distance_bin} leaves {'no distance' if not allowed else 'one distance, 2'}"
                         f": the value sits at distance 1 from its key, so a query's distance is >= 2")
    return "distance_bin", allowed


def _earliest(occupied: list[bool], d: int) -> int | None:
    """The earliest start of a pair at distance d whose four positions (key, value, query, the free one after
    it) are free and inside the sequence; None if there is none."""
    return next((p for p in range(len(occupied) - d - 1)
                 if not (occupied[p] or occupied[p + 1] or occupied[p + d] or occupied[p + d + 1])), None)


def _fitting(occupied: list[bool], allowed: list[int]) -> list[tuple[int, int]]:
    """[(d, its earliest start)] for every allowed d that fits, d ascending: from the pairs of free two-position
    blocks (few, where this is asked: the sequence is crowded)."""
    blocks = [p for p in range(len(occupied) - 1) if not (occupied[p] or occupied[p + 1])]
    wanted, earliest = set(allowed), {}
    for j, a in enumerate(blocks):
        for b in blocks[j + 1:]:
            if b - a >= 2 and b - a in wanted and b - a not in earliest:
                earliest[b - a] = a
    return sorted(earliest.items())


def _occupy(occupied: list[bool], p: int, d: int) -> None:
    occupied[p] = occupied[p + 1] = occupied[p + d] = occupied[p + d + 1] = True


def _scatter(allowed: list[int], n_pairs: int, seq_len: int, rng: random.Random) -> tuple[list[int], list[int]] | None:
    """(key positions, distances) of one scattered example, or None at a dead end (a pair with no distance
    left that fits). The pairs in a random order, each draws its distance uniformly among the allowed ones that
    still fit (by rejection: uniform over the allowed ones while there is room) and takes the earliest start
    that has room for it. Earliest, not random: packed together, other pairs stand between a key and its query
    as often as the distances allow, so "answer with the latest value" answers fewer queries (at 4 pairs and
    distances 2 … 8, 65 % of them against 92 % with random starts; `distance_spread`)."""
    occupied = [False] * seq_len
    starts, distances = [0] * n_pairs, [0] * n_pairs
    for i in rng.sample(range(n_pairs), n_pairs):
        for _ in range(8):
            d = rng.choice(allowed)
            if (p := _earliest(occupied, d)) is not None:
                break
        else:  # crowded: draw among the distances that fit, listed
            fitting = _fitting(occupied, allowed)
            if not fitting:
                return None
            d, p = rng.choice(fitting)
        starts[i], distances[i] = p, d
        _occupy(occupied, p, d)
    return starts, distances


def _check_scatter_fit(seq_len: int, n_pairs: int, distance_bin: tuple[int, int] | None,
                       lags: object) -> list[int]:
    """The allowed distances (`_allowed`); ValueError naming the argument unless the pairs can all be placed at
    one of them (each at its earliest start), and naming n_pairs when a dry run (SCATTER_DRY examples from a
    fixed seed, SCATTER_DRY_TRIES draws in all) meets too many dead ends: too crowded to draw (a sequence the
    pairs fill, 4N = T, would need its distances to tile it)."""
    name, allowed = _allowed(seq_len, distance_bin, lags)

    def fits_at(d: int) -> bool:
        occupied = [False] * seq_len
        for _ in range(n_pairs):
            if (p := _earliest(occupied, d)) is None:
                return False
            _occupy(occupied, p, d)
        return True

    if not any(fits_at(d) for d in allowed):
        shown = distance_bin if name == "distance_bin" else (seq_len if name == "seq_len" else spans(allowed))
        raise ValueError(f"{name} {shown} cannot place {n_pairs} pairs in seq_len {seq_len} at any one of its "
                         f"distances: a pair at distance d takes positions p, p + 1, p + d and p + d + 1")
    rng, drawn, tries = random.Random(0), 0, 0
    while drawn < SCATTER_DRY and tries < SCATTER_DRY_TRIES and 4 * n_pairs < seq_len:
        drawn += _scatter(allowed, n_pairs, seq_len, rng) is not None
        tries += 1
    if drawn < SCATTER_DRY:
        raise ValueError(f"n_pairs {n_pairs} leave too little room in seq_len {seq_len} for layout='scattered' at "
                         f"these distances (a dry run drew {drawn} of {SCATTER_DRY} examples in {tries} tries); "
                         f"use fewer pairs, a longer sequence or shorter distances")
    return allowed


def spans(distances: Iterable[int]) -> str:
    """[2, 3, 4, 9, 17, 18] -> '2-4,9,17-18': the text `piattn train --mqar-lags` reads."""
    return lag_runs(distances, dash="-", sep=",")


def _scattered_queries(n_examples: int, seq_len: int, n_pairs: int, distance_bin: tuple[int, int] | None,
                       lags: object, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(key positions, query positions) int64 [n_examples, n_pairs] of the scattered layout (`_scatter`, an
    example drawn again at a dead end, at most SCATTER_TRIES times)."""
    allowed = _check_scatter_fit(seq_len, n_pairs, distance_bin, lags)
    rng = random.Random(int(torch.randint(0, 2**62, (), generator=generator)))
    starts, queries = [], []
    for _ in range(n_examples):
        for _ in range(SCATTER_TRIES):
            if (placed := _scatter(allowed, n_pairs, seq_len, rng)) is not None:
                break
        else:
            raise ValueError(f"n_pairs {n_pairs} found no room in seq_len {seq_len} at these distances in "
                             f"{SCATTER_TRIES} draws; use fewer pairs, a longer sequence or shorter distances")
        starts.append(placed[0])
        queries.append([p + d for p, d in zip(*placed, strict=True)])
    shape = (n_examples, n_pairs)
    return (torch.tensor(starts, dtype=torch.int64).reshape(shape),
            torch.tensor(queries, dtype=torch.int64).reshape(shape))


def _binned_queries(n_examples: int, seq_len: int, n_pairs: int, distance_bin: tuple[int, int] | None,
                    generator: torch.Generator) -> torch.Tensor:
    """Query positions int64 [n_examples, n_pairs] with every distance in distance_bin (anywhere if None)."""
    first, last = _check_fit(seq_len, n_pairs, distance_bin)
    # One Python generator seeded from the torch one: the placement is a per-example loop of small draws
    rng = random.Random(int(torch.randint(0, 2**62, (), generator=generator)))
    rows = [_place(first, last, seq_len, rng) for _ in range(n_examples)]
    return torch.tensor(rows, dtype=torch.int64).reshape(n_examples, n_pairs)


def _explicit_queries(distances: Sequence[int] | torch.Tensor, n_examples: int, seq_len: int,
                      n_pairs: int) -> torch.Tensor:
    """Query positions int64 [n_examples, n_pairs] from distances [n_pairs] or [n_examples, n_pairs];
    ValueError naming distances unless every query fits after the pairs, in the sequence, without overlap."""
    d = torch.as_tensor(distances)
    if d.is_floating_point() or d.is_complex() or d.dtype == torch.bool:
        raise ValueError(f"distances must be integers, got dtype {d.dtype}")
    if tuple(d.shape) not in ((n_pairs,), (n_examples, n_pairs)):
        raise ValueError(f"distances must have shape ({n_pairs},) or ({n_examples}, {n_pairs}), got {tuple(d.shape)}")
    queries = 2 * torch.arange(n_pairs) + d.to(torch.int64).expand(n_examples, n_pairs)
    if (queries < 2 * n_pairs).any():
        raise ValueError(f"distances put a query among the pairs: pair i's query 2i + distance must be >= "
                         f"2 * n_pairs = {2 * n_pairs}")
    if (queries > seq_len - 2).any():
        raise ValueError(f"distances put a query past the end: pair i's query 2i + distance must be <= "
                         f"seq_len - 2 = {seq_len - 2} (the position after it is kept free)")
    if (queries.sort(dim=1).values.diff(dim=1) < 2).any():
        raise ValueError("distances make two queries overlap: each query takes two positions (its key, then "
                         "a free one)")
    return queries


def _assemble(keys: torch.Tensor, values: torch.Tensor, pairs: torch.Tensor, queries: torch.Tensor, seq_len: int,
              filler: int) -> dict[str, torch.Tensor]:
    """keys, values, pairs (key positions: [N] packed, [B, N] scattered), queries int64 [B, N] -> tokens,
    targets, distance int64 [B, seq_len] (module layout)."""
    n_examples, n_pairs = keys.shape
    rows = torch.arange(n_examples)[:, None]
    pairs = pairs.expand(n_examples, n_pairs)
    tokens = torch.full((n_examples, seq_len), filler, dtype=torch.int64)
    tokens[rows, pairs], tokens[rows, pairs + 1] = keys, values
    tokens[rows, queries] = keys  # the answer is the target only, never a token after the query
    targets = torch.full_like(tokens, IGNORE)
    targets[rows, queries] = values
    distance = torch.full_like(tokens, -1)
    distance[rows, queries] = queries - pairs
    return dict(tokens=tokens, targets=targets, distance=distance)


def mqar_batch(n_examples: int, seq_len: int, n_pairs: int, *, key_vocab: int, value_vocab: int,
               distance_bin: tuple[int, int] | None = None, distances: Sequence[int] | torch.Tensor | None = None,
               layout: str = "packed", lags: Iterable[int] | None = None, generator: torch.Generator) -> dict:
    """n_examples MQAR sequences (layout, ids and targets in the module docstring); deterministic per generator.

    Key–query distances, at most one of:
        none of them     packed: each query anywhere after the pairs (uniform within what fits); scattered:
                         every distance 2 … seq_len - 2 (uniform within what fits)
        distance_bin     (lo, hi): every pair's distance in [lo, hi], uniform within what fits
        distances        packed only: explicit, int [n_pairs] (the same for every example) or [n_examples, n_pairs]
        lags             scattered only: the allowed distances, a collection of integers in [2, seq_len - 2]
    layout: "packed" (pairs at [0, 2N), queries after them; the default, its draws unchanged) or "scattered"
    (pairs and queries among the filler, each distance drawn from the allowed ones). In every case queries never
    overlap the pairs or each other. Raises ValueError naming the argument when the request cannot fit
    (n_pairs > seq_len / 4, key_vocab < n_pairs, hi > seq_len - 2, an unreachable bin, empty lags, ...) or when
    a packed bin of two distances or more leaves every query one distance (`single_distance`).

    Returns {"tokens", "targets", "distance": int64 [n_examples, seq_len], "n_pairs": int}: targets IGNORE but at
    the queries (their values), distance -1 but at the queries (query position - key position).
    """
    _check_sizes(n_examples, seq_len, n_pairs, key_vocab, value_vocab)
    _check_options(layout, distance_bin, distances, lags)
    if layout == "scattered":
        pairs, queries = _scattered_queries(n_examples, seq_len, n_pairs, distance_bin, lags, generator)
    elif distances is None:
        pairs, queries = 2 * torch.arange(n_pairs), _binned_queries(n_examples, seq_len, n_pairs, distance_bin,
                                                                    generator)
    else:
        pairs, queries = 2 * torch.arange(n_pairs), _explicit_queries(distances, n_examples, seq_len, n_pairs)
    # Distinct keys: the first n_pairs of a random permutation of the key vocabulary
    keys = torch.rand(n_examples, key_vocab, generator=generator).argsort(dim=1)[:, :n_pairs]
    values = torch.randint(key_vocab, key_vocab + value_vocab, (n_examples, n_pairs), generator=generator)
    batch = _assemble(keys, values, pairs, queries, seq_len, filler=key_vocab + value_vocab)
    return dict(batch, n_pairs=n_pairs)


def mqar_mix(n_examples: int, seq_len: int, pair_counts: Sequence[int], *, key_vocab: int, value_vocab: int,
             distance_bins: Sequence[tuple[int, int] | None] = (None,), stratified: bool = False,
             layout: str = "packed", lags: Iterable[int] | None = None, generator: torch.Generator) -> dict:
    """n_examples MQAR sequences whose number of pairs and distance bin vary per example; deterministic per
    generator. What `piattn train --task mqar` trains and scores (--mqar-pairs, --mqar-distance).

    Each example takes one combination (n_pairs, distance_bin) of pair_counts × distance_bins (None: anywhere,
    as in `mqar_batch`): drawn uniformly, or with `stratified` each combination in turn (shuffled), so every
    one holds n_examples / combinations examples up to one. The examples of each combination are then drawn by
    one `mqar_batch` call, combinations in order, from the same generator; with a single combination nothing
    is drawn first, so the result is `mqar_batch`'s own. layout and lags as in `mqar_batch`, for every
    combination (with lags, distance_bins must be (None,)).

    Returns {"tokens", "targets", "distance": int64 [n_examples, seq_len], "n_pairs": int64 [n_examples]}, the
    layout of `mqar_batch` row by row. ValueError naming the argument as `mqar_batch` does.
    """
    _check_int("n_examples", n_examples, 0)
    combos = [(int(n), b) for n in pair_counts for b in distance_bins]
    if not combos:
        raise ValueError("pair_counts and distance_bins must each hold at least one entry")
    for n_pairs, distance_bin in combos:
        check(seq_len, n_pairs, key_vocab=key_vocab, value_vocab=value_vocab, distance_bin=distance_bin,
              layout=layout, lags=lags)
    if len(combos) == 1:
        which = torch.zeros(n_examples, dtype=torch.int64)
    elif stratified:
        which = torch.randperm(n_examples, generator=generator) % len(combos)
    else:
        which = torch.randint(0, len(combos), (n_examples,), generator=generator)
    filler = key_vocab + value_vocab
    out = dict(tokens=torch.full((n_examples, seq_len), filler, dtype=torch.int64),
               targets=torch.full((n_examples, seq_len), IGNORE, dtype=torch.int64),
               distance=torch.full((n_examples, seq_len), -1, dtype=torch.int64),
               n_pairs=torch.zeros(n_examples, dtype=torch.int64))
    for c, (n_pairs, distance_bin) in enumerate(combos):
        rows = (which == c).nonzero().flatten()
        part = mqar_batch(len(rows), seq_len, n_pairs, key_vocab=key_vocab, value_vocab=value_vocab,
                          distance_bin=distance_bin, layout=layout, lags=lags, generator=generator)
        for key in ("tokens", "targets", "distance"):
            out[key][rows] = part[key]
        out["n_pairs"][rows] = n_pairs
    return out


def distance_spread(batch: dict) -> dict:
    """What a batch (`mqar_batch`, `mqar_mix`) drew, from its "distance": the shortcuts that need no key match.

    {"queries": n, "counts": {distance: queries}, "distinct": distances drawn, "commonest": the commonest distance,
    "commonest_share": its share of the queries (what the best fixed offset answers), "latest_value_share": the
    share of queries whose nearest earlier value is their own pair's (what "answer with the latest value"
    answers, values that repeat aside)}. Shares are None when the batch holds no query.
    """
    distance = batch["distance"]
    asked = distance >= 0
    drawn = distance[asked]
    counts = {int(d): int(n) for d, n in zip(*drawn.unique(return_counts=True), strict=True)}
    # values sit at query - distance + 1; the latest value before each position, by a running maximum
    rows, queries = asked.nonzero(as_tuple=True)
    values = torch.zeros_like(asked)
    values[rows, queries - drawn + 1] = True
    where = torch.arange(distance.shape[1]).expand_as(distance)
    latest = torch.where(values, where, -1).cummax(dim=1).values
    own = latest[rows, queries - 1] == queries - drawn + 1
    n = len(drawn)
    commonest = max(counts, key=lambda d: (counts[d], -d)) if counts else None
    return {"queries": n, "counts": counts, "distinct": len(counts), "commonest": commonest,
            "commonest_share": counts[commonest] / n if n else None,
            "latest_value_share": own.double().mean().item() if n else None}
