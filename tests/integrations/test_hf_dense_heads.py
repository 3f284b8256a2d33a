"""Dense heads in a conversion (`convert_to_pi(dense_heads=...)`): with none the conversion is today's, with
all the model is the original, with some each head is its pure path's; `PiCache` keeps the dense heads whole
and decodes as the full forward does; the retrieval-head score picks heads reproducibly."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from test_hf import randomize_gates, tiny_llama, tokens  # noqa: E402

from piattn.integrations.hf import convert_to_pi, from_pretrained_pi  # noqa: E402

PI = dict(window=3, period=8, sinks=1)


def _converted(dense_heads=None, dtype=torch.float64, **pi):
    model = convert_to_pi(tiny_llama().to(dtype), **{**PI, **pi}, dense_heads=dense_heads)
    randomize_gates(model)
    return model.to(dtype)


def _head_outputs(model, ids):
    """Per layer, the attention function's output [B, T, H, D] (before o_proj), captured by a pre-hook on o_proj."""
    outs = []
    hooks = [layer.self_attn.o_proj.register_forward_pre_hook(lambda m, a: outs.append(a[0]))
             for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    H = model.config.num_attention_heads
    return [o.reshape(*o.shape[:2], H, -1) for o in outs]


def test_no_dense_heads_is_todays_conversion_bit_for_bit():
    ids = tokens(2, 30)
    with torch.no_grad():
        plain = _converted(None)(ids, use_cache=False).logits
        empty = _converted({})(ids, use_cache=False).logits
        no_heads = _converted({0: [], 1: []})(ids, use_cache=False).logits
    assert torch.equal(plain, empty) and torch.equal(plain, no_heads)
    assert not hasattr(_converted({0: []}).config, "pi_dense_heads")


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_all_dense_heads_is_the_original_model(dtype, tol):
    """Against the original under "sdpa" (its "eager" takes the softmax in fp32 whatever the dtype)."""
    ids = tokens(2, 30)
    original = tiny_llama(attn_implementation="sdpa").to(dtype)
    with torch.no_grad():
        want = original(ids, use_cache=False).logits
        got = _converted({0: [0, 1], 1: [0, 1]}, dtype=dtype)(ids, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_mixed_heads_are_each_their_pure_paths_heads():
    """Layer 0 keeps KV head 1 dense (query heads 2, 3 under GQA), layer 1 KV head 0 (query heads 0, 1). The
    first layer's heads are compared with the pure paths on the same input; the second's with each pure path
    run on the mixed model's first-layer output (a mixed model whose layer 0 is mixed as well)."""
    ids = tokens(2, 30)
    mixed = _head_outputs(_converted({0: [1], 1: [0]}), ids)
    pi = _head_outputs(_converted(None), ids)
    dense = _head_outputs(_converted({0: [0, 1], 1: [0, 1]}), ids)
    torch.testing.assert_close(mixed[0][:, :, 2:], dense[0][:, :, 2:], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(mixed[0][:, :, :2], pi[0][:, :, :2], rtol=1e-12, atol=1e-12)
    # Layer 1 with layer 0 mixed the same way in both references.
    pi1 = _head_outputs(_converted({0: [1]}), ids)[1]
    dense1 = _head_outputs(_converted({0: [1], 1: [0, 1]}), ids)[1]
    torch.testing.assert_close(mixed[1][:, :, :2], dense1[:, :, :2], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(mixed[1][:, :, 2:], pi1[:, :, 2:], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bad,message", [
    ({2: [0]}, "layer 2"), ({-1: [0]}, "layer -1"), ({0: [2]}, "head 2"), ({0: [0, 0]}, "twice"),
    ([(0, 1)], "must map"),
])
def test_dense_heads_refused_in_one_line(bad, message):
    model = tiny_llama()
    with pytest.raises(ValueError, match=message) as info:
        convert_to_pi(model, **PI, dense_heads=bad)
    assert "dense_heads" in str(info.value) and "\n" not in str(info.value)
    assert not any(hasattr(m, "pi_gate") for m in model.modules())  # left as it was


def test_dense_heads_saved_and_reloaded(tmp_path):
    model = _converted({1: [1]}, dtype=torch.float32)
    model.save_pretrained(tmp_path)
    loaded = from_pretrained_pi(tmp_path).eval()
    assert loaded.config.pi_dense_heads == [[], [1]]
    ids = tokens(1, 20)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, use_cache=False).logits, model(ids, use_cache=False).logits)
