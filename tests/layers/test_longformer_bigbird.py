"""LongformerAttention, BigBirdAttention and their gathered-attention helper against dense masked SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from piattn.config import ModelConfig
from piattn.layers.bigbird import BigBirdAttention
from piattn.layers.longformer import LongformerAttention
from piattn.layers.sparse import gathered_attention
from piattn.masks import dense_mask
from piattn.masks.bigbird import bigbird_mask
from piattn.masks.longformer import longformer_mask

D_MODEL, HEADS = 16, 2

LAYERS = {  # id: (class, keywords, mask_mod(n, causal)): the mask through SDPA is the independent oracle
    "longformer-w3-g2": (LongformerAttention, dict(window=3, n_global=2), lambda n, c: longformer_mask(3, 2, c)),
    "longformer-w0-g0": (LongformerAttention, dict(window=0, n_global=0), lambda n, c: longformer_mask(0, 0, c)),
    "longformer-w9-g1": (LongformerAttention, dict(window=9, n_global=1), lambda n, c: longformer_mask(9, 1, c)),
    "bigbird-b4-g1-r2": (BigBirdAttention, dict(block=4, n_global=1, n_random=2),
                         lambda n, c: bigbird_mask(n, 4, n_global=1, n_random=2, causal=c)),
    "bigbird-b8-g0-r1": (BigBirdAttention, dict(block=8, n_global=0, n_random=1, seed=3),
                         lambda n, c: bigbird_mask(n, 8, n_global=0, n_random=1, causal=c, seed=3)),
    "bigbird-b3-w2-g2-r3": (BigBirdAttention, dict(block=3, window_blocks=2, n_global=2, n_random=3, seed=9),
                            lambda n, c: bigbird_mask(n, 3, window_blocks=2, n_global=2, n_random=3, causal=c,
                                                      seed=9)),
}


def make_layer(name, causal, **kwargs):
    cls, layer_kwargs, _ = LAYERS[name]
    return cls(D_MODEL, HEADS, causal=causal, **layer_kwargs, **kwargs).double()


def qkv(T, dtype=torch.float64, seed=0, B=2):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, HEADS, T, D_MODEL // HEADS, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
            for _ in range(3)]


def outputs_and_grads(fn, q, k, v, dy=None):
    """(y, dq, dk, dv) of y = fn(q, k, v) under a fixed random cotangent dy."""
    y = fn(q, k, v)
    if dy is None:
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(y.dtype)
    return (y, *torch.autograd.grad(y, (q, k, v), dy))


def assert_all_close(name, got, expected):
    for what, a, b in zip(("y", "dq", "dk", "dv"), got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, msg=lambda m, w=what: f"{name} {w}: {m}")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("T", [1, 5, 13, 40])
@pytest.mark.parametrize("name", list(LAYERS))
def test_attend_equals_dense_masked_sdpa(name, T, causal):
    layer = make_layer(name, causal)
    allowed = dense_mask(LAYERS[name][2](T, causal), T)
    q, k, v = qkv(T)
    got = outputs_and_grads(lambda *t: layer.attend(*t, None), q, k, v)
    expected = outputs_and_grads(lambda *t: F.scaled_dot_product_attention(*t, attn_mask=allowed), q, k, v)
    assert_all_close(name, got, expected)


@pytest.mark.parametrize("name", ["longformer-w3-g2", "bigbird-b4-g1-r2"])
def test_bf16_attend_is_close_to_the_fp64_oracle(name):
    T, causal = 37, False
    layer = make_layer(name, causal)
    q, k, v = (t.detach().bfloat16() for t in qkv(T))
    y = layer.attend(q, k, v, None)
    assert y.dtype == torch.bfloat16
    allowed = dense_mask(LAYERS[name][2](T, causal), T)
    expected = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=allowed)
    torch.testing.assert_close(y.double(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("name", list(LAYERS))
def test_causal_layer_does_not_leak_the_future(name):
    torch.manual_seed(0)
    layer = make_layer(name, True, rotary=True)
    x = torch.randn(2, 29, D_MODEL, dtype=torch.float64)
    y = layer(x)
    for t in (0, 1, 4, 11, 17, 28):
        x2 = x.clone()
        x2[:, t] += torch.randn(2, D_MODEL, dtype=torch.float64)
        y2 = layer(x2)
        assert torch.equal(y2[:, :t], y[:, :t]), f"{name}: perturbing token {t} changed an earlier output"
        assert not torch.equal(y2[:, t], y[:, t])


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_candidate_lists_are_the_mask_rows(name, causal):
    """Each non-global row's valid candidates are its mask row; causal global rows too (their keys are
    all global), bidirectional global rows run dense and only need a subset."""
    T = 31
    layer = make_layer(name, causal)
    index, valid = layer.candidate_keys(T)
    allowed = dense_mask(LAYERS[name][2](T, causal), T)
    group = layer.block if isinstance(layer, BigBirdAttention) else 1  # queries per index row
    n_dense = layer.n_global * group
    for i in range(T):
        listed = torch.zeros(T, dtype=torch.bool)
        listed[index[i // group][valid[i]]] = True
        if causal or i >= n_dense:
            assert torch.equal(listed, allowed[i]), f"row {i}"
        else:
            assert (listed <= allowed[i]).all(), f"row {i}"


def test_candidate_count_does_not_grow_with_length():
    longformer = LongformerAttention(D_MODEL, HEADS, window=4, n_global=2, causal=True)
    bidir_longformer = LongformerAttention(D_MODEL, HEADS, window=4, n_global=2, causal=False)
    bigbird = BigBirdAttention(D_MODEL, HEADS, block=8, n_global=1, n_random=2, causal=True)
    bidir_bigbird = BigBirdAttention(D_MODEL, HEADS, block=8, n_global=1, n_random=2, causal=False)
    for T in (100, 1000, 3000):
        assert longformer.candidate_keys(T)[0].shape == (T, 4 + 1 + 2)
        assert bidir_longformer.candidate_keys(T)[0].shape == (T, 2 * 4 + 1 + 2)
        # one index row per query block: the gathered k/v hold T/8 rows of 8·(sliding + global + random) keys
        index, valid = bigbird.candidate_keys(T)
        assert index.shape == (-(-T // 8), 8 * (2 + 1 + 2)) and valid.shape == (T, 8 * (2 + 1 + 2))
        assert bidir_bigbird.candidate_keys(T)[0].shape == (-(-T // 8), 8 * (3 + 1 + 2))


def test_layer_forward_shapes_and_gradients():
    for layer in (LongformerAttention(D_MODEL, HEADS, rotary=True), BigBirdAttention(D_MODEL, HEADS, block=4)):
        x = torch.randn(3, 21, D_MODEL)
        y = layer(x)
        assert y.shape == x.shape
        y.sum().backward()
        for pname, p in layer.named_parameters():
            assert p.grad is not None and p.grad.abs().sum() > 0, pname


@pytest.mark.parametrize("make", [lambda: LongformerAttention(D_MODEL, HEADS, dropout=0.5),
                                  lambda: BigBirdAttention(D_MODEL, HEADS, block=4, dropout=0.5)])
def test_dropout_only_in_training(make):
    torch.manual_seed(0)
    layer = make()
    x = torch.randn(2, 30, D_MODEL)
    layer.eval()
    assert torch.equal(layer(x), layer(x))
    layer.train()
    assert not torch.equal(layer(x), layer(x))


def test_from_config_reads_the_sparse_fields():
    cfg = ModelConfig(n_layer=1, n_head=2, d_model=16, attention="dense", window=5, n_global=3, sparse_block=4,
                      n_random=1, dropout=0.0)
    longformer = LongformerAttention.from_config(cfg, causal=False)
    assert (longformer.window, longformer.n_global, longformer.causal) == (5, 3, False)
    bigbird = BigBirdAttention.from_config(cfg, causal=True)
    assert (bigbird.block, bigbird.n_global, bigbird.n_random, bigbird.window_blocks) == (4, 3, 1, 2)
    default = ModelConfig(n_layer=1, n_head=2, d_model=16, attention="dense")
    assert BigBirdAttention.from_config(default, causal=True).window_blocks == 1  # the paper's 3 sliding blocks


@pytest.mark.parametrize("call,name", [
    (lambda: LongformerAttention(D_MODEL, HEADS, window=-1), "window"),
    (lambda: LongformerAttention(D_MODEL, HEADS, n_global=-1), "n_global"),
    (lambda: BigBirdAttention(D_MODEL, HEADS, block=0), "block"),
    (lambda: BigBirdAttention(D_MODEL, HEADS, n_global=1.0), "n_global"),
    (lambda: BigBirdAttention(D_MODEL, HEADS, n_random=-1), "n_random"),
    (lambda: BigBirdAttention(D_MODEL, HEADS, window_blocks=-1), "window_blocks"),
    (lambda: BigBirdAttention(D_MODEL, HEADS, seed=None), "seed"),
    (lambda: gathered_attention(*qkv(4), torch.zeros(4, 2, dtype=torch.int32), torch.ones(4, 2, dtype=torch.bool)),
     "index"),
    (lambda: gathered_attention(*qkv(4), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2, dtype=torch.bool)),
     "index"),
    (lambda: gathered_attention(*qkv(4), torch.full((4, 2), 4), torch.ones(4, 2, dtype=torch.bool)), "index"),
    (lambda: gathered_attention(*qkv(4), torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 3, dtype=torch.bool)),
     "valid"),
    (lambda: gathered_attention(*qkv(4), torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 2, dtype=torch.bool),
                                dropout_p=1.0), "dropout_p"),
    (lambda: gathered_attention(*qkv(4), torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 2, dtype=torch.bool),
                                chunk_size=0), "chunk_size"),
    (lambda: gathered_attention(*qkv(4), torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 2, dtype=torch.bool),
                                group=0), "group"),
    (lambda: gathered_attention(*qkv(5), torch.zeros(2, 2, dtype=torch.long), torch.ones(5, 2, dtype=torch.bool),
                                group=2), "index"),
])
def test_bad_arguments_name_themselves(call, name):
    with pytest.raises(ValueError, match=rf"^{name} must"):
        call()


# gathered_attention on its own: arbitrary candidate lists against SDPA with the equivalent dense mask


def random_candidates(Tq, Tk, M, seed):
    g = torch.Generator().manual_seed(seed)
    index = torch.randint(0, Tk, (Tq, M), generator=g)  # repeats within a row are likely
    valid = torch.rand(Tq, M, generator=g) < 0.7
    allowed = torch.zeros(Tq, Tk, dtype=torch.bool)
    for i in range(Tq):
        allowed[i, index[i][valid[i]]] = True
    return index, valid, allowed


@pytest.mark.parametrize("chunk_size", [None, 1, 7])
def test_gathered_attention_counts_repeated_keys_once(chunk_size):
    q, k, v = qkv(23)
    index, valid, allowed = random_candidates(23, 23, 12, seed=2)
    assert any(len(set(row[ok].tolist())) < int(ok.sum()) for row, ok in zip(index, valid, strict=True))
    valid[0] = False  # row 0 is empty: it must return 0 (SDPA would give NaN), so the oracle leaves it out
    dy = torch.randn(2, HEADS, 23, D_MODEL // HEADS, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = outputs_and_grads(lambda *t: gathered_attention(*t, index, valid, chunk_size=chunk_size), q, k, v, dy)
    expected = outputs_and_grads(
        lambda q_, k_, v_: F.scaled_dot_product_attention(q_[:, :, 1:], k_, v_, attn_mask=allowed[1:]),
        q, k, v, dy[:, :, 1:])
    y, dq, dk, dv = got
    expected_y, expected_dq, expected_dk, expected_dv = expected
    assert_all_close("gathered", (y[:, :, 1:], dq[:, :, 1:], dk, dv),
                     (expected_y, expected_dq[:, :, 1:], expected_dk, expected_dv))
    assert torch.equal(y[:, :, 0], torch.zeros_like(y[:, :, 0]))
    assert torch.equal(dq[:, :, 0], torch.zeros_like(dq[:, :, 0]))


@pytest.mark.parametrize("chunk_size", [None, 1, 2])
@pytest.mark.parametrize("T,group", [(23, 4), (20, 5), (3, 8)])
def test_gathered_attention_with_shared_rows(T, group, chunk_size):
    """Queries sharing an index row, each with its own validity (a short last group included)."""
    q, k, v = qkv(T)
    n_rows = -(-T // group)
    g = torch.Generator().manual_seed(6)
    index = torch.randint(0, T, (n_rows, 10), generator=g)
    index[:, 1] = index[:, 0]  # a certain repeat
    valid = torch.rand(T, 10, generator=g) < 0.6
    valid[:, 0] = True  # every query sees something, so the dense oracle has no NaN row
    valid[:, 1] = True
    allowed = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        allowed[i, index[i // group][valid[i]]] = True
    got = outputs_and_grads(lambda *t: gathered_attention(*t, index, valid, group=group, chunk_size=chunk_size),
                            q, k, v)
    expected = outputs_and_grads(lambda *t: F.scaled_dot_product_attention(*t, attn_mask=allowed), q, k, v)
    assert_all_close(f"group {group}", got, expected)


def test_gathered_attention_queries_and_keys_of_different_lengths():
    q = qkv(5)[0]
    k, v = qkv(17, seed=4)[1:]
    index, valid, allowed = random_candidates(5, 17, 6, seed=3)
    valid[:, 0] = True  # no empty row: SDPA would return NaN for it
    allowed[torch.arange(5), index[:, 0]] = True
    torch.testing.assert_close(gathered_attention(q, k, v, index, valid),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=allowed), atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_accumulates_in_fp32(dtype):
    q, k, v = (t.detach().to(dtype) for t in qkv(30))
    index, valid, allowed = random_candidates(30, 30, 16, seed=5)
    valid[:, 0] = True
    allowed[torch.arange(30), index[:, 0]] = True
    y = gathered_attention(q, k, v, index, valid)
    assert y.dtype == dtype
    # oracle: the same rounded inputs in fp64, rounded once at the end
    expected = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=allowed).to(dtype)
    ulp = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11, torch.float32: 2 ** -24}[dtype]
    torch.testing.assert_close(y.double(), expected.double(), atol=4 * ulp, rtol=2 * ulp)


def test_gathered_attention_dropout_drops_normalised_weights():
    q, k, v = (t.detach() for t in qkv(9))
    index, valid = torch.arange(9).expand(9, 9).clone(), torch.ones(9, 9, dtype=torch.bool)
    torch.manual_seed(5)
    y = gathered_attention(q, k, v, index, valid, dropout_p=0.3)
    # oracle: the same draw (same shape, dtype and generator state) applied to the dense softmax weights
    torch.manual_seed(5)
    weights = F.dropout(torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, -1), 0.3)
    torch.testing.assert_close(y, weights @ v, atol=1e-12, rtol=1e-12)
    assert not torch.allclose(y, gathered_attention(q, k, v, index, valid))
