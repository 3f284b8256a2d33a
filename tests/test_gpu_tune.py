"""benchmarks/gpu_tune.py: it restores the tile rule it overrides, and reports a tile setting whose results differ
from the rule's instead of timing it. (Its smoke run end to end, JSON and markdown, runs inside
`test_gpu_run_smoke.py`, whose tune step is that run.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _gpu_tune():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_tune
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return gpu_tune


# Triton's interpreter evaluates both sides of tl.where (exp overflows and 0/0 in masked lanes, computed and
# discarded), and this test's kernel is wrong on purpose: numpy's warnings about it are expected, not shown.
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_wrong_results_are_reported_and_the_rule_restored(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gpu_tune = _gpu_tune()
    from piattn.ops.pi import triton as triton_backend

    rule = triton_backend._tiles
    xs = gpu_tune.make_inputs(1, 2, 40, 16, torch.device("cpu"), grad=False, dtype=torch.float32)
    timing, got = gpu_tune.time_config(xs, (32, 16, 4, 1), lambda fn: 1.0)
    assert timing["status"] == "ok" and triton_backend._tiles is rule
    wrong = [got[0] + 1.0, *got[1:]]
    timing, _ = gpu_tune.time_config(xs, (32, 16, 4, 1), lambda fn: 1.0, expected=wrong)
    assert timing["status"].startswith("wrong: y") and triton_backend._tiles is rule
