"""piattn.integrations.hf: π-Attention inside a transformers Llama, checked against independent oracles.

Oracles: the attention module's pieces run by hand (projections, RoPE written here, the gate MLP evaluated
from its weights, `pi_attention` on the reference backend); the unconverted Llama with a dense additive
4D mask that spells out the π pattern and its priors; and greedy decoding by full forwards without a cache.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

import piattn  # noqa: E402
from piattn.integrations.hf import PiCache, cache_nbytes, convert_to_pi, from_pretrained_pi  # noqa: E402

ATOL = 1e-5


def tiny_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    """2 layers, width 64, 4 query heads sharing 2 key/value heads (GQA), fp32, eager attention."""
    cfg = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=100, max_position_embeddings=256, bos_token_id=None,
               eos_token_id=None, pad_token_id=None, attn_implementation="eager")
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**cfg, **overrides})).eval()


def randomize_gates(model, seed: int = 1) -> None:
    """Give every gate a non-constant output, so that per-token, per-head α is actually exercised."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".pi_gate." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def tokens(B: int, T: int, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, 100, (B, T), generator=torch.Generator().manual_seed(seed))


def pi_additive_mask(T: int, window: int, period: int, prior: float) -> torch.Tensor:
    """[1, 1, T, T]: log prior on i−window … i, log(1 − prior) on i − period, −inf elsewhere (causal)."""
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    local = (j <= i) & (j >= i - window)
    skip = (j == i - period) & ~local
    mask = torch.full((T, T), float("-inf"))
    mask[local] = math.log(prior)
    mask[skip] = math.log(1 - prior)
    return mask[None, None]


def rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """x [B, H, T, D] rotated by RoPE in Llama's half-split layout: pairs (m, m + D/2) turn by pos·base^(−2m/D)."""
    D = x.shape[-1]
    angle = positions.double()[:, None] * base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def by_hand_attention(attn, x: torch.Tensor, cfg, window: int, period: int, eps: float) -> torch.Tensor:
    """The converted attention module on x [B, T, d], recomputed from its weights -> [B, T, d]."""
    B, T, _ = x.shape
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    D = cfg.hidden_size // H
    q = attn.q_proj(x).view(B, T, H, D).transpose(1, 2)
    k = attn.k_proj(x).view(B, T, Hkv, D).transpose(1, 2)
    v = attn.v_proj(x).view(B, T, Hkv, D).transpose(1, 2)
    pos, base = torch.arange(T), cfg.rope_parameters["rope_theta"]
    q, k = rope(q, pos, base), rope(k, pos, base)
    k, v = (t.repeat_interleave(H // Hkv, dim=1) for t in (k, v))  # query head h reads kv head h // (H/Hkv)
    g0, g2 = attn.pi_gate[0], attn.pi_gate[2]
    alpha = torch.sigmoid(F.linear(F.gelu(F.linear(x, g0.weight, g0.bias)), g2.weight, g2.bias))
    gate = eps + (1 - 2 * eps) * alpha.transpose(1, 2)
    y = piattn.pi_attention(q, k, v, gate, window=window, period=period, eps=eps, scale=D**-0.5,
                            backend="reference")
    return attn.o_proj(y.transpose(1, 2).reshape(B, T, H * D))


def test_attention_layer_matches_by_hand():
    model = convert_to_pi(tiny_llama(), window=3, period=8)
    randomize_gates(model)
    attn = model.model.layers[1].self_attn
    seen = {}
    attn.register_forward_pre_hook(lambda m, a, kw: seen.update(x=kw["hidden_states"]), with_kwargs=True)
    attn.register_forward_hook(lambda m, a, out: seen.update(y=out[0]))
    with torch.no_grad():
        model(tokens(2, 40))
        expected = by_hand_attention(attn, seen["x"], model.config, window=3, period=8, eps=1e-4)
    assert seen["y"].shape == (2, 40, 64)
    torch.testing.assert_close(seen["y"], expected, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("period", [8, 50])
def test_fixed_prior_model_matches_dense_masked_llama(period):
    """Whole model, variant "fixed": identical to the plain Llama given the π pattern as an additive mask.

    period 50 > T: no query has a skip key, so this is local attention over the window.
    """
    T, window, prior = 40, 3, 0.7
    plain = tiny_llama()
    model = convert_to_pi(copy.deepcopy(plain), window=window, period=period, variant="fixed", prior=prior)
    ids = tokens(2, T)
    with torch.no_grad():
        expected = plain(ids, attention_mask=pi_additive_mask(T, window, period, prior)).logits
        actual = model(ids).logits
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=ATOL)


def test_period_beyond_length_is_local_attention_whatever_the_gate():
    T, window = 40, 3
    plain = tiny_llama()
    model = convert_to_pi(copy.deepcopy(plain), window=window, period=T + 5)
    randomize_gates(model)  # α scales every candidate of a query alike when there is no skip: no effect
    ids = tokens(2, T)
    local = pi_additive_mask(T, window, T + 5, prior=0.5) - math.log(0.5)  # 0 on the window, −inf elsewhere
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain(ids, attention_mask=local).logits, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("prompt_len", [5, 12])  # shorter and longer than the cache's capacity (9)
def test_generate_with_pi_cache_matches_full_forwards(prompt_len):
    window, period, new = 3, 8, 24  # 3·period new tokens
    model = convert_to_pi(tiny_llama(), window=window, period=period)
    cache, _ = generate_with_pi_cache_and_compare(model, prompt_len, new)

    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    capacity = max(window, period) + 1
    per_position = 2 * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 4  # k+v, B=2, fp32
    assert cache.get_seq_length() == prompt_len + new - 1  # the last token is sampled, never fed back
    assert cache.nbytes == capacity * per_position
    assert torch.equal(cache.layers[0].positions, torch.arange(prompt_len + new - 1 - capacity, prompt_len + new - 1))


def test_pi_cache_stays_bounded_while_dynamic_cache_grows():
    window, period = 3, 8
    capacity = max(window, period) + 1
    model = convert_to_pi(tiny_llama(), window=window, period=period)
    T = 20
    ids = tokens(1, T)
    pi_cache, dense_cache = PiCache(model.config), DynamicCache()
    sizes = []
    with torch.no_grad():
        for t in range(T):
            a = model(ids[:, t : t + 1], cache=pi_cache, use_cache=True).logits
            b = model(ids[:, t : t + 1], cache=dense_cache, use_cache=True).logits
            torch.testing.assert_close(a, b, atol=ATOL, rtol=ATOL)
            sizes.append((pi_cache.nbytes, cache_nbytes(dense_cache)))
    assert all(pi == sizes[capacity - 1][0] for pi, _ in sizes[capacity - 1 :])  # full after capacity tokens
    assert sizes[-1][1] == sizes[-1][0] * T // capacity  # the dynamic cache holds all T


def test_gate_starts_at_init_alpha_and_gets_gradients():
    model = convert_to_pi(tiny_llama(), window=3, period=8, gate_init_alpha=0.9)
    alphas = []
    for layer in model.model.layers:
        layer.self_attn.pi_gate.register_forward_hook(lambda m, a, out: alphas.append(out))
    model.train()
    ids = tokens(2, 20)
    loss = F.cross_entropy(model(ids).logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    assert len(alphas) == 2 and all(a.shape == (2, 20, 4) for a in alphas)
    torch.testing.assert_close(torch.cat(alphas), torch.full((4, 20, 4), 0.9), atol=1e-6, rtol=0)
    gates = [layer.self_attn.pi_gate for layer in model.model.layers]
    assert all(g[2].weight.grad.abs().sum() > 0 and g[2].bias.grad.abs().sum() > 0 for g in gates)

    # The zero last weight blocks the first layer's gradient only until it has moved once.
    with torch.no_grad():
        for g in gates:
            g[2].weight -= 0.1 * g[2].weight.grad
    model.zero_grad()
    F.cross_entropy(model(ids).logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    assert all(p.grad.abs().sum() > 0 for g in gates for p in g.parameters())


def test_attention_dropout_acts_in_training_only():
    plain = tiny_llama()
    model = convert_to_pi(tiny_llama(attention_dropout=0.5), window=3, period=8)
    reference = convert_to_pi(copy.deepcopy(plain), window=3, period=8)
    ids = tokens(2, 20)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=ATOL, rtol=ATOL)
        model.train()
        assert not torch.allclose(model(ids).logits, reference(ids).logits, atol=1e-3)


def test_save_and_load_round_trip(tmp_path):
    model = convert_to_pi(tiny_llama(), window=3, period=8, variant="separate", logit_clamp=10.0)
    randomize_gates(model)
    model.save_pretrained(tmp_path)
    loaded = from_pretrained_pi(tmp_path).eval()
    assert loaded.config.pi_attention == model.config.pi_attention
    assert loaded.config.pi_attention["variant"] == "separate" and loaded.config.pi_attention["period"] == 8
    assert loaded.config._attn_implementation == "pi_attention"
    gates = {n: p for n, p in model.named_parameters() if ".pi_gate." in n}
    assert len(gates) == 2 * 4  # two layers, two linear layers with weight and bias each
    loaded_params = dict(loaded.named_parameters())
    assert all(torch.equal(loaded_params[n], p) for n, p in gates.items())
    ids = tokens(2, 30)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=0, rtol=0)


def test_loading_a_checkpoint_without_gates_raises(tmp_path):
    plain = tiny_llama()
    plain.config.pi_attention = {"window": 3, "period": 8, "variant": "adaptive"}
    plain.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="lacks gate weights"):
        from_pretrained_pi(tmp_path)


def test_an_all_ones_mask_changes_nothing_and_a_hole_in_the_mask_raises():
    model = convert_to_pi(tiny_llama(), window=3, period=8)
    ids = tokens(2, 10)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, attention_mask=torch.ones(2, 10)).logits, model(ids).logits)
        holed = torch.ones(2, 10, dtype=torch.long)
        holed[0, 4] = 0  # a pad between tokens: the relative pattern cannot skip it
        with pytest.raises(ValueError, match="one run"):
            model(ids, attention_mask=holed)


def conversion_state(model) -> dict:
    """Everything convert_to_pi changes: gates, pre-hooks, config.pi_attention, the attention implementation."""
    return dict(gates=[n for n, m in model.named_modules() if hasattr(m, "pi_gate")],
                hooks=sum(len(m._forward_pre_hooks) for m in model.modules()),
                params=[n for n, _ in model.named_parameters()],
                settings=getattr(model.config, "pi_attention", None),
                attention=model.config._attn_implementation)


@pytest.mark.parametrize("kwargs, match", [
    (dict(window=-1), "window"),
    (dict(window=True), "window"),
    (dict(period=0), "period"),
    (dict(variant="dense"), "variant"),
    (dict(backend="nope"), "backend"),
    (dict(prior=1.5), "prior"),
    (dict(prior=0.0, variant="fixed"), "prior"),
    (dict(eps=0.7), "eps"),
    (dict(eps=0.0), "eps"),
    (dict(logit_clamp=0.0), "logit_clamp"),
    (dict(gate_init_alpha=1.0), "gate_init_alpha"),
    (dict(gate_init_alpha=0.0, variant="fixed"), "gate_init_alpha"),
])
def test_bad_arguments_raise_at_convert_time_and_leave_the_model_unchanged(kwargs, match):
    plain = tiny_llama()
    model = copy.deepcopy(plain)
    before = conversion_state(model)
    with pytest.raises(ValueError, match=match):
        convert_to_pi(model, **kwargs)
    assert conversion_state(model) == before
    ids = tokens(1, 12)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, atol=0, rtol=0)


def test_a_model_that_cannot_switch_attention_is_left_unchanged(monkeypatch):
    """A model class that does not dispatch through AttentionInterface: refused before any gate is attached."""
    model = tiny_llama()
    monkeypatch.setattr(model, "_can_set_attn_implementation", lambda: False)
    before = conversion_state(model)
    with pytest.raises(ValueError, match="AttentionInterface"):
        convert_to_pi(model)
    assert conversion_state(model) == before


def test_stored_settings_are_the_pi_settings_and_the_backend():
    model = convert_to_pi(tiny_llama(), period=8, prior=0.3)
    assert model.config.pi_attention == dict(window=4, period=8, variant="adaptive", prior=0.3, logit_clamp=20.0,
                                             eps=1e-4, sinks=0, backend="auto")


def test_loading_checks_the_stored_settings(tmp_path):
    model = convert_to_pi(tiny_llama(), window=3, period=8)
    model.config.pi_attention = {**model.config.pi_attention, "eps": 0.7}
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="eps"):
        from_pretrained_pi(tmp_path)


def test_converting_twice_raises():
    model = convert_to_pi(tiny_llama())
    with pytest.raises(ValueError, match="already converted"):
        convert_to_pi(model)


# --- grouped-query attention, sinks and padding -------------------------------------------------------


def pi_sink_additive_mask(T: int, window: int, period: int, prior: float, sinks: int) -> torch.Tensor:
    """pi_additive_mask plus the sink keys j < sinks for every query i >= j that reads them in neither its
    window nor its skip, with the local prior."""
    mask = pi_additive_mask(T, window, period, prior)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    sink = (j < sinks) & (j <= i) & torch.isinf(mask[0, 0])
    mask[0, 0][sink] = math.log(prior)
    return mask


def test_key_value_heads_reach_the_operator_unrepeated(monkeypatch):
    import piattn.integrations.hf.attention as hf_attention

    shapes = []
    real = hf_attention.pi_attention_with_settings
    monkeypatch.setattr(hf_attention, "pi_attention_with_settings",
                        lambda q, k, v, *a, **kw: shapes.append((q.shape, k.shape, v.shape)) or real(q, k, v, *a, **kw))
    model = convert_to_pi(tiny_llama(), window=3, period=8)
    with torch.no_grad():
        model(tokens(2, 12))
    assert shapes == [((2, 4, 12, 16), (2, 2, 12, 16), (2, 2, 12, 16))] * 2  # 4 query heads, 2 kv heads


@pytest.mark.parametrize("period", [8, 50])
def test_sinks_match_the_dense_masked_llama(period):
    T, window, prior, sinks = 40, 3, 0.7, 3
    plain = tiny_llama()
    model = convert_to_pi(copy.deepcopy(plain), window=window, period=period, variant="fixed", prior=prior,
                          sinks=sinks)
    assert model.config.pi_attention["sinks"] == sinks
    ids = tokens(2, T)
    with torch.no_grad():
        expected = plain(ids, attention_mask=pi_sink_additive_mask(T, window, period, prior, sinks)).logits
        torch.testing.assert_close(model(ids).logits, expected, atol=ATOL, rtol=ATOL)


def generate_with_pi_cache_and_compare(model, prompt_len: int, new: int) -> tuple[PiCache, torch.Tensor]:
    """Randomise `model`'s gates, generate `new` tokens greedily after a random prompt [2, prompt_len] with a
    PiCache, assert the ids and logits equal `greedy_by_full_forwards`' (no cache); -> (the cache, the prompt)."""
    randomize_gates(model)
    prompt = tokens(2, prompt_len)
    cache = PiCache(model.config)
    with torch.no_grad():
        out = model.generate(prompt, cache=cache, max_new_tokens=new, do_sample=False,
                             return_dict_in_generate=True, output_logits=True)
        ids, logits = greedy_by_full_forwards(model, prompt, new)  # the oracle: no cache
    assert torch.equal(out.sequences, ids)
    torch.testing.assert_close(torch.stack(out.logits), logits, atol=ATOL, rtol=ATOL)
    return cache, prompt


def greedy_by_full_forwards(model, prompt: torch.Tensor, new: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding of one unpadded batch by full forwards, no cache -> (ids, logits [new, B, V])."""
    ids, step_logits = prompt, []
    for _ in range(new):
        logits = model(ids, use_cache=False).logits[:, -1]
        step_logits.append(logits)
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], 1)
    return ids, torch.stack(step_logits)


@pytest.mark.parametrize("prompt_len", [3, 14])  # within the sinks + capacity, and beyond
def test_generate_with_sinks_and_pi_cache_matches_full_forwards(prompt_len):
    window, period, sinks, new = 3, 8, 2, 20
    model = convert_to_pi(tiny_llama(), window=window, period=period, sinks=sinks)
    cache, prompt = generate_with_pi_cache_and_compare(model, prompt_len, new)
    cfg = model.config
    per_position = 2 * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * (cfg.hidden_size // 4) * 4
    assert cache.nbytes == (max(window, period) + 1 + sinks) * per_position  # constant: ring + sinks
    # The sink copies are the keys of positions 0 and 1, as DynamicCache holds them.
    dense = DynamicCache()
    with torch.no_grad():
        model(prompt, cache=dense, use_cache=True)
    torch.testing.assert_close(cache.layers[1].sink_keys, dense.layers[1].keys[:, :, :sinks])


def left_pad(prompts: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts [T_b] -> (ids [B, max T], attention_mask [B, max T]) padded on the left."""
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T - len(p):] = p
        mask[b, T - len(p):] = 1
    return ids, mask


@pytest.mark.parametrize("cache_kind", ["pi", "dynamic"])
@pytest.mark.parametrize("sinks", [0, 2])
def test_left_padded_batch_generates_what_each_prompt_generates_alone(cache_kind, sinks):
    model = convert_to_pi(tiny_llama(), window=3, period=8, sinks=sinks)
    randomize_gates(model)
    prompts = [tokens(1, n, seed=n)[0] for n in (4, 13, 9)]  # pads 9, 0 and 4 in the batch
    new = 12
    ids, mask = left_pad(prompts)
    cache = PiCache(model.config) if cache_kind == "pi" else DynamicCache()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=new,
                             do_sample=False, return_dict_in_generate=True, output_logits=True, pad_token_id=0)
        for b, prompt in enumerate(prompts):
            alone, logits = greedy_by_full_forwards(model, prompt[None], new)
            assert torch.equal(out.sequences[b, ids.shape[1] - len(prompt):], alone[0])
            torch.testing.assert_close(torch.stack(out.logits)[:, b], logits[:, 0], atol=1e-4, rtol=1e-4)


def test_padded_rows_give_each_sequence_its_own_logits():
    """One forward, no cache: left- and right-padded rows; the real tokens' logits are those of each alone."""
    model = convert_to_pi(tiny_llama(), window=3, period=8, sinks=2)
    randomize_gates(model)
    a, b = tokens(1, 7, seed=5)[0], tokens(1, 12, seed=6)[0]
    ids = torch.zeros(3, 12, dtype=torch.long)
    mask = torch.zeros(3, 12, dtype=torch.long)
    ids[0, 5:], mask[0, 5:] = a, 1  # left padding
    ids[1, :7], mask[1, :7] = a, 1  # right padding
    ids[2], mask[2] = b, 1
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        got = model(ids, attention_mask=mask, position_ids=positions).logits
        alone_a, alone_b = model(a[None]).logits[0], model(b[None]).logits[0]
    torch.testing.assert_close(got[0, 5:], alone_a, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1, :7], alone_a, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[2], alone_b, atol=1e-4, rtol=1e-4)
