"""pi_attention_weights: the weights the operator applies, with grouped-query heads, sinks and documents,
against the "torch" backend (another implementation of the same operator); its argument checks."""

from __future__ import annotations

import pytest
import torch

import piattn
from piattn.config.pi import PiSettings
from piattn.ops.pi.weights import pi_attention_weights
from utils import make_inputs


def documents(B: int, T: int) -> torch.Tensor:
    """[B, T] ids: documents of a few lengths, ids coming back (runs, not values, make documents)."""
    ids = torch.tensor([0] * 7 + [1] * 12 + [0] * 3 + [2] * (T - 22))
    return torch.stack([ids, ids.roll(5)])[:B]


@pytest.mark.parametrize("variant", ["union", "separate", "fixed", "adaptive"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_weights_applied_to_v_give_the_operator(variant, causal):
    q, _, _, gate = make_inputs(2, 4, 40, 8, variant=variant, requires_grad=False)
    _, k, v, _ = make_inputs(2, 2, 40, 8, variant="union", seed=1, requires_grad=False)  # H_kv = 2 of H = 4
    ids = documents(2, 40)
    settings = PiSettings(window=3, period=8, variant=variant, prior=0.3, sinks=2)
    w, key, valid = pi_attention_weights(q, k, gate, settings=settings, causal=causal, document_ids=ids)
    assert w.shape == (2, 4, 40, settings.window * (1 if causal else 2) + 1 + (1 if causal else 2) + 2)
    assert key.shape == valid.shape == (2, 40, w.shape[-1]) and key.dtype == torch.int64
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 40, dtype=torch.float64), atol=1e-12, rtol=0)
    assert (w * ~valid[:, None]).abs().max() == 0  # nothing on a slot that reads no key
    start = torch.tensor([0] * 7 + [7] * 12 + [19] * 3 + [22] * 18)
    assert bool((key[0][valid[0]] >= start[:, None].expand_as(key[0])[valid[0]]).all())  # inside the document
    heads = v.repeat_interleave(2, 1)  # query head h reads key/value head h // 2
    gathered = torch.stack([heads[b][:, key[b]] for b in range(2)])  # [B, H, T, |U|, D]
    y = (w.unsqueeze(-1) * gathered).sum(-2)
    expected = piattn.pi_attention(q, k, v, gate, causal=causal, document_ids=ids, backend="torch",
                                   **settings.as_kwargs())
    torch.testing.assert_close(y, expected, atol=1e-12, rtol=1e-12)


def test_slots_keep_the_settings_layout_when_the_text_is_shorter():
    """T < period: the skip slot is still there, invalid everywhere (slot m is one key class at every T)."""
    q, k, _, gate = make_inputs(1, 2, 5, 4, requires_grad=False)
    w, _, valid = pi_attention_weights(q, k, gate, settings=PiSettings(window=3, period=16, sinks=1))
    assert w.shape[-1] == 4 + 1 + 1 and not valid[..., 4].any() and w[..., 4].abs().max() == 0


def test_bad_arguments_are_named():
    q, k, _, gate = make_inputs(1, 4, 10, 4, requires_grad=False)
    with pytest.raises(ValueError, match="settings must be a piattn.config.PiSettings"):
        pi_attention_weights(q, k, gate, settings={"window": 3})
    with pytest.raises(ValueError, match="k and v have 3 heads"):
        pi_attention_weights(q, k[:, :3], gate)
    with pytest.raises(ValueError, match="variant 'adaptive' needs gate"):
        pi_attention_weights(q, k, None)
    with pytest.raises(ValueError, match="document_ids must have shape"):
        pi_attention_weights(q, k, gate, document_ids=torch.zeros(1, 9, dtype=torch.long))
