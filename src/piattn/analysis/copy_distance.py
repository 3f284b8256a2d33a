"""Loss by copy distance: how far back the byte to copy lies, against what each kind of attention reaches.

Copy distance. `tokens` long [N, T] holds N evaluation windows; the model predicts tokens[:, t] from
tokens[:, :t]. The context key of target t (t >= n) is tokens[t − n : t]. Its copy distance is

    d(t) = t − s  for the largest s with n <= s < t and tokens[s − n : s] == tokens[t − n : t],

i.e. the most recent earlier position whose preceding n tokens equal the target's: the byte at s is the
candidate to copy, and a model that predicts tokens[t] by copying must carry information across lag d
(from key t − d = s, or from its context just before it). d = NO_MATCH (−1) when there is no such s or
t < n. Only positions in the same window count: a window is all the model sees.

Why n = 4 (`COPY_N`, the default). On bytes of English text the n-gram before a target is what an
induction/copy mechanism would match on. n = 1 or 2 matches almost every byte within a few positions
(letter and bigram statistics, not copying), so nearly everything would land in the short-lag class.
n = 4 spans a short word with its space or a long word's fragment: a match then mostly means a repeated
word, name or phrase, while most repeated words still match (a longer n loses the short ones). A larger
n makes the matches sparser (more class N) and more often genuine copies of long strings, with longer
distances; a smaller n moves bytes towards short distances and class A. n <= 8 bytes pack exactly into
an int64 key; any n and vocabulary stays exact here (`_context_keys`), with no hash.

Classes. Each distance is classed against two reach descriptions (`Reach`): the reference, local
attention (window k = 5 in the evidence runs, L layers: lags 0 … k·L), and the kind under test (single π
or multi-scale π, from `piattn.analysis.multiscale.reachable_lags`); `lag_classes` holds the table.
The classes depend on the kind, so each kind gets its own codes over the same bytes. A model's Reach is
what its attention kind declares (`piattn.layers.AttentionLayer.lag_reach`, built from `reach`,
`local_reach` and `full_reach` here): this module names no kind.

Statistics. `compare_by_class` reports, per class, the byte count and the mean loss of a kind, and the
paired difference (kind − reference) on the same bytes with a percentile bootstrap interval whose unit
is a window (or a document, with `groups`): bytes of one window share a text and are not independent.
Run it once per training seed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from numbers import Real

import torch

from ..checks import is_int
from .multiscale import layer_hops, reachable_lags

COPY_N = 4
"""The context length n used for the evidence runs (module docstring: why)."""

NO_MATCH = -1
"""The copy distance of a target with no earlier match in its window (or t < n)."""

CLASSES = ("A", "B", "C", "D", "N")
"""Class codes: code i is the class CLASSES[i] (see `lag_classes`)."""

_A, _B, _C, _D, _N = range(len(CLASSES))
_INT64_LIMIT = 2**63
# The bootstrap builds its [resamples, units] weight matrix in chunks of at most this many entries.
_CHUNK = 1 << 22


def _check_int(name: str, value, minimum: int) -> int:
    if not is_int(value) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _check_tensor(name: str, value, ndim: int, kind: str) -> torch.Tensor:
    """value as a tensor of `ndim` dims whose dtype is of `kind` ("int", "float" or "bool")."""
    if not isinstance(value, torch.Tensor) or value.dim() != ndim:
        raise ValueError(f"{name} must be a {ndim}-D tensor, got {_describe(value)}")
    dtype_ok = {"int": not value.dtype.is_floating_point and not value.dtype.is_complex
                and value.dtype != torch.bool,
                "float": value.dtype.is_floating_point,
                "bool": value.dtype == torch.bool}[kind]
    if not dtype_ok:
        raise ValueError(f"{name} must be a {kind} tensor, got dtype {value.dtype}")
    return value


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dim()}-D tensor of shape {tuple(value.shape)}"
    return repr(value)


# --- copy distances --------------------------------------------------------------------------------

def _context_keys(tokens: torch.Tensor, n: int) -> torch.Tensor:
    """long [N, T − n]: [:, j] identifies the n-gram tokens[:, j : j + n] exactly (equal keys ⇔ equal
    n-grams, across the whole call). Requires T > n and tokens >= 0.

    Each token is a digit in base V = max(tokens) + 1; while the packed number stays below 2^63 it is
    the key itself (n <= 7 bytes always: 256^7 < 2^63; an 8th byte ranks the keys first). When one more
    digit would overflow, the keys so far are replaced by their dense ranks (torch.unique), which keeps
    them exact and < N·T, so any vocabulary and any n work without hashing."""
    width = tokens.shape[1] - n
    vocab = int(tokens.max()) + 1
    key = torch.zeros_like(tokens[:, :width])
    bound = 1  # every key < bound
    for i in range(n):
        if bound * vocab > _INT64_LIMIT:
            key = torch.unique(key, return_inverse=True)[1]
            bound = int(key.max()) + 1
        key = key * vocab + tokens[:, i : i + width]
        bound *= vocab
    return key


def copy_distances(tokens: torch.Tensor, n: int = COPY_N) -> torch.Tensor:
    """long [N, T]: the copy distance d(t) of every target of every window (module docstring), NO_MATCH
    where there is none.

    tokens: integer [N, T], values >= 0 (bytes, or token ids of any vocabulary); n: context length >= 1.
    Per window, the keys are sorted stably, so equal keys stay in position order and each position's
    previous occurrence is its left neighbour in the sorted order: O(N·T·log T), on tokens' device."""
    tokens = _check_tensor("tokens", tokens, 2, "int").long()
    n = _check_int("n", n, 1)
    if tokens.numel() and int(tokens.min()) < 0:
        raise ValueError(f"tokens must be >= 0, got a minimum of {int(tokens.min())}")
    N, T = tokens.shape
    dist = torch.full((N, T), NO_MATCH, dtype=torch.long, device=tokens.device)
    if n >= T or N == 0:
        return dist
    keys = torch.empty_like(tokens)
    # The first n targets have no context: distinct negative keys, which match nothing (real keys >= 0).
    keys[:, :n] = -1 - torch.arange(n, device=tokens.device)
    keys[:, n:] = _context_keys(tokens, n)
    sorted_keys, order = torch.sort(keys, dim=1, stable=True)
    repeat = sorted_keys[:, 1:] == sorted_keys[:, :-1]
    gap = order[:, 1:] - order[:, :-1]  # > 0 within a run of equal keys: the stable sort kept t ascending
    # order[:, 0] is the first occurrence of its key in the window, so it keeps NO_MATCH.
    return dist.scatter_(1, order[:, 1:], torch.where(repeat, gap, NO_MATCH))


def copy_lags(windows: torch.Tensor, n: int = COPY_N) -> torch.Tensor:
    """long [N, T]: for a language model's windows [N, T + 1] (inputs windows[:, :-1], targets
    windows[:, 1:]), the lag each target's copy spans, NO_MATCH where it has none.

    Target t of a window (windows[:, t], t >= 1) is predicted by the query at position t − 1; the token to
    copy sits at s = t − d (`copy_distances`). The query reads it across lag t − 1 − s = d − 1, which is
    what a kind's reach (lags from a query back to a key) must contain: column j of the result is the lag
    of target j + 1, in the order of the model's targets."""
    windows = _check_tensor("windows", windows, 2, "int")
    if windows.shape[1] < 2:
        raise ValueError(f"windows must hold T + 1 >= 2 tokens per row (inputs and targets), got {windows.shape[1]}")
    d = copy_distances(windows, n)[:, 1:]
    return torch.where(d == NO_MATCH, NO_MATCH, d - 1)


# --- classes ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Reach:
    """Which lags one kind of attention reaches after all its layers.

    reachable: bool [max_lag + 1], [d] = lag d reachable (`reachable_lags`); span: the largest reachable
    lag, which may exceed max_lag (L·max(k, π) for single π, k·L for local attention)."""

    reachable: torch.Tensor
    span: int

    def __post_init__(self):
        _check_tensor("reachable", self.reachable, 1, "bool")
        _check_int("span", self.span, 0)


def reach(window: int, schedule, max_lag: int) -> Reach:
    """The Reach of window k plus a skip schedule (periods per layer: `periods_per_layer(period, L, H)`
    for single π, any multi-scale Schedule) over lags 0 … max_lag. The span is the longest path: every
    layer's largest hop."""
    reachable = reachable_lags(window, schedule, max_lag)  # checks all three arguments
    return Reach(reachable, sum(max(layer_hops(window, periods)) for periods in schedule))


def local_reach(window: int, n_layer: int, max_lag: int) -> Reach:
    """The Reach of local attention alone (no skip): lags 0 … window·n_layer."""
    return reach(window, ((),) * _check_int("n_layer", n_layer, 0), max_lag)


def full_reach(max_lag: int) -> Reach:
    """The Reach of attention that reads every earlier key (dense): lags 0 … max_lag, span max_lag."""
    max_lag = _check_int("max_lag", max_lag, 0)
    return Reach(torch.ones(max_lag + 1, dtype=torch.bool), max_lag)


def lag_classes(kind: Reach, local: Reach) -> torch.Tensor:
    """long [max_lag + 1]: the class code (index into CLASSES) of each copy distance d = 0 … max_lag.

        class  copy distance d
        A      local attention reaches d (d <= k·L for window k, L layers)
        B      the kind reaches d, local attention does not (what the skips add)
        C      neither reaches d, and d < kind.span: one of the kind's gaps (single π: below L·max(k, π))
        D      neither reaches d, and d > kind.span: beyond every path of the kind
        N      no earlier match (d = NO_MATCH): not a lag, set by `copy_classes`

    A lag that local attention reaches is A whatever the kind, so every kind's A is the same bytes.
    kind.span is itself reachable, so C and D split the unreachable lags with nothing left over."""
    if kind.reachable.shape != local.reachable.shape:
        raise ValueError(f"kind and local must cover the same lags, got {kind.reachable.numel()} and "
                         f"{local.reachable.numel()} entries")
    lags = torch.arange(kind.reachable.numel(), device=kind.reachable.device)
    unreachable = torch.where(lags < kind.span, _C, _D)
    return torch.where(local.reachable, _A, torch.where(kind.reachable, _B, unreachable))


def copy_classes(distances: torch.Tensor, kind: Reach, local: Reach) -> torch.Tensor:
    """long [N, T]: the class code of every target (`lag_classes`; NO_MATCH is N).

    distances: long [N, T] from `copy_distances`; every distance must be <= the reaches' max_lag (take
    max_lag = T − 1)."""
    distances = _check_tensor("distances", distances, 2, "int")
    table = lag_classes(kind, local).to(distances.device)
    if distances.numel() and (int(distances.min()) < NO_MATCH or int(distances.max()) >= table.numel()):
        raise ValueError(f"distances must lie in {NO_MATCH} … {table.numel() - 1} (the reaches' max_lag), "
                         f"got {int(distances.min())} … {int(distances.max())}")
    return torch.where(distances == NO_MATCH, _N, table[distances.clamp(min=0)])


# --- statistics ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ClassStats:
    """One class of one kind. count: scored bytes in it; loss and reference_loss: their mean loss under
    the kind and the reference; diff = loss − reference_loss; low, high: its bootstrap interval. The
    means are nan for an empty class."""

    count: int
    loss: float
    reference_loss: float
    diff: float
    low: float
    high: float


def _unit_sums(values: torch.Tensor, unit: torch.Tensor, units: int) -> torch.Tensor:
    """float64 [units, len(CLASSES)]: the sum of `values` [M] over the bytes of each unit and class;
    `unit` [M] holds each byte's unit · len(CLASSES) + class."""
    return torch.bincount(unit, weights=values, minlength=units * len(CLASSES)).view(units, len(CLASSES))


def _bootstrap(diff_sums: torch.Tensor, counts: torch.Tensor, n_resamples: int, seed: int,
               level: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(low, high), float64 [C] each: the percentile interval of the class means of the differences.

    diff_sums, counts: float64 [G, C] per unit. A resample draws G units with replacement; its class
    mean is (w @ diff_sums) / (w @ counts) with w [G] the times each unit was drawn. Resamples in which
    a class is empty (0/0) are left out of that class's quantiles."""
    units = diff_sums.shape[0]
    both = torch.cat([diff_sums, counts], 1)  # [G, 2C]: one product gives numerators and denominators
    generator = torch.Generator().manual_seed(seed)
    chunk = max(1, _CHUNK // max(units, 1))
    means = []
    for start in range(0, n_resamples, chunk):
        rows = min(chunk, n_resamples - start)
        drawn = torch.randint(units, (rows, units), generator=generator)
        weights = torch.zeros(rows, units, dtype=torch.float64).scatter_add_(
            1, drawn, torch.ones(rows, units, dtype=torch.float64))
        num, den = (weights @ both).chunk(2, dim=1)
        means.append(num / den)
    tail = (1 - level) / 2
    quantiles = torch.tensor([tail, 1 - tail], dtype=torch.float64)
    low, high = torch.nanquantile(torch.cat(means), quantiles, dim=0)
    return low, high


def paired_class_stats(loss: torch.Tensor, reference_loss: torch.Tensor, codes: torch.Tensor, *,
                       scored: torch.Tensor | None = None, groups: torch.Tensor | None = None,
                       n_resamples: int = 1000, seed: int = 0, level: float = 0.95) -> dict[str, ClassStats]:
    """{class: ClassStats} for every class in CLASSES: one kind's per-byte loss against the reference's.

    loss, reference_loss: float [N, T], the loss of each target byte (same windows, same order);
    codes: long [N, T] from `copy_classes`; scored: bool [N, T], the bytes to count (default all; e.g.
    leave out the targets an evaluation does not score); groups: long [N], the document of each window,
    to resample documents instead of windows. The interval is the percentile bootstrap at `level` over
    n_resamples resamples of the units, the same resamples for every class and, for one seed, for every
    kind (common random numbers; deterministic given the seed)."""
    loss = _check_tensor("loss", loss, 2, "float")
    shape = loss.shape
    reference_loss = _check_tensor("reference_loss", reference_loss, 2, "float")
    codes = _check_tensor("codes", codes, 2, "int")
    scored = torch.ones(shape, dtype=torch.bool) if scored is None else _check_tensor("scored", scored, 2, "bool")
    for name, value in (("reference_loss", reference_loss), ("codes", codes), ("scored", scored)):
        if value.shape != shape:
            raise ValueError(f"{name} must have the shape of loss {tuple(shape)}, got {tuple(value.shape)}")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= len(CLASSES)):
        raise ValueError(f"codes must lie in 0 … {len(CLASSES) - 1} (indices into CLASSES)")
    if groups is None:
        unit_of_row, units = torch.arange(shape[0]), shape[0]
    else:
        groups = _check_tensor("groups", groups, 1, "int")
        if groups.shape[0] != shape[0]:
            raise ValueError(f"groups must have one entry per window ({shape[0]}), got {groups.shape[0]}")
        _, unit_of_row = torch.unique(groups.cpu(), return_inverse=True)
        units = int(unit_of_row.max()) + 1 if unit_of_row.numel() else 0
    n_resamples = _check_int("n_resamples", n_resamples, 1)
    seed = _check_int("seed", seed, 0)
    if isinstance(level, bool) or not isinstance(level, Real) or not 0 < level < 1:
        raise ValueError(f"level must be a number in (0, 1), got {level!r}")

    keep = scored.cpu()
    unit = (unit_of_row[:, None] * len(CLASSES) + codes.cpu().long())[keep]
    counts = _unit_sums(torch.ones(unit.shape, dtype=torch.float64), unit, units)
    sums = _unit_sums(loss.detach().cpu().double()[keep], unit, units)
    reference_sums = _unit_sums(reference_loss.detach().cpu().double()[keep], unit, units)
    low, high = _bootstrap(sums - reference_sums, counts, n_resamples, seed, level)
    total, mean, reference_mean = counts.sum(0), sums.sum(0), reference_sums.sum(0)
    mean, reference_mean = mean / total, reference_mean / total
    return {name: ClassStats(int(total[c]), float(mean[c]), float(reference_mean[c]),
                             float(mean[c] - reference_mean[c]), float(low[c]), float(high[c]))
            for c, name in enumerate(CLASSES)}


def compare_by_class(losses: Mapping[str, torch.Tensor], codes: torch.Tensor | Mapping[str, torch.Tensor],
                     reference: str, **options) -> dict[str, dict[str, ClassStats]]:
    """{kind: {class: ClassStats}}: `paired_class_stats` of every kind in `losses` against
    losses[reference] (the reference's own row has diff 0 and the interval [0, 0]).

    losses: {kind: float [N, T]} from one training seed, all on the same windows; codes: long [N, T]
    shared by all kinds, or {kind: long [N, T]} (each kind classed by its own reach, `copy_classes`);
    options: scored, groups, n_resamples, seed, level of `paired_class_stats`."""
    if not isinstance(losses, Mapping) or reference not in losses:
        raise ValueError(f"reference must name a kind of losses, got {reference!r} "
                         f"(kinds: {list(losses) if isinstance(losses, Mapping) else losses!r})")
    if isinstance(codes, Mapping) and set(codes) != set(losses):
        raise ValueError(f"codes must have the kinds of losses {sorted(losses)}, got {sorted(codes)}")
    return {kind: paired_class_stats(loss, losses[reference], codes[kind] if isinstance(codes, Mapping) else codes,
                                     **options)
            for kind, loss in losses.items()}
