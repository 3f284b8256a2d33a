"""The Long Range Arena tasks: ListOps, Pathfinder and Retrieval, each a bidirectional `Encoder` classifier.

π-Attention in an encoder has skips at ±π. Splits are generated (ListOps, Pathfinder) or read from the
LRA release's files with `--data` (ListOps, Retrieval).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import TrainConfig
from ..config.flags import flag
from ..data import listops, pathfinder, retrieval
from ..data.examples import Examples, compact
from .classification import ClassificationTask, ImageFlags, SplitFlags, data_file, encoder_config, split_seed


@dataclass
class ListOpsFlags:
    listops_min_len: int | None = flag(None, "fewest tokens of a generated ListOps expression (default "
                                       "seq-len / 4 + 1)", low=1)
    listops_max_len: int | None = flag(None, "most tokens of a generated ListOps expression (default seq-len - 1)",
                                       low=1)


@dataclass
class PathfinderFlags:
    contour_length: int | None = flag(None, "Pathfinder paddles per target curve (LRA: 6, 9, 14; default 14)",
                                      low=1)


class ListOpsTask(ClassificationTask):
    """ListOps: the value 0–9 of a nested list expression; Encoder with mean pooling, ids padded to --seq-len.

    Generated: token counts in [--listops-min-len, --listops-max-len], by default [seq_len/4 + 1, seq_len - 1]
    (LRA: 501–1999 at 2000). From --data: LRA's basic_train.tsv, basic_val.tsv, basic_test.tsv (or ours,
    written with `listops.write_tsv` under those names).
    """

    name = "listops"
    default_seq_len = 2000
    flags = (SplitFlags, ListOpsFlags)
    flag_notes = {"data": ": a folder with LRA's basic_{train,val,test}.tsv (default: generated)",
                  "seq_len": f" {default_seq_len}"}
    FILES = {"train": "basic_train.tsv", "validation": "basic_val.tsv", "test": "basic_test.tsv"}

    @classmethod
    def check_config(cls, cfg):
        if cfg.data.data is not None:
            if cfg.task.listops_min_len is not None or cfg.task.listops_max_len is not None:
                raise ValueError("--listops-min-len / --listops-max-len apply to generated ListOps, not to --data")
            data_file(cfg, cls.FILES, "train", cls.name)
            return
        low, high = cls.lengths(cfg)
        if not 1 <= low <= high <= cfg.data.seq_len:
            raise ValueError(f"ListOps lengths must satisfy 1 <= --listops-min-len ({low}) <= --listops-max-len "
                             f"({high}) <= --seq-len ({cfg.data.seq_len})")

    @staticmethod
    def lengths(cfg: TrainConfig) -> tuple[int, int]:
        """(fewest, most) tokens of a generated expression, both inclusive."""
        low = cfg.task.listops_min_len if cfg.task.listops_min_len is not None else cfg.data.seq_len // 4 + 1
        high = cfg.task.listops_max_len if cfg.task.listops_max_len is not None else cfg.data.seq_len - 1
        return low, high

    @classmethod
    def make_config(cls, cfg):
        return encoder_config(cfg, vocab_size=listops.VOCAB_SIZE, num_classes=10)

    def load_split(self, split):
        size = self.split_size(split)
        if self.cfg.data.data is not None:
            examples = listops.read_tsv(data_file(self.cfg, self.FILES, split, self.name))[:size]
        else:
            low, high = self.lengths(self.cfg)
            try:  # generate's bounds are exclusive
                examples = listops.generate(size, split_seed(self.cfg.task.data_seed, split), min_length=low - 1,
                                            max_length=high + 1)
            except ValueError as err:
                raise ValueError(f"--listops-min-len / --listops-max-len: {err}") from None
        try:
            inputs = listops.encode([source for source, _ in examples], self.cfg.data.seq_len)
        except ValueError as err:
            raise ValueError(f"--seq-len {self.cfg.data.seq_len} is too short for the {split} split: {err}") from None
        return Examples(compact(inputs, listops.VOCAB_SIZE), listops.targets(examples))


class PathfinderTask(ClassificationTask):
    """Pathfinder: are the two marked dots joined by a curve? Pixels row by row, Encoder with mean pooling.

    Images of --image-size² pixels (sequence length; --seq-len must be that or left out) with target curves
    of --contour-length paddles (LRA: 6, 9, 14) are generated. A pixel of value v is token v + 1, so no
    pixel, black ones included, is taken for padding (id 0) and left out of the pooled mean.
    """

    name = "pathfinder"
    flags = (SplitFlags, ImageFlags, PathfinderFlags)
    flag_notes = {"seq_len": " image-size²"}
    VOCAB_SIZE = 257
    DEFAULT_IMAGE_SIZE = 32
    DEFAULT_CONTOUR_LENGTH = 14

    @classmethod
    def resolve_seq_len(cls, cfg):
        return cls.image_size(cfg) ** 2

    @classmethod
    def image_size(cls, cfg: TrainConfig) -> int:
        return cfg.task.image_size if cfg.task.image_size is not None else cls.DEFAULT_IMAGE_SIZE

    @classmethod
    def contour_length(cls, cfg: TrainConfig) -> int:
        return cfg.task.contour_length if cfg.task.contour_length is not None else cls.DEFAULT_CONTOUR_LENGTH

    @classmethod
    def check_config(cls, cfg):
        if cfg.data.data is not None:
            raise ValueError("--data does not apply to --task pathfinder: its images are generated "
                             "(--image-size, --contour-length, --train-size, --eval-size)")
        size = cls.image_size(cfg)
        if cfg.data.seq_len != size * size:
            raise ValueError(f"--seq-len must be --image-size² = {size * size} for --task pathfinder (or left out), "
                             f"got {cfg.data.seq_len}")

    @classmethod
    def make_config(cls, cfg):
        return encoder_config(cfg, vocab_size=cls.VOCAB_SIZE, num_classes=2)

    def load_split(self, split):
        try:
            images, labels = pathfinder.generate(self.split_size(split), split_seed(self.cfg.task.data_seed, split),
                                                 self.image_size(self.cfg), self.contour_length(self.cfg))
        except ValueError as err:
            raise ValueError(f"--image-size / --contour-length: {err}") from None
        return Examples(compact(pathfinder.as_sequences(images) + 1, self.VOCAB_SIZE), labels)


class RetrievalTask(ClassificationTask):
    """Retrieval (AAN): does one paper cite the other? A dual Encoder over two byte sequences of --seq-len.

    --data is a folder with LRA's new_aan_pairs.train.tsv, .eval.tsv (validation) and .test.tsv; each text
    is cut to its first --seq-len bytes (LRA: 4000). Read whole by default: about 2.3 GB of ids in memory
    for LRA's 147,086 training pairs at 4000 (and four times that while reading), so --train-size helps.
    """

    name = "retrieval"
    default_seq_len = retrieval.MAX_LENGTH
    flag_notes = {"data": " (required): a folder with LRA's new_aan_pairs.*.tsv",
                  "seq_len": f" {default_seq_len} per text"}
    FILES = {"train": "new_aan_pairs.train.tsv", "validation": "new_aan_pairs.eval.tsv",
             "test": "new_aan_pairs.test.tsv"}

    @classmethod
    def check_config(cls, cfg):
        if cfg.data.data is None:
            raise ValueError(f"--task retrieval needs --data: a folder with {', '.join(cls.FILES.values())}")
        data_file(cfg, cls.FILES, "train", cls.name)

    @classmethod
    def make_config(cls, cfg):
        return encoder_config(cfg, vocab_size=retrieval.VOCAB_SIZE, num_classes=2, dual=True)

    def load_split(self, split):
        ids, labels = retrieval.read_pairs(data_file(self.cfg, self.FILES, split, self.name), self.cfg.data.seq_len,
                                           self.split_size(split))
        if len(labels) == 0:
            raise ValueError(f"--data: the {split} file {self.FILES[split]!r} holds no pairs")
        return Examples(compact(ids, retrieval.VOCAB_SIZE), labels)
