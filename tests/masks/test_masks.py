"""mask_mods against the offset definition of docs/design.md, and inside FlexAttention."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, create_mask, flex_attention

from piattn.masks import dense_mask, local_mask, pi_mask


def allowed_offsets(window, period, causal):
    """kv - q offsets a query may see: causal {0..-window} ∪ {-period}, bidirectional {-w..w} ∪ {±period}."""
    local = set(range(-window, 1)) if causal else set(range(-window, window + 1))
    if period is None:
        return local
    return local | ({-period} if causal else {-period, period})


def expected(n, window, period, causal):
    return torch.tensor([[(j - i) in allowed_offsets(window, period, causal) for j in range(n)]
                         for i in range(n)])


CASES = list(itertools.product([1, 5, 17, 40], [0, 1, 3, 4], [1, 2, 4, 5, 16, 50], [True, False]))


@pytest.mark.parametrize("n,window,period,causal", CASES)
def test_pi_mask_matches_offsets(n, window, period, causal):
    assert torch.equal(dense_mask(pi_mask(window, period, causal), n), expected(n, window, period, causal))


@pytest.mark.parametrize("n,window,causal", list(itertools.product([1, 6, 30], [0, 1, 4, 40], [True, False])))
def test_local_mask_matches_offsets(n, window, causal):
    assert torch.equal(dense_mask(local_mask(window, causal), n), expected(n, window, None, causal))


def test_spot_values():
    causal = dense_mask(pi_mask(4, 16, True), 48)
    assert causal[20, 4] and causal[20, 16] and causal[20, 20]
    assert not causal[20, 15] and not causal[20, 21] and not causal[4, 20]
    bidir = dense_mask(pi_mask(4, 16, False), 48)
    assert bidir[4, 20] and bidir[20, 24] and not bidir[4, 21]
    assert dense_mask(pi_mask(4, 16, True), 48).sum() == 48 + 4 * 48 - (1 + 2 + 3 + 4) + (48 - 16)


def test_names():
    assert pi_mask(4, 16, True).__name__ == "pi_w4_p16_causal"
    assert pi_mask(2, 8, False).__name__ == "pi_w2_p8_bidirectional"
    assert local_mask(3, True).__name__ == "local_w3_causal"


def test_broadcasting_and_dtype():
    mod = pi_mask(2, 5, True)
    zero = torch.tensor(0)
    scalar = mod(zero, zero, torch.tensor(7), torch.tensor(2))
    assert scalar.dtype == torch.bool and scalar.shape == () and bool(scalar)
    q = torch.arange(6).view(1, 1, 6, 1)
    kv = torch.arange(6).view(1, 1, 1, 6)
    out = mod(torch.zeros(2, 1, 1, 1, dtype=torch.long), torch.zeros(1, 3, 1, 1, dtype=torch.long), q, kv)
    # the pattern ignores batch and head, so b and h only have to broadcast
    assert torch.broadcast_shapes(out.shape, (2, 3, 6, 6)) == (2, 3, 6, 6)
    assert torch.equal(out[0, 0], expected(6, 2, 5, True))


def test_dense_mask_broadcasts_a_mask_that_ignores_an_index():
    first_two_keys = dense_mask(lambda b, h, q, kv: kv < 2, 4)
    assert torch.equal(first_two_keys, torch.tensor([[True, True, False, False]] * 4))
    assert dense_mask(pi_mask(1, 2), 0).shape == (0, 0)


@pytest.mark.parametrize("bad", [-1, 1.5, True, None])
def test_rejects_bad_window(bad):
    with pytest.raises(ValueError):
        local_mask(bad)
    with pytest.raises(ValueError):
        pi_mask(bad, 4)


@pytest.mark.parametrize("bad", [0, -3, 2.0, False])
def test_rejects_bad_period(bad):
    with pytest.raises(ValueError):
        pi_mask(2, bad)


def masked_softmax_attention(q, k, v, allowed):
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("period", [None, 3, 16])
def test_flex_attention_eager(causal, period):
    """vmap (create_mask, create_block_mask) and the eager flex_attention accept the mask_mods."""
    n = 40
    mod = local_mask(4, causal) if period is None else pi_mask(4, period, causal)
    allowed = expected(n, 4, period, causal)
    assert torch.equal(create_mask(mod, 1, 1, n, n, device="cpu")[0, 0], allowed)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 8, generator=g) for _ in range(3))
    block_mask = create_block_mask(mod, 1, 1, n, n, device="cpu", BLOCK_SIZE=16)
    y = flex_attention(q, k, v, block_mask=block_mask)
    torch.testing.assert_close(y, masked_softmax_attention(q, k, v, allowed))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
def test_flex_attention_compiled():
    n = 64
    mod = pi_mask(4, 16, True)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g) for _ in range(3))
    block_mask = create_block_mask(mod, 1, 1, n, n, device="cpu", BLOCK_SIZE=16)
    y = torch.compile(flex_attention)(q, k, v, block_mask=block_mask)
    torch.testing.assert_close(y, masked_softmax_attention(q, k, v, expected(n, 4, 16, True)))
