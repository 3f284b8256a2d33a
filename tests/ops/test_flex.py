"""Backend "flex" against "reference": forward on CPU (torch's FlexAttention has no CPU backward), forward
and every gradient on CUDA.

Each new shape, dtype or pattern compiles a kernel (several seconds on CPU), so the CPU tests share one
shape: T = 301 is odd, spans three 128-row blocks (the last one partial) and leaves block-sparse gaps.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import piattn
from piattn.ops.pi import flex
from piattn.ops.pi.pattern import VARIANTS, log_priors
from utils import assert_close, forward_backward, make_inputs

if "flex" not in piattn.BACKENDS:
    pytest.skip("backend 'flex' is not offered by this torch build", allow_module_level=True)

SHAPE = (1, 2, 301, 16)  # B, H, T, D
PATTERN = dict(window=4, period=16)
NAMES = ("y", "dq", "dk", "dv", "dgate")
cuda_only = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="flex's backward needs CUDA: torch has no CPU backward for it"
)


def _compare_forward(dtype, *, shape=SHAPE, variant="adaptive", causal=True, q_scale=1.0, **pattern):
    """Inference as a model runs it: inputs that require grad, under no_grad (which flex allows on CPU)."""
    pattern = pattern or PATTERN
    q, k, v, gate = make_inputs(*shape, variant=variant, dtype=dtype)
    kw = dict(pattern, causal=causal, variant=variant, prior=0.3)
    with torch.no_grad():
        q = q * q_scale
        expected = piattn.pi_attention(q, k, v, gate, backend="reference", **kw)
        actual = piattn.pi_attention(q, k, v, gate, backend="flex", **kw)
    assert_close("y", expected, actual, dtype)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("variant", VARIANTS)
def test_forward_fp32(variant, causal):
    _compare_forward(torch.float32, variant=variant, causal=causal)


def test_forward_bf16_near_clamp():
    # Scores up to |z| ≈ 30 cross the clamp at 20; tolerance 2e-2 (utils.TOLERANCES), about two bf16 ulps
    # at |y| ~ 1: both backends round the same bf16 inputs, the result is rounded once more.
    _compare_forward(torch.bfloat16, q_scale=7.5)


@pytest.mark.slow
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("variant", VARIANTS)
def test_forward_bf16(variant, causal):
    _compare_forward(torch.bfloat16, variant=variant, causal=causal)


def test_forward_sequence_shorter_than_period():
    _compare_forward(torch.float32, shape=(2, 2, 13, 16), window=4, period=16)


@pytest.mark.parametrize("variant", ["adaptive", "separate"])
def test_forward_period_within_window(variant):
    # The skip offsets are local keys already: no skip branch, every key gets the local prior.
    _compare_forward(torch.float32, variant=variant, causal=False, window=5, period=3)


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


def test_dropout_is_refused():
    q, k, v, gate = make_inputs(*SHAPE, dtype=torch.float32, requires_grad=False)
    with pytest.raises(ValueError, match=r"dropout_p=0\.1.*'torch' or 'reference'"):
        piattn.pi_attention(q, k, v, gate, dropout_p=0.1, backend="flex")


def test_float64_is_refused():
    q, k, v, gate = make_inputs(*SHAPE, dtype=torch.float64, requires_grad=False)
    with pytest.raises(ValueError, match="float64"):
        piattn.pi_attention(q, k, v, gate, backend="flex")


def test_cpu_backward_is_refused():
    q, k, v, gate = make_inputs(*SHAPE, dtype=torch.float32)
    with pytest.raises(ValueError, match="forward-only"):
        piattn.pi_attention(q, k, v, gate, backend="flex")


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_cuda(variant, causal, dtype):
    inputs = make_inputs(2, 3, 301, 32, variant=variant, dtype=dtype, device="cuda")
    kw = dict(PATTERN, causal=causal, variant=variant, prior=0.3)
    expected = forward_backward(*inputs, backend="reference", **kw)
    actual = forward_backward(*inputs, backend="flex", **kw)
    for name, e, a in zip(NAMES, expected, actual, strict=True):
        if e is not None:
            assert_close(name, e, a, dtype)


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_small_blocks_cuda(block_size):
    """Sparse blocks below flex's default tiles, as the GPU benchmark uses them; forward and gradients."""
    dtype = torch.bfloat16
    q, k, v, gate = make_inputs(2, 3, 301, 64, dtype=dtype, device="cuda")
    kw = dict(PATTERN, causal=True, variant="adaptive", prior=0.5, logit_clamp=20.0, scale=0.125)
    expected = forward_backward(q, k, v, gate, backend="reference", **kw)
    y = flex.flex_pi_attention(q, k, v, gate, eps=1e-4, block_size=block_size, **kw)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    actual = (y, *torch.autograd.grad(y, (q, k, v, gate), dy.to(y.device, y.dtype)))
    for name, e, a in zip(NAMES, expected, actual, strict=True):
        assert_close(name, e, a, dtype)
