"""The choice of backend (piattn.ops.pi.backends): what each declares, what "auto" picks, and the errors.

A GPU is simulated by passing device="cuda" to `select`: the declarations, not the hardware, decide.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

import piattn
from piattn.config.pi import VARIANTS
from piattn.ops.pi.backends import AUTO_ORDER, REGISTRY, Backend, by_keywords, select
from piattn.ops.pi.validate import SUPPORTED_DTYPES
from utils import DEVICE, assert_close, make_inputs

CALL = dict(dtype=torch.float32, head_dim=64, needs_grad=True, dropout_p=0.0)


def test_backends_lists_auto_then_what_this_install_runs():
    names = ("auto", *(name for name, b in REGISTRY.items() if b.available()))
    assert names == piattn.BACKENDS
    assert {"reference", "torch"} <= set(piattn.BACKENDS)


def test_every_backend_loads_its_function():
    for name in piattn.BACKENDS[1:]:
        fn = REGISTRY[name].load()
        assert callable(fn) and fn.__name__ == f"run_{name}"


def test_auto_on_cpu_is_fused_then_torch_and_correct():
    """Every dtype runs "fused" where its C kernels build (else "torch", `test_fused_unavailable.py`)."""
    q, k, v, gate = make_inputs(1, 2, 33, 8, requires_grad=False)
    fused = "fused" if REGISTRY["fused"].refusal(device="cpu", **CALL) is None else "torch"
    assert select("auto", device="cpu", **CALL).name == fused
    assert select("auto", device="cpu", **{**CALL, "dtype": torch.float64}).name == fused
    assert select("auto", device="cpu", **{**CALL, "dtype": torch.bfloat16}).name == fused
    assert select("auto", device="cpu", **{**CALL, "dtype": torch.float16}).name == fused
    assert_close("auto", piattn.pi_attention(q, k, v, gate, backend="reference"), piattn.pi_attention(q, k, v, gate))


CALLS = list(itertools.product(("cpu", "cuda"), SUPPORTED_DTYPES, (8, 64, 256, 257, 512), (False, True), (0.0, 0.1)))


@pytest.mark.parametrize("device,dtype,head_dim,needs_grad,dropout_p", CALLS)
def test_auto_picks_the_first_backend_that_can_run_the_call(device, dtype, head_dim, needs_grad, dropout_p):
    call = dict(device=device, dtype=dtype, head_dim=head_dim, needs_grad=needs_grad, dropout_p=dropout_p)
    chosen = select("auto", **call)
    assert chosen.refusal(**call) is None
    order = AUTO_ORDER[device]
    assert chosen.name in order
    before = order[: order.index(chosen.name)]
    assert all(REGISTRY[name].refusal(**call) is not None for name in before)


def test_auto_on_a_simulated_gpu():
    """Triton where its kernels run it (when this install has triton), torch for fp64 and head dims > 256."""
    triton_ok = REGISTRY["triton"].refusal(device="cuda", **CALL) is None
    assert select("auto", device="cuda", **CALL).name == ("triton" if triton_ok else "torch")
    for change in (dict(dtype=torch.float64), dict(head_dim=257)):
        assert select("auto", device="cuda", **{**CALL, **change}).name == "torch"
        assert REGISTRY["triton"].refusal(device="cuda", **{**CALL, **change}) is not None


@pytest.mark.skipif("triton" not in piattn.BACKENDS, reason="backend 'triton' is not runnable on this install")
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_what_auto_picks_on_a_gpu_runs(dtype):
    """The calls "auto" hands triton on a GPU run in triton (here on its CPU interpreter): the largest head
    dim, gradients and dropout included; one more head dim and "auto" leaves triton."""
    call = dict(dtype=dtype, head_dim=256, needs_grad=True, dropout_p=0.2)
    assert select("auto", device="cuda", **call).name == "triton"
    assert select("auto", device="cuda", **{**call, "head_dim": 257}).name == "torch"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v, gate = make_inputs(1, 1, 5, 256, dtype=dtype, device=device)
    y = piattn.pi_attention(q, k, v, gate, window=2, period=3, dropout_p=0.2, backend="triton")
    y.sum().backward()
    assert torch.isfinite(y).all() and torch.isfinite(gate.grad).all()


def _limited(**fields) -> dict[str, Backend]:
    return {name: dataclasses.replace(b, **fields) for name, b in REGISTRY.items()}


def test_auto_error_lists_every_backend_and_why():
    registry = _limited(dtypes=(torch.float16,), devices=None)  # every backend refused for its dtype alone
    with pytest.raises(ValueError) as err:
        select("auto", device="cuda", **CALL, registry=registry)
    message = str(err.value)
    assert message.startswith("backend 'auto' found no backend for this call (cuda, float32, head dim 64")
    for name in REGISTRY:
        assert f"{name}: " in message, name
    assert message.count("no float32") == len(REGISTRY)


def test_auto_error_names_backends_outside_its_order_that_could():
    registry = {**REGISTRY, "torch": dataclasses.replace(REGISTRY["torch"], devices=("cpu", "cuda"))}
    with pytest.raises(ValueError, match=r"torch: runs on cpu/cuda, not mps.*can run it: 'reference'"):
        select("auto", device="mps", **CALL, registry=registry, auto_order={"mps": ("torch",)})


def test_auto_error_names_backends_missing_from_the_registry():
    registry = {"triton": REGISTRY["triton"]}
    with pytest.raises(ValueError, match="torch: not declared"):
        select("auto", device="cpu", **CALL, registry=registry)


@pytest.mark.parametrize(
    "backend,dtype,D,kwargs,reason",
    [
        ("flex", torch.float64, 8, {}, "no float64"),
        ("flex", torch.float32, 8, dict(dropout_p=0.1), r"no dropout \(dropout_p=0.1\)"),
        ("flex", torch.float32, 8, dict(grad=True), "forward-only on cpu"),
        ("triton", torch.float64, 8, {}, "no float64"),
        ("triton", torch.float32, 320, {}, "head dim 320 > 256"),
    ],
)
def test_explicit_backend_that_cannot_run_the_call(backend, dtype, D, kwargs, reason):
    """One ValueError naming the backend, the call, the reason and the backends that could run it."""
    if backend not in piattn.BACKENDS:
        pytest.skip(f"backend {backend!r} is not runnable on this install")
    grad = kwargs.pop("grad", False)
    # On the backend's own device, so that the refusal is the one under test, not "runs on cuda, not cpu"
    # (triton on a GPU machine, where its CPU interpreter is off).
    device = "cpu" if "cpu" in (REGISTRY[backend].devices or ("cpu",)) else DEVICE
    q, k, v, gate = make_inputs(1, 1, 6, D, dtype=dtype, device=device, requires_grad=grad)
    can = [name for name in REGISTRY if name != backend and name in piattn.BACKENDS
           and REGISTRY[name].refusal(device=device, dtype=dtype, head_dim=D, needs_grad=grad,
                                      dropout_p=kwargs.get("dropout_p", 0.0)) is None]
    assert "reference" in can and "torch" in can
    pattern = rf"backend '{backend}' cannot run this call \({device}, .*\): {reason}.*Backends that can: " + ", ".join(
        f"'{name}'" for name in can)
    with pytest.raises(ValueError, match=pattern):
        piattn.pi_attention(q, k, v, gate, backend=backend, **kwargs)


def test_explicit_backend_on_a_simulated_gpu():
    with pytest.raises(ValueError, match=r"backend 'triton' cannot run .*no float64.*can: 'reference', 'torch'$"):
        select("triton", device="cuda", **{**CALL, "dtype": torch.float64})


def test_explicit_backend_without_its_device():
    registry = {**REGISTRY, "triton": dataclasses.replace(REGISTRY["triton"], devices=("cuda",))}
    with pytest.raises(ValueError, match="backend 'triton' cannot run .*runs on cuda, not cpu"):
        select("triton", device="cpu", **CALL, registry=registry)


def test_explicit_backend_without_its_dependency():
    registry = {**REGISTRY, "triton": dataclasses.replace(REGISTRY["triton"], requires=("no_such_module_xyz",))}
    assert not registry["triton"].available()
    with pytest.raises(ValueError, match="needs no_such_module_xyz, which is not installed"):
        select("triton", device="cuda", **CALL, registry=registry)


@pytest.fixture
def fused_unbuildable(monkeypatch):
    """"fused" as on a machine without a C compiler: its probe (`fused.unavailable`) says why; returns the list
    of times its library was asked for."""
    from piattn.ops.pi import fused

    reason = "its C kernels do not build: no compiler. Install a C compiler or set CC to one, or pick backend='torch'"
    monkeypatch.setattr(fused, "_state", {"functions": None, "reason": reason})
    asked = []
    load = fused._load
    monkeypatch.setattr(fused, "_load", lambda: asked.append(1) or load())
    return asked


def test_a_backend_whose_probe_refuses_is_skipped_by_auto_and_refused_by_name(fused_unbuildable):
    """A backend's probe (`Backend.probe`: "fused"'s library that cannot be built) is a refusal like any other:
    "auto" takes the next backend and lists the reason when none can; naming the backend raises it."""
    order = {"cpu": ("fused", "torch", "reference")}
    assert REGISTRY["fused"].probe == "unavailable"
    assert select("auto", device="cpu", **CALL, auto_order=order).name == "torch"
    with pytest.raises(ValueError, match=r"^backend 'fused' cannot run this call \(cpu, float32, .*\): its C kernels "
                                         r"do not build: no compiler\. Install a C compiler or set CC to one, or pick "
                                         r"backend='torch'\. Backends that can: 'reference', 'torch'"):
        select("fused", device="cpu", **CALL)
    registry = {"fused": REGISTRY["fused"], "torch": dataclasses.replace(REGISTRY["torch"], devices=("cuda",))}
    with pytest.raises(ValueError, match=r"fused: its C kernels do not build: no compiler.*torch: runs on cuda"):
        select("auto", device="cpu", **CALL, registry=registry, auto_order=order)
    q, k, v, gate = make_inputs(1, 2, 20, 8)
    with pytest.raises(ValueError, match="backend 'fused' cannot run this call .*its C kernels do not build"):
        piattn.pi_attention(q, k, v, gate, backend="fused")
    with pytest.raises(ValueError, match="backend 'fused' cannot run this call: its C kernels do not build"):
        by_keywords(REGISTRY["fused"].load())(q, k, v, gate, window=4, period=8, causal=True, variant="adaptive",
                                              prior=0.5, logit_clamp=20.0, eps=1e-4, scale=0.3)


def test_a_probe_is_asked_last_and_only_when_needed(fused_unbuildable):
    """The probe may build a library: it is not asked for a call naming another backend, nor where the
    declaration already refuses (another device or dtype)."""
    select("torch", device="cpu", **CALL)
    select("auto", device="cpu", **CALL, auto_order={"cpu": ("torch", "fused")})
    assert REGISTRY["fused"].refusal(device="cuda", **CALL).startswith("runs on cpu")
    assert REGISTRY["fused"].refusal(device="cpu", **CALL, variant="xyz").startswith("does not implement variant")
    assert fused_unbuildable == []
    assert REGISTRY["fused"].refusal(device="cpu", **CALL).startswith("its C kernels do not build")
    assert fused_unbuildable == [1]


def test_unknown_backend():
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'reference', 'torch'"):
        select("cuda-magic", device="cpu", **CALL)


def test_every_variant_has_a_backend_and_every_backend_declares_its_variants():
    """Variants are declared per backend like the other features; "reference" runs every one."""
    for b in REGISTRY.values():
        assert b.variants and b.variants <= set(VARIANTS), b.name
    assert REGISTRY["reference"].variants == set(VARIANTS)


def test_a_backend_without_the_variant_is_refused_and_auto_picks_the_next():
    """The fast CPU backends ("fused", "torch") declaring only two variants: "auto" runs the others on "reference"."""
    registry = {**REGISTRY, **{name: dataclasses.replace(REGISTRY[name], variants=frozenset({"union", "fixed"}))
                               for name in ("fused", "torch")}}
    assert registry["torch"].refusal(device="cpu", **CALL, variant="separate") == (
        "does not implement variant 'separate' (runs fixed, union)")
    assert registry["torch"].refusal(device="cpu", **CALL, variant="union") is None
    assert select("auto", device="cpu", **CALL, variant="separate", registry=registry).name == "reference"
    fast = select("auto", device="cpu", **CALL).name  # "fused", or "torch" where its kernels do not build
    assert select("auto", device="cpu", **CALL, variant="union", registry=registry).name == fast
    with pytest.raises(ValueError, match=r"backend 'torch' cannot run this call \(cpu, .*variant 'separate'\): "
                                         r"does not implement variant 'separate'.*Backends that can: 'reference'"):
        select("torch", device="cpu", **CALL, variant="separate", registry=registry)


def test_pi_attention_runs_a_variant_on_a_backend_that_declares_it(monkeypatch):
    """With "fused" and "torch" declaring no "separate", "auto" runs it on "reference" and naming "torch" is
    refused."""
    from piattn.ops.pi import torch as torch_backend

    for name in ("fused", "torch"):
        monkeypatch.setitem(REGISTRY, name, dataclasses.replace(REGISTRY[name], variants=frozenset({"adaptive"})))
    ran_torch = []
    monkeypatch.setattr(torch_backend.PiAttentionFunction, "apply", lambda *args: ran_torch.append(args))
    q, k, v, gate = make_inputs(1, 2, 33, 8, variant="separate", requires_grad=False)
    kw = dict(variant="separate", window=3, period=8)
    y = piattn.pi_attention(q, k, v, gate, **kw)
    assert not ran_torch
    assert torch.equal(y, piattn.pi_attention(q, k, v, gate, backend="reference", **kw))
    with pytest.raises(ValueError, match="backend 'torch' cannot run .*does not implement variant 'separate'"):
        piattn.pi_attention(q, k, v, gate, backend="torch", **kw)


def test_a_variant_no_backend_declares_is_refused_not_run_as_another(monkeypatch):
    """A variant added to the settings but to no backend's declaration: every backend refuses it with its
    reason (before the declarations, "torch" ran it silently as "union")."""
    monkeypatch.setattr(piattn.config.pi, "VARIANTS", (*VARIANTS, "novel"))
    q, k, v = make_inputs(1, 2, 16, 8, variant="union", requires_grad=False)[:3]
    with pytest.raises(ValueError, match=r"backend 'auto' found no backend .*variant 'novel'\): fused: does not "
                                         r"implement variant 'novel'.*; torch: does not implement variant 'novel'"):
        piattn.pi_attention(q, k, v, variant="novel", window=2, period=4)
