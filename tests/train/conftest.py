"""Fixtures of the training tests."""

from __future__ import annotations

import pytest
from distributed_runs import common_args

from piattn.cli import main
from utils import write_word_corpus


@pytest.fixture(scope="module", autouse=True)
def single_threaded(one_thread):
    """Every training test module runs with one intra-op thread (`one_thread` in tests/conftest.py)."""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The small word corpus of the multi-process training tests (tests/train/distributed_runs.py)."""
    return write_word_corpus(tmp_path_factory.mktemp("distributed") / "corpus",
                             {"train": [300] * 3, "validation": [300], "test": [300]})


@pytest.fixture(scope="module")
def reference(corpus):
    """The one-process run (a batch of 2 sequences) the multi-process runs are compared with, trained in the
    module that compares (module scope: its bit-for-bit comparisons need the same process state)."""
    out = corpus.parent / "reference"
    assert main(common_args(corpus, out, "--batch-size", "2")) == 0
    return out
