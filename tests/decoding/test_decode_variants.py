"""Which decoding step runs which variant: each declares its own (`decode_steps.REGISTRY`: the torch step
`decode_torch.TORCH_OPS_VARIANTS`, the compiled one `native.PRIOR_MODES`), every variant decodes exactly on a
step that declares it, the compiled step is never handed one it does not declare, and a variant no step
declares is refused with the reason, never run as another."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import piattn.config.pi as pi_config
import piattn.ops.pi.decode as decode
import piattn.ops.pi.decode_native as decode_native
import piattn.ops.pi.native as native
from piattn.config.pi import GATED_VARIANTS, VARIANTS
from piattn.decoding.cache import RingCache
from piattn.models import GPT, GPTConfig
from piattn.ops.pi.decode import decode_ring, decode_settings, pi_decode
from piattn.ops.pi.decode_steps import REGISTRY


def test_every_variant_has_a_decoding_step_that_declares_it():
    assert set(VARIANTS) == decode.TORCH_OPS_VARIANTS == REGISTRY["torch"].variants
    assert set(native.PRIOR_MODES) == {"union", "fixed", "adaptive"} == REGISTRY["compiled"].variants  # one softmax


def _declare(monkeypatch, step: str, variants) -> None:
    """Step `step` of the registry declaring `variants` only, for the test: a plan is remembered per registered
    step, so the plans built from now on are of the step so declared."""
    monkeypatch.setitem(REGISTRY, step, dataclasses.replace(REGISTRY[step], variants=frozenset(variants)))


def _model(variant: str) -> GPT:
    cfg = GPTConfig.from_name("tiny", attention="pi", variant=variant, vocab_size=50, dropout=0.0, n_layer=2,
                              d_model=32, n_head=4, window=2, period=5, sinks=1)
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    for block in model.blocks:  # gates that vary per token
        if block.attn.gate is not None:
            torch.nn.init.normal_(block.attn.gate[2].weight, std=1.0)
    return model


@pytest.fixture
def handed_to_the_compiled_step(monkeypatch) -> list:
    """The prior mode of each call the plans make of the compiled step (whether or not it applies): the ring
    step's and the layers' whole one-token step (`DecodePlan.token`) alike."""
    modes = []
    real = decode_native.run

    def spy(plan, *args, **kwargs):
        gate_layers = args[5]
        modes.append(plan.prior_mode if gate_layers is None else
                     native.PRIOR_HIDDEN if len(gate_layers) == 2 else native.PRIOR_INPUT)
        return real(plan, *args, **kwargs)

    monkeypatch.setattr(decode_native, "run", spy)
    return modes


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_decodes_exactly_on_a_step_that_declares_it(variant, handed_to_the_compiled_step):
    """Token by token (the ring step) and in steps of 3 (`_decode_rows`), equal to the full forward; the
    compiled step sees the variants it declares, and no other."""
    model = _model(variant)
    idx = torch.randint(0, 50, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(idx)
        for n in (1, 3):
            cache = model.init_cache(2)
            steps = torch.cat([model(idx[:, t:t + n], cache) for t in range(0, idx.shape[1], n)], 1)
            torch.testing.assert_close(steps, full, rtol=0, atol=2e-5, msg=f"steps of {n}")
    calls = handed_to_the_compiled_step
    if variant in native.PRIOR_MODES:  # every step of one token, and every step of three, of every layer
        assert len(calls) == (idx.shape[1] + idx.shape[1] // 3) * len(model.blocks)
    else:
        assert calls == []


def _ring_case(variant: str):
    g = torch.Generator().manual_seed(4)
    B, H, D, N = 1, 2, 8, 12
    k, v = torch.randn(B, H, N, D, generator=g), torch.randn(B, H, N, D, generator=g)
    cache = RingCache(B, H, D, 6, dtype=torch.float32)
    cache.append(k, v)
    q = torch.randn(B, H, 1, D, generator=g)
    gate = 0.1 + 0.8 * torch.rand(B, H, 1, generator=g) if variant in GATED_VARIANTS else None
    settings = decode_settings(pi_config.PI_DEFAULTS, D**-0.5)._replace(window=2, period=5, variant=variant,
                                                                        prior=0.3, logit_clamp=None, eps=1e-4)
    kw = dict(capacity=cache.capacity, position=cache.seen - 1)
    return q, cache.kv, gate, settings, kw, (k, v)


def test_a_variant_the_compiled_step_does_not_declare_runs_in_torch_ops(monkeypatch, handed_to_the_compiled_step):
    q, kv, gate, settings, kw, _ = _ring_case("union")
    declared = decode_ring(q, kv, gate, settings, **kw)
    _declare(monkeypatch, "compiled", {"fixed"})
    handed_to_the_compiled_step.clear()
    y = decode_ring(q, kv, gate, settings, **kw)
    assert handed_to_the_compiled_step == []
    torch.testing.assert_close(y, declared, rtol=2e-6, atol=2e-7)


def test_a_variant_the_torch_ops_do_not_declare_is_refused(monkeypatch):
    """"separate" without its torch-ops declaration: no step runs it, and both ways of decoding say so."""
    _declare(monkeypatch, "torch", decode.TORCH_OPS_VARIANTS - {"separate"})
    q, kv, gate, settings, kw, (k, v) = _ring_case("separate")
    reason = (r"^no decoding step runs variant 'separate': the compiled step runs variants adaptive, fixed, union, "
              r"not 'separate'; the torch step runs variants adaptive, fixed, union, not 'separate'$")
    with pytest.raises(ValueError, match=reason):
        decode_ring(q, kv, gate, settings, **kw)
    with pytest.raises(ValueError, match=reason):
        pi_decode(q, k, v, gate, window=2, period=5, variant="separate")


def test_a_variant_no_step_declares_is_refused_not_run_as_another(monkeypatch):
    """A variant added to the settings but to no step's declaration is refused; before the declarations the
    ring step ran it as "union" in the compiled step, and `pi_decode` in torch ops."""
    monkeypatch.setattr(pi_config, "VARIANTS", (*VARIANTS, "novel"))
    q, kv, _, settings, kw, (k, v) = _ring_case("novel")
    reason = r"no decoding step runs variant 'novel'"
    try:
        with pytest.raises(ValueError, match=reason):
            decode_ring(q, kv, None, settings, **kw)
        with pytest.raises(ValueError, match=reason):
            pi_decode(q, k, v, None, window=2, period=5, variant="novel")
    finally:
        decode._settings_checked.cache_clear()  # it remembers "novel" as checked
