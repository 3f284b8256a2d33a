"""The operator settings travel typed, end to end: a model config builds each layer's `PiSettings` once, hands
the π layer that object, and the layer hands it to the operator whole (`pi_attention_with_settings`), in every
layer, with per-layer periods and in hybrid stacks."""

from __future__ import annotations

import pytest
import torch

import piattn.config.model as model_config
import piattn.layers.sharding as sharding
from piattn.config import PI_DEFAULTS, EncoderConfig, GPTConfig, PiSettings
from piattn.layers import PiAttention
from piattn.models import GPT, Encoder


def settings_seen(monkeypatch) -> list:
    """The settings object of every operator call a layer makes (the call itself runs as before)."""
    seen = []
    real = sharding.pi_attention_with_settings

    def spy(q, k, v, gate, settings, **kw):
        seen.append(settings)
        return real(q, k, v, gate, settings, **kw)

    monkeypatch.setattr(sharding, "pi_attention_with_settings", spy)
    return seen


@pytest.mark.parametrize("make", [
    lambda: GPT(GPTConfig(n_layer=3, n_head=2, d_model=16, block_size=32, vocab_size=20, window=2,
                          period=[[3, 5], [7, 7], [3, 5]], variant="separate", prior=0.3, logit_clamp=9.0,
                          gate_eps=1e-3, sinks=1, dropout=0.0, backend="reference")),
    lambda: Encoder(EncoderConfig(n_layer=2, n_head=2, d_model=16, block_size=32, vocab_size=20, window=1,
                                  period=6, variant="fixed", prior=0.2, dropout=0.0, num_classes=2)),
    lambda: GPT(GPTConfig(n_layer=4, n_head=2, d_model=16, block_size=32, vocab_size=20, layers="pi,dense",
                          period="cover", dropout=0.0)),
], ids=["gpt-per-layer-periods", "encoder", "hybrid-cover"])
def test_each_layer_hands_the_operator_the_config_s_own_settings_object(make, monkeypatch):
    model = make().eval()
    cfg = model.cfg if hasattr(model, "cfg") else model.config
    pi_layers = [i for i, kind in enumerate(cfg.layer_kinds()) if kind == "pi"]
    seen = settings_seen(monkeypatch)
    with torch.no_grad():
        model(torch.randint(1, 20, (2, 12)))
    assert [s is cfg.pi_settings(i) for s, i in zip(seen, pi_layers, strict=True)] == [True] * len(pi_layers)
    for i in pi_layers:
        assert model.blocks[i].attn.settings is cfg.pi_settings(i)
        assert isinstance(cfg.pi_settings(i), PiSettings)


def test_the_config_builds_each_layer_s_settings_once(monkeypatch):
    """`ModelConfig` builds every layer's settings in __post_init__ (checking them), and asking for them or
    building a model from the config builds none again."""
    built = []
    real = model_config.PiSettings

    class Counted(real):
        def __post_init__(self):
            built.append(self)
            super().__post_init__()

    monkeypatch.setattr(model_config, "PiSettings", Counted)
    cfg = GPTConfig(n_layer=4, n_head=2, d_model=16, block_size=32, vocab_size=20, period=[[3, 5], [7, 9]] * 2,
                    dropout=0.0)
    made = len(built)
    assert made == 2  # the two distinct layers' settings (equal layers share one object)
    assert cfg.pi_settings(0) is cfg.pi_settings(2) and cfg.pi_settings(1) is cfg.pi_settings(3)
    GPT(cfg)
    assert len(built) == made and [cfg.pi_settings(i).period for i in range(4)] == [(3, 5), (7, 9)] * 2


def test_a_config_with_bad_settings_names_the_setting():
    with pytest.raises(ValueError, match="variant must be one of"):
        GPTConfig(n_layer=2, n_head=2, d_model=16, variant="both")
    with pytest.raises(ValueError, match=r"eps must lie in \(0, 0.5\), got 0.7"):
        GPTConfig(n_layer=2, n_head=2, d_model=16, gate_eps=0.7)


def test_a_layer_takes_its_settings_whole_or_by_keyword_not_both():
    settings = PiSettings(window=3, period=(5, 9), variant="fixed", prior=0.3)
    layer = PiAttention(16, 2, settings=settings)
    assert layer.settings is settings and layer.gate is None
    assert PiAttention(16, 2, window=3, period=[5, 9], variant="fixed", prior=0.3).settings == settings
    with pytest.raises(ValueError, match="not both: got settings and window, period"):
        PiAttention(16, 2, settings=settings, window=5, period=[5, 9])
    with pytest.raises(ValueError, match="settings must be a piattn.config.PiSettings or None, got dict"):
        PiAttention(16, 2, settings=dict(window=3))
    with pytest.raises(ValueError, match="period has 2 entries; per-head periods need one per query head"):
        PiAttention(16, 4, settings=settings)
    assert PiAttention(16, 2, settings=PI_DEFAULTS, window=PI_DEFAULTS.window).settings is PI_DEFAULTS
