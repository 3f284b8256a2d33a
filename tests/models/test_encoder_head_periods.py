"""Multi-scale π in the bidirectional models: the `Encoder` and the vision tower take per-head and per-layer
periods and schedules through `ModelConfig.period` (the one parser, `resolve_periods`), and a model with them
equals the same model whose attention runs every head alone, by the reference backend, at its own int period.
Bad periods raise one line naming `period`."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import piattn.layers.sharding as sharding
from piattn.config.vision import VisionLanguageConfig
from piattn.models import Encoder, EncoderConfig
from piattn.models.vision import DualEncoder
from piattn.ops.pi import pi_attention_with_settings

PERIODS = [[2, 5, 5, 11], [7, 3, 3, 3]]  # per layer; π = 2 inside the window 2


def head_by_head(layer_periods):
    """A stand-in for `pi_attention_with_settings` in the layers: each query head alone, reference backend, its
    own int period (taken from the settings' per-head periods, or the int), its key/value head h // (H / H_kv)."""
    def attention(q, k, v, gate, settings, *, backend, **kw):
        H, H_kv = q.shape[1], k.shape[1]
        periods = [settings.period] * H if isinstance(settings.period, int) else list(settings.period)
        layer_periods.append(periods)
        heads = [pi_attention_with_settings(q[:, h:h + 1], k[:, h // (H // H_kv)][:, None],
                                            v[:, h // (H // H_kv)][:, None], None if gate is None else gate[:, h:h + 1],
                                            dataclasses.replace(settings, period=periods[h]), backend="reference", **kw)
                 for h in range(H)]
        return torch.cat(heads, 1)
    return attention


def spread_gates(model):
    for module in model.modules():
        if getattr(module, "gate", None) is not None and hasattr(module, "settings"):
            torch.nn.init.normal_(module.gate[2].bias, std=2.0)
            torch.nn.init.normal_(module.gate[2].weight, std=1.0)


@pytest.mark.parametrize("n_kv_head", [None, 2])
def test_encoder_with_per_layer_periods_equals_head_by_head_reference(monkeypatch, n_kv_head):
    torch.manual_seed(0)
    cfg = EncoderConfig(n_layer=2, n_head=4, n_kv_head=n_kv_head, d_model=32, block_size=32, vocab_size=20,
                        window=2, period=PERIODS, dropout=0.0, num_classes=3, backend="torch")
    model = Encoder(cfg).double().eval()
    spread_gates(model)
    idx = torch.randint(1, 20, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(idx)
        seen = []
        monkeypatch.setattr(sharding, "pi_attention_with_settings", head_by_head(seen))
        expected = model(idx)
    assert seen == PERIODS  # each layer ran its own per-head periods
    torch.testing.assert_close(logits, expected, atol=1e-10, rtol=1e-10)


def test_vision_tower_with_per_head_periods_equals_head_by_head_reference(monkeypatch):
    torch.manual_seed(0)
    cfg = VisionLanguageConfig(n_layer=2, n_head=4, d_model=32, image_size=16, patch_size=4, window=1,
                               period=[1, 3, 4, 5], dropout=0.0, caption_len=8)  # 4 patches per row
    model = DualEncoder(cfg).double().eval()
    spread_gates(model.image)
    images = torch.randn(2, 3, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        features = model.image(images)
        seen = []
        monkeypatch.setattr(sharding, "pi_attention_with_settings", head_by_head(seen))
        expected = model.image(images)
    assert seen == [[1, 3, 4, 5]] * 2
    torch.testing.assert_close(features, expected, atol=1e-10, rtol=1e-10)


def test_schedules_resolve_for_the_encoder_and_the_vision_tower():
    cfg = EncoderConfig(n_layer=2, n_head=4, d_model=32, block_size=64, vocab_size=20, window=2, period="cover")
    assert len(cfg.period) == 2 and all(len(heads) == 4 for heads in cfg.period)  # reaching every lag < 64
    assert EncoderConfig.from_dict(cfg.to_dict()).period == cfg.period  # stored resolved
    vision = VisionLanguageConfig(n_layer=2, n_head=4, d_model=32, image_size=16, patch_size=4, period="geometric:2")
    assert vision.period == [2, 4, 8, 16]
    assert VisionLanguageConfig(n_layer=2, n_head=4, d_model=32, image_size=16, patch_size=4).period == 4


@pytest.mark.parametrize("period, match", [
    ([2, 4], r"periods has 2 entries: a list of ints needs one per head, n_head=4"),
    ([[2, 4, 8, 16]], r"periods has 1 layers, the model n_layer=2"),
    ([2, 0, 8, 16], r"periods\[1\] must be an int >= 1"),
    ([2, -1, 8, 16], r"periods\[1\] must be an int >= 1"),
    ([2, 4.5, 8, 16], r"periods\[1\] must be an int >= 1"),
    (0, r"period must be an int >= 1, got 0"),
    (16.0, r"period must be an int, a list of n_head ints"),
    ("zigzag:4", r"period schedule must be one of single, geometric, cover"),
])
@pytest.mark.parametrize("config", ["encoder", "vision"])
def test_bad_periods_raise_one_line(period, match, config):
    with pytest.raises(ValueError, match=match) as raised:
        if config == "encoder":
            EncoderConfig(n_layer=2, n_head=4, d_model=32, block_size=32, vocab_size=20, period=period)
        else:
            VisionLanguageConfig(n_layer=2, n_head=4, d_model=32, image_size=16, patch_size=4, period=period)
    assert "\n" not in str(raised.value)
