"""The image tower, the CLIP dual encoder and its loss."""

from __future__ import annotations

import math

import pytest
import torch

from piattn.config.vision import VisionLanguageConfig
from piattn.layers import ATTENTION
from piattn.models import DualEncoder, ImageEncoder, clip_loss


def config(**overrides) -> VisionLanguageConfig:
    fields = dict(n_layer=1, n_head=2, d_model=16, dropout=0.0, image_size=16, patch_size=4, caption_len=8)
    return VisionLanguageConfig(**{**fields, **overrides})


def changed_patches(cfg: VisionLanguageConfig, row: int, col: int) -> set[int]:
    """Raster indices of the patch features that move when the pixels of patch (row, col) change."""
    torch.manual_seed(0)
    encoder = ImageEncoder(cfg).eval()
    images = torch.randn(1, 3, cfg.image_size, cfg.image_size)
    changed = images.clone()
    p = cfg.patch_size
    changed[:, :, row * p:(row + 1) * p, col * p:(col + 1) * p] += 1.0
    with torch.no_grad():
        diff = (encoder.features(changed) - encoder.features(images)).abs().amax(-1)[0]
    return set((diff > 1e-6).nonzero().flatten().tolist())


def test_period_defaults_to_the_patches_per_row_so_the_skip_key_is_the_patch_above_and_below():
    cfg = config(attention="pi", window=0)
    assert cfg.grid == 4 and cfg.period == 4 and cfg.block_size == 16
    # patch (1, 2) is raster index 6; one layer with window 0 lets it reach itself and ±π only
    assert changed_patches(cfg, 1, 2) == {2, 6, 10}
    assert changed_patches(cfg, 0, 3) == {3, 7}
    assert config(attention="pi", period=5).period == 5  # an explicit π is kept
    assert changed_patches(config(attention="local", window=1), 1, 2) == {5, 6, 7}  # the row neighbours only
    assert changed_patches(config(attention="dense"), 1, 2) == set(range(16))


def test_text_tower_config():
    cfg = config(attention="pi", text_attention="local", embed_dim=12)
    text = cfg.text_config()
    assert (text.attention, text.block_size, text.num_classes, text.pool) == ("local", 8, 12, "mean")
    assert (text.d_model, text.n_layer, text.vocab_size) == (16, 1, 257)
    assert config().embed_dim == 16  # d_model by default


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(image_size=18), r"image_size \(18\) must be a multiple of patch_size \(4\)"),
    (dict(block_size=10), "block_size must be the number of patches"),
    (dict(embed_dim=1), "embed_dim must be an integer >= 2"),
    (dict(init_temperature=0.0), "init_temperature must be > 0"),
])
def test_config_checks(overrides, message):
    with pytest.raises(ValueError, match=message):
        config(**overrides)


def test_config_round_trips_through_a_dict():
    cfg = config(attention="pi", embed_dim=8)
    assert VisionLanguageConfig.from_dict(cfg.to_dict()) == cfg


def test_dual_encoder_logits_are_scaled_cosines():
    torch.manual_seed(0)
    model = DualEncoder(config()).eval()
    images, captions = torch.randn(3, 3, 16, 16), torch.randint(1, 257, (5, 8))
    logits = model(images, captions)
    assert logits.shape == (3, 5)
    assert model.logit_scale.item() == pytest.approx(1 / 0.07)
    cos = torch.nn.functional.cosine_similarity(model.image(images)[:, None], model.text(captions)[None], dim=-1)
    assert torch.allclose(logits, cos / 0.07, atol=1e-5)
    with torch.no_grad():
        model.log_scale.fill_(10.0)
    assert model.logit_scale.item() == 100.0  # CLIP's cap


def test_every_parameter_learns_from_the_loss():
    torch.manual_seed(0)
    model = DualEncoder(config(attention="pi"))
    clip_loss(model(torch.randn(4, 3, 16, 16), torch.randint(1, 257, (4, 8)))).backward()
    assert [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0] == []


def test_clip_loss_by_hand():
    logits = torch.tensor([[2.0, 0.0], [1.0, 3.0]])
    image_to_text = -math.log(math.e ** 2 / (math.e ** 2 + 1)) - math.log(math.e ** 3 / (math.e + math.e ** 3))
    text_to_image = -math.log(math.e ** 2 / (math.e ** 2 + math.e)) - math.log(math.e ** 3 / (1 + math.e ** 3))
    assert clip_loss(logits).item() == pytest.approx((image_to_text + text_to_image) / 4)


def test_images_of_another_size_are_refused():
    with pytest.raises(ValueError, match=r"images must be \[B, C, 16, 16\]"):
        ImageEncoder(config())(torch.randn(1, 3, 12, 12))


@pytest.mark.parametrize("kind", sorted(ATTENTION))
def test_every_attention_kind_runs_the_image_tower(kind):
    torch.manual_seed(0)
    cfg = config(attention=kind, image_size=32, sparse_block=4, bucket_size=8)  # 64 patches
    features = ImageEncoder(cfg)(torch.randn(2, 3, 32, 32))
    assert features.shape == (2, cfg.embed_dim) and features.isfinite().all()
