"""`PiCache` (transformers) knows what it was made for: another model's cache fails in one line, at the
first forward, instead of deep inside the attention (an index past the sink copies, a list index) or with
a message that blames the cache kind."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from piattn.integrations.hf import PiCache, convert_to_pi  # noqa: E402


def _llama(layers: int = 2, **pi):
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100, max_position_embeddings=256, bos_token_id=None,
                      eos_token_id=None, pad_token_id=None, attn_implementation="eager")
    torch.manual_seed(0)
    return convert_to_pi(LlamaForCausalLM(cfg).eval(), **{"window": 3, "period": 8, **pi})


# the model's settings, the settings of the model whose cache it is given, what the error says. Before: a
# ValueError telling to "use PiCache", an IndexError, and a RuntimeError from an index past the sink copies
# (a device-side assert on a GPU).
MISMATCHES = {
    "smaller ring": ({}, dict(period=4), r"rings of 5 positions and 0 sinks, but this model has 2 layers and "
                                        r"needs 9 positions and 0 sinks"),
    "fewer sinks": (dict(sinks=2), dict(sinks=1), r"and 1 sinks, but .* needs 9 positions and 2 sinks"),
    "fewer layers": ({}, dict(layers=1), r"^cache was made for 1 layers"),
    "more layers": ({}, dict(layers=3), r"^cache was made for 3 layers"),
}


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_a_picache_of_another_model_is_refused_in_one_line(case):
    own, other, match = MISMATCHES[case]
    model, cache = _llama(**own), PiCache(_llama(**other).config)
    ids = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), pytest.raises(ValueError, match=match) as err:
        for t in range(12):
            model(ids[:, t:t + 1], cache=cache, use_cache=True)
    assert "\n" not in str(err.value) and str(err.value).startswith("cache was made for")
    with torch.no_grad():  # the model's own cache decodes what the full forward computes
        good = PiCache(model.config)
        steps = torch.cat([model(ids[:, t:t + 1], cache=good, use_cache=True).logits for t in range(12)], 1)
        torch.testing.assert_close(steps, model(ids).logits, rtol=0, atol=1e-5)


def test_a_picache_refuses_another_batch_in_one_line():
    """Before: torch.cat's 'Sizes of tensors must match'."""
    model = _llama()
    cache = PiCache(model.config)
    with torch.no_grad():
        model(torch.zeros(2, 3, dtype=torch.long), cache=cache, use_cache=True)
        with pytest.raises(ValueError, match=r"^key_states must have shape \[B, Hkv, t, D\] = \[2, 2, t, 16\]"):
            model(torch.zeros(3, 1, dtype=torch.long), cache=cache, use_cache=True)
