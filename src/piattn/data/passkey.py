"""Passkey retrieval in real text: a short key stated once, asked for d tokens later, scored as exact recall.

One example, in a causal LM's token ids (built from separately tokenized pieces, so every count is exact):

    prefix     `prefix` tokens of book text (so that the key is never among a converted model's sinks)
    statement  " The pass key is 48213. Remember it."
    filler     book text, continuing the prefix's span (the statement is inserted into running text)
    question   " What is the pass key? The pass key is" (+ the tokenizer's lone space token, if it has one)
    answer     the key's tokens ("4", "8", "2", "1", "3" for SmolLM2, which spells numbers digit by digit)

The **distance** d is the lag, in tokens, from the query that predicts the first answer token (the question's
last token, `PasskeyExample.query_position`) to the key's first token in the statement
(`PasskeyExample.key_position`): d = query_position − key_position. Answer token j is predicted at
query_position + j and is the statement's token key_position + j, so every answer token is read at the same
lag d (what an induction head must reach). The filler's length is what sets d; the shortest d a template
allows (no filler) is `PasskeyTemplate.min_distance`, about 19 for SmolLM2. An example is
prefix + key + d + answer tokens long (`PasskeyTemplate.length`): the sequences are as long as their
distance needs, so that short distances cost little; the key always sits `prefix` tokens into the text.

**Scoring** (`score_examples`): one forward over the whole example, teacher-forced; an example is retrieved
when every answer token is the argmax of its logits. That is exactly greedy decoding of as many tokens as
the key has: greedy decoding emits the argmax at each step, so it reproduces the key iff each argmax given the
correct previous tokens is correct (the first wrong one is where greedy decoding leaves the key). Also kept:
the number of answer tokens right, and the mean cross-entropy of the answer tokens.

**Distances** come in bins (`distance_bins`): from the template's shortest distance to the longest the context
allows, cut at 2^k + 1 (so 33–64, 65–128, …: a power-of-two window W is a bin edge, and the bins above it are
beyond the window). The test set (`evaluation_examples`) draws `per_bin` examples per bin, d uniform in the bin;
training examples (`train_example`) draw a bin uniformly, then d in it. Every example is a function of (seed,
bin, index) or (seed, step) alone (its own `random.Random`), so a set is the same whatever else was drawn, and
training resumed at step s gets the examples it would have had. The filler is a span of a token stream
(`filler_stream`: the documents of any `piattn.data.text.load_documents` source, tokenized and joined).

Comparisons (`paired_bootstrap`): two models' exact-retrieval indicators on the same examples, the mean
difference and its 95% percentile interval from resampling the examples within each bin (paired).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

STATEMENT = " The pass key is {key}. Remember it."
QUESTION = " What is the pass key? The pass key is"
KEY_DIGITS = 5


@dataclass(frozen=True)
class PasskeyExample:
    """One example: ids [L] int64, the key, its distance and where things sit (see the module docstring)."""

    ids: torch.Tensor
    key: str
    distance: int
    key_position: int  # the key's first token in the statement
    answer_start: int  # the first answer token; answer_start + answer_length == len(ids)
    answer_length: int
    bin: int = -1  # index of its distance bin (-1: none)

    @property
    def query_position(self) -> int:
        """The position whose logits predict the first answer token."""
        return self.answer_start - 1

    @property
    def answer(self) -> torch.Tensor:
        return self.ids[self.answer_start : self.answer_start + self.answer_length]


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _find(seq: Sequence[int], sub: Sequence[int]) -> int:
    """The first index where `sub` occurs in `seq` as a contiguous run, or -1."""
    n = len(sub)
    for i in range(len(seq) - n + 1):
        if list(seq[i : i + n]) == list(sub):
            return i
    return -1


class PasskeyTemplate:
    """The statement, question and answer of a key, as token ids of `tokenizer` (a Hugging Face one: called on
    a text it returns {"input_ids": [...]}).

    The answer is the tokens of " " + key; when the tokenizer gives the space a token of its own (the tokens
    of " " + key end with those of the key), that token goes to the question, so that the answer is the key's
    tokens alone. The answer must occur in the statement's tokens as it is (ValueError otherwise: the model
    could not copy it token for token).
    """

    def __init__(self, tokenizer, *, digits: int = KEY_DIGITS, statement: str = STATEMENT, question: str = QUESTION):
        if digits < 1:
            raise ValueError(f"digits must be >= 1, got {digits}")
        if "{key}" not in statement:
            raise ValueError(f"statement must contain '{{key}}', got {statement!r}")
        self.tokenizer, self.digits, self.statement_text, self.question_text = tokenizer, digits, statement, question
        self._question = _encode(tokenizer, question)

    def random_key(self, rng: random.Random) -> str:
        """`digits` decimal digits, the first not 0."""
        return str(rng.randrange(10 ** (self.digits - 1), 10**self.digits))

    def pieces(self, key: str) -> tuple[list[int], int, list[int], list[int]]:
        """(statement ids, index of the key's first token in them, question ids, answer ids) for `key`."""
        spaced, bare = _encode(self.tokenizer, " " + key), _encode(self.tokenizer, key)
        question = list(self._question)
        if len(spaced) > len(bare) and spaced[len(spaced) - len(bare):] == bare:
            question += spaced[: len(spaced) - len(bare)]
            answer = bare
        else:
            answer = spaced
        statement = _encode(self.tokenizer, self.statement_text.format(key=key))
        offset = _find(statement, answer)
        if offset < 0 or not answer:
            raise ValueError(f"the answer tokens {answer} of key {key!r} do not occur in the statement's tokens "
                             f"{statement}: this tokenizer joins the key with its neighbours; change the template")
        return statement, offset, question, answer

    def min_distance(self, key: str | None = None) -> int:
        """The shortest distance (no filler between the statement and the question) for `key` (default: 1…1)."""
        statement, offset, question, _ = self.pieces(key or "1" * self.digits)
        return len(statement) - offset + len(question) - 1

    def length(self, distance: int, prefix: int, key: str | None = None) -> int:
        """Tokens in an example of `distance` with `prefix` tokens before the statement."""
        _, offset, _, answer = self.pieces(key or "1" * self.digits)
        return prefix + offset + distance + 1 + len(answer)

    def max_distance(self, context: int, prefix: int, key: str | None = None) -> int:
        """The longest distance whose example fits `context` tokens."""
        return context - self.length(0, prefix, key)


def make_example(template: PasskeyTemplate, stream: torch.Tensor, distance: int, rng: random.Random, *,
                 prefix: int, bin: int = -1) -> PasskeyExample:
    """An example of exactly `distance`, its key and filler drawn with `rng` (a span of `stream`, [N] int64)."""
    key = template.random_key(rng)
    statement, offset, question, answer = template.pieces(key)
    filler = distance - (len(statement) - offset) - len(question) + 1
    if filler < 0:
        raise ValueError(f"distance {distance} is below this template's shortest, "
                         f"{template.min_distance(key)} (the statement and the question with no filler)")
    if prefix < 0:
        raise ValueError(f"prefix must be >= 0, got {prefix}")
    span = prefix + filler
    if span > len(stream):
        raise ValueError(f"the filler stream has {len(stream)} tokens, fewer than the {span} this example needs")
    start = rng.randrange(0, len(stream) - span + 1)
    text = stream[start : start + span].tolist()
    ids = text[:prefix] + statement + text[prefix:] + question + answer
    answer_start = len(ids) - len(answer)
    example = PasskeyExample(torch.tensor(ids, dtype=torch.long), key, distance, prefix + offset, answer_start,
                             len(answer), bin)
    assert example.query_position - example.key_position == distance
    return example


def distance_bins(min_distance: int, max_distance: int) -> list[tuple[int, int]]:
    """Bins (low, high), both inclusive, covering min_distance … max_distance, cut after each power of two
    strictly between them: (19, 32), (33, 64), (65, 128), … , (2^k + 1, max_distance)."""
    if min_distance < 1 or max_distance < min_distance:
        raise ValueError(f"need 1 <= min_distance <= max_distance, got {min_distance} and {max_distance}")
    cuts = [2**k for k in range(1, max_distance.bit_length() + 1) if min_distance < 2**k < max_distance]
    lows = [min_distance] + [c + 1 for c in cuts]
    highs = cuts + [max_distance]
    return list(zip(lows, highs, strict=True))


def bins_beyond(bins: Sequence[tuple[int, int]], window: int) -> list[int]:
    """Indices of the bins whose every distance is beyond a local window of `window` (low > window: the key
    lies outside the window of the query that reads it)."""
    return [b for b, (low, _) in enumerate(bins) if low > window]


def parse_bins(spec: str) -> list[tuple[int, int]]:
    """'19-32,33-64,65-128' -> [(19, 32), (33, 64), (65, 128)]; ValueError for anything else."""
    bins = []
    for part in spec.split(","):
        low, sep, high = part.strip().partition("-")
        if not sep or not low.strip().isdigit() or not high.strip().isdigit():
            raise ValueError(f"distance bins must be LOW-HIGH pairs separated by commas, got {spec!r}")
        bins.append((int(low), int(high)))
    for (a, b), (c, _) in zip(bins, bins[1:] + [(None, None)], strict=True):
        if a < 1 or b < a or (c is not None and c <= b):
            raise ValueError(f"distance bins must be 1 <= LOW <= HIGH and increase without overlap, got {spec!r}")
    return bins


def _check_bins(template: PasskeyTemplate, bins: Sequence[tuple[int, int]]) -> None:
    if not bins:
        raise ValueError("bins must not be empty")
    shortest = template.min_distance()
    if bins[0][0] < shortest:
        raise ValueError(f"the first bin starts at {bins[0][0]}, below the template's shortest distance {shortest}")


def evaluation_examples(template: PasskeyTemplate, stream: torch.Tensor, bins: Sequence[tuple[int, int]],
                        per_bin: int, *, seed: int, prefix: int) -> list[PasskeyExample]:
    """`per_bin` examples per bin, bin by bin; example i of bin b depends on (seed, b, i) only."""
    _check_bins(template, bins)
    out = []
    for b, (low, high) in enumerate(bins):
        for i in range(per_bin):
            rng = random.Random(f"passkey-test:{seed}:{b}:{i}")
            out.append(make_example(template, stream, rng.randint(low, high), rng, prefix=prefix, bin=b))
    return out



def train_example(template: PasskeyTemplate, stream: torch.Tensor, bins: Sequence[tuple[int, int]], *, seed: int,
                  step: int, prefix: int) -> PasskeyExample:
    """Training example number `step` of data order `seed`: a bin drawn uniformly, then d uniform in it."""
    _check_bins(template, bins)
    rng = random.Random(f"passkey-train:{seed}:{step}")
    b = rng.randrange(len(bins))
    return make_example(template, stream, rng.randint(*bins[b]), rng, prefix=prefix, bin=b)


def filler_stream(source: str, split: str | None, tokenizer, *, max_chars: int | None = None) -> torch.Tensor:
    """[N] int64: the documents of `source` [split] (`piattn.data.text.load_documents`; split None for a
    source without splits), tokenized one by one and joined; at most `max_chars` characters are read."""
    from .text import load_documents

    ids: list[int] = []
    used = 0
    for doc in load_documents(source, split):
        if max_chars is not None:
            doc = doc[: max_chars - used]
        ids += _encode(tokenizer, doc)
        used += len(doc)
        if max_chars is not None and used >= max_chars:
            break
    return torch.tensor(ids, dtype=torch.long)


def answer_logits(model, example: PasskeyExample, mask: torch.Tensor | None = None) -> torch.Tensor:
    """[answer_length, vocab] fp32: the logits that predict each answer token, from one teacher-forced forward
    of `model` (a transformers causal LM, or anything called the same way) over the example less its last
    token, which predicts nothing. `logits_to_keep` asks for the last answer_length positions' logits only
    (the output layer on every position is a fifth of a small model's forward); `mask`: a 4D additive
    attention mask over those L − 1 positions, or None."""
    extra = {} if mask is None else dict(attention_mask=mask)
    A = example.answer_length
    logits = model(example.ids[None, :-1], use_cache=False, logits_to_keep=A, **extra).logits[0]
    return logits[-A:].float()


def answer_loss(model, example: PasskeyExample, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The mean cross-entropy of the answer tokens (a 0-dim tensor with its graph: the training loss)."""
    return F.cross_entropy(answer_logits(model, example, mask), example.answer)


def score_example(model, example: PasskeyExample, mask: torch.Tensor | None = None) -> dict:
    """{"correct": every answer token argmax-right (bool), "tokens": how many are, "loss": mean answer
    cross-entropy}, without gradients."""
    with torch.no_grad():
        logits = answer_logits(model, example, mask)
    right = logits.argmax(-1) == example.answer
    return dict(correct=bool(right.all()), tokens=int(right.sum()),
                loss=float(F.cross_entropy(logits, example.answer)))


def score_examples(model, examples: Sequence[PasskeyExample], *, mask_for: Callable[[int], torch.Tensor] | None = None,
                   progress: bool = False, label: str = "") -> dict:
    """`score_example` of each example: {"correct": [bool], "tokens": [int], "loss": [float]} in their order;
    `mask_for(T)`: the 4D additive mask for the T = L − 1 positions an example of L tokens is run on (the mask
    engine), or None."""
    from tqdm import tqdm

    out: dict[str, list] = dict(correct=[], tokens=[], loss=[])
    for ex in tqdm(examples, desc=label, unit="example", disable=not progress, dynamic_ncols=True):
        r = score_example(model, ex, None if mask_for is None else mask_for(len(ex.ids) - 1))
        for k in out:
            out[k].append(r[k])
    return out


def accuracy_by_bin(correct: Sequence, bins_of: Sequence[int], n_bins: int) -> list[float | None]:
    """The mean of `correct` over the examples of each bin (None for a bin without examples)."""
    sums, counts = [0.0] * n_bins, [0] * n_bins
    for c, b in zip(correct, bins_of, strict=True):
        sums[b] += float(c)
        counts[b] += 1
    return [s / n if n else None for s, n in zip(sums, counts, strict=True)]


def paired_bootstrap(a: Sequence, b: Sequence, strata: Sequence[int], *, n_resamples: int = 2000,
                     seed: int = 0) -> dict:
    """Mean of a − b over paired examples (a[i], b[i] scored on the same example i) and its 95% percentile
    interval, resampling the examples with replacement within each stratum (bin), so that every resample
    keeps each bin's count. {"difference", "low", "high", "n"}."""
    a_t, b_t = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    s = torch.as_tensor(strata, dtype=torch.long)
    if not (a_t.shape == b_t.shape == s.shape) or a_t.ndim != 1 or len(a_t) == 0:
        raise ValueError(f"a, b and strata must be equal-length, non-empty 1D sequences, got {len(a)}, {len(b)}, "
                         f"{len(strata)}")
    diff = a_t - b_t
    gen = torch.Generator().manual_seed(seed)
    total = torch.zeros(n_resamples, dtype=torch.float64)
    for value in s.unique():
        d = diff[s == value]
        pick = torch.randint(0, len(d), (n_resamples, len(d)), generator=gen)
        total += d[pick].sum(1)
    means = total / len(diff)
    low, high = torch.quantile(means, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return dict(difference=float(diff.mean()), low=low, high=high, n=len(diff))


def summarize_scores(scores: dict, examples: Sequence[PasskeyExample], n_bins: int, seconds: float) -> dict:
    """A record of `score_examples`' results: exact-retrieval accuracy overall and by bin, the share of key
    tokens right and the answer loss by bin, the per-example results (in the examples' order: "correct" as
    0/1, "tokens_right", "loss") and the seconds the scoring took."""
    bins_of = [e.bin for e in examples]
    share = [t / e.answer_length for t, e in zip(scores["tokens"], examples, strict=True)]
    return dict(accuracy=sum(scores["correct"]) / len(examples),
                accuracy_by_bin=accuracy_by_bin(scores["correct"], bins_of, n_bins),
                tokens_right_by_bin=accuracy_by_bin(share, bins_of, n_bins),
                loss_by_bin=accuracy_by_bin(scores["loss"], bins_of, n_bins),
                correct=[int(c) for c in scores["correct"]], tokens_right=list(scores["tokens"]),
                loss=[round(x, 4) for x in scores["loss"]], seconds=round(seconds, 1))


def compare_beyond(correct: Sequence, reference: Sequence, bins_of: Sequence[int], bins: Sequence[tuple[int, int]],
                   window: int, *, n_resamples: int = 2000, seed: int = 0) -> dict | None:
    """Two models' exact retrieval on the same examples, pooled over the bins beyond `window` (`bins_beyond`):
    {"accuracy", "reference_accuracy", "difference", "low", "high", "n"} (`paired_bootstrap`, stratified by
    bin); None when no bin lies beyond the window."""
    beyond = set(bins_beyond(bins, window))
    keep = [i for i, b in enumerate(bins_of) if b in beyond]
    if not keep:
        return None
    a, b = [correct[i] for i in keep], [reference[i] for i in keep]
    stats = paired_bootstrap(a, b, [bins_of[i] for i in keep], n_resamples=n_resamples, seed=seed)
    return dict(accuracy=sum(a) / len(a), reference_accuracy=sum(b) / len(b), **stats)
