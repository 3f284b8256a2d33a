"""The "torch" backend as PyTorch custom operators, so that `torch.compile` captures it whole.

Traced as Python, the backend breaks a compiled graph: its forward chooses a code path from the values of
the inputs (`all_finite`, a host sync), and its chunk loop would unroll into thousands of graph nodes.
Registered as two operators it is one opaque node each way:

    piattn::pi_attention_fwd (q, k, v, gate, dropout_keep, document_ids, settings…) -> (y, saved)
    piattn::pi_attention_bwd (dy, q, k, v, gate, dropout_keep, document_ids, saved, want_gate, settings…)
                             -> [dq, dk, dv] or [dq, dk, dv, dgate]

They run the backend's plain functions `torch.torch_forward` and `torch.torch_backward`, as its eager
autograd Function does. `register_fake` gives their output shapes to the compiler (and makes meta and
fake tensors run), and `register_autograd` ties the backward to the forward. `saved` are the tensors
forward keeps for backward besides its inputs (`torch.saved_layout`): they leave the forward as outputs
so that AOTAutograd can keep them for the backward graph. The settings are `OpSettings`' fields, in its
order (`settings.py`).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from .backends import refuse_double_backward
from .settings import OpSettings
from .torch import saved_layout, slot_plan, torch_backward, torch_forward

_FWD_SCHEMA = (f"(Tensor q, Tensor k, Tensor v, Tensor? gate, Tensor? dropout_keep, Tensor? document_ids, "
               f"{OpSettings.schema()}) -> (Tensor, Tensor[])")
_BWD_SCHEMA = (f"(Tensor dy, Tensor q, Tensor k, Tensor v, Tensor? gate, Tensor? dropout_keep, Tensor? document_ids, "
               f"Tensor[] saved, bool want_gate, {OpSettings.schema()}) -> Tensor[]")


@torch.library.custom_op("piattn::pi_attention_fwd", mutates_args=(), schema=_FWD_SCHEMA)
def pi_attention_fwd(q, k, v, gate, dropout_keep, document_ids, *settings) -> tuple[Tensor, list[Tensor]]:
    """π-Attention forward of the "torch" backend: (y [B, H, T, D] in q's dtype, `saved_layout`'s tensors)."""
    settings = OpSettings(*settings)
    y, saved = torch_forward(q, k, v, gate, dropout_keep, slot_plan(q, k, document_ids, settings), settings)
    return y, list(saved.values())


@pi_attention_fwd.register_fake
def _(q, k, v, gate, dropout_keep, document_ids, *settings):
    saved = saved_layout(q, k, OpSettings(*settings))
    return q.new_empty(q.shape), [q.new_empty(shape, dtype=dtype) for shape, dtype in saved.values()]


@torch.library.custom_op("piattn::pi_attention_bwd", mutates_args=(), schema=_BWD_SCHEMA)
def pi_attention_bwd(dy, q, k, v, gate, dropout_keep, document_ids, saved, want_gate, *settings) -> list[Tensor]:
    """π-Attention backward of the "torch" backend: [dq, dk, dv], and dgate when `want_gate`."""
    settings = OpSettings(*settings)
    kept = dict(zip(saved_layout(q, k, settings), saved, strict=True))
    grads = torch_backward(dy, q, k, v, gate, dropout_keep, slot_plan(q, k, document_ids, settings), kept, settings,
                           want_dgate=want_gate)
    return list(grads) if want_gate else list(grads[:3])


@pi_attention_bwd.register_fake
def _(dy, q, k, v, gate, dropout_keep, document_ids, saved, want_gate, *settings):
    grads = [q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)]
    return grads + [gate.new_empty(gate.shape)] if want_gate else grads


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, gate, keep, docs, *settings = inputs
    ctx.settings = settings
    ctx.save_for_backward(q, k, v, gate, keep, docs, *output[1])
    ctx.mark_non_differentiable(*output[1])


def _backward(ctx, dy, _saved_grads):
    refuse_double_backward("torch")
    q, k, v, gate, keep, docs, *saved = ctx.saved_tensors
    want_gate = gate is not None and ctx.needs_input_grad[3]
    grads = pi_attention_bwd(dy, q, k, v, gate, keep, docs, saved, want_gate, *ctx.settings)
    # One gradient per input of pi_attention_fwd: q, k, v, gate, then dropout_keep, document_ids and the settings.
    return (*grads[:3], grads[3] if want_gate else None) + (None,) * (2 + len(ctx.settings))


pi_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def is_symbolic(x: Tensor) -> bool:
    """Whether x holds no values: traced by torch.compile, or a meta or fake tensor."""
    return torch.compiler.is_compiling() or x.device.type == "meta" or is_fake(x)


def pi_attention_torch_op(q, k, v, gate, *, window, period, causal, variant, prior, logit_clamp, eps, scale,
                          dropout_keep, dropout_p, sinks=0, document_ids=None):
    """Same contract as `pi_attention_reference`: the "torch" backend through `piattn::pi_attention_fwd`."""
    settings = OpSettings(window=window, period=period, causal=causal, variant=variant, prior=prior,
                          logit_clamp=logit_clamp, eps=eps, scale=scale, dropout_p=dropout_p, sinks=sinks)
    y, _ = pi_attention_fwd(q, k, v, gate, dropout_keep, document_ids, *settings)
    return y
