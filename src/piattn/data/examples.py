"""Fixed splits of labelled examples held in memory, and their resumable, sharded batch loader.

The classification tasks (LRA ListOps, Pathfinder, Retrieval, and the reach task) build a split as one
`Examples` in a compact integer dtype; `ExampleLoader` serves its batches in `SequenceLoader`'s seeded
order, so the loader state is (epoch, position) and a resumed run sees the same batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .packing import SequenceLoader


@dataclass(frozen=True)
class Examples:
    """One split: inputs [n, L] (or [n, 2, L] for pairs) of token ids in a compact integer dtype; labels int64 [n]."""

    inputs: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return len(self.labels)


def compact(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """ids in the smallest integer dtype holding 0 … vocab_size - 1: a split of LRA length stays a few bytes per id."""
    if vocab_size <= 256:
        return ids.to(torch.uint8)
    return ids.to(torch.int16 if vocab_size <= 2**15 else torch.int32)


class _Indices:
    """The dataset 0 … n-1, item i a 0-dim int64 tensor: lets SequenceLoader order the examples of a split."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(index)


class ExampleLoader:
    """Batches (inputs int64 [B, …], labels int64 [B]) of a split, in `SequenceLoader`'s order.

    Shuffled from `seed` per epoch, sharded over ranks, resumable: state_dict / load_state_dict are the
    SequenceLoader's (epoch, position and the configuration they depend on).
    """

    def __init__(self, examples: Examples, batch_size: int, seed: int = 0, shuffle: bool = True, rank: int = 0,
                 world_size: int = 1, drop_last: bool = True):
        self.examples = examples
        self.order = SequenceLoader(_Indices(len(examples)), batch_size, seed=seed, shuffle=shuffle, rank=rank,
                                    world_size=world_size, drop_last=drop_last)

    @property
    def batches_per_epoch(self) -> int:
        return self.order.batches_per_epoch

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        index = self.order.next_batch()
        return self.examples.inputs[index].long(), self.examples.labels[index]

    def state_dict(self) -> dict:
        return self.order.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.order.load_state_dict(state)
