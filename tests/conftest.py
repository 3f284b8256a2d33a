"""Fixtures shared by every test file."""

from __future__ import annotations

import inspect
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Without a GPU, Triton kernels run in Triton's CPU interpreter. Set before piattn or triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs one worker per core (pytest-xdist): torch's own threads would only take turns with
    # the other workers' on the same cores. Tests that need more threads set them themselves.
    torch.set_num_threads(1)
    # and so do the processes the tests start (the CLI, the benchmarks' smoke runs, the C builds' probes):
    # with two threads each beside the other worker, OpenMP's waiting threads made a tiny model's step about
    # 30× slower (gpu_run.py's smoke run: a training step 1,247 ms against 41 ms). A child that needs threads
    # asks for them (--threads, torch.set_num_threads).
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config):
    """Under `--dist loadgroup` (make test), a file marked `xdist_group` runs on one worker, so that its module
    fixture (a process group, a training run) starts once. pytest-xdist 3.8 groups a test by assigning its
    `_nodeid`; pytest 9.2's node ids no longer read it, so the files split silently and every worker started
    their fixtures again. Refuse such a pair rather than run that way."""
    if getattr(config.option, "dist", None) == "loadgroup" and "_nodeid" not in inspect.getsource(
            pytest.Item.nodeid.fget):
        raise pytest.UsageError("--dist loadgroup would not group the xdist_group files with this pytest "
                                f"({pytest.__version__}: its node ids ignore the group pytest-xdist sets); install "
                                "pytest<9.2, as pyproject's test extra asks")


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


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread: tiny models run many times faster than with threads competing on a busy CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches and its shape guesses emptied before and after the test: torch.compile (and flex's
    uncompiled path, which traces its wrapper with dynamo) otherwise carries state from earlier tests, e.g.
    sizes marked dynamic, which has broken flex's trace (unbacked symbols)."""
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def native_step_built():
    """Skip without a C compiler; fail where one exists but the compiled decoding step does not build."""
    import shutil

    import piattn.ops.pi.native as native

    if shutil.which(os.environ.get("CC") or "cc") is None:
        pytest.skip("no C compiler ($CC or cc) to build the compiled decoding step")
    if native.unavailable() is not None:
        pytest.fail(f"the compiled step must build where a compiler exists: {native.unavailable()}")


@pytest.fixture
def compiled_calls(monkeypatch) -> list:
    """Whether each call of the compiled step for rows (`decode_native.run` without a token to store: the route
    of `DecodePlan.rows`, the layers' steps of a few tokens and the HF cached steps) ran (True) or declined
    (False)."""
    import piattn.ops.pi.decode_native as decode_native

    taken = []
    real = decode_native.run

    def spy(*args, **kwargs):
        y = real(*args, **kwargs)
        if kwargs.get("fresh_slot") is None:
            taken.append(y is not None)
        return y

    monkeypatch.setattr(decode_native, "run", spy)
    return taken
