"""Backend "flex" on its own: the offset-built block mask, the score_mod's gate gradient and the sparse
block sizes of `pi_attention_flex`. Against "reference": test_conformance.py.

T = 301 is odd, spans three 128-row blocks (the last one partial) and leaves block-sparse gaps.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import piattn
from piattn.config.pi import VARIANTS
from piattn.ops.pi import flex
from piattn.ops.pi.pattern import Pattern, document_bounds, log_priors, slot_keys
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


@pytest.mark.parametrize("part", ["all", "local", "skip"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("T", "window", "period", "sinks", "block"), [(70, 3, 8, 4, 16), (45, 2, 5, 12, 8)])
def test_document_block_mask_matches_create_block_mask(T, window, period, sinks, block, causal, part):
    """With sinks and documents (one block mask per batch row): the same tiles as torch's dense construction
    from this backend's mask_mod, and that mask_mod is U's `part` as `pattern.slot_keys` gives it."""
    ids = torch.tensor([[t // 13 for t in range(T)], [(t * 7) // 30 % 2 for t in range(T)]])
    pat = Pattern(window, period, causal, sinks)
    ours = flex._build_block_mask(pat, T, ids, torch.device("cpu"), block, part)
    mask_mod = flex._mask_mod(window, period, causal, part, sinks, document_bounds(ids)[0])
    theirs = create_block_mask(mask_mod, 2, None, T, T, device="cpu", BLOCK_SIZE=block)
    assert torch.equal(ours.to_dense(), theirs.to_dense())
    assert torch.equal(ours.full_kv_num_blocks, theirs.full_kv_num_blocks)
    slots = flex._part_slots(pat, part)
    key, valid = (t[..., slots] for t in slot_keys(pat, T, ids))
    # Invalid slots hold key 0 and add nothing there.
    dense = torch.zeros(2, T, T, dtype=torch.long).scatter_add_(2, key, valid.long()) > 0
    pos = torch.arange(T)
    got = torch.stack([mask_mod(torch.tensor(b), 0, pos[:, None], pos[None, :]) for b in range(2)])
    assert torch.equal(got, dense)


def test_block_mask_is_cached():
    args = (301, 4, 16, True, torch.device("cpu"), 128)
    assert flex.block_mask(*args) is flex.block_mask(*args)
    assert flex.block_mask(*args, "local") is not flex.block_mask(*args)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.usefixtures("fresh_dynamo")
def test_score_mod_gradient_reaches_gate():
    """This backend's mask and score_mod, run by flex's uncompiled (dense, autograd) path, give the
    reference's gate gradient: torch allows that path on CPU as long as q, k, v do not require grad."""
    q, k, v, gate = make_inputs(*SHAPE, dtype=torch.float32, requires_grad=False)
    gate.requires_grad_()
    priors = torch.stack(log_priors("adaptive", gate, 0.5, 1e-4), -1)
    mod = flex._score_mod(PATTERN["window"], PATTERN["period"], 20.0, priors)
    mask = flex.block_mask(SHAPE[2], PATTERN["window"], PATTERN["period"], True, torch.device("cpu"), 16)
    actual = flex_attention(q, k, v, score_mod=mod, block_mask=mask, scale=SHAPE[-1] ** -0.5)
    expected = piattn.pi_attention(q, k, v, gate, backend="reference", **PATTERN)
    dy = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1))
    assert_close("y", expected, actual)
    assert_close("dgate", *(torch.autograd.grad(y, gate, dy)[0] for y in (expected, actual)))


@pytest.mark.parametrize("variant", VARIANTS)
def test_all_features_cpu(variant):
    """Sinks, documents and grouped-query attention through this backend's whole path on CPU (block masks
    per batch row, mask_mod, score_mod, enable_gqa, the "separate" mix): the reference's forward."""
    q, k, v, gate = make_inputs(2, 4, 45, 16, variant=variant, dtype=torch.float32, requires_grad=False)
    k, v = k[:, :2], v[:, :2]
    ids = torch.tensor([[0] * 10 + [1] * 20 + [0] * 15, [t // 7 for t in range(45)]])
    for causal in (True, False):
        kw = dict(window=3, period=8, causal=causal, variant=variant, prior=0.3, sinks=3, document_ids=ids)
        with torch.no_grad():
            expected = piattn.pi_attention(q, k, v, gate, backend="reference", **kw)
            actual = piattn.pi_attention(q, k, v, gate, backend="flex", **kw)
        assert_close(f"y ({'causal' if causal else 'bidir'})", expected, actual)


@pytest.mark.parametrize("T", [24, 40, 56])
@pytest.mark.parametrize("seed", range(4))
def test_cpu_rows_all_written(T, seed):
    """Every output row on CPU, at the lengths (T = 8 mod 16) where torch 2.13's compiled CPU kernel left
    rows unwritten (zeros or NaN) for this sliding-window pattern: the reference's forward."""
    q, k, v, gate = make_inputs(1, 2, T, 16, dtype=torch.float32, requires_grad=False, seed=seed)
    with torch.no_grad():
        expected = piattn.pi_attention(q, k, v, gate, backend="reference", **PATTERN)
        actual = piattn.pi_attention(q, k, v, gate, backend="flex", **PATTERN)
    assert_close("y", expected, actual)


def test_cpu_says_it_runs_uncompiled():
    """The CPU path is a different kernel from the GPU's: the user is told once, in one line, and why."""
    flex._say_once.cache_clear()
    q, k, v, gate = make_inputs(1, 1, 9, 8, dtype=torch.float32, requires_grad=False)
    with pytest.warns(UserWarning, match="uncompiled on CPU") as record, torch.no_grad():
        piattn.pi_attention(q, k, v, gate, backend="flex", **PATTERN)
        piattn.pi_attention(q, k, v, gate, backend="flex", **PATTERN)
    assert sum("uncompiled on CPU" in str(w.message) for w in record) == 1


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
