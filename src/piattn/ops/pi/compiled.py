"""The "torch" backend as PyTorch custom operators, so that `torch.compile` captures it whole.

Traced as Python, the backend breaks a compiled graph: its forward chooses a code path from the values of
the inputs (`all_finite`, a host sync), and its chunk loop would unroll into thousands of graph nodes.
Registered as two operators it is one opaque node each way:

    piattn::pi_attention_fwd (q, k, v, gate, dropout_keep, document_ids, settings…) -> (y, saved)
    piattn::pi_attention_bwd (dy, q, k, v, gate, dropout_keep, document_ids, saved, want_gate, settings…)
                             -> [dq, dk, dv] or [dq, dk, dv, dgate]

They run the backend's plain functions `torch.torch_forward` and `torch.torch_backward`, as its eager
autograd Function does. `register_fake` gives their output shapes to the compiler (and makes meta and
fake tensors run), and `register_autograd` ties the backward to the forward: that glue, the same for every
backend that registers operators, is `operators.register_pair`. `saved` are the tensors forward keeps for
backward besides its inputs (`torch.saved_layout`): they leave the forward as outputs so that AOTAutograd
can keep them for the backward graph. The settings are `OpSettings`' fields, in its order (`settings.py`).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from .operators import register_pair
from .settings import OpSettings
from .torch import saved_layout, slot_plan, torch_backward, torch_forward


def _forward(q, k, v, gate, dropout_keep, document_ids, settings: OpSettings) -> tuple[Tensor, list[Tensor]]:
    """π-Attention forward of the "torch" backend: (y [B, H, T, D] in q's dtype, `saved_layout`'s tensors)."""
    y, saved = torch_forward(q, k, v, gate, dropout_keep, slot_plan(q, k, document_ids, settings), settings)
    return y, list(saved.values())


def _forward_fake(q, k, v, gate, dropout_keep, document_ids, settings: OpSettings):
    saved = saved_layout(q, k, settings)
    return q.new_empty(q.shape), [q.new_empty(shape, dtype=dtype) for shape, dtype in saved.values()]


def _backward(dy, q, k, v, gate, dropout_keep, document_ids, saved, want_gate, settings: OpSettings) -> list[Tensor]:
    """π-Attention backward of the "torch" backend: [dq, dk, dv], and dgate when `want_gate`."""
    kept = dict(zip(saved_layout(q, k, settings), saved, strict=True))
    grads = torch_backward(dy, q, k, v, gate, dropout_keep, slot_plan(q, k, document_ids, settings), kept, settings,
                           want_dgate=want_gate)
    return list(grads) if want_gate else list(grads[:3])


pi_attention_fwd, pi_attention_bwd = register_pair("pi_attention", "torch", forward=_forward,
                                                   forward_fake=_forward_fake, backward=_backward,
                                                   saved="Tensor[] saved", periods=False)


def is_symbolic(x: Tensor) -> bool:
    """Whether x holds no values: traced by torch.compile, or a meta or fake tensor."""
    return torch.compiler.is_compiling() or x.device.type == "meta" or is_fake(x)


def run_torch_op(q, k, v, gate, settings: OpSettings, dropout_keep=None, document_ids=None):
    """The contract, `backends.BackendRun`: the "torch" backend through `piattn::pi_attention_fwd`."""
    y, _ = pi_attention_fwd(q, k, v, gate, dropout_keep, document_ids, *settings)
    return y
