"""Random-lag key–value recall: find the marker, return the symbol after it, wherever it sits.

One sequence of length seq_len, with q = seq_len - 1 the query position and lag drawn per example:

    tokens[:q]           independent uniform symbols 0 … n_symbols-1 (the filler, and the value)
    tokens[q - lag - 1]  the marker, id n_symbols (the key)
    tokens[q - lag]      the value: a filler symbol, the answer
    tokens[q]            the query, id n_symbols + 1 (a model needs n_symbols + 2 input ids)

Unlike `piattn.data.reach`, the lag is not fixed: the query cannot look at one offset, it must find the
marker by content and copy what follows it. Read the answer out at q only (a causal LM's last logits);
then, in the terms of `piattn.analysis`, it needs query q to reach both the value (lag d = lag) and the
marker (d = lag + 1). Every other token is independent of the answer, so chance is 1 / n_symbols.

`value_first=True` is the option for when that is too slow to learn: the marker then sits right AFTER
the value (tokens[q - lag + 1], so lag >= 2 and the query must reach lags lag and lag - 1). A model can
then copy the value into the marker with a previous-token head and find the marker by its own id, where
the plain order needs a tag "my predecessor is the marker" built on every token and searched for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import is_int


@dataclass(frozen=True)
class RecallExamples:
    """n examples: tokens int64 [n, seq_len] (query last), answer int64 [n] (the value), lag int64 [n]."""

    tokens: torch.Tensor
    answer: torch.Tensor
    lag: torch.Tensor

    def __len__(self) -> int:
        return len(self.answer)


def _check_int(name: str, value: object, low: int) -> None:
    if not is_int(value) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def lag_bounds(seq_len: int, value_first: bool = False) -> tuple[int, int]:
    """The smallest and largest lag a sequence of seq_len has room for: [1, seq_len - 2], or [2, seq_len - 1]
    when the value comes first (the marker then sits between the value and the query)."""
    return (2, seq_len - 1) if value_first else (1, seq_len - 2)


def check(seq_len: int, n_symbols: int, lag_min: int, lag_max: int, value_first: bool = False) -> None:
    """ValueError naming the argument unless the lags fit (`lag_bounds`), lag_min <= lag_max, n_symbols >= 2."""
    _check_int("seq_len", seq_len, 3)
    _check_int("n_symbols", n_symbols, 2)
    low, high = lag_bounds(seq_len, value_first)
    _check_int("lag_min", lag_min, low)
    _check_int("lag_max", lag_max, low)
    if lag_max > high:
        where = "between the value and the query" if value_first else "at lag + 1"
        raise ValueError(f"lag_max must be <= {high} for seq_len {seq_len} (the marker sits {where}), "
                         f"got {lag_max}")
    if lag_min > lag_max:
        raise ValueError(f"lag_min must be <= lag_max = {lag_max}, got {lag_min}")


def generate(n: int, *, seed: int, seq_len: int, n_symbols: int, lag_min: int, lag_max: int,
             stratified: bool = False, value_first: bool = False) -> RecallExamples:
    """n examples, deterministic per seed; lag uniform in [lag_min, lag_max].

    value_first: the marker right after the value instead of right before it (see the module docstring).

    stratified: lags lag_min, lag_min + 1, … in turn (shuffled), so every lag gets n / (number of lags)
    examples up to one: an evaluation split then measures every lag equally well.
    """
    _check_int("n", n, 0)
    check(seq_len, n_symbols, lag_min, lag_max, value_first)
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, n_symbols, (n, seq_len), generator=generator, dtype=torch.int64)
    span = lag_max - lag_min + 1
    if stratified:
        lag = lag_min + torch.arange(n, dtype=torch.int64)[torch.randperm(n, generator=generator)] % span
    else:
        lag = torch.randint(lag_min, lag_max + 1, (n,), generator=generator, dtype=torch.int64)
    query = seq_len - 1
    rows = torch.arange(n)
    tokens[rows, query - lag + (1 if value_first else -1)] = n_symbols
    tokens[:, query] = n_symbols + 1
    return RecallExamples(tokens, tokens[rows, query - lag].clone(), lag)
