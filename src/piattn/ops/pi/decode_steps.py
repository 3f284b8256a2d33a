"""The decoding steps, declared once: what each runs, and why it refuses what it does not.

A step computes the rows of a `DecodePlan` (`decode_plan.py`): the new queries' outputs from the key and value
rows their slots read. Each is a `DecodeStep`: the module that holds its function `run(plan, ...)`, and what it
supports: the variants, whether it finishes the gate itself (from the gate MLP's hidden layer or its input),
whether it reads every head over its own slot table in one call (per-head periods), whether it is a decoding
layer's whole one-token step (RoPE, the new key and value stored, then the attention), the dtypes, devices and
batch sizes. `DecodeStep.refusal` turns that into a reason for one concrete call (None: it runs), as
`backends.Backend.refusal` does for the operator's backends.

What a plan settles once (the variant, the features) it asks when it is built; what only a call says (dtype,
device, a gradient asked for, whether the compiled library loaded) the step's own `run` decides, returning None
where it does not run, in the one place of each step that decides it (`decode_native.refusal`). A plan tries its
steps in `ORDER` and runs the first that takes the call.

A new step (a CUDA one, say) is its module, with `run` and `unavailable`, and one line of `REGISTRY`, placed
where "auto" should try it (`ORDER` is the registry's order).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

import torch

from . import native
from .decode_torch import TORCH_OPS_VARIANTS


@dataclass(frozen=True)
class DecodeStep:
    """A decoding step: its module (`run`, `unavailable`) and what it supports (None: any)."""

    name: str
    module: str
    variants: frozenset[str]
    gate_in_step: bool = False
    per_head_periods: bool = False
    token: bool = False
    dtypes: frozenset[torch.dtype] | None = None
    devices: frozenset[str] | None = None
    max_batch: int | None = None
    gradients: bool = True

    def load(self) -> ModuleType:
        """Its module: a module of piattn.ops.pi by name, or any module by its dotted path."""
        return importlib.import_module(self.module if "." in self.module else f"{__package__}.{self.module}")

    def refusal(self, variant: str, *, per_head: bool = False, dtype: torch.dtype | None = None,
                device: str | None = None, batch: int | None = None, needs_grad: bool = False) -> str | None:
        """Why this step cannot run a call of `variant` (and, where given, heads of different periods, dtype,
        device type, batch size, a gradient asked for); None when it can, as declared (the compiled library may
        still be missing: `unavailable`)."""
        if variant not in self.variants:
            return f"the {self.name} step runs variants {', '.join(sorted(self.variants))}, not {variant!r}"
        if per_head and not self.per_head_periods:
            return f"the {self.name} step reads one slot table for every head, not one period per head"
        if dtype is not None and self.dtypes is not None and dtype not in self.dtypes:
            return f"the {self.name} step runs {', '.join(sorted(map(str, self.dtypes)))}, not {dtype}"
        if device is not None and self.devices is not None and device not in self.devices:
            return f"the {self.name} step runs on {', '.join(sorted(self.devices))}, not {device}"
        if batch is not None and self.max_batch is not None and batch > self.max_batch:
            return f"the {self.name} step runs batches of at most {self.max_batch}, not {batch}"
        if needs_grad and not self.gradients:
            return f"the {self.name} step computes no gradient"
        return None

    def unavailable(self) -> str | None:
        """Why this step cannot run on this install (None when it can)."""
        return self.load().unavailable()


REGISTRY: dict[str, DecodeStep] = {
    # decode_step.c through ctypes: one call per layer and step. Not "separate" (two softmaxes; one in C).
    "compiled": DecodeStep("compiled", "decode_native", frozenset(native.PRIOR_MODES), gate_in_step=True,
                           per_head_periods=True, token=True, dtypes=frozenset(native.DTYPES),
                           devices=frozenset({"cpu"}), gradients=False),
    # A dozen torch ops on the gathered rows: every variant, device and dtype, with autograd; per-head periods in
    # one call (a pass per distinct period over every head, each head's rows kept from its own).
    "torch": DecodeStep("torch", "decode_torch", TORCH_OPS_VARIANTS, gate_in_step=True, per_head_periods=True),
}
# The order in which a plan tries its steps (the registry's): the first that takes a call runs it.
ORDER: tuple[str, ...] = tuple(REGISTRY)
# The steps that decode a model by its operator backend (`decode_plan.decode_plan`): "auto" every registered step,
# in order (None); "fused" (compiled code asked for by name) the compiled step alone, never torch ops in its place
# (where it does not run, such a model runs its operator, which runs or refuses with its reason). Any other
# backend named runs its operator on every step.
FOR_BACKEND: dict[str, tuple[str, ...] | None] = {"auto": None, "fused": ("compiled",)}


def steps_for(backend: str) -> tuple[DecodeStep, ...] | None:
    """The steps that decode a model of operator backend `backend`, in the order they are tried; None for a
    backend that has none (`FOR_BACKEND`)."""
    if backend not in FOR_BACKEND:
        return None
    names = FOR_BACKEND[backend]
    return tuple(REGISTRY.values()) if names is None else tuple(REGISTRY[name] for name in names)
