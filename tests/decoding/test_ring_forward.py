"""The decoding layers' one-token step (`WindowedAttention._ring_forward`): the q, k, v projection, then one
compiled call that runs the whole gate MLP from the layer's live weights (`PiAttention.whole_gate_layers`,
`native.PRIOR_INPUT`), rotates q and the new key, stores the key and value in the ring and attends
(`DecodePlan.token`, `decode_native.run` with the token to store), and the cache's checks remembered
(`RingCache.check`).
It must give the rows and the cache of the general path (`AttentionLayer.forward`: heads, append,
`decode_ring`), follow every change of the weights (an update through `.data` included: the folded projection
it replaced missed that one), step aside for hooks, observers and autograd, and refuse what the general path
refuses."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess

import pytest
import torch
from torch import nn

import piattn.ops.pi.decode_native as decode_native
import piattn.ops.pi.native as native
from piattn.decoding.cache import RingCache
from piattn.layers import LocalAttention, PiAttention
from piattn.layers.base import AttentionLayer
from piattn.models import GPT, GPTConfig
from piattn.models.block import dropped

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float64: dict(rtol=1e-12, atol=1e-12)}


@pytest.fixture(autouse=True)
def compiled_step():
    if shutil.which(os.environ.get("CC") or "cc") is None:
        pytest.skip("no C compiler ($CC or cc) to build the compiled decoding step")
    if native.unavailable() is not None:
        pytest.fail(f"the compiled step must build where a compiler exists: {native.unavailable()}")


def _layer(kind: str = "pi", dtype=torch.float32, **kw):
    torch.manual_seed(0)
    kw = {"window": 3, "rotary": True, **kw}
    if kind == "pi":
        layer = PiAttention(32, 4, period=7, **kw)
        if layer.gate is not None:  # gates that vary per token
            nn.init.normal_(layer.gate[2].weight, std=1.0)
    else:
        layer = LocalAttention(32, 4, **kw)
    return layer.to(dtype).eval()


def _general(layer, x, cache):
    """The general path: `AttentionLayer.forward` (heads, append, `attend_ring` → `decode_ring`)."""
    return AttentionLayer.forward(layer, x, cache)


@pytest.fixture
def token_steps(monkeypatch) -> list:
    """Whether each call of the compiled one-token step ran (True) or declined (False)."""
    taken = []
    real = decode_native.run

    def spy(*args, **kwargs):
        y = real(*args, **kwargs)
        if kwargs.get("fresh_slot") is not None:
            taken.append(y is not None)
        return y

    monkeypatch.setattr(decode_native, "run", spy)
    return taken


CASES = {
    "pi adaptive": ("pi", {}),
    "pi fixed": ("pi", dict(variant="fixed")),
    "pi union": ("pi", dict(variant="union")),
    "pi separate": ("pi", dict(variant="separate")),  # no compiled step: torch ops after the Python step
    "pi sinks": ("pi", dict(sinks=2)),
    "pi grouped": ("pi", dict(n_kv_heads=2)),
    "pi no rope": ("pi", dict(rotary=False)),
    "local": ("local", {}),
    "local sinks grouped": ("local", dict(sinks=1, n_kv_heads=1)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", list(CASES))
def test_the_one_token_step_gives_the_rows_and_cache_of_the_general_path(case, dtype, token_steps):
    """From an empty cache, 14 one-token steps (the first ones sinks, where there are) beside the same steps
    through `AttentionLayer.forward`. Without a gate MLP the rows and the stored keys are the same bit for bit
    (RoPE in the C step rounds as `Rotary.rotate` does); with one, equal up to the rounding of its first layer
    (computed in the compiled step)."""
    kind, kw = CASES[case]
    layer = _layer(kind, dtype, **kw)
    x = torch.randn(3, 14, 32, generator=torch.Generator().manual_seed(1), dtype=dtype)
    fast, general = (layer.init_cache(3, dtype=dtype) for _ in range(2))
    with torch.no_grad():
        for t in range(x.shape[1]):
            y = layer(x[:, t:t + 1], fast)
            expected = _general(layer, x[:, t:t + 1], general)
            if kind == "pi" and layer.settings.variant == "adaptive":
                torch.testing.assert_close(y, expected, **TOL[dtype])
                torch.testing.assert_close(fast.kv, general.kv, **TOL[dtype])
            else:
                assert torch.equal(y, expected), f"step {t}"
                assert torch.equal(fast.kv, general.kv), f"step {t}"
            assert fast.seen == general.seen == t + 1
    compiled = case != "pi separate"
    sinks = kw.get("sinks", 0)
    assert token_steps == ([True] * (x.shape[1] - sinks) if compiled else [])


def test_a_model_decodes_through_the_one_token_step_and_matches_the_full_forward(token_steps):
    cfg = GPTConfig.from_name("tiny", vocab_size=50, dropout=0.0, n_layer=2, d_model=32, n_head=4, window=2, period=5)
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    for block in model.blocks:
        nn.init.normal_(block.attn.gate[2].weight, std=1.0)
    idx = torch.randint(0, 50, (2, 20), generator=torch.Generator().manual_seed(2))
    cache = model.init_cache(2)
    with torch.no_grad():
        steps = torch.cat([model(idx[:, t:t + 1], cache) for t in range(idx.shape[1])], 1)
        full = model(idx)
    assert token_steps == [True] * (idx.shape[1] * len(model.blocks))
    torch.testing.assert_close(steps, full, rtol=0, atol=2e-5)


def test_the_whole_gate_is_the_layers_own_parameters():
    layer = _layer()
    w_in, b_in, w, b = layer.whole_gate_layers()
    assert w_in is layer.gate[0].weight and b_in is layer.gate[0].bias
    assert w is layer.gate[2].weight and b is layer.gate[2].bias


def _steps_match(layer, dtype=torch.float32, steps=6, taken=None):
    x = torch.randn(2, steps, 32, generator=torch.Generator().manual_seed(4), dtype=dtype)
    fast, general = (layer.init_cache(2, dtype=dtype) for _ in range(2))
    with torch.no_grad():
        for t in range(steps):
            torch.testing.assert_close(layer(x[:, t:t + 1], fast), _general(layer, x[:, t:t + 1], general),
                                       **TOL[dtype])


@pytest.mark.parametrize("change", ["in place", "through .data", "load_state_dict", "new parameter", "data",
                                    "double"])
def test_the_step_follows_every_change_of_the_weights(change, token_steps):
    """Each change between two decodings; the fast step must see it (it reads the parameters on every step)."""
    layer = _layer()
    _steps_match(layer)
    with torch.no_grad():
        if change == "in place":  # what an optimizer step does
            layer.gate[0].weight.add_(0.5)
        elif change == "through .data":  # an EMA or a loader writing through .data: no version counter moves
            layer.gate[0].weight.data.add_(0.5)
            layer.qkv.weight.data.mul_(1.5)
        elif change == "load_state_dict":
            layer.load_state_dict({k: v + 0.25 for k, v in layer.state_dict().items()})
        elif change == "new parameter":
            layer.qkv.bias = nn.Parameter(torch.randn(layer.qkv.out_features))
        elif change == "data":  # the same tensor object, other memory, the same version counter
            layer.gate[0].bias.data = layer.gate[0].bias.data + 1.0
        else:
            layer.double()
    dtype = torch.float64 if change == "double" else torch.float32
    _steps_match(layer, dtype)
    assert token_steps and all(token_steps)  # every step through the compiled call


def test_an_observed_or_hooked_gate_is_computed_as_modules(monkeypatch):
    layer = _layer()
    seen = []
    layer.observe_gate(seen.append)
    assert layer.whole_gate_layers() is None
    _steps_match(layer, steps=3)
    assert len(seen) == 6 and seen[0].shape == (2, 4, 1)  # every step's α̃, of both paths
    layer.observe_gate(None)
    calls = []
    handle = layer.gate[0].register_forward_hook(lambda *_: calls.append(1))
    assert layer.whole_gate_layers() is None
    _steps_match(layer, steps=3)
    assert len(calls) == 6  # every step called the hooked gate, on both paths
    handle.remove()
    assert layer.whole_gate_layers() is not None
    layer.gate[0] = nn.Linear(32, 16, bias=False)  # a first layer without a bias: the gate's own modules
    assert layer.whole_gate_layers() is None
    _steps_match(layer, steps=3)
    assert PiAttention(32, 4, variant="union").whole_gate_layers() is None


def test_hooks_on_the_projections_are_called_by_the_fast_step():
    layer = _layer()
    called = []
    handles = [layer.qkv.register_forward_hook(lambda *_: called.append("qkv")),
               layer.out.register_forward_hook(lambda *_: called.append("out"))]
    cache = layer.init_cache(1)
    with torch.no_grad():
        layer(torch.randn(1, 1, 32), cache)
    assert called == ["qkv", "out"]
    for handle in handles:
        handle.remove()
    called.clear()
    handle = nn.modules.module.register_module_forward_hook(lambda module, *_: called.append(type(module).__name__))
    try:
        with torch.no_grad():
            layer(torch.randn(1, 1, 32), cache)
    finally:
        handle.remove()
    # every module called while every module is hooked: qkv, out, and the gate MLP's four layers
    assert called.count("Linear") == 4 and {"GELU", "Sigmoid", "Sequential"} <= set(called)
    called.clear()
    handle = nn.modules.module.register_module_forward_hook(lambda module, *_: called.append(type(module).__name__))
    try:
        layer(torch.randn(1, 5, 32))  # the full forward too
    finally:
        handle.remove()
    assert called.count("Linear") == 4 and {"GELU", "Sigmoid", "Sequential"} <= set(called)
    assert layer.whole_gate_layers() is not None  # the compiled gate again once the hook is gone


def test_autograd_and_training_dropout_keep_the_general_path(token_steps):
    layer = _layer()
    x = torch.randn(1, 1, 32, requires_grad=True)
    y = layer(x, layer.init_cache(1))  # autograd: the general path, which keeps the graph
    y.sum().backward()
    assert x.grad is not None and token_steps == []
    layer.dropout = 0.5
    layer.train()
    with torch.no_grad():
        layer(torch.randn(1, 1, 32), layer.init_cache(1))
    assert token_steps == []


def test_the_remembered_check_still_refuses_another_layer():
    pi, local = _layer(), _layer("local")
    cache = pi.init_cache(2)
    with torch.no_grad():
        pi(torch.randn(2, 1, 32), cache)
        with pytest.raises(ValueError, match="cache was made for batch 2"):
            pi(torch.randn(3, 1, 32), cache)
        pi(torch.randn(2, 1, 32), cache)  # accepted before: still accepted
        with pytest.raises(ValueError, match="needs at least 5 positions"):
            _layer("local", window=4)(torch.randn(2, 1, 32), local.init_cache(2))
    assert cache.seen == 2


def test_a_cache_full_to_max_positions_refuses_the_next_token_as_before():
    layer = _layer()
    cache = layer.init_cache(1, max_positions=3)
    with torch.no_grad():
        for _ in range(3):
            layer(torch.randn(1, 1, 32), cache)
        assert cache.next_token_slot() is None
        kv = cache.kv.clone()
        with pytest.raises(ValueError, match="at most 3 positions"):
            layer(torch.randn(1, 1, 32), cache)
    assert cache.seen == 3 and torch.equal(cache.kv, kv)


def test_the_ring_slot_of_the_next_token():
    cache = RingCache(1, 2, 4, 5, sinks=2)
    slots = []
    for _ in range(9):
        slots.append(cache.next_token_slot())
        cache.append(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
    assert slots == [None, None, 4, 5, 6, 2, 3, 4, 5]  # sinks go through append; then sinks + p mod capacity


def _token_call(layer, cache, *, fresh_slot, kind=None):
    B = cache.batch_size
    x = torch.randn(B, 1, 32)
    proj = layer.qkv(x)
    plan = layer._plan(cache.capacity, x.device)  # window 3, period 7: the layer's own
    slot, valid = plan.ring_slots(cache.seen)
    rotation = (*layer.rotary._table(cache.seen + 1, x.device), cache.seen)
    plan = plan if kind is None else dataclasses.replace(plan, kind=kind)
    return decode_native.run(plan, proj, cache.kv, slot, valid, x, layer.whole_gate_layers(), fresh_slot=fresh_slot,
                             rotation=rotation)


def test_the_packed_step_refuses_what_is_out_of_range_and_writes_nothing():
    """One block of arguments instead of 38 converted one by one: the C step still checks the row it writes, every
    slot and kind, before it reads or writes anything."""
    layer = _layer()
    cache = layer.init_cache(2)
    with torch.no_grad():
        for _ in range(4):
            layer(torch.randn(2, 1, 32), cache)
        kv = cache.kv.clone()
        assert _token_call(layer, cache, fresh_slot=cache.next_token_slot()) is not None  # a consistent call runs
        assert not torch.equal(cache.kv, kv)  # and stored the token
        kv = cache.kv.clone()
        for bad in (cache.capacity, -1):
            with pytest.raises(ValueError, match="^slot must index rows 0 … N − 1 of kv_store"):
                _token_call(layer, cache, fresh_slot=bad)
        with pytest.raises(ValueError, match="^kind must hold 0"):
            _token_call(layer, cache, fresh_slot=0, kind=torch.tensor([0, 0, 0, 0, 2]))
    assert torch.equal(cache.kv, kv)


def test_a_library_whose_argument_block_differs_is_not_used(tmp_path):
    source = tmp_path / "other.c"
    source.write_text("long long pi_step_args_size(void) { return 8; }\n"
                      "int pi_decode_step_packed_f32(const void *a) { return 0; }\n"
                      "int pi_decode_step_packed_f64(const void *a) { return 0; }\n")
    library = tmp_path / "other.so"
    subprocess.run([os.environ.get("CC") or "cc", "-shared", "-fPIC", str(source), "-o", str(library)], check=True)
    with pytest.raises(OSError, match=f"argument block has 8 bytes where {native.ARGS.size} are packed"):
        native._open(library)


def test_dropout_is_skipped_where_it_is_the_identity():
    x = torch.randn(4, 8)
    drop = nn.Dropout(0.5)
    assert dropped(drop.eval(), x) is x
    assert dropped(nn.Dropout(0.0).train(), x) is x
    y = dropped(drop.train(), x)
    assert y is not x and bool((y == 0).any())
