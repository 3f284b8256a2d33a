"""The recall task: return the value after the marker, at a lag that changes per example (`piattn.data.recall`).

Where the reach task asks for the token at one fixed lag, recall draws the lag per example in
[--lag-min, --lag-max]: the model must find the marker by content, and its accuracy by lag shows which
lags its attention reaches, which `piattn.analysis` predicts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from ..config import GPTConfig, TrainConfig
from ..config.flags import flag
from ..data import recall
from ..data.examples import Examples, compact
from ..models import GPT
from ..train.task import evaluation_sums, per_second
from .classification import ClassificationTask, SplitFlags, split_seed


@dataclass
class RecallFlags:
    recall_symbols: int | None = flag(None, "recall: symbols of the filler and the values (default 8; chance "
                                      "1/symbols)", low=2, high=2**15 - 3)
    lag_min: int | None = flag(None, "recall: the shortest lag from the value to the query (default: the "
                               "least there is room for, 1 or 2)", low=1)
    lag_max: int | None = flag(None, "recall: the longest lag from the value to the query (default: the "
                               "most there is room for, seq-len - 2 or - 1)", low=1)
    recall_order: str | None = flag(None, "recall: marker-value (default: the marker, then the value) or "
                                    "value-marker (the marker right after the value; lags from 2)",
                                    choices=("marker-value", "value-marker"))
    recall_loss: str | None = flag(None, "recall: where training asks for the value: query (the last position "
                                   "only, default) or every (also every position lag-min … lag-max after it, each "
                                   "at its own lag; evaluation always reads the query)", choices=("query", "every"))


class RecallTask(ClassificationTask):
    """Recall: a causal `GPT` over --recall-symbols + 2 ids, read out at the last position (the query).

    The prediction is over all ids (marker and query included), as in the reach task, so the answer can
    reach the query only through causal attention. --recall-loss every trains every position after the
    value as a query too (denser supervision); the metrics are always those of the query. Validation and
    test splits hold every lag equally often (`generate(..., stratified=True)`); training lags are uniform.
    """

    name = "recall"
    default_seq_len = 64
    flags = (SplitFlags, RecallFlags)
    flag_notes = {"seq_len": f" {default_seq_len}"}
    report_sections = ("lags",)
    reach_carries = "the value and its marker"
    validation_metrics = (*ClassificationTask.validation_metrics, "chance")
    DEFAULT_SYMBOLS = 8

    @classmethod
    def settings(cls, cfg: TrainConfig) -> dict:
        """The generator's arguments but n, seed and stratified (defaults filled in)."""
        t = cfg.task
        value_first = t.recall_order == "value-marker"
        low, high = recall.lag_bounds(cfg.data.seq_len, value_first)
        return dict(seq_len=cfg.data.seq_len, n_symbols=t.recall_symbols or cls.DEFAULT_SYMBOLS,
                    lag_min=t.lag_min if t.lag_min is not None else low,
                    lag_max=t.lag_max if t.lag_max is not None else high, value_first=value_first)

    @classmethod
    def lags_needed(cls, cfg: TrainConfig, lags: list[int]) -> dict[int, tuple[int]]:
        """{lag of the value: (lag of its marker,)} for every lag of the task: the model finds the value by the
        marker, which sits just before the value (marker-value) or just after it (value-marker)."""
        s = cls.settings(cfg)
        shift = -1 if s["value_first"] else 1
        return {lag: (lag + shift,) for lag in range(s["lag_min"], s["lag_max"] + 1)}

    @classmethod
    def check_config(cls, cfg):
        if cfg.data.data is not None:
            raise ValueError("--data does not apply to --task recall: its sequences are generated")
        s = cls.settings(cfg)
        if s["seq_len"] < 3:
            raise ValueError(f"--seq-len must be >= 3 for --task recall (marker, value, query), got {s['seq_len']}")
        low, high = recall.lag_bounds(s["seq_len"], s["value_first"])
        order = f"--recall-order {cfg.task.recall_order or 'marker-value'}"
        if s["lag_min"] < low:
            raise ValueError(f"--lag-min must be >= {low} with {order}, got {s['lag_min']}")
        if s["lag_max"] > high:
            raise ValueError(f"--lag-max must be <= {high} with --seq-len {s['seq_len']} and {order}, "
                             f"got {s['lag_max']}")
        if s["lag_min"] > s["lag_max"]:
            raise ValueError(f"--lag-min must be <= --lag-max = {s['lag_max']}, got {s['lag_min']}")

    @classmethod
    def config_class(cls, cfg):
        return GPTConfig

    @classmethod
    def make_config(cls, cfg):
        return GPTConfig.from_name(cfg.model.config, vocab_size=cls.settings(cfg)["n_symbols"] + 2,
                                   block_size=cfg.data.seq_len, **cfg.model.model_fields())

    def build_model(self):
        return GPT(self.config)

    def logits(self, model, inputs):
        """inputs [B, seq_len] (query last) -> [B, n_symbols + 2]."""
        return model(inputs)[:, -1]

    def load_split(self, split):
        s = self.settings(self.cfg)
        data = recall.generate(self.split_size(split), seed=split_seed(self.cfg.task.data_seed, split),
                               stratified=split != "train", **s)
        return Examples(compact(data.tokens, s["n_symbols"] + 2), data.answer)

    def loss(self, model, batch):
        """Cross-entropy at the query; with --recall-loss every, the mean over every position whose lag
        from the value is in [--lag-min, --lag-max] (the query among them): each such position is asked
        the same value, at its own lag, so one sequence supervises many lags at once."""
        if self.cfg.task.recall_loss != "every":
            return super().loss(model, batch)
        inputs, labels = (t.to(self.ctx.device, non_blocking=True) for t in batch)
        s = self.settings(self.cfg)
        value = (s["seq_len"] - 1 - self.lags(inputs))[:, None]
        lag = torch.arange(s["seq_len"], device=inputs.device)[None, :] - value  # [B, T]: each position's lag
        asked = (lag >= s["lag_min"]) & (lag <= s["lag_max"])
        logits = model(inputs).float()  # [B, T, ids]
        return F.cross_entropy(logits[asked], labels[:, None].expand_as(asked)[asked]), inputs.numel()

    def lags(self, inputs: torch.Tensor) -> torch.Tensor:
        """inputs [B, seq_len] -> the lag of each example, int64 [B], read off where its marker is."""
        s = self.settings(self.cfg)
        marker = (inputs == s["n_symbols"]).int().argmax(1)
        return s["seq_len"] - marker if s["value_first"] else s["seq_len"] - 2 - marker

    def _score(self, model, batch) -> dict:
        inputs, labels = (t.to(self.ctx.device, non_blocking=True) for t in batch)
        logits = self.logits(model, inputs).float()
        correct, lags = logits.argmax(-1) == labels, self.lags(inputs)
        scores = {"nats": F.cross_entropy(logits, labels, reduction="sum").double(), "correct": correct.sum(),
                  "examples": len(labels), "tokens": inputs.numel()}
        s = self.settings(self.cfg)
        for lag in range(s["lag_min"], s["lag_max"] + 1):
            at = lags == lag
            scores[f"examples_{lag}"] = at.sum()
            scores[f"correct_{lag}"] = (correct & at).sum()
        return scores

    def evaluate(self, model, split, max_batches):
        """{"accuracy", "loss", "examples", "tokens_per_second", "chance", "accuracy_by_lag", "examples_by_lag"}.

        accuracy_by_lag / examples_by_lag: {str(lag): value} for every lag in [--lag-min, --lag-max] that
        the scored batches hold (JSON keys are strings).
        """
        s = self.settings(self.cfg)
        lags = range(s["lag_min"], s["lag_max"] + 1)
        keys = ("nats", "correct", "examples", "tokens", *(f"{kind}_{lag}" for lag in lags
                                                           for kind in ("examples", "correct")))
        loader = self.eval_loader(split)
        sums, seconds = evaluation_sums(model, loader, max_batches, self.ctx, keys, self._score)
        held = [lag for lag in lags if sums[f"examples_{lag}"] > 0]
        return {"accuracy": sums["correct"] / sums["examples"], "loss": sums["nats"] / sums["examples"],
                "examples": int(sums["examples"]), "tokens_per_second": per_second(sums["tokens"], seconds),
                "chance": 1 / s["n_symbols"],
                "accuracy_by_lag": {str(lag): sums[f"correct_{lag}"] / sums[f"examples_{lag}"] for lag in held},
                "examples_by_lag": {str(lag): int(sums[f"examples_{lag}"]) for lag in held}}
