"""Decoding a converted Hugging Face model with `PiCache` through the compiled step (`decode_native.py`):
one-token steps and steps of 2–4 tokens equal the full forward and the torch-ops step (fp64 to 1e-10, fp32
to the HF tests' 1e-5), with sinks, grouped-query attention (the tiny Llama's 4 query heads on 2 key/value
heads) and per-head and per-layer periods; a spy proves the compiled step ran every step of every layer; an
explicit `backend="fused"` never falls back to torch ops; without the compiled step (`PIATTN_NATIVE=0`)
everything still runs, and gives the same logits."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("transformers")

from test_hf import randomize_gates, tiny_llama, tokens  # noqa: E402
from transformers import DynamicCache  # noqa: E402

import piattn.integrations.hf.attention as hf_attention  # noqa: E402
import piattn.ops.pi.decode_native as decode_native  # noqa: E402
import piattn.ops.pi.decode_torch as decode_torch  # noqa: E402
import piattn.ops.pi.native as native  # noqa: E402
from piattn.integrations.hf import PiCache, convert_to_pi  # noqa: E402

TOL = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-5, atol=1e-5)}
PROMPT, TOTAL = 7, 30  # a prompt longer than 4 (the full operator), then steps well past the ring and the sinks

CASES = {
    "adaptive": dict(window=3, period=8),
    "sinks": dict(window=3, period=8, sinks=2),
    "fixed": dict(window=2, period=5, variant="fixed", prior=0.7),
    "union": dict(window=2, period=6, variant="union"),
    "per-head periods": dict(window=3, period=[2, 8, 5, 13]),
    "per-layer periods and sinks": dict(window=3, period=[[2, 8, 5, 13], [6, 6, 3, 9]], sinks=1),
}


pytestmark = pytest.mark.usefixtures("native_step_built")


def _model(dtype: torch.dtype, **pi):
    model = convert_to_pi(tiny_llama().to(dtype), **pi)
    randomize_gates(model)
    return model.to(dtype)


def _steps(model, ids: torch.Tensor, n: int) -> torch.Tensor:
    """Logits [B, T − PROMPT, V] of the positions after the prompt, decoded in steps of n tokens with a PiCache."""
    cache = PiCache(model.config)
    out = []
    with torch.no_grad():
        model(ids[:, :PROMPT], cache=cache)
        for t in range(PROMPT, ids.shape[1], n):
            out.append(model(ids[:, t:t + n], cache=cache).logits)
    return torch.cat(out, 1)


def _calls(model) -> int:
    """Compiled calls per decoding step: one per layer, per-head periods included (each head over its own
    period's slot table: `DecodePlan.ring_slots`, `decode_slots.block_slots`)."""
    return model.config.num_hidden_layers


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", list(CASES))
def test_picache_one_token_steps_go_through_the_compiled_step(case, dtype, compiled_calls, monkeypatch):
    model = _model(dtype, **CASES[case])
    ids = tokens(2, TOTAL)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits[:, PROMPT:]
    compiled = _steps(model, ids, 1)
    assert compiled_calls and all(compiled_calls)
    assert len(compiled_calls) == (TOTAL - PROMPT) * _calls(model)
    torch.testing.assert_close(compiled, full, **TOL[dtype])
    # The same steps in torch ops (the compiled step switched off): the same logits.
    monkeypatch.setattr(native, "_state", {"functions": None, "reason": "switched off by the test"})
    compiled_calls.clear()
    torch_ops = _steps(model, ids, 1)
    assert compiled_calls == [] or not any(compiled_calls)
    torch.testing.assert_close(compiled, torch_ops, **TOL[dtype])


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("case", ["adaptive", "sinks", "per-layer periods and sinks"])
def test_picache_steps_of_a_few_tokens_equal_the_full_forward(case, n, compiled_calls):
    model = _model(torch.float64, **CASES[case])
    ids = tokens(2, TOTAL)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits[:, PROMPT:]
    steps = _steps(model, ids, n)
    assert compiled_calls and all(compiled_calls)
    assert len(compiled_calls) == -(-(TOTAL - PROMPT) // n) * _calls(model)
    torch.testing.assert_close(steps, full, **TOL[torch.float64])


def test_generate_with_picache_runs_the_compiled_step(compiled_calls):
    model = _model(torch.float32, window=3, period=8, sinks=2)
    prompt = tokens(2, 9)
    with torch.no_grad():
        out = model.generate(prompt, cache=PiCache(model.config), max_new_tokens=12, do_sample=False)
        ids = prompt
        for _ in range(12):
            ids = torch.cat([ids, model(ids, use_cache=False).logits[:, -1:].argmax(-1)], 1)
    assert torch.equal(out, ids)
    assert len(compiled_calls) == 11 * model.config.num_hidden_layers and all(compiled_calls)


def test_separate_decodes_in_torch_ops_and_the_compiled_step_is_not_handed_it(compiled_calls):
    """"separate" normalises two groups apart: the compiled step does not declare it, the torch ops do."""
    model = _model(torch.float64, window=3, period=8, sinks=1, variant="separate")
    ids = tokens(2, TOTAL)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits[:, PROMPT:]
    torch.testing.assert_close(_steps(model, ids, 1), full, **TOL[torch.float64])
    assert compiled_calls == []


@pytest.fixture
def operator_backends(monkeypatch) -> list:
    """The backend of each call the HF attention function makes of the full operator, which then runs as
    "torch" (the routing is what is tested here; the fused operator has its own tests)."""
    seen = []
    real = hf_attention.pi_attention_with_settings

    def spy(*args, backend, **kwargs):
        seen.append(backend)
        return real(*args, backend="torch", **kwargs)

    monkeypatch.setattr(hf_attention, "pi_attention_with_settings", spy)
    return seen


def test_an_explicit_fused_backend_decodes_in_compiled_code_only(compiled_calls, operator_backends, monkeypatch):
    """backend="fused" asks for compiled code: its steps run the compiled step where it applies, else the fused
    operator (which runs or refuses with its reason), never the torch-ops step in its place."""
    if "fused" not in hf_attention.BACKENDS:
        pytest.skip("the fused backend is not available on this install")
    model = _model(torch.float64, window=3, period=8, sinks=2, backend="fused")
    ids = tokens(2, 16)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits[:, PROMPT:]
    assert operator_backends == ["fused"] * model.config.num_hidden_layers
    operator_backends.clear()
    torch.testing.assert_close(_steps(model, ids, 1), full, **TOL[torch.float64])
    assert operator_backends == ["fused"] * model.config.num_hidden_layers  # the prompt only
    assert len(compiled_calls) == (16 - PROMPT) * model.config.num_hidden_layers and all(compiled_calls)

    torch_ops = []
    monkeypatch.setattr(decode_torch, "run", lambda *a, **k: torch_ops.append(1))
    monkeypatch.setattr(native, "_state", {"functions": None, "reason": "switched off by the test"})
    operator_backends.clear()
    torch.testing.assert_close(_steps(model, ids, 1), full, **TOL[torch.float64])
    assert operator_backends == ["fused"] * (16 - PROMPT + 1) * model.config.num_hidden_layers
    assert torch_ops == []


def test_without_the_compiled_step_picache_and_model_decoding_still_run(tmp_path):
    """PIATTN_NATIVE=0 in a fresh interpreter: no warning, the compiled step unavailable, and HF PiCache steps
    of 1 and 3 tokens and the model's own generation still equal full forwards."""
    here = os.path.dirname(__file__)
    code = textwrap.dedent(f"""
        import sys, warnings
        warnings.simplefilter("error", RuntimeWarning)
        sys.path.insert(0, {here!r})
        import torch
        import piattn.ops.pi.native as native
        from test_hf import randomize_gates, tiny_llama, tokens
        from piattn.integrations.hf import PiCache, convert_to_pi
        from piattn.models import GPT, GPTConfig
        model = convert_to_pi(tiny_llama().double(), window=3, period=[2, 8, 5, 13], sinks=2).double()
        randomize_gates(model)
        ids = tokens(2, 20)
        with torch.no_grad():
            full = model(ids, use_cache=False).logits
            for n in (1, 3):
                cache = PiCache(model.config)
                model(ids[:, :6], cache=cache)
                steps = torch.cat([model(ids[:, t:t + n], cache=cache).logits for t in range(6, 20, n)], 1)
                torch.testing.assert_close(steps, full[:, 6:], rtol=1e-10, atol=1e-10)
        cfg = GPTConfig.from_name("tiny", vocab_size=50, dropout=0.0, n_layer=2, d_model=32, n_head=4, window=2,
                                  period=5, sinks=1)
        gpt = GPT(cfg).eval()
        idx = torch.randint(0, 50, (1, 20), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            for n in (1, 3):
                c = gpt.init_cache(1)
                steps = torch.cat([gpt(idx[:, t:t + n], c) for t in range(0, 20, n)], 1)
                torch.testing.assert_close(steps, gpt(idx), rtol=0, atol=2e-5)
        print(native.unavailable())
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PIATTN_NATIVE": "0", "PIATTN_CACHE": str(tmp_path),
                               "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "disabled by PIATTN_NATIVE=0"
    assert "Warning" not in done.stderr.replace("FutureWarning", "")


@pytest.fixture
def step_priors(monkeypatch) -> list:
    """(prior_mode, whether the gate's last layer was given, the gate's shape) of each call of the compiled step
    for rows, which then runs as it would."""
    seen = []
    real = decode_native.run

    def spy(plan, x, kv, slot, valid, gate, gate_layers, **kwargs):
        mode = plan.prior_mode if gate_layers is None else native.PRIOR_HIDDEN
        seen.append((mode, gate_layers is not None, None if gate is None else tuple(gate.shape)))
        return real(plan, x, kv, slot, valid, gate, gate_layers, **kwargs)

    monkeypatch.setattr(decode_native, "run", spy)
    return seen


def _dynamic_steps(model, ids: torch.Tensor) -> torch.Tensor:
    """`_steps` of one token with a DynamicCache (the operator's path, α computed whole in torch ops)."""
    cache = DynamicCache()
    out = []
    with torch.no_grad():
        model(ids[:, :PROMPT], cache=cache)
        for t in range(PROMPT, ids.shape[1]):
            out.append(model(ids[:, t:t + 1], cache=cache).logits)
    return torch.cat(out, 1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", ["adaptive", "sinks", "per-head periods"])
def test_adaptive_one_token_steps_hand_the_gate_hidden_layer_to_the_compiled_step(case, dtype, step_priors):
    """A one-token PiCache step of an adaptive model hands the compiled step the gate MLP's hidden
    pre-activation and its last layer (PRIOR_HIDDEN: GELU, linear, σ and clip in C), not α̃ computed in torch
    ops; the logits equal the full forward's and DynamicCache's."""
    model = _model(dtype, **CASES[case])
    ids = tokens(2, TOTAL)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits[:, PROMPT:]
    dynamic = _dynamic_steps(model, ids)
    step_priors.clear()
    steps = _steps(model, ids, 1)
    n_hidden = model.model.layers[0].self_attn.pi_gate[0].out_features
    assert len(step_priors) == (TOTAL - PROMPT) * _calls(model)
    assert set(step_priors) == {(native.PRIOR_HIDDEN, True, (2, 1, n_hidden))}
    torch.testing.assert_close(steps, full, **TOL[dtype])
    torch.testing.assert_close(steps, dynamic, **TOL[dtype])


def test_a_hooked_gate_is_computed_whole_and_its_hooks_run(step_priors):
    """A gate with a forward hook is called as a module on every step (its hook sees every token), and the
    compiled step gets its α̃ (PRIOR_ALPHA); the logits are unchanged."""
    model = _model(torch.float64, window=3, period=8, sinks=1)
    ids = tokens(2, TOTAL)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits[:, PROMPT:]
    seen = []
    gate = model.model.layers[1].self_attn.pi_gate
    handle = gate.register_forward_hook(lambda module, args, out: seen.append(out.shape[1]))
    try:
        step_priors.clear()
        steps = _steps(model, ids, 1)
    finally:
        handle.remove()
    assert seen == [PROMPT] + [1] * (TOTAL - PROMPT)
    layers = model.config.num_hidden_layers
    assert [mode for mode, _, _ in step_priors].count(native.PRIOR_ALPHA) == TOTAL - PROMPT  # the hooked layer
    assert [mode for mode, _, _ in step_priors].count(native.PRIOR_HIDDEN) == (TOTAL - PROMPT) * (layers - 1)
    torch.testing.assert_close(steps, full, **TOL[torch.float64])
