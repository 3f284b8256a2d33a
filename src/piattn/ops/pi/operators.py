"""A backend as a pair of PyTorch custom operators, the glue written once: `register_pair`.

torch.compile cannot trace a backend whose forward reads its inputs' values, loops over chunks or calls C
through ctypes; registered as two operators it is one opaque node each way. Each backend that does so
("torch" in `compiled.py`, "fused" and "triton" at the ends of their modules) gives its forward, the
forward's fake (output shapes for the compiler, meta and fake tensors) and its backward; this module writes
the schemas, the backward's fake, what autograd keeps (`setup_context`) and the backward registration,
identical for all of them:

    piattn::<prefix>_fwd (q, k, v, gate, <keep>, document_ids, [periods,] settings…) -> (y, <saved>)
    piattn::<prefix>_bwd (dy, q, k, v, gate, <keep>, document_ids, <saved>, want_gate, [periods,] settings…)
                         -> [dq, dk, dv] or [dq, dk, dv, dgate]

<saved> is what the forward keeps for the backward besides its inputs; it leaves the forward as an output so
that AOTAutograd keeps it for the backward graph. periods (`int[]`, for a backend taking per-head periods):
one per query head, or empty for `settings.period` in every head (`OpSettings.to_op`). The settings are
`OpSettings`' fields, in its order (`settings.py`); the functions a backend gives read them back as one
`OpSettings`, the periods folded in (`OpSettings.from_op`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .backends import refuse_double_backward
from .settings import OpSettings

# The tensors every operator takes first, after dy for the backward: q, k, v, gate, the keep mask, document_ids.
_N_TENSORS = 6


def register_pair(prefix: str, backend: str, *, forward: Callable, forward_fake: Callable, backward: Callable,
                  saved: str, keep: str = "dropout_keep", periods: bool = True):
    """Define and tie together the operators `piattn::{prefix}_fwd` and `piattn::{prefix}_bwd`; returns them.

    forward(q, k, v, gate, keep, document_ids, settings) -> (y, saved), and forward_fake the same on tensors
    without values; backward(dy, q, k, v, gate, keep, document_ids, saved, want_gate, settings) -> [dq, dk,
    dv] or with dgate when want_gate. settings: one `OpSettings`. saved: its schema, "Tensor <name>" or
    "Tensor[] <name>"; keep: the keep mask's argument name; periods: whether the operators take `int[]
    periods` (else settings.period is the one period of every head). backend names the backend in the
    refusal of double backward.
    """
    tail = f"{'int[] periods, ' if periods else ''}{OpSettings.schema()}"
    inputs = f"Tensor q, Tensor k, Tensor v, Tensor? gate, Tensor? {keep}, Tensor? document_ids"
    saved_type = saved.split()[0]
    many = saved_type == "Tensor[]"

    def settings_of(rest) -> OpSettings:
        return OpSettings.from_op(rest[0], rest[1:]) if periods else OpSettings(*rest)

    def fwd(*args):
        return forward(*args[:_N_TENSORS], settings_of(args[_N_TENSORS:]))

    def fwd_fake(*args):
        return forward_fake(*args[:_N_TENSORS], settings_of(args[_N_TENSORS:]))

    fwd_op = torch.library.custom_op(f"piattn::{prefix}_fwd", fwd, mutates_args=(),
                                     schema=f"({inputs}, {tail}) -> (Tensor, {saved_type})")
    fwd_op.register_fake(fwd_fake)

    def bwd(dy, *args):
        rest = args[_N_TENSORS + 2:]
        return backward(dy, *args[:_N_TENSORS + 2], settings_of(rest))

    def bwd_fake(dy, q, k, v, gate, keep, document_ids, saved, want_gate, *rest):
        grads = [q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)]
        return grads + [gate.new_empty(gate.shape)] if want_gate else grads

    bwd_op = torch.library.custom_op(f"piattn::{prefix}_bwd", bwd, mutates_args=(),
                                     schema=f"(Tensor dy, {inputs}, {saved}, bool want_gate, {tail}) -> Tensor[]")
    bwd_op.register_fake(bwd_fake)

    def setup_context(ctx, inputs, output) -> None:
        kept = list(output[1]) if many else [output[1]]
        ctx.rest = inputs[_N_TENSORS:]  # periods and the settings, as the operators take them
        ctx.save_for_backward(*inputs[:_N_TENSORS], *kept)
        ctx.mark_non_differentiable(*kept)

    def backward_of(ctx, dy, _saved_grad):
        refuse_double_backward(backend)
        q, k, v, gate, keep, docs, *kept = ctx.saved_tensors
        want_gate = gate is not None and ctx.needs_input_grad[3]
        grads = bwd_op(dy, q, k, v, gate, keep, docs, kept if many else kept[0], want_gate, *ctx.rest)
        # One gradient per input of the forward: q, k, v, gate; none for the keep mask, document_ids, periods
        # and the settings.
        return (*grads[:3], grads[3] if want_gate else None) + (None,) * (_N_TENSORS - 4 + len(ctx.rest))

    fwd_op.register_autograd(backward_of, setup_context=setup_context)
    return fwd_op, bwd_op
