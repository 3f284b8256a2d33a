"""Choosing the dense heads of a conversion by a retrieval-head score on a copy probe: the score is what the
attention probabilities say (checked by brute force), a head built to copy scores highest, and the choice is
reproducible from a seed."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from test_hf import tiny_llama  # noqa: E402
from transformers import AttentionInterface, AttentionMaskInterface  # noqa: E402
from transformers.masking_utils import eager_mask  # noqa: E402
from transformers.models.llama.modeling_llama import eager_attention_forward  # noqa: E402

from piattn.integrations.hf import (  # noqa: E402
    convert_to_pi,
    copy_probe,
    copy_scores,
    duo_attention_scores,
    retrieval_head_scores,
    top_dense_heads,
)


def test_a_head_built_to_copy_scores_highest():
    """Hand-set probabilities: query head 3 (KV head 1 with head 2) puts all its mass on the copy source, the
    others spread theirs causally; KV head 1 scores 1/2 + (uniform share)/2, the highest, and its argmax score
    is the copying head's 1 averaged with the uniform head's 0."""
    n, B, H = 6, 2, 4
    T = 2 * n
    causal = torch.tril(torch.ones(T, T))
    uniform = (causal / causal.sum(1, keepdim=True)).expand(B, H, T, T).clone()
    copying = uniform.clone()
    for i in range(n - 1):
        copying[:, 3, n + i] = 0
        copying[:, 3, n + i, i + 1] = 1
    scores = copy_scores([uniform, copying], n, n_kv_heads=2)
    share = torch.tensor([1 / (n + i + 1) for i in range(n - 1)]).mean()
    torch.testing.assert_close(scores[0], torch.stack([share, share]).float())
    torch.testing.assert_close(scores[1], torch.stack([share, (1 + share) / 2]).float())
    assert top_dense_heads(scores, 0.25) == {1: [1]}
    argmax = copy_scores([copying], n, n_kv_heads=2, measure="argmax")
    assert float(argmax[0, 1]) >= 0.5 > float(argmax[0, 0])


def test_scores_equal_a_brute_force_attention_mass():
    """The score of each KV head on the tiny Llama equals a loop over rows, queries and query heads of the
    attention probabilities recorded from the model's own attention call."""
    model = tiny_llama()
    n, B, seed = 10, 3, 7
    recorded = []

    def record(module, query, key, value, attention_mask, **kwargs):
        out, probs = eager_attention_forward(module, query, key, value, attention_mask, **kwargs)
        recorded.append(probs.detach())
        return out, probs

    AttentionInterface.register("record_probs", record)
    AttentionMaskInterface.register("record_probs", eager_mask)
    model.set_attn_implementation("record_probs")
    with torch.no_grad():
        model(copy_probe(B, n, (0, 100), seed), use_cache=False)
    model.set_attn_implementation("eager")
    H, Hkv = 4, 2
    want = torch.zeros(2, Hkv)
    for layer, probs in enumerate(recorded):
        for kv in range(Hkv):
            total, count = 0.0, 0
            for h in range(kv * H // Hkv, (kv + 1) * H // Hkv):
                for b in range(B):
                    for i in range(n - 1):
                        total += float(probs[b, h, n + i, i + 1])
                        count += 1
            want[layer, kv] = total / count
    got = retrieval_head_scores(model, length=n, batch=B, seed=seed, vocab=(0, 100))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_choice_is_reproducible_from_a_seed_and_leaves_a_converted_model_converted():
    model = convert_to_pi(tiny_llama(), window=3, period=8)
    a = retrieval_head_scores(model, length=16, batch=2, seed=3)
    b = retrieval_head_scores(model, length=16, batch=2, seed=3)
    c = retrieval_head_scores(model, length=16, batch=2, seed=4)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert model.config._attn_implementation == "pi_attention"
    assert top_dense_heads(a, 0.5) == top_dense_heads(b, 0.5)
    assert sum(map(len, top_dense_heads(a, 0.5).values())) == 2
    assert top_dense_heads(a, 0.0) == {} and top_dense_heads(a, 1.0) == {0: [0, 1], 1: [0, 1]}


def test_ties_go_to_the_lower_layer_then_head():
    scores = torch.tensor([[0.5, 0.9], [0.9, 0.5]])
    assert top_dense_heads(scores, 0.25) == {0: [1]}
    assert top_dense_heads(scores, 0.75) == {0: [0, 1], 1: [0]}
    with pytest.raises(ValueError, match="fraction"):
        top_dense_heads(scores, 1.5)


def test_a_tiebreak_orders_equal_scores_before_the_layer_does():
    gates = torch.tensor([[1.0, 1.0], [1.0, 0.2]])  # three heads clamped at 1, as DuoAttention's gates are
    retrieval = torch.tensor([[0.1, 0.3], [0.7, 0.9]])
    assert top_dense_heads(gates, 0.25, tiebreak=retrieval) == {1: [0]}  # not {0: [0]}: the tie goes to 0.7
    assert top_dense_heads(gates, 0.5, tiebreak=retrieval) == {0: [1], 1: [0]}
    assert top_dense_heads(gates, 0.75, tiebreak=retrieval) == {0: [0, 1], 1: [0]}  # the tiebreak never outranks
    with pytest.raises(ValueError, match="tiebreak"):
        top_dense_heads(gates, 0.5, tiebreak=retrieval[:1])


def test_chosen_heads_convert():
    """The chosen heads go straight into convert_to_pi; at fraction 1 the conversion is the original model."""
    original = tiny_llama(attn_implementation="sdpa").double()
    ids = copy_probe(1, 12, (0, 100), 0)
    chosen = top_dense_heads(retrieval_head_scores(tiny_llama(), length=12, batch=1), 1.0)
    converted = convert_to_pi(tiny_llama().double(), window=3, period=8, dense_heads=chosen)
    with torch.no_grad():
        torch.testing.assert_close(converted(ids, use_cache=False).logits, original(ids, use_cache=False).logits,
                                   rtol=1e-12, atol=1e-12)


def _mixed_logits(model, ids, gates):
    modules = [layer.self_attn for layer in model.model.layers]
    for m, g in zip(modules, gates, strict=True):
        m._pi_dense_mix = g
    try:
        with torch.no_grad():
            return model(ids, use_cache=False).logits
    finally:
        for m in modules:
            m._pi_dense_mix = None


def test_duo_mix_is_the_pure_paths_at_zero_and_one():
    original = tiny_llama(attn_implementation="sdpa").double()
    model = convert_to_pi(tiny_llama().double(), window=3, period=8, sinks=1)
    ids = copy_probe(2, 12, (0, 100), 0)
    with torch.no_grad():
        converted = model(ids, use_cache=False).logits
        dense = original(ids, use_cache=False).logits
    ones, zeros = torch.ones(2, 2, dtype=torch.float64), torch.zeros(2, 2, dtype=torch.float64)
    torch.testing.assert_close(_mixed_logits(model, ids, ones), dense, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(_mixed_logits(model, ids, zeros), converted, rtol=1e-12, atol=1e-12)


def test_duo_attention_scores_are_reproducible_and_pushed_toward_streaming():
    model = convert_to_pi(tiny_llama(), window=3, period=8, sinks=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kwargs = dict(steps=6, length=12, batch=2, lr=0.05)
    a = duo_attention_scores(model, seed=1, **kwargs)
    b = duo_attention_scores(model, seed=1, **kwargs)
    assert a.shape == (2, 2) and torch.equal(a, b)
    assert bool(((a >= 0) & (a <= 1)).all())
    pushed = duo_attention_scores(model, seed=1, l1=10.0, **kwargs)
    assert float(pushed.mean()) < float(a.mean())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # the model is left as it was
    assert all(p.requires_grad for p in model.parameters())
    chosen = top_dense_heads(a, 0.5)
    assert sum(map(len, chosen.values())) == 2 and chosen == top_dense_heads(b, 0.5)
