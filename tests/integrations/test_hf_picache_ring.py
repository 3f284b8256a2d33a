"""`PiCache` stores a one-token decoding step in place: its ring is one storage made once (grown by doubling
until full), each step writes the new position into its slot, and neither the update nor the attention copies
the ring; what a step writes does not grow with the ring's capacity. Steps of mixed sizes (one token, a few,
a prompt), beam search and the batch-row operations still give what the full forward, or DynamicCache, gives;
and `check`, asked by every layer on every step, answers at once for the settings it accepted."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

pytest.importorskip("transformers")

from test_hf import randomize_gates, tiny_llama, tokens  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from piattn.integrations.hf import PiCache, convert_to_pi  # noqa: E402

CASES = {
    "adaptive": dict(window=3, period=8),
    "sinks": dict(window=3, period=8, sinks=2),
    "per-head periods": dict(window=3, period=[2, 8, 5, 13]),
    "per-layer periods and sinks": dict(window=3, period=[[2, 8, 5, 13], [6, 6, 3, 9]], sinks=1),
    "separate": dict(window=3, period=8, sinks=1, variant="separate"),  # the torch-ops step
}


class _Writes(TorchDispatchMode):
    """Elements written by each aten op run under it: what it allocates, or the tensor it writes in place
    (a view op writes nothing)."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            self.sizes += [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


def _model(dtype=torch.float64, **pi):
    model = convert_to_pi(tiny_llama().to(dtype), **pi)
    randomize_gates(model)
    return model.to(dtype)


def _decode(model, ids: torch.Tensor, prompt: int, sizes=(1,)):
    """Logits [B, T − prompt, V] of ids after `prompt` tokens, in steps cycling through `sizes` tokens; the
    cache; per step (its size, each layer's storage pointer after it, the elements its ops wrote)."""
    cache = PiCache(model.config)
    out, steps, t, i = [], [], prompt, 0
    with torch.no_grad():
        model(ids[:, :prompt], cache=cache)
        while t < ids.shape[1]:
            n = min(sizes[i % len(sizes)], ids.shape[1] - t)
            with _Writes() as writes:
                out.append(model(ids[:, t:t + n], cache=cache).logits)
            steps.append((n, [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers],
                          sum(writes.sizes)))
            t, i = t + n, i + 1
    return torch.cat(out, 1), cache, steps


@pytest.mark.parametrize("case", list(CASES))
def test_one_token_steps_write_the_ring_in_place(case):
    """Once the ring is full, every one-token step leaves each layer's storage where it was (before: the update
    concatenated and trimmed it into new tensors on every step), and the steps equal the full forward."""
    model = _model(**CASES[case])
    ids = tokens(2, 40)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
    prompt = 5  # shorter than every ring: the steps fill it, wrap it, and go round it twice
    logits, cache, steps = _decode(model, ids, prompt)
    torch.testing.assert_close(logits, full[:, prompt:], rtol=1e-10, atol=1e-10)
    capacity = max(layer.capacity for layer in cache.layers)
    pointers = [p for n, p, _ in steps[capacity:]]
    assert all(p == pointers[0] for p in pointers)
    assert all(layer.keys.shape[2] == layer.capacity for layer in cache.layers)  # grown to full, no further
    assert torch.equal(cache.layers[0].positions, torch.arange(40 - cache.layers[0].capacity, 40))
    k, v = cache.layers[1].ordered()  # the ring read oldest first: the last `capacity` keys of a DynamicCache
    dense = DynamicCache()
    with torch.no_grad():
        model(ids, cache=dense)
    n = cache.layers[1].capacity
    torch.testing.assert_close(k, dense.layers[1].keys[:, :, -n:], rtol=1e-10, atol=1e-10)  # projected one by one
    torch.testing.assert_close(v, dense.layers[1].values[:, :, -n:], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("sinks", [0, 2])
def test_what_a_one_token_step_writes_does_not_grow_with_the_ring(sinks):
    """The same model with rings of 9, 65 and 257 positions (period 8, 64, 256): a one-token step's ops write
    the same number of elements, and none of them writes a tenth of one layer's largest ring. Before, the update
    copied the ring twice per layer and step, and the attention once more."""
    written = {}
    for period in (8, 64, 256):
        model = _model(window=3, period=period, sinks=sinks)
        ids = tokens(2, period + 20)
        _decode(model, ids, period + 4)  # warm-up: the slot tables each position phase needs are built once
        _, cache, steps = _decode(model, ids, period + 4)
        ring = cache.layers[0].keys.numel()
        assert ring == 2 * 2 * (period + 1) * 16  # B, Hkv, capacity, D
        written[period] = {w for _, _, w in steps}
    with _Writes() as probe, torch.no_grad():  # the largest op output of one more step, beside the largest ring
        model(ids[:, -1:], cache=cache)
    assert max(probe.sizes) < ring / 10
    assert len(written[8]) == 1 and written[8] == written[64] == written[256]


def test_steps_of_mixed_sizes_equal_the_full_forward():
    """One-token steps (in place) between prompts and steps of 2–4 and 12 tokens (the block, then written
    into the ring), across the ring's growth and wraps, with sinks and per-layer periods."""
    model = _model(window=3, period=[[2, 8, 5, 13], [6, 6, 3, 9]], sinks=2)
    ids = tokens(2, 70)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
    for prompt in (1, 3, 17):
        logits, cache, steps = _decode(model, ids, prompt, sizes=(1, 3, 1, 1, 2, 12, 4, 1))
        torch.testing.assert_close(logits, full[:, prompt:], rtol=1e-10, atol=1e-10)
        assert cache.nbytes == sum(2 * 2 * 2 * (layer.capacity + 2) * 16 * 8 for layer in cache.layers)


def test_beam_search_and_batch_rows_act_on_the_ring():
    """Beam search (reorder_cache, batch_repeat_interleave) gives what it gives with DynamicCache, and selecting
    batch rows keeps each row's ring and sinks: decoding on gives the logits of those rows alone."""
    model = _model(torch.float32, window=3, period=8, sinks=2)
    prompt = tokens(2, 6)
    with torch.no_grad():
        beams = {kind: model.generate(prompt, cache=cache, max_new_tokens=14, num_beams=3,
                                      do_sample=False, num_return_sequences=2)
                 for kind, cache in (("pi", PiCache(model.config)), ("dynamic", DynamicCache()))}
    assert torch.equal(beams["pi"], beams["dynamic"])

    ids = tokens(3, 24)
    cache = PiCache(model.config)
    with torch.no_grad():
        for t in range(16):
            model(ids[:, t:t + 1], cache=cache)
        cache.batch_select_indices(torch.tensor([2, 0]))
        cache.reorder_cache(torch.tensor([1, 0]))
        steps = torch.cat([model(ids[[0, 2], t:t + 1], cache=cache).logits for t in range(16, 24)], 1)
        full = model(ids[[0, 2]], use_cache=False).logits[:, 16:]
    torch.testing.assert_close(steps, full, rtol=1e-5, atol=1e-5)


def test_check_accepts_its_model_at_once_and_still_refuses_another():
    """`check` remembers the settings it accepted last, by their content: another model's, or this model's
    settings changed in place to a longer ring, are still refused."""
    own, other = _model(torch.float32, window=3, period=8), _model(torch.float32, window=3, period=16)
    cache = PiCache(own.config)
    for _ in range(2):
        cache.check(own.config)
    with pytest.raises(ValueError, match=r"^cache was made for 2 layers, rings of 9 positions .* needs 17 positions"):
        cache.check(other.config)
    cache.check(own.config)
    own.config.pi_attention = {**own.config.pi_attention, "period": 16}
    with pytest.raises(ValueError, match=r"needs 17 positions"):
        cache.check(own.config)
