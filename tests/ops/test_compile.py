"""torch.compile of π-Attention: the "torch" backend as custom operators (ops/pi/compiled.py), "fused" likewise
(the end of ops/pi/fused.py), whole-graph capture of a GPT's forward and backward, meta and fake tensors, and the
backends that cannot compile."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._subclasses.fake_tensor import FakeTensorMode

from piattn import BACKENDS, pi_attention
from piattn.models import GPT, GPTConfig
from piattn.ops.pi import fused
from piattn.ops.pi.backends import constant_under_compile, select
from piattn.ops.pi.compiled import pi_attention_bwd, pi_attention_fwd, run_torch_op
from piattn.ops.pi.settings import OpSettings
from piattn.ops.pi.torch import run_torch, saved_layout, slot_plan, torch_backward, torch_forward
from utils import make_inputs

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_dynamo")

T = 40
MODELS = {  # attention kind and its settings: gated π (Variant 3), separate π (Variant 1), local window; per-head
    # periods with sinks and grouped-query attention (run with packed documents)
    "pi-adaptive": dict(attention="pi", variant="adaptive", window=3, period=8),
    "pi-separate": dict(attention="pi", variant="separate", window=3, period=8),
    "local": dict(attention="local", window=3),
    "pi-features": dict(attention="pi", variant="adaptive", window=3, period=[5, 8, 8, 13], sinks=1, n_head=4,
                        n_kv_head=2),
}
# The operators of each backend registered for torch.compile: (forward, backward) as named in a graph's code.
OPS = {"torch": ("piattn.pi_attention_fwd", "piattn.pi_attention_bwd"),
       "fused": ("piattn.pi_fused_fwd", "piattn.pi_fused_bwd")}


def auto_on_cpu(dtype=torch.float64) -> str:
    """What "auto" runs on a CPU, eager and compiled alike: "fused", or "torch" where its kernels do not build."""
    return select("auto", device="cpu", dtype=dtype, head_dim=8, needs_grad=True, dropout_p=0.0).name


def tiny_gpt(kind: str, backend: str = "auto") -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig.from_name("tiny", **{**dict(vocab_size=32, block_size=T, n_layer=1, n_head=2, d_model=32, d_ff=64,
                                                dropout=0.0, backend=backend), **MODELS[kind]})
    return GPT(cfg).double()


def loss_and_grads(model: torch.nn.Module, forward, idx: torch.Tensor):
    logits = forward(idx[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logits.detach(), grads


def recording_backend(graphs: dict):
    """aot_eager that keeps the code of the forward and backward graphs AOTAutograd hands it."""

    def compiler(name):
        def run(gm, example_inputs):
            graphs.setdefault(name, []).append(gm.code)
            return make_boxed_func(gm.forward)

        return run

    return aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"))


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Seconds of tracing each on a CPU, where `make test` runs one case of each backend and kind (a GPU runs all).
SLOW = [pytest.mark.slow] if DEVICE == "cpu" else []


@pytest.mark.parametrize(("kind", "backend", "dtype"), [
    pytest.param("pi-adaptive", "torch", torch.float64, marks=SLOW), ("pi-adaptive", "auto", torch.float64),
    ("pi-separate", "torch", torch.float64), pytest.param("pi-separate", "auto", torch.float64, marks=SLOW),
    ("local", "auto", torch.float64), ("pi-features", "torch", torch.float64),
    pytest.param("pi-features", "auto", torch.float32, marks=SLOW), ("pi-features", "fused", torch.float32)])
def test_fullgraph_gpt_matches_eager(kind, backend, dtype):
    """One graph each way (fullgraph raises on any break), the operators in them, and eager's numbers. "auto"
    compiles to what it runs in eager: on a CPU "fused" (its operators), where its kernels build. Per-head
    periods: one "fused" call for all heads, one "torch" call per period group; with sinks, grouped heads and
    packed documents. fp32: eager and compiled run the same kernels, up to the rounding of what is around them."""
    if backend == "fused" and fused.unavailable() is not None:
        pytest.skip(f"backend 'fused' cannot run here: {fused.unavailable()}")
    model = tiny_gpt(kind, backend).to(dtype)
    idx = torch.randint(0, 32, (2, T + 1), generator=torch.Generator().manual_seed(1))
    extra = {}
    if kind == "pi-features":
        extra = dict(document_ids=torch.stack([torch.arange(T) // 13, torch.arange(T) // 7 % 2]))

    def run(forward):
        return loss_and_grads(model, lambda x: forward(x, **extra), idx)

    want_logits, want_grads = run(model)
    graphs = {}
    got_logits, got_grads = run(torch.compile(model, backend=recording_backend(graphs), fullgraph=True))
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_logits, want_logits, **tol)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], **{**tol, "rtol": tol["rtol"] * 10}, msg=name)
    assert len(graphs["forward"]) == len(graphs["backward"]) == 1
    ran = auto_on_cpu(dtype) if backend == "auto" else backend
    calls = len(set(MODELS[kind]["period"])) if kind == "pi-features" and ran == "torch" else 1
    assert graphs["forward"][0].count(OPS[ran][0]) == calls
    assert graphs["backward"][0].count(OPS[ran][1]) == calls
    other = OPS["torch" if ran == "fused" else "fused"]
    assert not any(op in code for op in other for code in graphs["forward"] + graphs["backward"])


def test_dropout_mask_is_drawn_in_the_graph():
    """The mask pi_attention draws reaches the operator and its backward inside one graph."""
    args = op_args("adaptive", None, True, torch.float64)
    q, k, v, gate = args[:4]

    def f(q, k, v, gate):
        return pi_attention(q, k, v, gate, window=3, period=8, dropout_p=0.25).sum()

    graphs = {}
    loss = torch.compile(f, backend=recording_backend(graphs), fullgraph=True)(q, k, v, gate)
    grads = torch.autograd.grad(loss, (q, k, v, gate))
    assert all(g.isfinite().all() for g in grads)
    assert "aten.rand" in graphs["forward"][0] and OPS[auto_on_cpu()][1] in graphs["backward"][0]


def test_reference_backend_compiles_whole():
    """"reference" is traced as plain torch code, grouped-query k, v and sinks included."""
    torch.manual_seed(0)
    q = torch.randn(1, 4, T, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 2, T, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    gate = torch.rand(1, 4, T, dtype=torch.float64).clamp(0.1, 0.9).requires_grad_()

    def f(q, k, v, gate):
        return pi_attention(q, k, v, gate, window=3, period=8, sinks=2, variant="adaptive",
                            backend="reference").square().sum()

    want = torch.autograd.grad(f(q, k, v, gate), (q, k, v, gate))
    got = torch.autograd.grad(torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v, gate), (q, k, v, gate))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", [b for b in ("flex",) if b in BACKENDS])
def test_backend_that_cannot_compile_is_named(backend):
    """Dynamo's error carries the ValueError naming the backend (without fullgraph, the call runs eagerly)."""
    q, k, v = (torch.randn(1, 2, 32, 16) for _ in range(3))

    def f(q, k, v):
        return pi_attention(q, k, v, variant="union", window=3, period=8, backend=backend)

    with torch.no_grad(), pytest.raises(Exception, match=f"backend '{backend}' cannot run inside torch.compile"):
        torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v)


def test_dynamic_shapes_one_graph_for_every_length():
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")

    def f(q, k, v, gate):
        return pi_attention(q, k, v, gate, window=3, period=8, variant="adaptive")

    compiled = torch.compile(f, backend=counter, dynamic=True, fullgraph=True)
    graphs = []
    for t in (24, 40):
        q, k, v, gate = op_args("adaptive", None, True, torch.float64, T=t)[:4]
        torch.testing.assert_close(compiled(q, k, v, gate), f(q, k, v, gate), rtol=1e-12, atol=1e-12)
        graphs.append(counter.frame_count)
    assert graphs[1] == graphs[0]  # no recompilation for the new length


@pytest.mark.parametrize("variant", ["adaptive", "separate", "union"])
def test_meta_tensors_give_shapes(variant):
    q = torch.empty(2, 4, 50, 16, device="meta", dtype=torch.bfloat16)
    k = v = torch.empty(2, 4, 50, 16, device="meta", dtype=torch.bfloat16)
    gate = None if variant == "union" else torch.empty(2, 4, 50, device="meta")
    y = pi_attention(q, k, v, gate, variant=variant, window=4, period=16)
    assert (y.shape, y.dtype, y.device.type) == (q.shape, q.dtype, "meta")


def test_model_runs_on_meta_and_fake_tensors():
    """Shape inference through a whole model: the gate's value check and the backend's host sync are skipped."""
    with torch.device("meta"):
        model = GPT(GPTConfig.from_name("tiny", vocab_size=32, block_size=T, attention="pi"))
        logits = model(torch.zeros(2, T, dtype=torch.long))
    assert logits.shape == (2, T, 32) and logits.device.type == "meta"
    model = tiny_gpt("pi-adaptive")
    with FakeTensorMode(allow_non_fake_inputs=True):
        logits = model(torch.zeros(2, T, dtype=torch.long))
        logits.sum().backward()
    assert logits.shape == (2, T, 32)


def test_eager_gate_check_still_runs():
    q = k = v = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="gate values must lie in the open interval"):
        pi_attention(q, k, v, torch.ones(1, 2, 8), variant="adaptive", window=2, period=4)


CASES = [  # variant, logit_clamp, causal, dtype
    ("adaptive", None, True, torch.float64),
    ("separate", None, False, torch.float64),
    ("fixed", None, True, torch.float32),
    ("union", 5.0, True, torch.float64),
]


def op_args(variant, logit_clamp, causal, dtype, window=3, period=8, dropout_p=0.0, T=24):
    """The arguments of piattn::pi_attention_fwd, for q, k, v [2, 2, T, 8]: q, k, v, gate, dropout_keep,
    document_ids, then the settings."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, T, 8, dtype=dtype, requires_grad=True) for _ in range(3))
    gate = None
    if variant in ("adaptive", "separate"):
        gate = torch.rand(2, 2, T, dtype=dtype).clamp(0.1, 0.9).requires_grad_()
    slots = (window + 1 if causal else 2 * window + 1) + (1 if causal else 2)
    keep = torch.rand(2, 2, T, slots) >= dropout_p if dropout_p else None
    settings = OpSettings(window=window, period=period, causal=causal, variant=variant, prior=0.7,
                          logit_clamp=logit_clamp, eps=1e-6, scale=0.3, dropout_p=dropout_p, sinks=0)
    return (q, k, v, gate, keep, None, *settings)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-clamp{c[1]}-causal{c[2]}")
def test_opcheck(case):
    """Schema, fake implementation (shapes, dtypes, strides), autograd registration and AOT dispatch.

    With a logit clamp, the saved clamp mask is left unwritten where a slot has no key (no later read
    depends on it), so two runs can differ there and the output comparison of test_aot_dispatch_dynamic
    is skipped.
    """
    tests = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if case[1] is not None:
        tests = tests[:-1]
    args = op_args(*case)
    torch.library.opcheck(pi_attention_fwd, args, test_utils=tests)
    y, saved = pi_attention_fwd(*args)
    dy = torch.randn_like(y)
    inputs = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    bwd_args = (dy, *inputs[:6], saved, inputs[3] is not None, *inputs[6:])
    torch.library.opcheck(pi_attention_bwd, bwd_args)


def test_opcheck_with_dropout():
    args = op_args("adaptive", None, True, torch.float64, dropout_p=0.25)
    torch.library.opcheck(pi_attention_fwd, args)


def test_saved_tensors_describe_the_forward():
    """The fake implementation's description of what forward keeps, against what it keeps."""
    for variant, clamp, causal, dtype in CASES:
        args = op_args(variant, clamp, causal, dtype)
        _, saved = pi_attention_fwd(*args)
        described = saved_layout(args[0], args[1], OpSettings(*args[6:]))
        assert [(tuple(t.shape), t.dtype) for t in saved] == list(described.values())


@pytest.mark.parametrize("case", [*CASES, ("separate", 3.0, True, torch.float64, 0.25)],
                         ids=lambda c: f"{c[0]}-clamp{c[1]}-causal{c[2]}")
def test_the_function_and_the_operators_run_the_plain_functions(case):
    """`torch_forward` and `torch_backward` called directly give, bit for bit, what autograd gets through the
    eager Function and through the operators: both wrap them, neither has a copy of the computation."""
    q, k, v, gate, keep, docs, *settings = op_args(*case[:4], dropout_p=case[4] if len(case) > 4 else 0.0)
    settings = OpSettings(*settings)
    slots = slot_plan(q, k, docs, settings)
    with torch.no_grad():
        y, saved = torch_forward(q, k, v, gate, keep, slots, settings)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(2), dtype=y.dtype)
        want = torch_backward(dy, q, k, v, gate, keep, slots, saved, settings, want_dgate=gate is not None)
    assert list(saved) == list(saved_layout(q, k, settings))
    leaves = [t for t in (q, k, v, gate) if t is not None]
    for run in (run_torch, run_torch_op):
        got = run(q, k, v, gate, settings, keep, docs)
        assert torch.equal(got, y), run.__name__
        for a, b in zip(torch.autograd.grad(got, leaves, dy), want[:len(leaves)], strict=True):
            assert torch.equal(a, b), run.__name__


def test_the_operators_take_the_settings_in_the_order_of_opsettings():
    """`OpSettings`' fields are the one home of the settings' order: every operator's schema ends with them."""
    from piattn.ops.pi.fused import pi_fused_bwd, pi_fused_fwd

    ops = [pi_attention_fwd, pi_attention_bwd, pi_fused_fwd, pi_fused_bwd]
    if "triton" in BACKENDS:
        from piattn.ops.pi.triton import pi_triton_bwd, pi_triton_fwd

        ops += [pi_triton_fwd, pi_triton_bwd]
    n = len(OpSettings._fields)
    for op in ops:
        names = tuple(arg.name for arg in op._opoverload._schema.arguments)
        assert names[-n:] == OpSettings._fields, op


def test_double_backward_is_refused_through_the_operator():
    args = op_args("adaptive", None, True, torch.float64)
    y, _ = pi_attention_fwd(*args)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(y.sum(), args[0], create_graph=True)


def needs_fused() -> None:
    if fused.unavailable() is not None:
        pytest.skip(f"backend 'fused' cannot run here: {fused.unavailable()}")


def fused_call(variant: str, causal: bool, dropout_p: float):
    """f(q, k, v, gate) -> pi_attention(backend="fused") and its inputs: fp64, four query heads on two key/value
    heads, a period per head (2 lies in the window), a sink, two documents."""
    q = torch.randn(2, 4, 24, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).requires_grad_()
    k, v, gate = make_inputs(2, 2, 24, 8, variant=variant, dtype=torch.float64)[1:]
    gate = None if gate is None else torch.cat([gate.detach()] * 2, 1).requires_grad_()
    docs = torch.tensor([[0] * 9 + [1] * 15, [0] * 24])

    def f(q, k, v, gate):
        return pi_attention(q, k, v, gate, window=3, period=(2, 6, 6, 11), causal=causal, variant=variant, prior=0.3,
                            logit_clamp=2.0, sinks=1, document_ids=docs, dropout_p=dropout_p, backend="fused")

    return f, [t for t in (q, k, v, gate) if t is not None]


@pytest.mark.parametrize(("variant", "causal", "dropout_p"),
                         [("adaptive", True, 0.0), ("separate", False, 0.25), ("union", True, 0.2)])
def test_fused_backend_compiles_whole(variant, causal, dropout_p):
    """"fused" as the operators piattn::pi_fused_fwd / _bwd: one graph each way, the same kernels as eager, so
    the same numbers exactly (per-head periods in one call, sinks, documents, grouped heads, dropout)."""
    needs_fused()
    f, inputs = fused_call(variant, causal, dropout_p)
    gate = inputs[3] if len(inputs) == 4 else None
    dy = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    torch.manual_seed(3)  # the dropout masks pi_attention draws: the same in eager and compiled (aot_eager)
    want_y = f(*inputs[:3], gate)
    want = torch.autograd.grad(want_y, inputs, dy)
    graphs = {}
    torch.manual_seed(3)
    got_y = torch.compile(f, backend=recording_backend(graphs), fullgraph=True)(*inputs[:3], gate)
    got = torch.autograd.grad(got_y, inputs, dy)
    assert torch.equal(got_y, want_y)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert graphs["forward"][0].count("piattn.pi_fused_fwd") == 1
    assert graphs["backward"][0].count("piattn.pi_fused_bwd") == 1


@pytest.mark.parametrize(("variant", "causal", "dropout_p"),
                         [("adaptive", True, 0.0), ("separate", False, 0.25), ("union", True, 0.0)])
def test_fused_opcheck(variant, causal, dropout_p):
    """Schema, fake implementations (shapes, dtypes, strides), autograd registration and AOT dispatch of the
    "fused" operators, with per-head periods, sinks, documents, grouped heads and a dropout mask."""
    from piattn.ops.pi.fused import pi_fused_bwd, pi_fused_fwd

    needs_fused()
    _, (q, k, v, *gate) = fused_call(variant, causal, dropout_p)
    gate = gate[0] if gate else None
    keep = torch.rand(2, 4, 24, 10, generator=torch.Generator().manual_seed(4)) >= dropout_p if dropout_p else None
    settings = OpSettings(window=3, period=2, causal=causal, variant=variant, prior=0.3, logit_clamp=2.0, eps=1e-6,
                          scale=0.3, dropout_p=dropout_p, sinks=1)
    args = (q, k, v, gate, keep, torch.tensor([[0] * 9 + [1] * 15, [0] * 24]), [2, 6, 6, 11], *settings)
    torch.library.opcheck(pi_fused_fwd, args)
    y, stat = pi_fused_fwd(*args)
    inputs = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    torch.library.opcheck(pi_fused_bwd, (torch.randn_like(y), *inputs[:6], stat, gate is not None, *inputs[6:]))


def test_without_its_kernels_compiled_auto_runs_torch_and_fused_is_refused(monkeypatch):
    """"fused"'s probe under torch.compile: asked while tracing (not traced), its refusal a constant of the graph;
    "auto" then compiles to "torch", and naming "fused" fails with the reason."""
    monkeypatch.setattr(fused, "_state", {"functions": None, "reason": "switched off by the test"})
    q, k, v, gate = op_args("adaptive", None, True, torch.float64)[:4]

    def f(q, k, v, gate, backend="auto"):
        return pi_attention(q, k, v, gate, window=3, period=8, backend=backend)

    graphs = {}
    got = torch.compile(f, backend=recording_backend(graphs), fullgraph=True)(q, k, v, gate)
    torch.autograd.grad(got.sum(), (q, k, v, gate))
    assert OPS["torch"][0] in graphs["forward"][0] and OPS["torch"][1] in graphs["backward"][0]
    torch.testing.assert_close(got, f(q, k, v, gate, "reference"), rtol=1e-10, atol=1e-12)
    with pytest.raises(Exception, match="backend 'fused' cannot run this call .*switched off by the test"):
        torch.compile(lambda *t: f(*t, backend="fused"), backend="aot_eager", fullgraph=True)(q, k, v, gate)


@pytest.mark.slow
def test_inductor_gpt_matches_eager():
    """The default compiler: inductor generates C++ for everything around the operators (slow to build)."""
    model = tiny_gpt("pi-adaptive").float()
    idx = torch.randint(0, 32, (2, T + 1), generator=torch.Generator().manual_seed(1))
    want_logits, want_grads = loss_and_grads(model, model, idx)
    got_logits, got_grads = loss_and_grads(model, torch.compile(model, fullgraph=True), idx)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-5)
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-3, atol=1e-5, msg=name)


needs_triton = pytest.mark.skipif("triton" not in BACKENDS,
                                  reason="backend 'triton' needs CUDA or TRITON_INTERPRET=1 set before import")


def triton_call(variant: str, features: bool, nan: bool = False):
    """f(q, k, v, gate) -> pi_attention(backend="triton") and its inputs: fp32, D = 8 (padded to 16 for the
    kernels); features: one key/value head for two query heads, two sinks, two documents, dropout."""
    q, k, v, gate = make_inputs(1, 2, 24, 8, variant=variant, dtype=torch.float32, device=DEVICE)
    extra = {}
    if features:
        k, v = (t.detach()[:, :1].requires_grad_() for t in (k, v))
        extra = dict(sinks=2, document_ids=torch.tensor([[0] * 9 + [1] * 15], device=DEVICE), dropout_p=0.2)
    if nan:
        with torch.no_grad():
            v[0, 0, 5, 3] = float("nan")

    def f(q, k, v, gate):
        return pi_attention(q, k, v, gate, window=3, period=8, causal=not features, variant=variant, prior=0.3,
                            logit_clamp=2.0, backend="triton", **extra)

    return f, [t for t in (q, k, v, gate) if t is not None]


@needs_triton
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter evaluates both sides of tl.where
@pytest.mark.parametrize(("variant", "features"), [pytest.param("adaptive", False, marks=SLOW), ("separate", True),
                                                   pytest.param("union", True, marks=SLOW)])
def test_triton_backend_compiles_whole(variant, features):
    """"triton" as the operators piattn::pi_triton_fwd / _bwd: one graph each way, the same kernels as
    eager, so the same numbers exactly (sinks, documents, grouped-query k, v, dropout and padding included)."""
    f, inputs = triton_call(variant, features)
    gate = inputs[3] if len(inputs) == 4 else None
    dy = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    torch.manual_seed(3)  # the dropout mask pi_attention draws: the same in eager and compiled (aot_eager)
    want_y = f(*inputs[:3], gate)
    want = torch.autograd.grad(want_y, inputs, dy)
    graphs = {}
    compiled = torch.compile(f, backend=recording_backend(graphs), fullgraph=True)
    torch.manual_seed(3)
    got_y = compiled(*inputs[:3], gate)
    got = torch.autograd.grad(got_y, inputs, dy)
    assert torch.equal(got_y, want_y)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert graphs["forward"][0].count("piattn.pi_triton_fwd") == 1
    assert graphs["backward"][0].count("piattn.pi_triton_bwd") == 1


@needs_triton
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_compiled_triton_keeps_a_nan_where_it_is_read():
    """The operator's backward takes the same "torch" fallback as eager for a non-finite input: compiled and
    eager gradients agree, NaN for NaN, and a row that never reads the bad value stays finite."""
    f, inputs = triton_call("adaptive", False, nan=True)
    dy = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    want = torch.autograd.grad(f(*inputs), inputs, dy)
    got = torch.autograd.grad(torch.compile(f, backend="aot_eager", fullgraph=True)(*inputs), inputs, dy)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert got[0][0, 0, :5].isfinite().all() and got[0][0, 0].isnan().any()  # rows before 5 never read v[5]


@needs_triton
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_triton_opcheck():
    """Schema, fake implementations (shapes, dtypes, strides) and autograd registration of the operators."""
    from piattn.ops.pi.triton import pi_triton_bwd, pi_triton_fwd

    q, k, v, gate = make_inputs(1, 2, 16, 16, dtype=torch.float32, device=DEVICE)
    settings = OpSettings(window=3, period=8, causal=True, variant="adaptive", prior=0.3, logit_clamp=2.0, eps=1e-4,
                          scale=0.25, dropout_p=0.0, sinks=0)
    args = (q, k, v, gate, None, None, [], *settings)  # []: one period, settings.period
    torch.library.opcheck(pi_triton_fwd, args, test_utils=("test_schema", "test_autograd_registration",
                                                            "test_faketensor"))
    y, stats = pi_triton_fwd(*args)
    detached = [t.detach() for t in (q, k, v, gate)]
    torch.library.opcheck(pi_triton_bwd, (torch.randn_like(y), *detached, None, None, stats.detach(), True,
                                          [], *settings), test_utils=("test_schema", "test_faketensor"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_compiles_to_the_triton_operator_on_cuda():
    """A GPT on CUDA compiled whole: "auto" picks "triton" there, as in eager."""
    model = tiny_gpt("pi-adaptive").float().cuda()
    idx = torch.randint(0, 32, (2, T + 1), device="cuda")
    graphs = {}
    compiled = torch.compile(model, backend=recording_backend(graphs), fullgraph=True)
    loss_and_grads(model, compiled, idx)
    assert graphs["forward"][0].count("piattn.pi_triton_fwd") == 1
    assert graphs["backward"][0].count("piattn.pi_triton_bwd") == 1


@pytest.mark.parametrize("kind", ["pi-adaptive", pytest.param("local", marks=SLOW)])
def test_documents_at_several_lengths(kind):
    """Packed documents compiled whole at a second length and back at the first (dynamo makes T symbolic
    at the second): each equals eager, logits and gradients. RoPE's table was sized by positions.max() (a
    data-dependent guard) and the pattern's clamp compared symbolic fields; both failed at the second T."""
    model = tiny_gpt(kind)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    for length in (T, T - 11, T):
        idx = torch.randint(0, 32, (2, length + 1), generator=torch.Generator().manual_seed(length))
        ids = torch.stack([torch.arange(length) // 13, torch.arange(length) // 7 % 2])
        expected, got = (loss_and_grads(model, lambda x, f=f, ids=ids: f(x, document_ids=ids), idx)
                         for f in (model, compiled))
        torch.testing.assert_close(got[0], expected[0], rtol=1e-10, atol=1e-10)
        assert got[1].keys() == expected[1].keys()
        for name in expected[1]:
            torch.testing.assert_close(got[1][name], expected[1][name], rtol=1e-10, atol=1e-10, msg=name)


def test_no_recompile_after_the_first_call():
    """A fresh model compiled before any eager call: the rotary table is computed in the graph, not stored
    (storing it changed the guarded dict and recompiled the whole model on the second call)."""
    model = tiny_gpt("local")
    assert any(hasattr(m, "_tables") for m in model.modules())
    graphs = {}
    forward = torch.compile(model, backend=recording_backend(graphs), fullgraph=True)
    idx = torch.randint(0, 32, (2, T + 1), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        loss_and_grads(model, forward, idx)
    assert len(graphs["forward"]) == len(graphs["backward"]) == 1


def test_compiling_a_model_warns_of_no_ignored_cache(fresh_dynamo):
    """Dynamo warns when it traces through a functools.lru_cache (it ignores the cache, which can be silently
    wrong): a compiled π model's forward calls none (the gate's clip built its constants through one)."""
    import warnings

    model = tiny_gpt("pi-adaptive")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(model, backend="aot_eager", fullgraph=True)(torch.randint(0, 32, (1, 16)))
    assert not [str(w.message) for w in caught if "lru_cache" in str(w.message)]


def test_the_constant_marker_is_the_public_decorators():
    """`constant_under_compile` sets on a function what `torch.compiler.assume_constant_result` sets (without
    importing Dynamo): if a torch release changes how the decorator marks, this fails before the compiled
    calls of the backends' probes do."""
    def public():
        return 1

    def ours():
        return 1

    torch.compiler.assume_constant_result(public)
    constant_under_compile(ours)
    assert vars(public) == vars(ours) and vars(ours)
