"""`pi_attention_with_settings`: the operator with its settings as one `PiSettings`, handed over whole, is
`pi_attention` with those settings' every field; `OpSettings.of` and the typed check read every field too, so
that a field added to `PiSettings` cannot be dropped on the way."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import piattn.ops.pi as ops_pi
from piattn import pi_attention
from piattn.config import PiSettings
from piattn.ops.pi import pi_attention_with_settings
from piattn.ops.pi.settings import OpSettings
from piattn.ops.pi.validate import check_settings_call

# Every field away from its default.
SETTINGS = PiSettings(window=2, period=(3, 7), variant="separate", prior=0.3, logit_clamp=6.0, eps=1e-3, sinks=1)


def test_every_field_reaches_the_operator(monkeypatch):
    seen = {}
    monkeypatch.setattr(ops_pi, "pi_attention", lambda q, k, v, gate, **kw: seen.update(kw) or q)
    q = torch.randn(1, 2, 8, 4)
    pi_attention_with_settings(q, q, q, None, SETTINGS, causal=False, scale=0.5, dropout_p=0.1, backend="torch")
    fields = {f.name: getattr(SETTINGS, f.name) for f in dataclasses.fields(PiSettings)}
    assert {name: seen[name] for name in fields} == fields
    assert (seen["causal"], seen["scale"], seen["dropout_p"], seen["backend"]) == (False, 0.5, 0.1, "torch")


@pytest.mark.parametrize("causal", [True, False])
def test_it_is_pi_attention_with_the_settings_fields(causal):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 20, 4, dtype=torch.float64, generator=g) for _ in range(3))
    gate = torch.rand(2, 2, 20, dtype=torch.float64, generator=g) * 0.9 + 0.05
    ids = torch.tensor([[0] * 12 + [1] * 8, [0] * 20])
    kw = dict(causal=causal, document_ids=ids, backend="reference")
    assert torch.equal(pi_attention_with_settings(q, k, v, gate, SETTINGS, **kw),
                       pi_attention(q, k, v, gate, **SETTINGS.as_kwargs(), **kw))


def test_a_bad_call_is_refused_with_the_operator_s_messages():
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="settings must be a piattn.config.PiSettings, got dict"):
        pi_attention_with_settings(q, q, q, None, dict(window=3))
    with pytest.raises(ValueError, match=r"dropout_p must lie in \[0, 1\)"):
        pi_attention_with_settings(q, q, q, None, SETTINGS, dropout_p=2.0)
    with pytest.raises(ValueError, match="period has 2 entries; per-head periods need one per query head, H=4"):
        pi_attention_with_settings(torch.randn(1, 4, 8, 4), q, q, None, SETTINGS)
    with pytest.raises(ValueError, match="settings must be a piattn.config.PiSettings, got tuple"):
        check_settings_call(q, q, q, None, (), causal=True, scale=None, dropout_p=0.0)
    with pytest.raises(ValueError, match="variant 'separate' needs gate"):
        check_settings_call(q, q, q, None, SETTINGS, causal=True, scale=None, dropout_p=0.0)


def test_op_settings_of_carries_every_field():
    op = OpSettings.of(SETTINGS, causal=False, scale=0.25, dropout_p=0.0)
    assert all(getattr(op, f.name) == getattr(SETTINGS, f.name) for f in dataclasses.fields(PiSettings))
    assert (op.causal, op.scale, op.dropout_p) == (False, 0.25, 0.0)
    assert set(OpSettings._fields) == {f.name for f in dataclasses.fields(PiSettings)} | {"causal", "scale",
                                                                                           "dropout_p"}
