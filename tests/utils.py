"""Shared test helpers: inputs for pi_attention, forward+backward runs, per-dtype comparisons, tiny models."""

from __future__ import annotations

import importlib.util
import itertools
import random
import sys
from pathlib import Path

import pytest
import torch

import piattn
from piattn.models import GPT, GPTConfig
from piattn.ops.pi.backends import REGISTRY
from piattn.ops.pi.pattern import GATED_VARIANTS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Costly: on a CPU triton runs in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1) and flex
# uncompiled, forward only (see flex.py), neither the path a CPU user takes; on CUDA flex compiles a kernel per
# shape and pattern (seconds each). They run a core of each set of backend cases by default (`make test`),
# the rest with -m slow (`make test-slow`); on a GPU triton runs every case.
COSTLY = ("flex",) if DEVICE == "cuda" else ("triton", "flex")
# fp32 sums run in another order than the reference's (blocked dots vs. per-offset sums; 3xTF32 dots on a
# GPU), and dα divides Σ dlogit by α or 1 - α (down to 0.02 in make_inputs), which scales that error up:
# 1e-4 instead of TOLERANCES' 2e-5 for triton's fp32.
LOOSER = {("triton", torch.float32): dict(atol=1e-4, rtol=1e-4)}


def param_id(x) -> str:
    """A test id for a dtype, a causal flag or anything else."""
    if isinstance(x, torch.dtype):
        return str(x).removeprefix("torch.")
    if isinstance(x, bool):
        return "causal" if x else "bidir"
    return str(x)


def backend_matrix(backends, core=None, **axes):
    """Parametrize (backend, *axes) over `backends` and the product of the axes' values.

    core(backend, *values) -> bool: whether a costly backend runs that case by default; its other cases
    are marked slow. Without core, costly backends run every case.
    """
    params = []
    for backend in backends:
        for values in itertools.product(*axes.values()):
            slow = backend in COSTLY and core is not None and not core(backend, *values)
            params.append(pytest.param(backend, *values, id="-".join(map(param_id, (backend, *values))),
                                       marks=[pytest.mark.slow] if slow else []))
    return ",".join(("backend", *axes)), params


def most_exact_dtype(backend: str) -> torch.dtype:
    """The most precise dtype a backend runs: fp64 where declared, else fp32."""
    return torch.float64 if torch.float64 in REGISTRY[backend].dtypes else torch.float32


def require_backend(backend: str, dtype: torch.dtype, D: int, *, grad: bool, dropout_p: float = 0.0,
                    features=()) -> None:
    """Skip, with the backend's declared reason, a case it does not run on DEVICE."""
    reason = REGISTRY[backend].refusal(device=DEVICE, dtype=dtype, head_dim=D, needs_grad=grad,
                                       dropout_p=dropout_p, features=frozenset(features))
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")

# Absolute/relative tolerances of a backend against "reference" (which itself accumulates in fp32 for
# low precision). Low precision inputs are rounded the same way for both, so the error comes from the
# order of fp32 sums and from rounding the result once.
TOLERANCES = {
    torch.float64: dict(atol=1e-10, rtol=1e-10),
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
}


def make_inputs(B, H, T, D, *, variant="adaptive", dtype=torch.float64, device="cpu", seed=0,
                requires_grad=True):
    """q, k, v [B, H, T, D] ~ N(0, 1) and a gate [B, H, T] in (0.02, 0.98) (None if the variant has none)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, T, D, generator=g, dtype=torch.float64).to(device, dtype) for _ in range(3))
    gate = None
    if variant in GATED_VARIANTS:
        gate = (0.02 + 0.96 * torch.rand(B, H, T, generator=g, dtype=torch.float64)).to(device, dtype)
    tensors = [t for t in (q, k, v, gate) if t is not None]
    for t in tensors:
        t.requires_grad_(requires_grad)
    return q, k, v, gate


def forward_backward(q, k, v, gate, dy_seed=1, **kwargs):
    """Run pi_attention and backprop a fixed random cotangent: (y, dq, dk, dv, dgate or None)."""
    y = piattn.pi_attention(q, k, v, gate, **kwargs)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(dy_seed), dtype=torch.float64)
    inputs = [t for t in (q, k, v, gate) if t is not None]
    grads = torch.autograd.grad(y, inputs, dy.to(y.device, y.dtype))
    grads = list(grads) + ([None] if gate is None else [])
    return (y, *grads)


def assert_close(name: str, expected: torch.Tensor, actual: torch.Tensor, dtype: torch.dtype | None = None,
                 tol: dict | None = None):
    """torch.testing.assert_close with the tolerance of `dtype` (or `tol`, atol and rtol); names the tensor
    in the failure message."""
    tol = tol or TOLERANCES[dtype or expected.dtype]
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{name}: non-finite values"
    torch.testing.assert_close(actual.double(), expected.double(), **tol, msg=lambda m: f"{name}: {m}")


# What forward_backward returns, in order.
OUTPUT_NAMES = ("y", "dq", "dk", "dv", "dgate")


# The reference-error rule (`compare_to_exact`): a backend's largest error against the exact result may be
# REFERENCE_ERROR_FACTOR times the reference's own, plus FLOOR_ULPS units in the last place of the tensor's
# largest element or of 1 (the test inputs are of unit size, and a gradient that is exactly 0 is a sum of
# terms that are not): a reference that happens to be exact leaves no room for another summation order, and
# a sum of n unit-size terms in another order can differ by about n/2 ulps (n = 32: the tests' head dims).
REFERENCE_ERROR_FACTOR = 8
FLOOR_ULPS = 16


def exact_run(inputs, *, seed: int = 0, grad: bool, **kwargs) -> tuple:
    """The reference backend on `inputs` (q, k, v, gate) converted to fp64 after their rounding to their own
    dtype: what every backend approximates, as `forward_backward` (grad) or the output alone. Same torch
    seed as the runs it judges, hence the same dropout mask."""
    exact_inputs = [None if t is None else t.detach().double().requires_grad_(grad) for t in inputs]
    torch.manual_seed(seed)
    if grad:
        return forward_backward(*exact_inputs, **{**kwargs, "backend": "reference"})
    with torch.no_grad():
        return (piattn.pi_attention(*exact_inputs, **{**kwargs, "backend": "reference"}),)


def compare_to_exact(reference: tuple, actual: tuple, exact: tuple) -> None:
    """Each tensor of `actual` (a backend's run) within the reference-error rule of the exact result: largest
    |actual - exact| <= REFERENCE_ERROR_FACTOR · largest |reference - exact| + FLOOR_ULPS ulps of
    max(largest |exact|, 1), in the dtype of `reference`.

    The bound follows the dtype and the values rather than a fixed atol: it is what the reference itself
    misses by in that dtype on these inputs, so a machine whose vector units sum in another order (AVX-512
    rather than AVX2, tensor cores rather than FMA loops) moves both errors together. fp32, bf16, fp16.
    """
    assert len(reference) == len(actual) == len(exact)
    for name, r, a, e in zip(OUTPUT_NAMES, reference, actual, exact, strict=False):
        assert (r is None) == (a is None), f"{name}: expected {'no ' if r is None else ''}gradient"
        if r is None:
            continue
        assert a.dtype == r.dtype, f"{name}: dtype {a.dtype} != {r.dtype}"
        assert a.shape == r.shape, f"{name}: shape {tuple(a.shape)} != {tuple(r.shape)}"
        assert torch.isfinite(a).all(), f"{name}: non-finite values"
        e = e.detach().double().to(a.device)
        reference_error = (r.double() - e).abs().max().item()
        error = (a.double() - e).abs()
        scale = max(e.abs().max().item(), 1.0)
        floor = FLOOR_ULPS * torch.finfo(r.dtype).eps * scale
        bound = REFERENCE_ERROR_FACTOR * reference_error + floor
        worst = error.max().item()
        assert worst <= bound, (
            f"{name}: largest error {worst:.3g} at {tuple(divmod_index(error.argmax().item(), error.shape))} > "
            f"{bound:.3g} = {REFERENCE_ERROR_FACTOR} x the reference's own {reference_error:.3g} + "
            f"{FLOOR_ULPS} ulps of {scale:.3g} ({r.dtype})")


def against_reference(backend: str, inputs, *, grad: bool, seed: int = 0, **kwargs) -> list[tuple]:
    """Run "reference" and `backend` on `inputs` (q, k, v, gate; same torch seed, so the same dropout mask) and
    compare the output, and with grad every gradient: fp64 within TOLERANCES, other dtypes by the
    reference-error rule (`compare_to_exact`). Returns [reference's run, backend's run]."""
    results = []
    for b in ("reference", backend):
        torch.manual_seed(seed)
        if grad:
            results.append(forward_backward(*inputs, backend=b, **kwargs))
        else:
            with torch.no_grad():  # inputs may require grad: flex on CPU takes them under no_grad
                results.append((piattn.pi_attention(*inputs, backend=b, **kwargs),))
    if inputs[0].dtype == torch.float64:
        compare(*results, torch.float64)
    else:
        compare_to_exact(*results, exact_run(inputs, seed=seed, grad=grad, **kwargs))
    return results


def divmod_index(flat: int, shape) -> list[int]:
    """The multi-index of a flat index into `shape`."""
    index = []
    for size in reversed(shape):
        flat, i = divmod(flat, size)
        index.append(i)
    return index[::-1]


def compare(expected: tuple, actual: tuple, dtype: torch.dtype | None = None, tol: dict | None = None) -> None:
    """Compare the tuples of two forward_backward runs (or their first elements) with `assert_close`:
    equal dtypes, finite values, TOLERANCES[dtype] or `tol`; a missing gradient (None) must be missing in
    both."""
    assert len(expected) == len(actual), f"{len(expected)} outputs expected, got {len(actual)}"
    for name, e, a in zip(OUTPUT_NAMES, expected, actual, strict=False):
        assert (e is None) == (a is None), f"{name}: expected {'no ' if e is None else ''}gradient"
        if e is None:
            continue
        assert a.dtype == e.dtype, f"{name}: dtype {a.dtype} != {e.dtype}"
        assert_close(name, e, a, dtype, tol)


def tiny_model(attention: str = "pi", variant: str = "adaptive", **overrides) -> GPT:
    """A GPT of kind `attention` in eval mode, seeded: 2 layers, width 32, 2 heads, window 3, period 8, a vocabulary
    of 50, no dropout, each of these unless `overrides` gives it (with any other GPTConfig field)."""
    torch.manual_seed(0)
    settings = {**dict(vocab_size=50, n_layer=2, d_model=32, n_head=2, window=3, period=8, dropout=0.0), **overrides}
    cfg = GPTConfig.from_name("tiny", attention=attention, variant=variant, **settings)
    model = GPT(cfg).eval()
    # gates away from 0.5 and varying per token, so that the gated variants differ from "union"
    for block in model.blocks:
        if getattr(block.attn, "gate", None) is not None:
            torch.nn.init.normal_(block.attn.gate[2].bias, std=2.0)
            torch.nn.init.normal_(block.attn.gate[2].weight, std=1.0)  # α follows the token
    return model


def write_word_corpus(root: Path, words_per_doc: dict[str, list[int]]) -> Path:
    """A PG-19-style folder of random words (some non-ASCII), `words_per_doc[split]` words in each file.

    Splits are written in the order given, from one seeded generator, so a layout gives the same text
    every time.
    """
    rng = random.Random(0)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "π", "and", "ω"]
    for split, sizes in words_per_doc.items():
        (root / split).mkdir(parents=True)
        for i, n in enumerate(sizes):
            (root / split / f"doc{i}.txt").write_text(" ".join(rng.choice(words) for _ in range(n)), encoding="utf-8")
    return root


def poisoned_input(t: torch.Tensor, p: int, value: str) -> torch.Tensor:
    """t with position p of batch 0, head 0 set to NaN, or to ±inf alternating along D (so that a dot with
    it is NaN, not a clampable ±inf)."""
    t = t.detach().clone()
    if t.dim() == 3:  # gate
        t[0, 0, p] = float(value)
    else:
        row = torch.full((t.shape[-1],), float("inf"), dtype=t.dtype)
        row[1::2] = -float("inf")
        t[0, 0, p] = float("nan") if value == "nan" else row
    return t.requires_grad_()


def load_script(path: Path, name: str):
    """The module of a script (benchmarks/, experiments/) that is not a package, loaded from its file as `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import does: a dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def load_experiment(script: str, name: str):
    """experiments/`script` loaded as `name` (`load_script`), with experiments/ on the path meanwhile: the scripts
    import their sibling runs.py."""
    folder = Path(__file__).resolve().parents[1] / "experiments"
    sys.path.insert(0, str(folder))
    try:
        return load_script(folder / script, name)
    finally:
        sys.path.remove(str(folder))


def decode_rows(q, k, v, gate, settings, *, gate_head=None, backend: str = "auto"):
    """The decoding rows of q [B, H, t, D] over the block k, v (the queries' keys last) through the plan of
    `settings` (`DecodePlan.rows`): the compiled step where it takes the call, else torch ops; with
    backend="fused" the compiled step alone (None where it declines)."""
    from piattn.ops.pi.decode_plan import decode_plan

    plan = decode_plan(settings, q.shape[1], device=q.device, backend=backend)
    return None if plan is None else plan.rows(q, (k, v), gate, gate_head)


def compiled_rows(q, k, v, gate, settings, *, gate_head=None):
    """`decode_rows` through the compiled step alone: its rows, or None where it does not take the call."""
    return decode_rows(q, k, v, gate, settings, gate_head=gate_head, backend="fused")



def train_summary(run: Path, capsys=None) -> dict:
    """The end-of-run summary `piattn train` wrote to RUN/summary.json (stdout holds the one for a person,
    which `capsys`, when given, is read past)."""
    import json

    if capsys is not None:
        capsys.readouterr()
    return json.loads((Path(run) / "summary.json").read_text(encoding="utf-8"))
