"""What each backend can run, declared once, and the choice of backend for a call.

Each backend is a `Backend`: where its function lives, and the variants, dtypes, devices, head dims,
gradients, dropout and optional features it supports. `Backend.refusal` turns that declaration into a
verdict on one concrete call, and `select` uses it both for `backend="auto"` (the first backend of
`AUTO_ORDER` that can run the call) and to explain why an explicitly named backend cannot. The backend
functions themselves check nothing.

The contract every backend function keeps, written once: `BackendRun`, a call's tensors and its one
`OpSettings` (built by `piattn.pi_attention`). `by_keywords` gives any of them the settings as keywords, the
form tests, benchmarks and docs call a backend in directly.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from .settings import OpSettings
from .validate import SUPPORTED_DTYPES

# Triton runs on the CPU only in its interpreter, which must be switched on before triton is imported.
TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def refuse_double_backward(backend: str) -> None:
    """Called first in a hand-written backward: raise a clear error when autograd is asked for a graph of
    the gradient (create_graph=True, for double backward), which that backward cannot give."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"double backward (create_graph=True) is not supported by backend {backend!r}; "
            f"backend='reference' (plain autograd) supports it"
        )


class BackendRun(Protocol):
    """A backend function: q [B, H, T, D], k, v [B, H_kv, T, D] (H_kv divides H), gate [B, H, T] or None,
    settings (settings.period a tuple only for a backend with `per_head_periods`), dropout_keep bool
    [B, H, T, |U|] in the contract's slot order or None (none: no dropout), document_ids [B, T] or None
    -> [B, H, T, D] in q's dtype. With per-head periods dropout_keep is [B, H, T, S], head h's mask, in the
    layout of its own pattern, in its first slots."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None,
                 settings: OpSettings, dropout_keep: torch.Tensor | None = None,
                 document_ids: torch.Tensor | None = None) -> torch.Tensor: ...


def by_keywords(run: BackendRun) -> Callable[..., torch.Tensor]:
    """`run` called with its settings as keywords: f(q, k, v, gate, *, window, period, causal, variant, prior,
    logit_clamp, eps, scale, dropout_keep=None, dropout_p=0.0, sinks=0, document_ids=None, **options), options
    passed on (flex's block_size). period: an int, or one per query head (any sequence of ints); without a
    keep mask there is no dropout, as in the reference (dropout_p is then 0)."""

    def call(q, k, v, gate, *, window, period, causal, variant, prior, logit_clamp, eps, scale, dropout_keep=None,
             dropout_p=0.0, sinks=0, document_ids=None, **options):
        settings = OpSettings(window=window, period=period if isinstance(period, int) else tuple(map(int, period)),
                              causal=causal, variant=variant, prior=prior, logit_clamp=logit_clamp, eps=eps,
                              scale=scale, dropout_p=0.0 if dropout_keep is None else dropout_p, sinks=sinks)
        return run(q, k, v, gate, settings, dropout_keep, document_ids, **options)

    call.__name__ = call.__qualname__ = f"{run.__name__}_by_keywords"
    call.__doc__ = f"`{run.__name__}` with its settings as keywords (`backends.by_keywords`)."
    return call


def constant_under_compile(fn: Callable) -> Callable:
    """`torch.compiler.assume_constant_result`, without importing Dynamo: that decorator imports
    `torch._dynamo` (1.3 s, half of `import piattn`, in every process that never compiles) to set one
    attribute on `fn`, which Dynamo reads when it meets a call of fn while tracing. Set here directly;
    tests/ops/test_compile.py checks that the public decorator sets the same, and that a compiled call
    keeps the answer as a constant."""
    fn._dynamo_marked_constant = True
    return fn


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@constant_under_compile
def _installed(module: str) -> bool:
    """Whether `module` can be imported. Under torch.compile dynamo calls it rather than tracing it (torch
    2.11's dynamo refuses to trace importlib's find_spec) and keeps the answer as a constant of the graph."""
    return _find_module(module)


@functools.cache
def _find_module(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _device_present(device: str) -> bool:
    if device == "cpu":
        return True
    accelerator = getattr(torch, device, None)
    return bool(getattr(accelerator, "is_available", lambda: False)())


@dataclass(frozen=True)
class Backend:
    """One backend and what it supports.

    variants: the variants (`piattn.config.pi.VARIANTS`) it computes; a call of another is refused.
    devices: device types it runs on (None: any). forward_only_on: device types where it has no backward.
    max_head_dim: the largest D (None: no limit). requires: modules that must be installed.
    """

    name: str
    module: str  # submodule of piattn.ops.pi
    function: str  # a `BackendRun`
    variants: frozenset[str] = frozenset()
    dtypes: tuple[torch.dtype, ...] = SUPPORTED_DTYPES
    devices: tuple[str, ...] | None = None
    max_head_dim: int | None = None
    forward_only_on: tuple[str, ...] = ()
    dropout: bool = True
    requires: tuple[str, ...] = ()
    # Optional parts of the contract it implements: "sinks", "documents" (document_ids), "gqa" (H_kv < H).
    features: frozenset[str] = frozenset()
    # Whether a NaN or ±inf input reaches only the outputs and gradients that read it. `pi_attention` sends a
    # call with a non-finite q, k, v or gate from a backend that does not to "torch", which does.
    contains_nonfinite: bool = False
    # Whether its function takes `period` as a tuple of one period per query head. `pi_attention` sends a call
    # with per-head periods straight to such a backend; to any other, once per distinct period (`heads.py`).
    per_head_periods: bool = False
    note: str = ""  # appended to a device refusal: how to get a supported device
    # A function of its module, asked last (only for a call it could otherwise run) and cached there: None when
    # this install can run the backend, else why not and what to do, e.g. "fused"'s C library that cannot be
    # built here. Its refusal, like any other: "auto" takes the next backend, a call naming it raises.
    probe: str | None = None
    # What runs it inside torch.compile and on tensors without values (meta, fake): "module.function" of
    # piattn.ops.pi, a `BackendRun` calling its custom operators ("reference": its plain torch code, traced as
    # is); None where it cannot run there ("flex": its block mask has data-dependent shapes).
    operator: str | None = None

    def available(self) -> bool:
        """Whether this install can run it at all: its modules exist and one of its devices is present."""
        if not all(_installed(m) for m in self.requires):
            return False
        return self.devices is None or any(_device_present(d) for d in self.devices)

    def refusal(
        self, *, device: torch.device | str, dtype: torch.dtype, head_dim: int, needs_grad: bool, dropout_p: float,
        features: frozenset[str] = frozenset(), variant: str | None = None,
    ) -> str | None:
        """None if this backend can run a call with these properties, else a short reason why not (variant
        None: a question about the other properties only)."""
        device = torch.device(device).type
        missing = [m for m in self.requires if not _installed(m)]
        if missing:
            return f"needs {', '.join(missing)}, which is not installed"
        if self.devices is not None and device not in self.devices:
            return f"runs on {'/'.join(self.devices)}, not {device}{self.note}"
        if dtype not in self.dtypes:
            return f"no {_dtype_name(dtype)} (runs {', '.join(map(_dtype_name, self.dtypes))})"
        if self.max_head_dim is not None and head_dim > self.max_head_dim:
            return f"head dim {head_dim} > {self.max_head_dim}"
        if needs_grad and device in self.forward_only_on:
            return f"forward-only on {device} (no backward there): run it under torch.no_grad()"
        if dropout_p > 0 and not self.dropout:
            return f"no dropout (dropout_p={dropout_p})"
        if variant is not None and variant not in self.variants:
            return f"does not implement variant {variant!r} (runs {', '.join(sorted(self.variants)) or 'none'})"
        missing = sorted(features - self.features)
        if missing:
            return f"does not implement {', '.join(missing)} yet"
        if self.probe is not None:
            return _probe(self.module, self.probe)
        return None

    def load(self) -> Callable:
        """The backend function (its module is imported on first use, so that `import piattn` stays cheap)."""
        return _load(self.module, self.function)

    def load_operator(self) -> BackendRun:
        """The function of `operator` (imported now)."""
        module, _, function = self.operator.rpartition(".")
        return _load(module, function)


@functools.cache
def _load(module: str, function: str) -> Callable:
    return getattr(importlib.import_module(f"{__package__}.{module}"), function)


@constant_under_compile
def _probe(module: str, function: str) -> str | None:
    """A backend's probe (`Backend.probe`). Under torch.compile dynamo does not trace it (the import, a
    compiler run, ctypes): it calls it while tracing and keeps the answer as a constant of the graph."""
    return _load(module, function)()


_LOW_AND_FP32 = (torch.float32, torch.bfloat16, torch.float16)
ALL_FEATURES = frozenset({"sinks", "documents", "gqa"})
# The paper's four (Eq. beta, Variants 1-3), written out rather than read from `piattn.config.pi.VARIANTS`: a
# variant added there runs on no backend until one declares it.
PAPER_VARIANTS = frozenset({"union", "separate", "fixed", "adaptive"})

REGISTRY: dict[str, Backend] = {
    b.name: b
    for b in (
        # The ground truth: a loop over offsets, O(T·|U|·D) memory.
        Backend("reference", "reference", "run_reference", variants=PAPER_VARIANTS, features=ALL_FEATURES,
                contains_nonfinite=True, operator="reference.run_reference"),
        # Blocked matrix products with a hand-written backward; any device torch runs on. With a non-finite
        # input it goes slot by slot (`all_finite`), so that a bad value stays in the rows that read it.
        Backend("torch", "torch", "run_torch", variants=PAPER_VARIANTS, features=ALL_FEATURES,
                contains_nonfinite=True, operator="compiled.run_torch_op"),
        # Fused kernels; tl.dot has no fp64, and D is padded to a power of two of at most 256. Per-head periods
        # in one launch of each kernel (each program reads its query head's period).
        Backend(
            "triton", "triton", "run_triton", variants=PAPER_VARIANTS, dtypes=_LOW_AND_FP32,
            devices=("cuda", "cpu") if TRITON_INTERPRET else ("cuda",), max_head_dim=256, requires=("triton",),
            note="" if TRITON_INTERPRET else " (set TRITON_INTERPRET=1 before importing triton for its CPU "
                                             "interpreter)", features=ALL_FEATURES,
            contains_nonfinite=True,  # forward and backward kernels alike (`triton_kernels._contained_dot`)
            per_head_periods=True, operator="triton.run_triton_op",
        ),
        # Fused C kernels for the CPU (fused_cpu.c, compiled on first use): fp32 and fp64, and bf16 and fp16 read
        # and written as such, computed in fp32; per-head periods in one call. Where the library cannot be built
        # or loaded (no C compiler, PIATTN_NATIVE=0) its probe refuses every call with the reason.
        Backend("fused", "fused", "run_fused", variants=PAPER_VARIANTS,
                dtypes=(torch.float32, torch.float64, torch.bfloat16, torch.float16), devices=("cpu",),
                features=ALL_FEATURES, contains_nonfinite=True, per_head_periods=True, probe="unavailable",
                operator="fused.run_fused_op"),
        # torch's FlexAttention: no fp64 kernels, no CPU backward, no per-slot dropout mask.
        Backend(
            "flex", "flex", "run_flex", variants=PAPER_VARIANTS, dtypes=_LOW_AND_FP32,
            devices=("cpu", "cuda"), forward_only_on=("cpu",), dropout=False,
            requires=("torch.nn.attention.flex_attention",), features=ALL_FEATURES,
        ),
    )
}

# What "auto" tries, in order, per device type; devices not listed try AUTO_DEFAULT. On a CPU "fused" (3-4x
# "torch", benchmarks/results/cpu_bench/cpu_bench.md) for every dtype where its C kernels build, else "torch".
# The reference comes last: slow, but it implements every feature, so a call the fast backends cannot run
# yet still runs.
AUTO_ORDER: dict[str, tuple[str, ...]] = {"cuda": ("triton", "torch", "reference"),
                                          "cpu": ("fused", "torch", "reference")}
AUTO_DEFAULT: tuple[str, ...] = ("torch", "reference")


def _describe(device: str, dtype: torch.dtype, head_dim: int, needs_grad: bool, dropout_p: float,
              features: frozenset[str], variant: str | None) -> str:
    grad = "with gradients" if needs_grad else "forward only"
    used = f", with {', '.join(sorted(features))}" if features else ""
    named = "" if variant is None else f", variant {variant!r}"
    return f"{device}, {_dtype_name(dtype)}, head dim {head_dim}, {grad}, dropout_p={dropout_p}{used}{named}"


def select(
    requested: str,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    head_dim: int,
    needs_grad: bool,
    dropout_p: float,
    features: frozenset[str] = frozenset(),
    variant: str | None = None,
    registry: Mapping[str, Backend] = REGISTRY,
    auto_order: Mapping[str, tuple[str, ...]] = AUTO_ORDER,
) -> Backend:
    """The backend to run a call: `requested` itself, or for "auto" the first of `auto_order` that can.

    Raises one ValueError that says why, backend by backend, when that backend (or, for "auto", every
    backend) cannot run the call, and which others could.
    """
    device = torch.device(device).type
    call = dict(device=device, dtype=dtype, head_dim=head_dim, needs_grad=needs_grad, dropout_p=dropout_p,
                features=features, variant=variant)
    # A backend's refusal is asked only when needed (a probe may build a library): the backends before the
    # one chosen, and all of them for an error message.
    if requested == "auto":
        order = auto_order.get(device, AUTO_DEFAULT)
        for name in order:
            if name in registry and registry[name].refusal(**call) is None:
                return registry[name]
    elif requested not in registry:
        names = ("auto", *(name for name, b in registry.items() if b.available()))
        raise ValueError(f"backend must be one of {names} on this install, got {requested!r}")
    elif registry[requested].refusal(**call) is None:
        return registry[requested]
    reasons = {name: b.refusal(**call) for name, b in registry.items()}
    able = [name for name, reason in reasons.items() if reason is None]
    if requested == "auto":
        refused = {**{name: "not declared" for name in order}, **reasons}
        listing = "; ".join(f"{name}: {reason}" for name, reason in refused.items() if reason is not None)
        unused = f". Not tried by 'auto', but can run it: {', '.join(map(repr, able))}" if able else ""
        raise ValueError(f"backend 'auto' found no backend for this call ({_describe(**call)}): {listing}{unused}")
    alternatives = ", ".join(repr(name) for name in able) if able else "none"
    raise ValueError(
        f"backend {requested!r} cannot run this call ({_describe(**call)}): {reasons[requested]}. "
        f"Backends that can: {alternatives}"
    )
