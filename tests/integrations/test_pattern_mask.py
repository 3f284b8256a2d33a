"""The mask engine's additive mask (`pattern_mask`) is the converted model's attention while its gate is constant:
softmax(q·k/√D + mask) over all keys equals the operator's reference backend with that gate, and the mask is
built from the homes of what it holds (the slots of `Pattern`/`slot_keys`, the gate's clip `clip_gate`, the
priors `log_priors`), not from a copy of them."""

from __future__ import annotations

import ast
import inspect
import math

import pytest
import torch

pytest.importorskip("transformers")

from piattn.integrations.hf import evaluation  # noqa: E402
from piattn.integrations.hf.evaluation import pattern_mask  # noqa: E402
from piattn.layers.gate import clip_gate  # noqa: E402
from piattn.ops.pi import pi_attention  # noqa: E402

EPS = 1e-3


def _masked_dense(q, k, v, mask):
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + mask
    return torch.softmax(scores, -1) @ v


def _alpha_tilde(alpha: float, eps: float) -> float:
    """The gate's α̃ for a constant σ = alpha, from the gate itself."""
    return float(clip_gate(torch.tensor([[[alpha]]], dtype=torch.float64), eps))


@pytest.mark.parametrize("T, window, period, sinks", [
    (20, 3, 7, 0), (20, 3, 7, 2), (17, 4, 4, 0), (17, 4, 2, 3),  # period inside the window: no skip key
    (24, 2, 30, 4), (24, 5, 9, 6),  # a period beyond T; sinks overlapping the window and the skip key
    (12, 0, 1, 1),
])
@pytest.mark.parametrize("alpha", [0.5, 0.2, 0.97])
def test_the_mask_is_the_operator_with_a_constant_gate(T, window, period, sinks, alpha):
    g = torch.Generator().manual_seed(T * 100 + window * 10 + sinks)
    B, H, D = 2, 3, 8
    q, k, v = (torch.randn(B, H, T, D, generator=g, dtype=torch.float64) for _ in range(3))
    mask = pattern_mask(T, window=window, period=period, sinks=sinks, alpha=alpha, eps=EPS, dtype=torch.float64)
    assert mask.shape == (1, 1, T, T)
    got = _masked_dense(q, k, v, mask)
    a = _alpha_tilde(alpha, EPS)
    settings = dict(window=window, period=period, sinks=sinks, logit_clamp=None, eps=EPS, causal=True,
                    backend="reference")
    gate = torch.full((B, H, T), a, dtype=torch.float64)
    want = pi_attention(q, k, v, gate, variant="adaptive", **settings)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    # The constant variants are the same function: "fixed" with the prior α̃, "union" where α̃ = 1/2.
    torch.testing.assert_close(got, pi_attention(q, k, v, variant="fixed", prior=a, **settings),
                               rtol=1e-10, atol=1e-10)
    if alpha == 0.5:
        torch.testing.assert_close(got, pi_attention(q, k, v, variant="union", **settings), rtol=1e-10, atol=1e-10)


def test_the_mask_holds_the_priors_on_the_pattern():
    T, a = 10, _alpha_tilde(0.3, EPS)
    mask = pattern_mask(T, window=2, period=5, sinks=1, alpha=0.3, eps=EPS, dtype=torch.float64)[0, 0]
    local, skip = math.log(a), math.log(1 - a)
    for i in range(T):
        for j in range(T):
            if j > i:
                want = float("-inf")
            elif i - j <= 2:
                want = local
            elif i - j == 5:
                want = skip
            elif j < 1:
                want = local
            else:
                want = float("-inf")
            assert float(mask[i, j]) == pytest.approx(want, abs=1e-12), (i, j)
    assert pattern_mask(T, window=2, period=5, sinks=1, alpha=0.3).dtype == torch.float32
    assert pattern_mask(T, window=2, period=5, sinks=1, alpha=0.3, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_the_mask_is_built_from_the_homes_of_the_pattern_the_gate_and_the_priors():
    """evaluation.py asks `slot_keys` for the slots (their precedence: local, then skip, then sinks),
    `clip_gate` for α̃ and `log_priors` for the logs, and writes none of them itself."""
    source = inspect.getsource(evaluation)
    tree = ast.parse(source)
    imported = {alias.name: node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                for alias in node.names}
    assert imported.get("slot_keys") == "ops.pi.pattern" and imported.get("Pattern") == "ops.pi.pattern"
    assert imported.get("log_priors") == "ops.pi.pattern"
    assert imported.get("clip_gate") == "layers.gate"
    body = inspect.getsource(pattern_mask)
    for own in ("1 - 2 * eps", "math.log", "== period", "< sinks", "<= window"):
        assert own not in body, own
