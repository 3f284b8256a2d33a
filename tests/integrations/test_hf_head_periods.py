"""Multi-scale π in the Hugging Face integration: `convert_to_pi(period=...)` takes every form GPTConfig.period
takes (per head, per layer, a schedule), resolved by the config's one parser and stored resolved; the
converted model equals the plain Llama given each head's π pattern as an additive mask; `PiCache` holds each
layer's own ring, and decoding with it equals full forwards; a saved model reloads its periods; bad periods
raise one line naming `period` and leave the model as it was."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from test_hf import (  # noqa: E402
    ATOL,
    by_hand_attention,
    conversion_state,
    generate_with_pi_cache_and_compare,
    pi_additive_mask,
    randomize_gates,
    tiny_llama,
    tokens,
)

from piattn.integrations.hf import HFPiSettings, PiCache, convert_to_pi, from_pretrained_pi  # noqa: E402

# 4 query heads on 2 key/value heads: π = 2 inside the window 3, π = 5 and 8 split the key/value groups.
HEAD_PERIODS = [2, 8, 5, 13]
LAYER_PERIODS = [[2, 8, 5, 13], [6, 6, 3, 9]]


def test_fixed_prior_model_with_per_head_periods_matches_dense_masked_llama():
    T, window, prior = 40, 3, 0.7
    plain = tiny_llama()
    model = convert_to_pi(copy.deepcopy(plain), window=window, period=HEAD_PERIODS, variant="fixed", prior=prior)
    mask = torch.cat([pi_additive_mask(T, window, p, prior) for p in HEAD_PERIODS], 1)  # [1, H, T, T]
    ids = tokens(2, T)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain(ids, attention_mask=mask).logits, atol=ATOL, rtol=ATOL)


def test_each_layer_runs_its_own_periods():
    model = convert_to_pi(tiny_llama(), window=3, period=LAYER_PERIODS)
    randomize_gates(model)
    seen = {}
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.register_forward_pre_hook(
            lambda m, a, kw, i=i: seen.update({f"x{i}": kw["hidden_states"]}), with_kwargs=True)
        layer.self_attn.register_forward_hook(lambda m, a, out, i=i: seen.update({f"y{i}": out[0]}))
    with torch.no_grad():
        model(tokens(2, 30))
        for i, periods in enumerate(LAYER_PERIODS):
            attn = model.model.layers[i].self_attn
            D = seen[f"y{i}"].shape[-1] // len(periods)
            # Head h's output computed with every head at period π_h (the reference operator, one int period),
            # kept for head h only; then the output projection.
            heads = [by_hand_heads(attn, seen[f"x{i}"], model.config, window=3, period=p)[..., h * D:(h + 1) * D]
                     for h, p in enumerate(periods)]
            torch.testing.assert_close(seen[f"y{i}"], attn.o_proj(torch.cat(heads, -1)), atol=ATOL, rtol=ATOL)


def by_hand_heads(attn, x, cfg, window, period):
    """`by_hand_attention` before the output projection: [B, T, H·D], every head with this one period."""
    saved = attn.o_proj
    attn.o_proj = torch.nn.Identity()
    try:
        return by_hand_attention(attn, x, cfg, window=window, period=period, eps=1e-4)
    finally:
        attn.o_proj = saved


@pytest.mark.parametrize("period, capacities", [(HEAD_PERIODS, [14, 14]), (LAYER_PERIODS, [14, 10])])
def test_generate_with_pi_cache_and_per_head_periods_matches_full_forwards(period, capacities):
    model = convert_to_pi(tiny_llama(), window=3, period=period, sinks=1)
    cache, _ = generate_with_pi_cache_and_compare(model, prompt_len=6, new=30)
    assert [layer.capacity for layer in cache.layers] == capacities  # max(window, the layer's largest π) + 1
    assert [layer.keys.shape[2] for layer in cache.layers] == capacities  # full, and no more


def test_schedules_are_resolved_and_stored_and_a_saved_model_reloads_them(tmp_path):
    model = convert_to_pi(tiny_llama(), window=2, period="geometric:3")
    assert model.config.pi_attention["period"] == [3, 6, 12, 24]
    cover = convert_to_pi(tiny_llama(), window=2, period="cover:40").config.pi_attention["period"]
    assert len(cover) == 2 and all(len(heads) == 4 for heads in cover)  # per layer: the designer's periods
    model = convert_to_pi(tiny_llama(), window=3, period=LAYER_PERIODS)
    randomize_gates(model)
    model.save_pretrained(tmp_path)
    loaded = from_pretrained_pi(tmp_path).eval()
    assert loaded.config.pi_attention["period"] == LAYER_PERIODS
    settings = HFPiSettings.of(loaded.config)
    assert [settings.layer(i).period for i in range(2)] == [tuple(p) for p in LAYER_PERIODS] and settings.reach == 13
    ids = tokens(1, 24)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=0, rtol=0)


def test_a_cache_made_for_shorter_rings_is_refused():
    short = convert_to_pi(tiny_llama(), window=3, period=[2, 3, 3, 2])
    long = convert_to_pi(tiny_llama(), window=3, period=LAYER_PERIODS)
    with pytest.raises(ValueError, match=r"rings of 4 positions .* needs \(14, 10\) positions"):
        long(tokens(1, 4), cache=PiCache(short.config), use_cache=True)


@pytest.mark.parametrize("period, match", [
    ([8, 16], r"periods has 2 entries: a list of ints needs one per head, n_head=4"),
    ([[2, 4, 8, 16]] * 3, r"periods has 3 layers, the model n_layer=2"),
    ([2, 0, 8, 16], r"periods\[1\] must be an int >= 1"),
    ([2, -4, 8, 16], r"periods\[1\] must be an int >= 1"),
    ([2, 4.0, 8, 16], r"periods\[1\] must be an int >= 1"),
    (0, r"period must be an int >= 1, got 0"),
    (8.0, r"period must be an int, a list of n_head ints"),
    ("spiral", r"period schedule must be one of single, geometric, cover"),
    (torch.tensor([2, 4, 8, 16], device="meta"), r"period must be an int, a list of n_head ints"),
])
def test_bad_periods_raise_one_line_and_leave_the_model_unchanged(period, match):
    plain = tiny_llama()
    model = copy.deepcopy(plain)
    before = conversion_state(model)
    with pytest.raises(ValueError, match=match) as raised:
        convert_to_pi(model, window=3, period=period)
    assert "\n" not in str(raised.value) and "period" in str(raised.value)
    assert conversion_state(model) == before


def test_the_attention_hands_each_layer_s_settings_object_to_the_operator_whole(monkeypatch):
    """The stored settings read back as one `PiSettings` per layer (equal layers sharing one), and each layer's
    attention hands its own object to the operator, not a dict of its fields."""
    import piattn.integrations.hf.attention as hf_attention
    from piattn.config import PiSettings

    model = convert_to_pi(tiny_llama(), window=3, period=LAYER_PERIODS, sinks=1)
    settings = HFPiSettings.of(model.config)
    assert all(type(s) is PiSettings for s in settings.layers) and settings.backend == "auto"
    assert [s.period for s in settings.layers] == [tuple(p) for p in LAYER_PERIODS] and settings.pi.sinks == 1
    same = HFPiSettings.of(convert_to_pi(tiny_llama(), window=3, period=HEAD_PERIODS).config)
    assert len(same.layers) == 2 and same.layers[0] is same.layers[1]
    seen = []
    real = hf_attention.pi_attention_with_settings
    monkeypatch.setattr(hf_attention, "pi_attention_with_settings",
                        lambda q, k, v, gate, s, **kw: seen.append(s) or real(q, k, v, gate, s, **kw))
    with torch.no_grad():
        model(tokens(1, 12))
    assert len(seen) == 2 and all(s is settings.layer(i) for i, s in enumerate(seen))
    with pytest.raises(ValueError, match="layers must be one piattn.config.PiSettings per layer"):
        HFPiSettings(({"window": 3},))
    with pytest.raises(ValueError, match="backend must be one of"):
        HFPiSettings(settings.layers, "nope")
