"""Dense heads in a conversion (`convert_to_pi(dense_heads=...)`): with none the conversion is today's, with
all the model is the original, with some each head is its pure path's; `PiCache` keeps the dense heads whole
and decodes as the full forward does; the retrieval-head score picks heads reproducibly."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from test_hf import randomize_gates, tiny_llama, tokens  # noqa: E402

from piattn.integrations.hf import PiCache, cache_nbytes, convert_to_pi, from_pretrained_pi  # noqa: E402

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


@pytest.mark.parametrize("dense_heads", [{0: [1], 1: [0]}, {0: [0, 1], 1: [1]}, {1: [0, 1]}])
@pytest.mark.parametrize("sizes", [(1,), (3, 1, 2)])
def test_picache_with_dense_heads_decodes_as_the_full_forward(dense_heads, sizes):
    """Token by token (and in steps of mixed sizes) after a prompt, past the ring's capacity: every position's
    logits equal the full forward's; the cache keeps every position of the dense heads, and counts them."""
    model = _converted(dense_heads)
    ids = tokens(2, 40)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = PiCache(model.config)
        prompt = 6
        out, t, i = [model(ids[:, :prompt], cache=cache).logits[:, -1:]], prompt, 0
        while t < ids.shape[1]:
            n = min(sizes[i % len(sizes)], ids.shape[1] - t)
            out.append(model(ids[:, t:t + n], cache=cache).logits)
            t, i = t + n, i + 1
    torch.testing.assert_close(torch.cat(out, 1), full[:, prompt - 1:], rtol=1e-10, atol=1e-10)
    D, B, T = model.config.hidden_size // model.config.num_attention_heads, 2, ids.shape[1]
    for index, layer in enumerate(cache.layers):
        n_dense = len(dense_heads.get(index, ()))
        assert layer.dense_heads == tuple(dense_heads.get(index, ()))
        if n_dense:
            assert layer.dense_keys.shape == (B, n_dense, T, D)
            assert layer.dense_kv.shape[3] >= T
        else:
            assert layer.dense_kv is None
        dense_bytes = 0 if layer.dense_kv is None else layer.dense_kv.nbytes
        assert cache.nbytes_by_layer[index] == layer.kv.nbytes + dense_bytes
    assert sum(cache.nbytes_by_layer) == cache_nbytes(cache) == cache.nbytes


def test_picache_with_dense_heads_generates_as_dynamic_cache():
    model = _converted({0: [1]})
    ids = tokens(2, 12)
    kwargs = dict(max_new_tokens=20, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        want = model.generate(ids, **kwargs)
        got = model.generate(ids, cache=PiCache(model.config), **kwargs)
    assert torch.equal(got, want)


def test_picache_refuses_another_choice_of_dense_heads():
    cache = PiCache(_converted({0: [1]}).config)
    model = _converted({0: [0]})
    with pytest.raises(ValueError, match="dense key/value heads"), torch.no_grad():
        model(tokens(1, 5), cache=cache)


def test_left_padding_with_dense_heads_gives_each_row_what_it_gives_alone():
    """The dense heads read no pad; with PiCache, decoding a left-padded batch gives each row its own logits."""
    model = _converted({0: [1], 1: [0]})
    ids = tokens(2, 24)
    pads = 5
    mask = torch.ones_like(ids)
    mask[0, :pads] = 0
    pos = (mask.cumsum(1) - 1).clamp(min=0)  # each row's text from position 0 (RoPE in fp32 is not shift-exact)
    with torch.no_grad():
        alone = model(ids[:1, pads:], use_cache=False).logits
        batch = model(ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        torch.testing.assert_close(batch[:1, pads:], alone, rtol=1e-10, atol=1e-10)
        cache, prompt = PiCache(model.config), 10
        steps = [model(ids[:, :prompt], attention_mask=mask[:, :prompt], position_ids=pos[:, :prompt],
                       cache=cache).logits[:, -1:]]
        for t in range(prompt, ids.shape[1]):
            steps.append(model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], position_ids=pos[:, t:t + 1],
                               cache=cache).logits)
    torch.testing.assert_close(torch.cat(steps, 1)[:1], alone[:, prompt - pads - 1:], rtol=1e-10, atol=1e-10)


@pytest.mark.slow  # compiling the model takes about a minute on 2 cores
def test_mixed_heads_compiled_give_the_eager_logits_and_gradients():
    """torch.compile over a model whose layers mix dense and π heads (graph breaks where the attention function
    reads positions from tensors): the same logits and the same gradients as the eager model."""
    ids = tokens(2, 24)
    model = _converted({0: [1], 1: [0]}, dtype=torch.float32)
    compiled = torch.compile(model)

    def loss_and_grads(m):
        model.zero_grad(set_to_none=True)
        logits = m(ids, use_cache=False).logits
        logits.logsumexp(-1).mean().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want_logits, want = loss_and_grads(model)
    got_logits, got = loss_and_grads(compiled)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    assert got.keys() == want.keys() and any(".pi_gate." in n for n in want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)
