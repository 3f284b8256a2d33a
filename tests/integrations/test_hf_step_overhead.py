"""A decoding step of a converted model through `PiCache` resolves nothing again: `HFPiSettings.of`, asked by
every attention layer and by the cache's `check` on every step, returns the settings it resolved for that config
object without freezing and hashing the stored settings again, and `check` accepts them at once; yet a change of
the settings (in place or replaced) or of the sizes that resolve them is still seen, and refused by a cache made
for other ones."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from test_hf import randomize_gates, tiny_llama  # noqa: E402

import piattn.integrations.hf.attention as hf_attention  # noqa: E402
import piattn.integrations.hf.cache as hf_cache  # noqa: E402
from piattn.integrations.hf import PiCache, convert_to_pi  # noqa: E402
from piattn.integrations.hf.attention import HFPiSettings  # noqa: E402


def _model(**pi):
    model = convert_to_pi(tiny_llama(), **pi)
    randomize_gates(model)
    return model


def _counted(monkeypatch, module, name: str) -> list[int]:
    """Count the calls of module.name (recursive calls included) from now on."""
    calls = [0]
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize("pi", [dict(window=3, period=8),
                                dict(window=3, period=[[2, 8, 5, 13], [6, 6, 3, 9]], sinks=1)])
def test_decoding_steps_resolve_the_settings_once(monkeypatch, pi):
    """After the prompt, the one-token steps neither rebuild the settings' key (`_frozen`: 2 calls per layer
    and step before) nor work out the cache's rings again (`_needs`), and still give the logits of a
    DynamicCache."""
    from transformers import DynamicCache

    model = _model(**pi)
    ids = torch.randint(0, model.config.vocab_size, (1, 24))
    cache, dense = PiCache(model.config), DynamicCache()
    with torch.no_grad():
        model(ids[:, :12], cache=cache)
        model(ids[:, :12], cache=dense)
        frozen, needs = _counted(monkeypatch, hf_attention, "_frozen"), _counted(monkeypatch, hf_cache, "_needs")
        for t in range(12, 24):
            got = model(ids[:, t:t + 1], cache=cache).logits
            want = model(ids[:, t:t + 1], cache=dense).logits
            torch.testing.assert_close(got, want)
    assert (frozen[0], needs[0]) == (0, 0)


def test_settings_changed_in_place_or_replaced_or_resized_are_seen():
    model = _model(window=3, period=8)
    config = model.config
    settings = HFPiSettings.of(config)
    assert HFPiSettings.of(config) is settings
    cache = PiCache(config)
    cache.check(config)
    config.pi_attention["period"] = 16  # in place: the same dict object
    assert HFPiSettings.of(config).pi.period == 16
    with pytest.raises(ValueError, match=r"needs 17 positions"):
        cache.check(config)
    config.pi_attention = {**config.pi_attention, "period": 8}
    assert HFPiSettings.of(config) == settings
    cache.check(config)
    config.pi_attention["period"] = [8, 8, 8]  # 3 heads' periods for 4 heads: refused, every time
    for _ in range(2):
        with pytest.raises(ValueError):
            HFPiSettings.of(config)
    config.pi_attention["period"] = 8
    config.num_hidden_layers = 3
    with pytest.raises(ValueError, match=r"^cache was made for 2 layers"):
        cache.check(config)
    config.num_hidden_layers = 2
    cache.check(config)
    assert HFPiSettings.of(config) is settings
    # Another model's config of the same settings: its own memo, the same settings; a config without them fails.
    other = _model(window=3, period=8)
    assert HFPiSettings.of(other.config) is settings
    del other.config.pi_attention
    with pytest.raises(ValueError, match="no pi_attention settings"):
        HFPiSettings.of(other.config)
