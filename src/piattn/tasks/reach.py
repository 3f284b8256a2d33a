"""The reach task: recall the token `--lag` positions before the query (`piattn.data.reach`).

It separates attention kinds by how far their layers reach: the answer must travel `--lag` positions
through attention, which `piattn.analysis` predicts exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import GPTConfig, TrainConfig
from ..config.flags import flag
from ..data import reach
from ..data.examples import Examples, compact
from ..models import GPT, Encoder
from .classification import ClassificationTask, SplitFlags, encoder_config, split_seed


@dataclass
class ReachFlags:
    lag: int | None = flag(None, "reach: positions from the answer to the query (required)", low=1)
    reach_vocab: int | None = flag(None, "reach: symbols in a sequence (default 8; chance 1/vocab)", low=2,
                                   high=2**15 - 1)
    causal: bool | None = flag(None, "reach: a causal GPT read at the query (default) or, with --no-causal, a "
                               "bidirectional Encoder")


class ReachTask(ClassificationTask):
    """Reach: recall the token --lag positions before the query, which ends the sequence.

    --causal (default): a `GPT` over --reach-vocab + 1 ids; the prediction is its logits at the last
    position (the query), over all vocab + 1 ids, so the answer must reach the query through causal
    attention, as `reach.reachable(..., causal=True)` analyses. --no-causal: an `Encoder` with pool "cls"
    (its first position) over the REVERSED sequence, so the pooled position is the query; the attention
    patterns are symmetric, so reversing changes no reachability. Neither pools other positions, which
    would let the answer into the readout without attention.
    """

    name = "reach"
    report_sections = ("lags",)  # its one lag, marked when reachable
    default_seq_len = 64
    flags = (SplitFlags, ReachFlags)
    flag_notes = {"seq_len": f" {default_seq_len}"}
    DEFAULT_VOCAB = 8

    @classmethod
    def vocab(cls, cfg: TrainConfig) -> int:
        return cfg.task.reach_vocab if cfg.task.reach_vocab is not None else cls.DEFAULT_VOCAB

    @staticmethod
    def causal(cfg: TrainConfig) -> bool:
        return cfg.task.causal is not False

    @classmethod
    def check_config(cls, cfg):
        if cfg.data.data is not None:
            raise ValueError("--data does not apply to --task reach: its sequences are generated")
        if cfg.task.lag is None:
            raise ValueError("--lag is required with --task reach (the distance from the answer to the query)")
        if not 1 <= cfg.task.lag <= cfg.data.seq_len - 1:
            raise ValueError(f"--lag must be in [1, --seq-len - 1 = {cfg.data.seq_len - 1}], got {cfg.task.lag}")

    @classmethod
    def config_class(cls, cfg):
        return GPTConfig if cls.causal(cfg) else super().config_class(cfg)

    @classmethod
    def make_config(cls, cfg):
        vocab = cls.vocab(cfg)
        if not cls.causal(cfg):
            return encoder_config(cfg, vocab_size=vocab + 1, num_classes=vocab, pool="cls")
        return GPTConfig.from_name(cfg.model.config, vocab_size=vocab + 1, block_size=cfg.data.seq_len,
                                   **cfg.model.model_fields())

    def build_model(self):
        return GPT(self.config) if self.causal(self.cfg) else Encoder(self.config)

    def logits(self, model, inputs):
        """inputs [B, seq_len] (query last) -> [B, vocab + 1] (causal) or [B, vocab] (bidirectional)."""
        if self.causal(self.cfg):
            return model(inputs)[:, -1]
        return model(inputs.flip(1))

    def load_split(self, split):
        vocab = self.vocab(self.cfg)
        tokens, targets, _ = reach.generate(self.split_size(split), self.cfg.data.seq_len, self.cfg.task.lag, vocab,
                                            split_seed(self.cfg.task.data_seed, split))
        return Examples(compact(tokens, vocab + 1), targets)
