"""`pi_attention`: the public operator, its argument checks and the choice of backend.

Every backend is a function with the signature of `reference.pi_attention_reference`; they differ in
how they compute, never in what.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from collections.abc import Callable

# Aliased: importing the submodule `.torch` rebinds the package attribute `torch` to that submodule.
import torch as _torch

from .pattern import Pattern
from .validate import check_arguments

# name -> (module, function). Modules load on first use, so that `import piattn` stays cheap.
_BACKEND_SOURCES = {
    "reference": ("reference", "pi_attention_reference"),
    "torch": ("torch", "pi_attention_torch"),
    "triton": ("triton", "pi_attention_triton"),
    "flex": ("flex", "pi_attention_flex"),
}


def _runnable(name: str) -> bool:
    """Whether this install can run backend `name` (its dependencies exist; nothing is imported)."""
    if name == "triton":
        has_device = _torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
        return has_device and importlib.util.find_spec("triton") is not None
    if name == "flex":
        return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None
    return True


BACKENDS: tuple[str, ...] = ("auto", *(name for name in _BACKEND_SOURCES if _runnable(name)))


@functools.cache
def _implementation(name: str) -> Callable:
    module, fn = _BACKEND_SOURCES[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), fn)


def choose_backend(device: _torch.device, dtype: _torch.dtype) -> str:
    """The backend "auto" resolves to: the fused Triton kernel on CUDA when present, else "torch"."""
    if device.type == "cuda" and "triton" in BACKENDS and dtype != _torch.float64:
        return "triton"
    return "torch"


def pi_attention(
    q: _torch.Tensor,
    k: _torch.Tensor,
    v: _torch.Tensor,
    gate: _torch.Tensor | None = None,
    *,
    window: int = 4,
    period: int = 16,
    causal: bool = True,
    variant: str = "adaptive",
    prior: float = 0.5,
    logit_clamp: float | None = 20.0,
    eps: float = 1e-4,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
) -> _torch.Tensor:
    """π-Attention: each query attends to a local window plus the keys ±period away, under one softmax.

    Args:
        q, k, v: [B, H, T, D] queries, keys, values (fp64, fp32, bf16 or fp16; low precision accumulates
            in fp32).
        gate: [B, H, T] the local prior α in (0, 1), for variants "adaptive" and "separate"; else None.
        window: local radius k >= 0. Causal queries see i-k … i, bidirectional ones i-k … i+k.
        period: skip distance π >= 1; the key i-π (and i+π when bidirectional). period <= window adds
            nothing beyond the window.
        causal: whether queries see only the past.
        variant: "union" (Eq. beta), "separate" (Variant 1), "fixed" (Variant 2, constant α = prior)
            or "adaptive" (Variant 3, α = gate).
        prior: the constant α of variant "fixed".
        logit_clamp: scores q·k·scale are clamped to [-logit_clamp, logit_clamp]; None disables.
        eps: floor of the priors: log max(α, eps) and log max(1 - α, eps).
        scale: score scale; None means 1/sqrt(D).
        dropout_p: dropout on the attention weights (like SDPA, applied whenever > 0: pass 0 in eval).
        backend: one of `piattn.BACKENDS`; "auto" picks the fastest for the device and dtype.

    Returns:
        [B, H, T, D] in the dtype of q.
    """
    check_arguments(
        q, k, v, gate, window=window, period=period, causal=causal, variant=variant, prior=prior,
        logit_clamp=logit_clamp, eps=eps, scale=scale, dropout_p=dropout_p,
    )
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} on this install, got {backend!r}")
    if backend == "auto":
        backend = choose_backend(q.device, q.dtype)
    B, H, T, D = q.shape
    keep = None
    if dropout_p > 0:
        # One mask layout for every backend, so that equal seeds give equal results across backends.
        n_slots = Pattern(window, period, causal).n_slots
        keep = _torch.rand(B, H, T, n_slots, device=q.device) >= dropout_p
    return _implementation(backend)(
        q, k, v, gate, window=window, period=period, causal=causal, variant=variant, prior=prior,
        logit_clamp=logit_clamp, eps=eps, scale=D**-0.5 if scale is None else scale,
        dropout_keep=keep, dropout_p=dropout_p,
    )
