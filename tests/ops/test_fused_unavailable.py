"""Backend "fused" where its C kernels cannot be built or loaded (no C compiler, PIATTN_NATIVE=0): it refuses with
the reason, and "auto" runs everything on the next backend. Fresh interpreters with their own PIATTN_CACHE, so this
runs on every machine, with or without a compiler."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

NO_KERNELS = """
import json, warnings, torch
warnings.simplefilter("always")
import piattn
from piattn.models import GPT, GPTConfig
from piattn.ops.pi import fused
from piattn.ops.pi.backends import select
torch.manual_seed(0)
q, k, v = (torch.randn(1, 4, 40, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
gate = (0.05 + 0.9 * torch.rand(1, 4, 40, dtype=torch.float64)).requires_grad_()
docs = torch.tensor([[0] * 15 + [1] * 25])
kw = dict(window=3, period=(5, 9, 9, 17), sinks=1, document_ids=docs)
with warnings.catch_warnings(record=True) as caught:
    worst = 0.0
    for backend in ("reference", "auto"):
        y = piattn.pi_attention(q, k, v, gate, backend=backend, **kw)
        got = (y, *torch.autograd.grad(y.square().sum(), (q, k, v, gate)))
        if backend == "reference":
            expected = got
    worst = max((a - b).abs().max().item() for a, b in zip(expected, got))
    try:
        piattn.pi_attention(q, k, v, gate, backend="fused", **kw)
        named = None
    except ValueError as err:
        named = str(err)
    cfg = GPTConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=32, block_size=64, vocab_size=50, period=[4, 8, 8, 16],
                    sinks=1, dropout=0.1)
    model = GPT(cfg)
    idx = torch.randint(0, 50, (2, 40))
    loss = model(idx, document_ids=torch.tensor([[0] * 20 + [1] * 20] * 2)).logsumexp(-1).mean()
    loss.backward()
    trained = bool(loss.isfinite()) and all(p.grad is not None and bool(p.grad.isfinite().all())
                                            for p in model.parameters())
    model.eval()
    with torch.no_grad():
        cache = model.init_cache(2)
        model(idx[:, :30], cache=cache)
        step = model(idx[:, 30:31], cache=cache)
        full = model(idx[:, :31])[:, -1:]
    decoded = (step - full).abs().max().item()
print(json.dumps(dict(reason=fused.unavailable(), worst=worst, named=named, trained=trained, decoded=decoded,
                      auto=select("auto", device="cpu", dtype=torch.float32, head_dim=8, needs_grad=True,
                                  dropout_p=0.0).name,
                      warnings=[str(w.message) for w in caught if "piattn" in str(w.message)])))
"""


@pytest.mark.parametrize("env,reason", [
    (dict(CC="/nonexistent/cc"), "its C kernels do not build: could not build fused_cpu.c with '/nonexistent/cc'"),
    (dict(PIATTN_NATIVE="0"), "its C kernels are switched off by PIATTN_NATIVE=0"),
], ids=("no-compiler", "PIATTN_NATIVE=0"))
def test_without_its_kernels_fused_refuses_and_auto_runs_everything(tmp_path, env, reason):
    """A machine without a C compiler (or with the kernels switched off) still runs everything through "auto"
    (the operator with per-head periods, sinks, documents and gradients, a GPT's training step with dropout and
    grouped heads, a cached decoding step); "fused" named explicitly is refused in one line that says why and
    what to do, and never runs "torch" in its place."""
    done = subprocess.run([sys.executable, "-c", NO_KERNELS], capture_output=True, text=True, check=True,
                          env={**os.environ, "PIATTN_CACHE": str(tmp_path), **env})
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["reason"].startswith(reason) and out["reason"].endswith("or pick backend='torch'"), out
    assert "\n" not in out["named"] and out["named"].startswith("backend 'fused' cannot run this call (cpu, float64")
    assert out["reason"] in out["named"] and "Backends that can: 'reference', 'torch'" in out["named"], out
    assert out["auto"] == "torch" and out["worst"] < 1e-10 and out["trained"] and out["decoded"] < 1e-5, out
    # No warning from the operator (only the decoding step's own, once, without a compiler: `native.py`).
    assert [w for w in out["warnings"] if not w.startswith("piattn: decoding runs in torch ops")] == [], out
    assert len(out["warnings"]) <= 1, out["warnings"]
