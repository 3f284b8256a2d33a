"""Sequence parallelism holds its settings typed: one `PiSettings` (the layer's own, or the one built from a
caller's keywords) in a `_Call`, whose fingerprint, the one the ranks agree on, covers every field of it.
(tests/parallel/test_sequence_parallel.py runs the calls across processes.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import piattn.parallel.sequence as sequence
from piattn import pi_attention
from piattn.config import PiSettings
from piattn.parallel import sequence_parallel_pi_attention, sequence_parallel_pi_attention_with_settings

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")

SETTINGS = PiSettings(window=2, period=(3, 7), variant="fixed", prior=0.3, logit_clamp=6.0, eps=1e-3)
OTHER = dict(window=3, period=(3, 8), variant="union", prior=0.4, logit_clamp=None, eps=1e-2, sinks=1)


def call(settings=SETTINGS, **changes):
    return dataclasses.replace(sequence._Call(settings, causal=True, scale=None, dropout_p=0.0, backend="auto",
                                              check_gate=True), **changes)


def test_the_fingerprint_covers_every_settings_field_and_the_call_but_not_the_backend():
    assert set(OTHER) == {f.name for f in dataclasses.fields(PiSettings)}
    q = torch.randn(1, 2, 8, 4)
    base = call().fingerprint(q, 2, None)
    assert call(PiSettings(**SETTINGS.as_kwargs())).fingerprint(q, 2, None) == base  # equal settings, equal print
    for name, value in OTHER.items():
        assert call(dataclasses.replace(SETTINGS, **{name: value})).fingerprint(q, 2, None) != base, name
    for name, value in dict(causal=False, scale=0.5, dropout_p=0.1, check_gate=False).items():
        assert call(**{name: value}).fingerprint(q, 2, None) != base, name
    assert call(backend="torch").fingerprint(q, 2, None) == base  # the backend may differ per device
    assert call().fingerprint(q, 1, None) != base and call().fingerprint(q, 2, q[:, :, :, 0]) != base


def test_without_a_process_group_the_typed_entry_is_the_operator():
    assert not torch.distributed.is_initialized()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 20, 4, dtype=torch.float64, generator=g) for _ in range(3))
    kw = dict(causal=False, backend="reference")
    expected = pi_attention(q, k, v, None, **SETTINGS.as_kwargs(), **kw)
    assert torch.equal(sequence_parallel_pi_attention_with_settings(q, k, v, None, SETTINGS, **kw), expected)
    assert torch.equal(sequence_parallel_pi_attention(q, k, v, None, **SETTINGS.as_kwargs(), **kw), expected)
    with pytest.raises(ValueError, match="settings must be a piattn.config.PiSettings, got dict"):
        sequence_parallel_pi_attention_with_settings(q, k, v, None, dict(window=2))
