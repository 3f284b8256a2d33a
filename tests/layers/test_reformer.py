"""ReformerAttention (LSH attention, shared QK) against dense masked oracles written here from the definition."""

from __future__ import annotations

import math

import pytest
import torch

from piattn.config import ModelConfig
from piattn.layers.reformer import ReformerAttention, lsh_attention


def dense_shared_qk(q, v, allowed):
    """q, v [B, H, T, D], allowed bool [B, H, T, T] ([i, j]: query i may read key j) -> [B, H, T, D].

    Keys are the unit queries; the diagonal gets logit -1e5 (Reformer's self rule) and is always allowed.
    """
    T, D = q.shape[-2:]
    k = q / q.norm(dim=-1, keepdim=True)
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)
    diagonal = torch.eye(T, dtype=torch.bool)
    scores = torch.where(diagonal, torch.full_like(scores, -1e5), scores)
    scores = scores.masked_fill(~(allowed | diagonal), float("-inf"))
    return torch.softmax(scores, -1) @ v


def lsh_mask(buckets, bucket_size, causal):
    """buckets [B, H, R, T] -> allowed [B, H, T, T]: some round puts i and j in one bucket, at most
    bucket_size apart among that bucket's tokens in position order (and j <= i when causal)."""
    T = buckets.shape[-1]
    same = buckets[..., :, None] == buckets[..., None, :]
    rank = (same & torch.ones(T, T, dtype=torch.bool).tril(-1)).sum(-1)  # same-bucket tokens before i
    allowed = same & ((rank[..., :, None] - rank[..., None, :]).abs() <= bucket_size)
    if causal:
        allowed = allowed & torch.ones(T, T, dtype=torch.bool).tril()
    return allowed.any(2)


def projections(layer, x):
    """The layer's q (after RoPE) and v [B, H, T, D], computed here from its weights."""
    B, T, d = x.shape
    q, v = (x @ layer.qkv.weight.T + layer.qkv.bias).split(d, -1)
    q, v = (t.view(B, T, layer.n_heads, -1).transpose(1, 2) for t in (q, v))
    return (q if layer.rotary is None else layer.rotary(q)), v


def layer_oracle(layer, x, allowed):
    """x [B, T, d] -> [B, T, d] with dense attention restricted to `allowed`."""
    q, v = projections(layer, x)
    y = dense_shared_qk(q, v, allowed)
    return layer.out(y.transpose(1, 2).reshape(x.shape))


def hash_mask(layer, x):
    """The oracle's mask from the layer's own bucket assignment of x."""
    q, _ = projections(layer, x)
    return lsh_mask(layer.buckets(q / q.norm(dim=-1, keepdim=True)), layer.bucket_size, layer.causal)


def assert_forward_and_gradients_match(layer, x, allowed):
    y, y_ref = layer(x), layer_oracle(layer, x, allowed)
    torch.testing.assert_close(y, y_ref, atol=1e-10, rtol=1e-10)
    inputs = [x, *layer.parameters()]
    dy = torch.randn_like(y)
    for g, g_ref in zip(torch.autograd.grad(y, inputs, dy), torch.autograd.grad(y_ref, inputs, dy), strict=True):
        torch.testing.assert_close(g, g_ref, atol=1e-10, rtol=1e-10)


def make_layer(d_model=32, n_heads=2, **kwargs):
    torch.manual_seed(0)
    return ReformerAttention(d_model, n_heads, **kwargs).double()


def make_x(B, T, d_model=32, seed=1):
    return torch.randn(B, T, d_model, generator=torch.Generator().manual_seed(seed), dtype=torch.float64,
                       requires_grad=True)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("rotary", [False, True], ids=["plain", "rope"])
@pytest.mark.parametrize("T", [1, 7, 16])
def test_one_bucket_one_window_is_dense_attention(causal, rotary, T):
    """n_buckets=1 and T <= bucket_size: every key is in reach, so this is dense shared-QK attention."""
    layer = make_layer(n_hashes=1, bucket_size=16, n_buckets=1, causal=causal, rotary=rotary)
    everything = torch.ones(T, T, dtype=torch.bool)
    assert_forward_and_gradients_match(layer, make_x(2, T), everything.tril() if causal else everything)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize(("T", "bucket_size", "n_buckets", "n_hashes"), [
    (37, 8, 4, 3),  # T not a multiple of the chunk, many keys found by several rounds
    (50, 5, 2, 2),
    (23, 4, 6, 1),
    (5, 8, 3, 2),   # T < bucket_size
    (1, 4, 2, 2),
    (40, 4, 1, 2),  # one bucket: a sliding window of 4 places, identical rounds
])
def test_operator_matches_dense_oracle_of_the_same_buckets(causal, T, bucket_size, n_buckets, n_hashes):
    g = torch.Generator().manual_seed(T)
    q, v = (torch.randn(2, 3, T, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    buckets = torch.randint(0, n_buckets, (2, 3, n_hashes, T), generator=g)
    y = lsh_attention(q, q / q.norm(dim=-1, keepdim=True), v, buckets, bucket_size=bucket_size, causal=causal)
    y_ref = dense_shared_qk(q, v, lsh_mask(buckets, bucket_size, causal))
    torch.testing.assert_close(y, y_ref, atol=1e-10, rtol=1e-10)
    dy = torch.randn(y.shape, generator=g, dtype=torch.float64)
    for grad, grad_ref in zip(torch.autograd.grad(y, [q, v], dy), torch.autograd.grad(y_ref, [q, v], dy),
                              strict=True):
        torch.testing.assert_close(grad, grad_ref, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_layer_matches_dense_oracle_of_its_hash(causal):
    layer = make_layer(n_hashes=2, bucket_size=6, causal=causal, rotary=True)
    x = make_x(2, 45)
    allowed = hash_mask(layer, x)
    assert not allowed.all(), "the hash should leave some pairs out, or the test proves nothing"
    assert_forward_and_gradients_match(layer, x, allowed)


def test_buckets_are_angular_lsh():
    layer = ReformerAttention(16, 1, n_hashes=4, bucket_size=4)
    k = torch.randn(2, 1, 40, 16)
    buckets = layer.buckets(k)
    n = layer.bucket_count(40)
    assert n == 20 and buckets.shape == (2, 1, 4, 40) and buckets.dtype == torch.long
    assert buckets.min() >= 0 and buckets.max() < n
    assert torch.equal(layer.buckets(3.0 * k), buckets), "a bucket depends on the direction only"
    assert torch.equal(layer.buckets(-k), (buckets + n // 2) % n), "the opposite direction, the opposite bucket"
    assert not torch.equal(buckets[:, :, 0], buckets[:, :, 1]), "rounds hash differently"


def test_bucket_count_follows_length_unless_fixed():
    layer = ReformerAttention(16, 1, bucket_size=8)
    assert [layer.bucket_count(T) for T in (1, 8, 9, 64)] == [2, 2, 4, 16]
    assert ReformerAttention(16, 1, bucket_size=8, n_buckets=6).bucket_count(64) == 6


@pytest.mark.parametrize("n_buckets", [None, 2])
def test_causal_output_ignores_future_tokens(n_buckets):
    """Perturb token t: outputs before t stay exactly as they were (buckets and in-bucket places of
    earlier tokens, hence their key sets, cannot depend on it), outputs from t on change."""
    layer = make_layer(n_hashes=2, bucket_size=4, n_buckets=n_buckets).eval()
    x = make_x(1, 48).detach()
    y = layer(x)
    g = torch.Generator().manual_seed(2)
    for t in (0, 5, 17, 30, 47):
        perturbed = x.clone()
        perturbed[:, t:] = torch.randn(perturbed[:, t:].shape, generator=g, dtype=torch.float64)
        y2 = layer(perturbed)
        torch.testing.assert_close(y2[:, :t], y[:, :t], atol=1e-12, rtol=0)
        assert (y2[:, t] - y[:, t]).abs().max() > 1e-6


def test_causal_prefix_gives_the_same_outputs_with_fixed_bucket_count():
    layer = make_layer(n_hashes=3, bucket_size=4, n_buckets=4, rotary=True).eval()
    x = make_x(2, 41).detach()
    y = layer(x)
    for t in (1, 9, 26):
        torch.testing.assert_close(layer(x[:, :t]), y[:, :t], atol=1e-12, rtol=0)


def test_never_stores_a_T_by_T_tensor():
    T, bucket_size = 512, 8
    layer = ReformerAttention(16, 2, n_hashes=2, bucket_size=bucket_size, causal=False)
    sizes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
        layer(torch.randn(1, T, 16)).sum().backward()
    # the largest is R·T·3c attention weights per head and batch row
    assert max(sizes) <= 2 * 2 * T * 3 * bucket_size < T * T


def test_seed_fixes_the_hash():
    k = torch.randn(1, 2, 30, 8)
    a, b, c = (ReformerAttention(16, 2, bucket_size=4, seed=s) for s in (3, 3, 4))
    assert torch.equal(a.buckets(k), b.buckets(k))
    assert not torch.equal(a.buckets(k), c.buckets(k))


def test_training_and_evaluation_hash_alike_and_dropout_only_in_training():
    layer = make_layer(bucket_size=4)
    x = make_x(2, 30).detach()
    y_eval = layer.eval()(x)
    assert torch.equal(layer.train()(x), y_eval)
    layer.dropout = 0.5
    assert not torch.equal(layer.train()(x), layer(x))
    assert torch.equal(layer.eval()(x), y_eval)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_accumulates_in_fp32(dtype):
    """With one bucket no hash can flip under rounding, so the result is the fp64 one, up to rounding."""
    layer = make_layer(n_buckets=1, bucket_size=8)
    x = make_x(2, 30).detach()
    y = layer.to(dtype)(x.to(dtype))
    assert y.dtype == dtype
    torch.testing.assert_close(y.double(), layer.double()(x.to(dtype).double()), atol=3e-2, rtol=3e-2)


def test_low_precision_with_hashing_is_finite():
    layer = ReformerAttention(32, 2, bucket_size=4).to(torch.bfloat16)
    y = layer(torch.randn(2, 37, 32, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()


def test_queries_and_values_only_and_every_parameter_learns():
    layer = ReformerAttention(32, 4, bucket_size=4, rotary=True)
    assert {n: tuple(p.shape) for n, p in layer.named_parameters()} == {
        "qkv.weight": (64, 32), "qkv.bias": (64,), "out.weight": (32, 32), "out.bias": (32,)}
    layer(torch.randn(2, 40, 32)).square().sum().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_from_config_reads_hash_rounds_and_bucket_size():
    cfg = ModelConfig.from_name("tiny", attention="dense", n_hashes=3, bucket_size=16)
    layer = ReformerAttention.from_config(cfg, causal=False)
    assert (layer.n_hashes, layer.bucket_size, layer.causal) == (3, 16, False)
    assert layer.rotary is not None


@pytest.mark.parametrize(("kwargs", "name"), [
    (dict(n_hashes=0), "n_hashes"),
    (dict(n_hashes=1.0), "n_hashes"),
    (dict(bucket_size=0), "bucket_size"),
    (dict(bucket_size=True), "bucket_size"),
    (dict(n_buckets=3), "n_buckets"),
    (dict(n_buckets=0), "n_buckets"),
    (dict(seed="x"), "seed"),
    (dict(dropout=1.0), "dropout"),
])
def test_bad_arguments_are_named(kwargs, name):
    with pytest.raises(ValueError, match=name):
        ReformerAttention(32, 4, **kwargs)


def test_operator_checks_its_arguments():
    q = torch.randn(1, 2, 10, 4)
    with pytest.raises(ValueError, match="buckets"):
        lsh_attention(q, q, q, torch.zeros(1, 2, 9, dtype=torch.long), bucket_size=4)
    with pytest.raises(ValueError, match="bucket_size"):
        lsh_attention(q, q, q, torch.zeros(1, 2, 1, 10, dtype=torch.long), bucket_size=0)
