"""The image kinds, neighbourhood and strided attention, against a dense-mask oracle written here from the
definitions (pixel rows and columns by plain integer arithmetic), forward and backward; their causality,
key counts and refusals."""

from __future__ import annotations

import pytest
import torch

from piattn.config import GPTConfig, ModelConfig
from piattn.layers import ATTENTION, NeighbourhoodAttention, StridedAttention
from piattn.layers.masked import MAX_POSITIONS
from piattn.models import GPT

D_MODEL, HEADS = 16, 2


def neighbourhood_oracle(T: int, width: int, radius: int, causal: bool) -> torch.Tensor:
    """bool [T, T] by loops: |Δrow| <= r and |Δcol| <= r (rows continue at `width`), causal also j <= i."""
    allowed = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        for j in range(T):
            (ri, ci), (rj, cj) = divmod(i, width), divmod(j, width)
            allowed[i, j] = abs(ri - rj) <= radius and abs(ci - cj) <= radius and (j <= i or not causal)
    return allowed


def strided_oracle(T: int, stride: int, causal: bool) -> torch.Tensor:
    """bool [T, T] by loops: Child et al.'s strided pattern."""
    allowed = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        for j in range(T):
            d = i - j if causal else abs(i - j)
            allowed[i, j] = d >= 0 and (d < stride or d % stride == 0)
    return allowed


def softmax_attention(q, k, v, allowed):
    """Softmax attention over the allowed keys, by hand (no SDPA): q, k, v [B, H, T, D]."""
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v


# id: (class, keywords, oracle(T, causal))
CASES = {
    "neighbourhood-w5-r1": (NeighbourhoodAttention, dict(image_width=5, radius=1),
                            lambda T, c: neighbourhood_oracle(T, 5, 1, c)),
    "neighbourhood-w6-r2": (NeighbourhoodAttention, dict(image_width=6, radius=2),
                            lambda T, c: neighbourhood_oracle(T, 6, 2, c)),
    "neighbourhood-w3-r0": (NeighbourhoodAttention, dict(image_width=3, radius=0),
                            lambda T, c: neighbourhood_oracle(T, 3, 0, c)),
    "strided-width7": (StridedAttention, dict(image_width=7), lambda T, c: strided_oracle(T, 7, c)),
    "strided-l3-over-width7": (StridedAttention, dict(image_width=7, stride=3), lambda T, c: strided_oracle(T, 3, c)),
    "strided-l1": (StridedAttention, dict(stride=1), lambda T, c: strided_oracle(T, 1, c)),
}


def qkv(T, seed=0, B=2):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, HEADS, T, D_MODEL // HEADS, generator=g, dtype=torch.float64).requires_grad_()
            for _ in range(3)]


def outputs_and_grads(fn, q, k, v):
    y = fn(q, k, v)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return (y, *torch.autograd.grad(y, (q, k, v), dy))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("T", [1, 4, 25, 37])  # 25 = a 5×5 image; 37: not a multiple of any width here
@pytest.mark.parametrize("name", list(CASES))
def test_attend_equals_the_oracle_forward_and_backward(name, T, causal):
    cls, kwargs, oracle = CASES[name]
    layer = cls(D_MODEL, HEADS, causal=causal, **kwargs).double()
    q, k, v = qkv(T)
    got = outputs_and_grads(lambda *t: layer.attend(*t, None), q, k, v)
    expected = outputs_and_grads(lambda *t: softmax_attention(*t, oracle(T, causal)), q, k, v)
    for what, a, b in zip(("y", "dq", "dk", "dv"), got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, msg=lambda m, w=what: f"{name} {w}: {m}")


@pytest.mark.parametrize("name", list(CASES))
def test_a_causal_layer_leaks_nothing_from_the_future(name):
    cls, kwargs, _ = CASES[name]
    torch.manual_seed(0)
    layer = cls(D_MODEL, HEADS, causal=True, rotary=True, **kwargs).double().eval()
    x = torch.randn(2, 31, D_MODEL, dtype=torch.float64)
    for t in (0, 12, 30):
        changed = x.clone()
        changed[:, t] += 1.0
        a, b = layer(x), layer(changed)
        assert torch.equal(a[:, :t], b[:, :t]), f"{name}: outputs before {t} moved"
        assert not torch.equal(a[:, t], b[:, t])


@pytest.mark.parametrize("height,width,radius", [(5, 6, 1), (7, 7, 2), (4, 9, 0), (6, 3, 3)])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_neighbourhood_key_counts(height, width, radius, causal):
    T = height * width
    allowed = neighbourhood_oracle(T, width, radius, causal)
    model = dict(image_width=width, radius=radius)
    assert NeighbourhoodAttention.keys_per_query(model, T, causal) == pytest.approx(allowed.sum().item() / T)
    # a pixel whose window fits in the image: (2r+1)², or r rows of 2r+1 above and r + 1 in its own row
    if height > 2 * radius and width > 2 * radius:
        inside = (height - 1 - radius) * width + radius  # bottom-most row whose window fits, when bidirectional
        inside = (height - 1) * width + radius if causal else inside
        assert allowed[inside].sum() == (2 * radius * radius + 2 * radius + 1 if causal else (2 * radius + 1) ** 2)
    # the layer's own mask is the oracle's
    layer = NeighbourhoodAttention(D_MODEL, HEADS, causal=causal, **model)
    assert torch.equal(layer.mask(T), allowed)


@pytest.mark.parametrize("T,stride", [(36, 6), (49, 7), (30, 4), (10, 1)])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_strided_key_counts(T, stride, causal):
    allowed = strided_oracle(T, stride, causal)
    assert StridedAttention.keys_per_query(dict(stride=stride), T, causal) == pytest.approx(allowed.sum().item() / T)
    if causal:  # query i: l keys of the band (when i >= l - 1) and ⌊i / l⌋ beyond it
        i = T - 1
        assert allowed[i].sum() == min(stride, i + 1) + i // stride
    layer = StridedAttention(D_MODEL, HEADS, causal=causal, image_width=stride)
    assert torch.equal(layer.mask(T), allowed)


def test_keys_per_query_of_the_study_kinds_on_a_32x32_image():
    T, W = 32 * 32, 32
    model = dict(n_layer=2, n_head=2, window=4, period=W, sinks=0, image_width=W, radius=1)
    counts = {name: ATTENTION[name].keys_per_query(model, T) for name in
              ("dense", "local", "pi", "neighbourhood", "strided")}
    assert counts["dense"] == (T + 1) / 2
    assert counts["local"] == pytest.approx((5 * T - 10) / T)  # 5 keys, fewer for the first 4 queries
    assert counts["pi"] == pytest.approx(counts["local"] + (T - W) / T)
    assert 4 < counts["neighbourhood"] < 5 and counts["strided"] > W  # 2r² + 2r + 1 = 5 inside
    with pytest.raises(ValueError, match="'longformer' declares no keys_per_query"):
        ATTENTION["longformer"].keys_per_query(model, T)


def test_refusals_name_the_setting():
    with pytest.raises(ValueError, match=r"^image_width must be set for neighbourhood attention .*got None$"):
        NeighbourhoodAttention(D_MODEL, HEADS)
    with pytest.raises(ValueError, match=r"^stride must be set for strided attention, or image_width .*neither$"):
        StridedAttention(D_MODEL, HEADS)
    with pytest.raises(ValueError, match="^radius must be an integer >= 0, got -1$"):
        NeighbourhoodAttention(D_MODEL, HEADS, image_width=4, radius=-1)
    with pytest.raises(ValueError, match="^stride must be an integer >= 1, got 0$"):
        StridedAttention(D_MODEL, HEADS, stride=0)
    with pytest.raises(ValueError, match="^image_width must be an integer >= 1, got 0$"):
        ModelConfig(image_width=0)
    with pytest.raises(ValueError, match="^image_width must be set for neighbourhood"):
        GPT(GPTConfig.from_name("tiny", attention="neighbourhood", vocab_size=40))
    for cls, kwargs in ((NeighbourhoodAttention, dict(image_width=4)), (StridedAttention, dict(stride=4))):
        layer = cls(D_MODEL, HEADS, **kwargs)
        with pytest.raises(ValueError, match=rf"^\w+ attention takes at most {MAX_POSITIONS} positions \(it runs "
                                             rf"dense attention under a T × T mask\), got T = {MAX_POSITIONS + 1}$"):
            layer.mask(MAX_POSITIONS + 1)


def test_a_model_of_each_image_kind_trains_a_step():
    for kind in ("neighbourhood", "strided"):
        torch.manual_seed(0)
        model = GPT(GPTConfig.from_name("tiny", attention=kind, vocab_size=40, n_layer=2, d_model=32, n_head=2,
                                        image_width=6, radius=2, dropout=0.1))
        idx = torch.randint(0, 40, (2, 36))
        loss = torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
        loss.backward()
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad), kind
        assert model.blocks[0].attn.settings == ({"image_width": 6, "radius": 2} if kind == "neighbourhood"
                                                 else {"stride": 6})
