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

Targets follow `piattn.data.recall`: targets[p] is what the logits at position p must predict, so the answer
sits at the query itself, targets[q_i] = v_i (never a token of the sequence after q_i), and every other position
holds IGNORE (-100,
the default ignore_index of `torch.nn.functional.cross_entropy`). Pair i's distance is q_i - 2i.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from ..checks import is_int

IGNORE = -100


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
    """`_windows`, ValueError naming distance_bin unless every pair can take a query in it."""
    first, last = _windows(seq_len, n_pairs, distance_bin)
    if not _fits(first, last, [False] * seq_len, [None] * n_pairs):
        raise ValueError(f"distance_bin {distance_bin} cannot fit {n_pairs} queries in seq_len {seq_len}: pair i's "
                         f"key is at 2i and every query must sit in [2 * n_pairs, seq_len - 2] without overlap")
    return first, last


def check(seq_len: int, n_pairs: int, *, key_vocab: int, value_vocab: int,
          distance_bin: tuple[int, int] | None = None) -> None:
    """The ValueError (naming the argument) `mqar_batch` would raise for these settings, without drawing."""
    _check_sizes(0, seq_len, n_pairs, key_vocab, value_vocab)
    _check_fit(seq_len, n_pairs, distance_bin)


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


def _assemble(keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor, seq_len: int,
              filler: int) -> dict[str, torch.Tensor]:
    """keys, values, queries int64 [B, N] -> tokens, targets, distance int64 [B, seq_len] (module layout)."""
    n_examples, n_pairs = keys.shape
    rows = torch.arange(n_examples)[:, None]
    pairs = 2 * torch.arange(n_pairs)
    tokens = torch.full((n_examples, seq_len), filler, dtype=torch.int64)
    tokens[:, pairs], tokens[:, pairs + 1] = keys, values
    tokens[rows, queries] = keys  # the answer is the target only, never a token after the query
    targets = torch.full_like(tokens, IGNORE)
    targets[rows, queries] = values
    distance = torch.full_like(tokens, -1)
    distance[rows, queries] = queries - pairs
    return dict(tokens=tokens, targets=targets, distance=distance)


def mqar_batch(n_examples: int, seq_len: int, n_pairs: int, *, key_vocab: int, value_vocab: int,
               distance_bin: tuple[int, int] | None = None, distances: Sequence[int] | torch.Tensor | None = None,
               generator: torch.Generator) -> dict:
    """n_examples MQAR sequences (layout, ids and targets in the module docstring); deterministic per generator.

    Key–query distances, at most one of:
        neither          each query anywhere after the pairs (uniform within what fits)
        distance_bin     (lo, hi): every pair's distance in [lo, hi], uniform within what fits
        distances        explicit, int [n_pairs] (the same for every example) or [n_examples, n_pairs]
    In every case queries never overlap the pairs or each other. Raises ValueError naming the argument when the
    request cannot fit (n_pairs > seq_len / 4, key_vocab < n_pairs, hi > seq_len - 2, an unreachable bin, ...).

    Returns {"tokens", "targets", "distance": int64 [n_examples, seq_len], "n_pairs": int}: targets IGNORE but at
    the queries (their values), distance -1 but at the queries (query position - key position).
    """
    _check_sizes(n_examples, seq_len, n_pairs, key_vocab, value_vocab)
    if distances is not None and distance_bin is not None:
        raise ValueError("distances and distance_bin are exclusive: give explicit distances or a bin, not both")
    if distances is None:
        queries = _binned_queries(n_examples, seq_len, n_pairs, distance_bin, generator)
    else:
        queries = _explicit_queries(distances, n_examples, seq_len, n_pairs)
    # Distinct keys: the first n_pairs of a random permutation of the key vocabulary
    keys = torch.rand(n_examples, key_vocab, generator=generator).argsort(dim=1)[:, :n_pairs]
    values = torch.randint(key_vocab, key_vocab + value_vocab, (n_examples, n_pairs), generator=generator)
    batch = _assemble(keys, values, queries, seq_len, filler=key_vocab + value_vocab)
    return dict(batch, n_pairs=n_pairs)


def mqar_mix(n_examples: int, seq_len: int, pair_counts: Sequence[int], *, key_vocab: int, value_vocab: int,
             distance_bins: Sequence[tuple[int, int] | None] = (None,), stratified: bool = False,
             generator: torch.Generator) -> dict:
    """n_examples MQAR sequences whose number of pairs and distance bin vary per example; deterministic per
    generator. What `piattn train --task mqar` trains and scores (--mqar-pairs, --mqar-distance).

    Each example takes one combination (n_pairs, distance_bin) of pair_counts × distance_bins (None: anywhere,
    as in `mqar_batch`): drawn uniformly, or with `stratified` each combination in turn (shuffled), so every
    one holds n_examples / combinations examples up to one. The examples of each combination are then drawn by
    one `mqar_batch` call, combinations in order, from the same generator; with a single combination nothing
    is drawn first, so the result is `mqar_batch`'s own.

    Returns {"tokens", "targets", "distance": int64 [n_examples, seq_len], "n_pairs": int64 [n_examples]}, the
    layout of `mqar_batch` row by row. ValueError naming the argument as `mqar_batch` does.
    """
    _check_int("n_examples", n_examples, 0)
    combos = [(int(n), b) for n in pair_counts for b in distance_bins]
    if not combos:
        raise ValueError("pair_counts and distance_bins must each hold at least one entry")
    for n_pairs, distance_bin in combos:
        check(seq_len, n_pairs, key_vocab=key_vocab, value_vocab=value_vocab, distance_bin=distance_bin)
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
                          distance_bin=distance_bin, generator=generator)
        for key in ("tokens", "targets", "distance"):
            out[key][rows] = part[key]
        out["n_pairs"][rows] = n_pairs
    return out
