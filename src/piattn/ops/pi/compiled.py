"""The "torch" backend as PyTorch custom operators, so that `torch.compile` captures it whole.

Traced as Python, the backend's `PiAttentionFunction` breaks a compiled graph: its forward chooses a code
path from the values of the inputs (`all_finite`, a host sync), and its chunk loop would unroll into
thousands of graph nodes. Registered as two operators it is one opaque node each way:

    piattn::pi_attention_fwd (q, k, v, gate, settings…, dropout_keep, document_ids) -> (y, saved)
    piattn::pi_attention_bwd (dy, q, k, v, gate, saved, want_gate, settings…, dropout_keep, document_ids)
                             -> [dq, dk, dv] or [dq, dk, dv, dgate]

`register_fake` gives their output shapes to the compiler (and makes meta and fake tensors run), and
`register_autograd` ties the backward to the forward. Both run the backend's own `PiAttentionFunction`
forward and backward, through a stand-in for autograd's ctx: the same code as eager, not a copy.

`saved` are the tensors that forward keeps for backward besides its inputs (`saved_layout` describes
them): they leave the forward as outputs so that AOTAutograd can keep them for the backward graph.
Settings cross as ints, floats, bools and a str, since an operator takes no other Python values.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from .backends import refuse_double_backward
from .pattern import Pattern
from .torch import PiAttentionFunction, _Slots

# The optional per-query tensors PiAttentionFunction.forward saves after q, k, v, gate (None when unused),
# in the order of its save_for_backward; its dropout mask follows them.
_OPTIONAL_SAVED = ("w", "probs", "coef", "clamp_pass")


def saved_layout(q: Tensor, k: Tensor, *, window: int, period: int, causal: bool, variant: str,
                 logit_clamp: float | None, sinks: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """What the backend's forward saves for backward besides its inputs, for q [B, H, T, D] and k
    [B, H_kv, T, D]: name -> (shape, dtype), all [N, G, |U|, T] slot-major (N = B·H_kv key heads, G = H / H_kv
    query heads per key head, |U| the pattern's slots, sinks included).

    w: the attention weights, in the accumulation dtype (fp64 for fp64 inputs, else fp32). probs, coef:
    "separate" with a skip slot only, the per-branch softmax and the mixing coefficients. clamp_pass
    (bool): with a logit clamp only, where the score was inside it.

    With `_function_args` and `_backward_ctx`, the only code here that knows the backend's internals:
    keep the three in step with `PiAttentionFunction` (the forward operator checks the names at run time).
    """
    B, H, T, _ = q.shape
    H_kv = k.shape[1]
    pattern = Pattern(window, period, causal, sinks)
    shape = (B * H_kv, H // H_kv, pattern.n_slots, T)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    saved = {"w": (shape, acc)}
    if variant == "separate" and pattern.skip_offsets:
        saved.update(probs=(shape, acc), coef=(shape, acc))
    if logit_clamp is not None:
        saved["clamp_pass"] = (shape, torch.bool)
    return saved


class _Ctx:
    """Stands in for autograd's ctx around `PiAttentionFunction`: keeps what forward saves and gives it,
    with which inputs want a gradient, to backward."""

    def __init__(self, saved: tuple = (), needs_input_grad: tuple[bool, ...] = ()):
        self.saved_tensors, self.needs_input_grad = saved, needs_input_grad

    def save_for_backward(self, *tensors) -> None:
        self.saved_tensors = tensors


def _function_args(q, k, v, gate, window, period, causal, variant, prior, logit_clamp, eps, scale, dropout_keep,
                   dropout_p, sinks, document_ids) -> tuple:
    """The arguments of `PiAttentionFunction.forward` after ctx (the operators' arguments, in their order)."""
    return (q, k, v, gate, window, period, causal, variant, prior, logit_clamp, eps, scale, dropout_keep, dropout_p,
            sinks, document_ids)


def _backward_ctx(q, k, v, gate, kept: dict, want_gate: bool, window, period, causal, variant, prior,
                  logit_clamp, eps, scale, dropout_keep, dropout_p, sinks, document_ids) -> _Ctx:
    """The ctx `PiAttentionFunction.backward` reads, as its forward left it (kept: `saved_layout`'s tensors,
    by name)."""
    saved = (q, k, v, gate, *(kept.get(n) for n in _OPTIONAL_SAVED), dropout_keep)
    ctx = _Ctx(saved, needs_input_grad=(True, True, True, want_gate) + (False,) * 10)
    B, H, T, _ = q.shape
    H_kv = k.shape[1]
    # The slot plan the forward built (kept on its ctx, not saved): rebuilt from the same arguments.
    ctx.slots = _Slots(Pattern(window, period, causal, sinks), T, document_ids, H_kv, B * H_kv, q.device)
    ctx.cfg = (window, causal, variant, eps, scale, dropout_p)
    return ctx


@torch.library.custom_op("piattn::pi_attention_fwd", mutates_args=())
def pi_attention_fwd(
    q: Tensor, k: Tensor, v: Tensor, gate: Tensor | None, window: int, period: int, causal: bool, variant: str,
    prior: float, logit_clamp: float | None, eps: float, scale: float, dropout_keep: Tensor | None,
    dropout_p: float, sinks: int, document_ids: Tensor | None,
) -> tuple[Tensor, list[Tensor]]:
    """π-Attention forward of the "torch" backend: (y [B, H, T, D] in q's dtype, `saved_layout`'s tensors)."""
    ctx = _Ctx()
    y = PiAttentionFunction.forward(ctx, *_function_args(
        q, k, v, gate, window, period, causal, variant, prior, logit_clamp, eps, scale, dropout_keep, dropout_p,
        sinks, document_ids))
    kept = dict(zip(_OPTIONAL_SAVED, ctx.saved_tensors[4:8], strict=True))
    names = saved_layout(q, k, window=window, period=period, causal=causal, variant=variant,
                         logit_clamp=logit_clamp, sinks=sinks)
    if [n for n in _OPTIONAL_SAVED if kept[n] is not None] != list(names):
        raise RuntimeError("piattn: compiled.saved_layout is out of step with PiAttentionFunction.forward")
    return y, [kept[n] for n in names]


@pi_attention_fwd.register_fake
def _(q, k, v, gate, window, period, causal, variant, prior, logit_clamp, eps, scale, dropout_keep, dropout_p,
      sinks, document_ids):
    saved = saved_layout(q, k, window=window, period=period, causal=causal, variant=variant,
                         logit_clamp=logit_clamp, sinks=sinks)
    return q.new_empty(q.shape), [q.new_empty(shape, dtype=dtype) for shape, dtype in saved.values()]


@torch.library.custom_op("piattn::pi_attention_bwd", mutates_args=())
def pi_attention_bwd(
    dy: Tensor, q: Tensor, k: Tensor, v: Tensor, gate: Tensor | None, saved: list[Tensor], want_gate: bool,
    window: int, period: int, causal: bool, variant: str, prior: float, logit_clamp: float | None, eps: float,
    scale: float, dropout_keep: Tensor | None, dropout_p: float, sinks: int, document_ids: Tensor | None,
) -> list[Tensor]:
    """π-Attention backward of the "torch" backend: [dq, dk, dv], and dgate when `want_gate`."""
    names = saved_layout(q, k, window=window, period=period, causal=causal, variant=variant,
                         logit_clamp=logit_clamp, sinks=sinks)
    kept = dict(zip(names, saved, strict=True))
    ctx = _backward_ctx(q, k, v, gate, kept, want_gate, window, period, causal, variant, prior, logit_clamp, eps,
                        scale, dropout_keep, dropout_p, sinks, document_ids)
    with torch.no_grad():  # as autograd runs it; a double backward is refused in `_backward` instead
        grads = PiAttentionFunction.backward(ctx, dy)
    return list(grads[:4]) if want_gate else list(grads[:3])


@pi_attention_bwd.register_fake
def _(dy, q, k, v, gate, saved, want_gate, *settings):
    grads = [q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)]
    return grads + [gate.new_empty(gate.shape)] if want_gate else grads


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, gate, window, period, causal, variant, prior, logit_clamp, eps, scale, keep, p, sinks, docs = inputs
    ctx.scalars = (window, period, causal, variant, prior, logit_clamp, eps, scale)
    ctx.dropout_p, ctx.sinks = p, sinks
    ctx.save_for_backward(q, k, v, gate, keep, docs, *output[1])
    ctx.mark_non_differentiable(*output[1])


def _backward(ctx, dy, _saved_grads):
    refuse_double_backward("torch")
    q, k, v, gate, keep, docs, *saved = ctx.saved_tensors
    want_gate = gate is not None and ctx.needs_input_grad[3]
    grads = pi_attention_bwd(dy, q, k, v, gate, saved, want_gate, *ctx.scalars, keep, ctx.dropout_p, ctx.sinks,
                             docs)
    # One gradient per input of pi_attention_fwd: q, k, v, gate, then 12 settings.
    return (*grads[:3], grads[3] if want_gate else None) + (None,) * 12


pi_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def is_symbolic(x: Tensor) -> bool:
    """Whether x holds no values: traced by torch.compile, or a meta or fake tensor."""
    return torch.compiler.is_compiling() or x.device.type == "meta" or is_fake(x)


def pi_attention_torch_op(q, k, v, gate, *, window, period, causal, variant, prior, logit_clamp, eps, scale,
                          dropout_keep, dropout_p, sinks=0, document_ids=None):
    """Same contract as `pi_attention_reference`: the "torch" backend through `piattn::pi_attention_fwd`."""
    y, _ = pi_attention_fwd(q, k, v, gate, window, period, causal, variant, prior, logit_clamp, eps, scale,
                            dropout_keep, dropout_p, sinks, document_ids)
    return y
