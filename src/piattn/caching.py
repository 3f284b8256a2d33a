"""Tensors kept between calls (tables, masks, index sets) built as ordinary tensors, whatever mode the first
call ran in.

A tensor made under `torch.inference_mode()` stays an inference tensor: a later training step that saves it
for backward, or writes it in place, fails. Lightning's sanity check, an evaluation before training, or one
generation call would otherwise leave such a tensor in a cache and break every step after it. `untainted`
builds them with inference mode off.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

Built = TypeVar("Built")


def untainted(build: Callable[..., Built]) -> Callable[..., Built]:
    """`build` run with inference mode switched off when it is on (so what it returns can be cached and used in
    training later); put it under the caching decorator: `@functools.lru_cache` above `@untainted`."""

    @functools.wraps(build)
    def outside_inference_mode(*args, **kwargs):
        # dynamo cannot trace the mode's query, and what a compiled graph builds is not kept
        if not torch.compiler.is_compiling() and torch.is_inference_mode_enabled():
            with torch.inference_mode(False):
                return build(*args, **kwargs)
        return build(*args, **kwargs)

    return outside_inference_mode
