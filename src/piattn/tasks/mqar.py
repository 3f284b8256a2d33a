"""The MQAR task: multi-query associative recall, scored by key–query distance and number of pairs
(`piattn.data.mqar`).

A sequence opens with N key–value pairs and later asks for every key once; the model must answer each query
with its value. The loss and the accuracy count only the queries. Where recall asks one query per sequence,
MQAR asks N, so a pattern must hold many pairs at once; its accuracy by the distance from key to query
shows which distances its attention serves, which `piattn.analysis` predicts (the query needs the key, d
back, and its value, d - 1 back).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from ..config import GPTConfig, TrainConfig
from ..config.flags import flag
from ..data import mqar
from ..data.examples import Examples, compact
from ..models import GPT
from ..train.task import evaluation_sums, per_second
from .classification import ClassificationTask, SplitFlags, split_seed

PAIRS_SYNTAX = "a count '8', a list '8,16,32,64' or a range '8-64' of integers >= 1"
DISTANCE_SYNTAX = "'uniform' or distance bins 'LO-HI[,LO-HI...]' of integers, 1 <= LO <= HI"
LAGS_SYNTAX = "distances and ranges 'A-B,C,...' of integers >= 2, e.g. '2-8,17-20'"


def parse_pairs(text: str) -> tuple[int, ...]:
    """--mqar-pairs' text -> the pair counts, ascending: '8' -> (8,), '8,16' -> (8, 16), '8-11' -> (8, 9, 10, 11).
    ValueError naming the flag and its syntax otherwise."""
    text = text.strip()
    ranged = re.fullmatch(r"(\d+)\s*-\s*(\d+)", text)
    if ranged:
        low, high = int(ranged[1]), int(ranged[2])
        counts = tuple(range(low, high + 1)) if 1 <= low <= high else ()
    elif re.fullmatch(r"\d+(\s*,\s*\d+)*", text):
        counts = tuple(int(n) for n in text.split(","))
    else:
        counts = ()
    if not counts or min(counts) < 1 or len(set(counts)) != len(counts):
        raise ValueError(f"--mqar-pairs must be {PAIRS_SYNTAX}, each count once, got {text!r}")
    return tuple(sorted(counts))


def parse_distance(text: str) -> tuple[tuple[int, int] | None, ...]:
    """--mqar-distance's text -> the distance bins: 'uniform' -> (None,), '1-8,9-32' -> ((1, 8), (9, 32)).
    ValueError naming the flag and its syntax otherwise."""
    text = text.strip()
    if text == "uniform":
        return (None,)
    bins = [re.fullmatch(r"(\d+)\s*-\s*(\d+)", part.strip()) for part in text.split(",")]
    parsed = tuple((int(m[1]), int(m[2])) for m in bins if m)
    if len(parsed) != len(bins) or any(not 1 <= lo <= hi for lo, hi in parsed) or len(set(parsed)) != len(parsed):
        raise ValueError(f"--mqar-distance must be {DISTANCE_SYNTAX}, each bin once, got {text!r}")
    return parsed


def parse_lags(text: str) -> tuple[int, ...]:
    """--mqar-lags' text -> the distances, ascending, each once: '2-4,9' -> (2, 3, 4, 9) (the text
    `piattn.data.mqar.spans` writes). ValueError naming the flag and its syntax otherwise."""
    parts = [re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", part.strip()) for part in text.split(",")]
    if not all(parts) or any(int(m[1]) < 2 or (m[2] is not None and int(m[2]) < int(m[1])) for m in parts):
        raise ValueError(f"--mqar-lags must be {LAGS_SYNTAX}, got {text!r}")
    return tuple(sorted({d for m in parts for d in range(int(m[1]), int(m[2] or m[1]) + 1)}))


@dataclass
class MQARFlags:
    mqar_pairs: str | None = flag(None, "mqar: key–value pairs per sequence: a count '8', a list '8,16,32,64' or "
                                  "a range '8-64' (each example draws one; validation and test hold each equally "
                                  "often); every count <= seq-len / 4 (default 8)")
    mqar_keys: int | None = flag(None, "mqar: size of the key vocabulary, >= the most pairs (default 64)", low=1)
    mqar_values: int | None = flag(None, "mqar: size of the value vocabulary (default 64; chance 1/values)",
                                   low=1)
    mqar_distance: str | None = flag(None, "mqar: where each query sits from its key: uniform (default: anywhere "
                                     "after the pairs) or distance bins 'LO-HI[,LO-HI...]' (each example draws one "
                                     "bin for all its pairs; validation and test hold each equally often)")
    mqar_layout: str | None = flag(None, "mqar: packed (default: the pairs open the sequence, the queries follow; "
                                   "pair 0's query is >= 2 × pairs away) or scattered (each pair's distance drawn "
                                   "from the bin or --mqar-lags, pairs and queries interleaved: short distances "
                                   "that no single offset serves)", choices=mqar.LAYOUTS)
    mqar_lags: str | None = flag(None, "mqar: draw every distance from these lags only, 'A-B,C,...' (e.g. the "
                                 "distances an arm serves: the within-reach control; default none, distances as "
                                 "--mqar-distance says); implies --mqar-layout scattered, excludes --mqar-distance")


class MQARTask(ClassificationTask):
    """MQAR: a causal `GPT` over keys + values + 1 ids (`mqar.vocab_size`), trained and scored at the queries.

    A split is a fixed set of `mqar.mqar_mix` sequences from the seed `split_seed(--data-seed, split)`;
    validation and test are stratified over the combinations of --mqar-pairs × --mqar-distance, training
    draws them uniformly. An `Examples`' labels are int [n, 2, seq_len]: the targets (IGNORE but at the
    queries) and the distance (-1 but at the queries). The prediction is over all ids, as in the recall task.
    """

    name = "mqar"
    default_seq_len = 64
    flags = (SplitFlags, MQARFlags)
    flag_notes = {"seq_len": f" {default_seq_len}"}
    report_sections = ("distances",)
    reach_carries = "the key and its value"
    validation_metrics = (*ClassificationTask.validation_metrics, "queries", "chance")
    DEFAULT_PAIRS = "8"
    DEFAULT_VOCAB = 64

    @classmethod
    def settings(cls, cfg: TrainConfig) -> dict:
        """`mqar.mqar_mix`'s arguments but n_examples, stratified and generator (defaults filled in)."""
        t = cfg.task
        lags = None if t.mqar_lags is None else parse_lags(t.mqar_lags)
        layout = t.mqar_layout or ("scattered" if lags is not None else "packed")
        return dict(seq_len=cfg.data.seq_len, pair_counts=parse_pairs(t.mqar_pairs or cls.DEFAULT_PAIRS),
                    key_vocab=t.mqar_keys or cls.DEFAULT_VOCAB, value_vocab=t.mqar_values or cls.DEFAULT_VOCAB,
                    distance_bins=parse_distance(t.mqar_distance or "uniform"), layout=layout, lags=lags)

    @classmethod
    def lags_needed(cls, cfg: TrainConfig, lags: list[int]) -> dict[int, tuple[int]]:
        """{distance d: (d - 1,)}: a query d after its key reads the key, d back, and its value, d - 1 back."""
        return {d: (d - 1,) for d in lags}

    @classmethod
    def sinks_note(cls, sinks: int) -> str:
        """A query sits anywhere, so a sink is no lag of it: the legend names the pairs the sinks hold."""
        if sinks < 2:
            return ""
        return (f"; the {sinks} sinks also hold pairs 0–{sinks // 2 - 1} (key and value among the first "
                f"{sinks} positions) at any distance, not marked")

    @classmethod
    def check_config(cls, cfg):
        if cfg.data.data is not None:
            raise ValueError("--data does not apply to --task mqar: its sequences are generated")
        t = cfg.task
        if t.mqar_lags is not None and t.mqar_distance is not None:
            raise ValueError("--mqar-lags and --mqar-distance are exclusive: the lags are the distances to draw from")
        if t.mqar_lags is not None and t.mqar_layout == "packed":
            raise ValueError("--mqar-lags needs --mqar-layout scattered (packed, pair 0's query is >= 2 × pairs "
                             "from its key)")
        s = cls.settings(cfg)
        seq_len, counts = s["seq_len"], s["pair_counts"]
        if seq_len < 4:
            raise ValueError(f"--seq-len must be >= 4 for --task mqar (a pair and its query), got {seq_len}")
        if counts[-1] > seq_len // 4:
            raise ValueError(f"--mqar-pairs: every count must be <= --seq-len / 4 = {seq_len // 4} (a pair takes "
                             f"two positions and its query two more), got {counts[-1]}")
        if s["key_vocab"] < counts[-1]:
            raise ValueError(f"--mqar-keys must be >= the most pairs, {counts[-1]} (the keys of a sequence are "
                             f"distinct), got {s['key_vocab']}")
        for n in counts:
            for distance_bin in s["distance_bins"]:
                if s["layout"] == "scattered":
                    cls._check_scattered(s, n, distance_bin, t)
                    continue
                try:
                    mqar.check(seq_len, n, key_vocab=s["key_vocab"], value_vocab=s["value_vocab"],
                               distance_bin=distance_bin)
                except ValueError:
                    if mqar.single_distance(seq_len, n, distance_bin) is None:
                        lo, hi = distance_bin
                        raise ValueError(
                            f"--mqar-distance {lo}-{hi} cannot hold {n} pairs in --seq-len {seq_len}: pair i's key "
                            f"sits at 2i and its query after all pairs, so with {n} pairs a bin needs LO <= "
                            f"{seq_len - 2 * n}, HI >= {2 * n} and HI <= {seq_len - 2}, and room for every query"
                        ) from None
                    shown = "uniform" if distance_bin is None else "-".join(map(str, distance_bin))
                    raise ValueError(
                        f"--mqar-distance {shown} puts every query at distance "
                        f"{mqar.single_distance(seq_len, n, distance_bin)} with {n} pairs in --seq-len {seq_len} "
                        f"(packed: pair 0's query is >= {2 * n} from its key), so one fixed offset answers them "
                        f"all; use --mqar-layout scattered or a bin that leaves room") from None

    @staticmethod
    def _check_scattered(s: dict, n: int, distance_bin: tuple[int, int] | None, t) -> None:
        """`mqar.check` of the scattered layout, its ValueError naming the flag."""
        try:
            mqar.check(s["seq_len"], n, key_vocab=s["key_vocab"], value_vocab=s["value_vocab"],
                       distance_bin=distance_bin, layout="scattered", lags=s["lags"])
        except ValueError as err:
            given = (f"--mqar-lags {t.mqar_lags}" if s["lags"] is not None else
                     f"--mqar-distance {'-'.join(map(str, distance_bin))}" if distance_bin is not None else
                     "--mqar-layout scattered")
            raise ValueError(f"{given} with {n} pairs in --seq-len {s['seq_len']}: {err}") from None

    @classmethod
    def config_class(cls, cfg):
        return GPTConfig

    @classmethod
    def make_config(cls, cfg):
        s = cls.settings(cfg)
        return GPTConfig.from_name(cfg.model.config, vocab_size=mqar.vocab_size(s["key_vocab"], s["value_vocab"]),
                                   block_size=cfg.data.seq_len, **cfg.model.model_fields())

    def build_model(self):
        return GPT(self.config)

    def generate(self, split: str) -> dict:
        """`mqar.mqar_mix` of `split` (its size and seed; stratified but for training)."""
        generator = torch.Generator().manual_seed(split_seed(self.cfg.task.data_seed, split))
        return mqar.mqar_mix(self.split_size(split), stratified=split != "train", generator=generator,
                             **self.settings(self.cfg))

    def load_split(self, split):
        data = self.generate(split)
        labels = torch.stack([data["targets"], data["distance"]], dim=1)  # IGNORE and -1: a signed dtype
        small = max(self.config.vocab_size, self.cfg.data.seq_len) < 2**15
        return Examples(compact(data["tokens"], self.config.vocab_size),
                        labels.to(torch.int16 if small else torch.int32))

    def _batch(self, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(inputs, targets, distance), int64 [B, seq_len] each, on the device."""
        inputs, labels = (t.to(self.ctx.device, non_blocking=True).long() for t in batch)
        return inputs, labels[:, 0], labels[:, 1]

    def loss(self, model, batch):
        """Mean cross-entropy over the queries of the batch (every other position is IGNORE)."""
        inputs, targets, _ = self._batch(batch)
        asked = targets != mqar.IGNORE
        return F.cross_entropy(model(inputs).float()[asked], targets[asked]), inputs.numel()

    def _score(self, model, batch) -> dict:
        inputs, targets, distance = self._batch(batch)
        asked = targets != mqar.IGNORE
        logits = model(inputs).float()[asked]
        correct = logits.argmax(-1) == targets[asked]
        n_pairs = asked.sum(1, keepdim=True).expand_as(asked)[asked]  # each query's count of pairs
        scores = {"nats": F.cross_entropy(logits, targets[asked], reduction="sum").double(),
                  "correct": correct.sum(), "queries": asked.sum(), "examples": len(inputs),
                  "tokens": inputs.numel()}
        # one cell per (pairs, distance): its queries and those answered
        cell = n_pairs * self.cfg.data.seq_len + distance[asked]
        queries, hits = cell.bincount(), cell.bincount(weights=correct.double())
        for c in queries.nonzero().flatten().tolist():
            n, d = divmod(c, self.cfg.data.seq_len)
            scores[f"queries_{n}_{d}"], scores[f"correct_{n}_{d}"] = queries[c], hits[c]
        return scores

    def evaluate(self, model, split, max_batches):
        """{"accuracy", "loss" (mean nats per query), "queries", "examples", "tokens_per_second", "chance",
        "accuracy_by_distance", "queries_by_distance", "accuracy_by_pairs", "queries_by_pairs",
        "by_pairs_distance"}.

        By distance (query position - key position) and by pairs: {str(key): value} over the keys the scored
        queries hold (JSON keys are strings). "by_pairs_distance": {"pairs": [N, ...], "distances": [d, ...],
        "accuracy": [[per distance] per count], "queries": [[...]]}, ascending, accuracy None where a count has
        no query at a distance (a table: one line per row in `piattn train`'s summary).
        """
        s = self.settings(self.cfg)
        cells = [(n, d) for n in s["pair_counts"] for d in range(1, s["seq_len"] - 1)]
        keys = ("nats", "correct", "queries", "examples", "tokens",
                *(f"{kind}_{n}_{d}" for n, d in cells for kind in ("queries", "correct")))
        loader = self.eval_loader(split)
        sums, seconds = evaluation_sums(model, loader, max_batches, self.ctx, keys, self._score)
        held = [(n, d, sums[f"correct_{n}_{d}"], int(sums[f"queries_{n}_{d}"])) for n, d in cells
                if sums[f"queries_{n}_{d}"] > 0]
        pairs, distances = sorted({n for n, *_ in held}), sorted({d for _, d, *_ in held})
        table = {(n, d): (c, q) for n, d, c, q in held}
        return {"accuracy": sums["correct"] / sums["queries"], "loss": sums["nats"] / sums["queries"],
                "queries": int(sums["queries"]), "examples": int(sums["examples"]),
                "tokens_per_second": per_second(sums["tokens"], seconds), "chance": 1 / s["value_vocab"],
                **breakdown("distance", [(d, c, q) for _, d, c, q in held]),
                **breakdown("pairs", [(n, c, q) for n, _, c, q in held]),
                "by_pairs_distance": {
                    "pairs": pairs, "distances": distances,
                    "accuracy": [[table[n, d][0] / table[n, d][1] if (n, d) in table else None for d in distances]
                                 for n in pairs],
                    "queries": [[table.get((n, d), (0, 0))[1] for d in distances] for n in pairs]}}


def breakdown(by: str, rows: list[tuple[int, float, int]]) -> dict:
    """{"accuracy_by_<by>": {str(key): accuracy}, "queries_by_<by>": {str(key): queries}} from (key, correct,
    queries) rows, summed per key, keys ascending."""
    correct: dict[int, float] = {}
    queries: dict[int, int] = {}
    for key, c, q in rows:
        correct[key] = correct.get(key, 0.0) + c
        queries[key] = queries.get(key, 0) + q
    order = sorted(queries)
    return {f"accuracy_by_{by}": {str(k): correct[k] / queries[k] for k in order},
            f"queries_by_{by}": {str(k): queries[k] for k in order}}


def pairs_view(result: dict, n_pairs: int) -> dict:
    """The by-distance entries ("accuracy_by_distance", "queries_by_distance") of the queries of sequences of
    `n_pairs` pairs alone, from an evaluation's "by_pairs_distance" (empty when it holds no such sequence)."""
    table = result["by_pairs_distance"]
    if n_pairs not in table["pairs"]:
        return {"accuracy_by_distance": {}, "queries_by_distance": {}}
    row = table["pairs"].index(n_pairs)
    held = [(d, a, q) for d, a, q in zip(table["distances"], table["accuracy"][row], table["queries"][row],
                                         strict=True) if q]
    return {"accuracy_by_distance": {str(d): a for d, a, _ in held},
            "queries_by_distance": {str(d): q for d, _, q in held}}
