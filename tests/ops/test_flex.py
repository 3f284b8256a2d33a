"""Backend "flex" on its own: the offset-built block mask, the score_mod's gate gradient and the sparse
block sizes of `pi_attention_flex`. Against "reference": test_conformance.py.

T = 301 is odd, spans three 128-row blocks (the last one partial) and leaves block-sparse gaps.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import piattn
from piattn.ops.pi import flex
from piattn.ops.pi.pattern import log_priors
from utils import assert_close, compare, forward_backward, make_inputs

if "flex" not in piattn.BACKENDS:
    pytest.skip("backend 'flex' is not offered by this torch build", allow_module_level=True)

SHAPE = (1, 2, 301, 16)  # B, H, T, D
PATTERN = dict(window=4, period=16)


@pytest.mark.parametrize("part", ["all", "local", "skip"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    ("T", "window", "period", "block"), [(301, 4, 16, 128), (77, 40, 50, 16), (9, 2, 16, 8)]
)
def test_block_mask_matches_create_block_mask(T, window, period, block, causal, part):
    """The offset-built block mask marks the same partial and full tiles as torch's dense construction."""
    ours = flex.block_mask(T, window, period, causal, torch.device("cpu"), block, part)
    mask_mod = flex._mask_mod(window, period, causal, part)
    theirs = create_block_mask(mask_mod, None, None, T, T, device="cpu", BLOCK_SIZE=block)
    assert torch.equal(ours.to_dense(), theirs.to_dense())
    assert torch.equal(ours.full_kv_num_blocks, theirs.full_kv_num_blocks)
    assert ours.BLOCK_SIZE == theirs.BLOCK_SIZE and ours.seq_lengths == theirs.seq_lengths


def test_block_mask_is_cached():
    args = (301, 4, 16, True, torch.device("cpu"), 128)
    assert flex.block_mask(*args) is flex.block_mask(*args)
    assert flex.block_mask(*args, "local") is not flex.block_mask(*args)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_score_mod_gradient_reaches_gate():
    """This backend's mask and score_mod, run by flex's uncompiled (dense, autograd) path, give the
    reference's gate gradient: torch allows that path on CPU as long as q, k, v do not require grad."""
    q, k, v, gate = make_inputs(*SHAPE, dtype=torch.float32, requires_grad=False)
    gate.requires_grad_()
    priors = torch.stack(log_priors("adaptive", gate, 0.5, 1e-4), -1)
    mod = flex._score_mod(PATTERN["window"], 20.0, priors)
    mask = flex.block_mask(SHAPE[2], PATTERN["window"], PATTERN["period"], True, torch.device("cpu"), 16)
    actual = flex_attention(q, k, v, score_mod=mod, block_mask=mask, scale=SHAPE[-1] ** -0.5)
    expected = piattn.pi_attention(q, k, v, gate, backend="reference", **PATTERN)
    dy = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1))
    assert_close("y", expected, actual)
    assert_close("dgate", *(torch.autograd.grad(y, gate, dy)[0] for y in (expected, actual)))


def test_direct_call_takes_no_dropout_mask():
    """pi_attention never sends flex a keep mask (flex declares no dropout); a direct caller that does is
    told so rather than silently given attention without dropout."""
    q, k, v, gate = make_inputs(*SHAPE, dtype=torch.float32, requires_grad=False)
    keep = torch.ones(*SHAPE[:3], 6, dtype=torch.bool)
    with pytest.raises(ValueError, match="dropout"):
        flex.pi_attention_flex(q, k, v, gate, window=4, period=16, causal=True, variant="adaptive", prior=0.5,
                               logit_clamp=20.0, eps=1e-4, scale=0.25, dropout_keep=keep, dropout_p=0.1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex's backward needs CUDA: torch has no CPU backward")
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_small_blocks_cuda(block_size):
    """Sparse blocks below flex's default tiles, as the GPU benchmark uses them; forward and gradients."""
    dtype = torch.bfloat16
    q, k, v, gate = make_inputs(2, 3, 301, 64, dtype=dtype, device="cuda")
    kw = dict(PATTERN, causal=True, variant="adaptive", prior=0.5, logit_clamp=20.0, scale=0.125)
    expected = forward_backward(q, k, v, gate, backend="reference", **kw)
    y = flex.pi_attention_flex(q, k, v, gate, eps=1e-4, block_size=block_size, **kw)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    actual = (y, *torch.autograd.grad(y, (q, k, v, gate), dy.to(y.device, y.dtype)))
    compare(expected, actual, dtype)
