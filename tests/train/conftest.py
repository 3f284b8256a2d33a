"""Fixtures of the training tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module", autouse=True)
def single_threaded(one_thread):
    """Every training test module runs with one intra-op thread (`one_thread` in tests/conftest.py)."""
