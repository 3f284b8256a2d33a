"""Fixtures shared by every test file."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def nan_poison(monkeypatch):
    """Make fresh allocations NaN-filled, so an element a kernel forgets to write cannot pass a test."""

    def poisoned(fn):
        def wrapper(*args, **kwargs):
            t = fn(*args, **kwargs)
            if t.is_floating_point():
                t.fill_(float("nan"))
            return t

        return wrapper

    monkeypatch.setattr(torch, "empty", poisoned(torch.empty))
    monkeypatch.setattr(torch, "empty_like", poisoned(torch.empty_like))
    monkeypatch.setattr(torch.Tensor, "new_empty", poisoned(torch.Tensor.new_empty))
