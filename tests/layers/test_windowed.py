"""WindowedAttention: `pi` and `local` run the operator with the typed settings they hold, nothing else."""

from __future__ import annotations

import pytest
import torch

import piattn
from piattn.config import PiSettings
from piattn.layers import LocalAttention, PiAttention
from piattn.layers.windowed import WindowedAttention


def test_both_kinds_hold_their_operator_settings():
    pi = PiAttention(32, 4, window=3, period=9, variant="fixed", prior=0.3, sinks=2, backend="reference")
    local = LocalAttention(32, 4, window=5, logit_clamp=None, sinks=1)
    assert isinstance(pi, WindowedAttention) and isinstance(local, WindowedAttention)
    assert pi.settings == PiSettings(window=3, period=9, variant="fixed", prior=0.3, sinks=2)
    assert local.settings == PiSettings(window=5, period=5, variant="union", logit_clamp=None, sinks=1)
    assert pi.backend == "reference" and local.backend == "auto"
    assert local.gate is None and not local.observe_gate(print)  # no gate: nothing to observe
    assert set(local.state_dict()) == {"qkv.weight", "qkv.bias", "out.weight", "out.bias"}
    assert (pi.cache_capacity(), pi.cache_sinks(), local.cache_capacity(), local.cache_sinks()) == (10, 2, 6, 1)


@pytest.mark.parametrize("kind", ["pi", "local"])
def test_attend_is_the_operator_with_the_settings(kind):
    torch.manual_seed(0)
    layer = (PiAttention(32, 4, n_kv_heads=2, window=3, period=7, sinks=1) if kind == "pi"
             else LocalAttention(32, 4, n_kv_heads=2, window=3, sinks=1)).double().eval()
    x = torch.randn(2, 30, 32, dtype=torch.float64)
    ids = torch.tensor([[0] * 12 + [1] * 18, [0] * 30])
    q, k, v = layer.heads(x)
    expected = piattn.pi_attention(q, k, v, layer.gate_values(x), causal=True, document_ids=ids, backend="reference",
                                   **layer.settings.as_kwargs())
    torch.testing.assert_close(layer.attend(q, k, v, x, document_ids=ids), expected, atol=1e-12, rtol=1e-12)
