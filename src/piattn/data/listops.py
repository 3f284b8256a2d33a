"""ListOps (Nangia & Bowman 2018) as generated for the Long Range Arena: nested list operations on digits.

An example is a prefix expression such as "[MAX 2 9 [MIN 4 7 ] 0 ]" and its value, a digit 0–9:
- `[MIN`, `[MAX`: smallest / largest argument;
- `[MED`: the median as LRA computes it, `int(np.median(args))`. For an even count that is the mean of
  the two middle values rounded down (values are >= 0, so int() floors): MED(3, 8, 2, 9) = ⌊(3 + 8)/2⌋ = 5,
  not the lower middle 3;
- `[SM`: sum modulo 10.
Each operator takes 2 to `max_args` arguments and is closed by `]`.

Generation follows LRA's `generate_tree`: a node at depth < max_depth (the root has depth 1) is an
operator with probability 1/4, else a uniform digit; a node at max_depth is always a digit, so an
expression has at most max_depth levels counting the digits (`depth`). Expressions are drawn until their
token count lies strictly between min_length and max_length (LRA: 500 < length < 2000), duplicates are
dropped as LRA does. A tree is abandoned as soon as it passes max_length, which keeps the distribution of
accepted trees and makes generation fast.

Official LRA files (`basic_train.tsv`, …) write each binary node of LRA's tree in parentheses:
"( ( ( [MAX 2 ) 9 ) ] )". The parentheses carry no information; `tokenize` drops them, so both forms map
to the same ids. (LRA's own tfds tokenizer also dropped `]`, which loses the tree structure; we keep it.)
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable, Sequence
from os import PathLike

import torch

from ..checks import is_int
from . import lra_tsv

MIN, MAX, MED, SUM_MOD, CLOSE = "[MIN", "[MAX", "[MED", "[SM", "]"
OPERATORS = (MIN, MAX, MED, SUM_MOD)
DIGITS = tuple(str(v) for v in range(10))
PAD = "<pad>"
TOKENS = (PAD, *OPERATORS, CLOSE, *DIGITS)  # token id = index; the padding id is 0
PAD_ID = 0
VOCAB_SIZE = len(TOKENS)
TOKEN_IDS = {token: i for i, token in enumerate(TOKENS)}
TSV_COLUMNS = ("Source", "Target")
_PARENTHESES = frozenset("()")
_OPERATOR_P = 0.25  # LRA's VALUE_P: a node below max_depth is an operator with this probability
# The defaults accept about one draw in ten; this many misses in a row means the bounds cannot be met.
_MAX_MISSES = 100_000


def apply(operator: str, args: Sequence[int]) -> int:
    """Value of `operator` (one of OPERATORS) on a non-empty list of digits."""
    if not args:
        raise ValueError(f"{operator} needs at least one argument")
    if operator == MIN:
        return min(args)
    if operator == MAX:
        return max(args)
    if operator == SUM_MOD:
        return sum(args) % 10
    if operator == MED:
        s = sorted(args)
        mid = len(s) // 2
        return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) // 2
    raise ValueError(f"operator must be one of {OPERATORS}, got {operator!r}")


class _TooLong(Exception):
    """Raised inside the recursion to abandon a tree that has already passed max_length."""


def _grow(rng: random.Random, level: int, max_depth: int, max_args: int, out: list[str], limit: int) -> int:
    """Append one subtree's tokens to `out` and return its value; raise _TooLong once len(out) >= limit."""
    if level >= max_depth or rng.random() >= _OPERATOR_P:
        value = rng.randrange(10)
        out.append(DIGITS[value])
    else:
        operator = OPERATORS[rng.randrange(len(OPERATORS))]
        out.append(operator)
        args = [_grow(rng, level + 1, max_depth, max_args, out, limit) for _ in range(rng.randint(2, max_args))]
        out.append(CLOSE)
        value = apply(operator, args)
    if len(out) >= limit:
        raise _TooLong
    return value


def _largest_tree(max_depth: int, max_args: int) -> int:
    """Token count of the biggest expression: every node above the last level an operator with max_args args."""
    size = 1
    for _ in range(max_depth - 1):
        size = 2 + max_args * size
    return size


def generate(n: int, seed: int = 0, *, min_length: int = 500, max_length: int = 2000, max_depth: int = 10,
             max_args: int = 10) -> list[tuple[str, int]]:
    """n distinct examples (source, target): source in LRA's token form, target its value 0–9.

    Token counts lie strictly between min_length and max_length; deterministic for a given seed.
    """
    for name, value, low in (("n", n, 0), ("max_depth", max_depth, 1), ("max_args", max_args, 2),
                             ("min_length", min_length, 0)):
        if not is_int(value) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if not isinstance(max_length, int) or max_length - min_length < 2:
        raise ValueError(f"max_length must be an integer >= min_length + 2 = {min_length + 2}, got {max_length!r}")
    if _largest_tree(max_depth, max_args) <= min_length:
        raise ValueError(f"min_length={min_length} is out of reach: with max_depth={max_depth} and "
                         f"max_args={max_args} an expression has at most {_largest_tree(max_depth, max_args)} tokens")
    rng = random.Random(seed)
    examples: list[tuple[str, int]] = []
    seen: set[str] = set()
    misses = 0
    while len(examples) < n:
        misses += 1
        if misses > _MAX_MISSES:
            raise ValueError(f"no new expression with {min_length} < tokens < {max_length} in {_MAX_MISSES} "
                             f"draws (max_depth={max_depth}, max_args={max_args}): widen the length bounds")
        tokens: list[str] = []
        try:
            value = _grow(rng, 1, max_depth, max_args, tokens, max_length)
        except _TooLong:
            continue
        source = " ".join(tokens)
        if len(tokens) > min_length and source not in seen:
            seen.add(source)
            examples.append((source, value))
            misses = 0
    return examples


def tokenize(source: str) -> list[str]:
    """Whitespace-separated tokens of `source` without LRA's parentheses; unknown tokens raise ValueError."""
    tokens = [t for t in source.split() if t not in _PARENTHESES]
    for t in tokens:
        if t not in TOKEN_IDS or t == PAD:
            raise ValueError(f"unknown ListOps token {t!r}; allowed: {', '.join(TOKENS[1:])}, '(' and ')'")
    return tokens


def evaluate(source: str) -> int:
    """Value of an expression (our form or LRA's parenthesised form), parsed with an explicit stack."""
    stack: list[tuple[str, list[int]]] = []
    result: list[int] = []
    for token in tokenize(source):
        if token in OPERATORS:
            stack.append((token, []))
            continue
        if token == CLOSE:
            if not stack:
                raise ValueError(f"unbalanced ']' in {source[:60]!r}")
            operator, args = stack.pop()
            value = apply(operator, args)
        else:
            value = int(token)
        (stack[-1][1] if stack else result).append(value)
    if stack or len(result) != 1:
        raise ValueError(f"not one complete expression ({len(stack)} unclosed, {len(result)} top-level "
                         f"values): {source[:60]!r}")
    return result[0]


def depth(source: str) -> int:
    """Levels of the expression tree, digits included: "7" -> 1, "[MAX 2 9 ]" -> 2 (LRA's max_depth)."""
    open_operators = deepest = 0
    for token in tokenize(source):
        if token in OPERATORS:
            open_operators += 1
        elif token == CLOSE:
            open_operators -= 1
        else:
            deepest = max(deepest, open_operators + 1)
    return deepest


def encode(sources: Sequence[str], length: int = 2000) -> torch.Tensor:
    """int64 [n, length]: token ids (TOKENS) of each source, right-padded with PAD_ID.

    A source longer than `length` raises ValueError: cutting an expression would change its value.
    """
    ids = torch.full((len(sources), length), PAD_ID, dtype=torch.int64)
    for row, source in enumerate(sources):
        tokens = tokenize(source)
        if len(tokens) > length:
            raise ValueError(f"source {row} has {len(tokens)} tokens, more than length={length}")
        ids[row, : len(tokens)] = torch.tensor([TOKEN_IDS[t] for t in tokens], dtype=torch.int64)
    return ids


def targets(examples: Sequence[tuple[str, int]]) -> torch.Tensor:
    """int64 [n]: the targets of (source, target) examples."""
    return torch.tensor([target for _, target in examples], dtype=torch.int64)


def class_balance(examples: Iterable[tuple[str, int]]) -> dict[int, float]:
    """Fraction of examples with each target 0–9 (every digit is a key; the fractions sum to 1)."""
    counts = Counter(target for _, target in examples)
    total = sum(counts.values())
    if total == 0:
        raise ValueError("examples must not be empty")
    return {v: counts.get(v, 0) / total for v in range(10)}


def write_tsv(examples: Iterable[tuple[str, int]], path: str | PathLike) -> None:
    """Write examples in LRA's layout: header "Source\\tTarget", then one "source\\ttarget" line each."""
    lra_tsv.write_tsv(path, TSV_COLUMNS, examples)


def read_tsv(path: str | PathLike) -> list[tuple[str, int]]:
    """Read (source, target) examples from our files or LRA's (`basic_train.tsv`, …; header required).

    Sources are returned as written (LRA's keep their parentheses); targets must be integers 0–9.
    """
    examples = []
    for number, (source, target) in lra_tsv.read_tsv(path, TSV_COLUMNS, header=True):
        if target.strip() not in DIGITS:
            raise ValueError(f"{path}:{number}: Target must be an integer 0–9, got {target!r}")
        examples.append((source, int(target)))
    return examples
