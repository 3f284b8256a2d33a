"""The optimiser of the paper's training setup: AdamW, warmup then cosine decay, global gradient clipping.

Paper (Table app_opt): β = (0.9, 0.95), ε = 1e-8, peak LR 3e-4, minimum LR 3e-5, linear warmup then cosine
decay, weight decay 0.1, global ℓ2 clipping at 1.0.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

BETAS = (0.9, 0.95)
EPS = 1e-8


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: decay on the ≥2-D weights of Linear layers, none on everything else.

    Norm gains, biases and embeddings are not decayed. A Linear weight that is also an embedding's (the LM
    head tied to the token embedding) counts as an embedding. Each parameter appears once even when tied.
    """
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decayed_ids = {id(m.weight) for m in model.modules()
                   if isinstance(m, nn.Linear) and m.weight.dim() >= 2 and id(m.weight) not in embedding_ids}
    decay, no_decay = [], []
    for p in model.parameters():  # yields a tied parameter once
        if p.requires_grad:
            (decay if id(p) in decayed_ids else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with the paper's β and ε over `param_groups(model, weight_decay)`."""
    if lr <= 0:
        raise ValueError(f"--lr must be > 0, got {lr!r}")
    if weight_decay < 0:
        raise ValueError(f"--weight-decay must be >= 0, got {weight_decay!r}")
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=BETAS, eps=EPS)


def lr_at(step: int, *, peak: float, minimum: float, warmup: int, total: int) -> float:
    """Learning rate of optimiser step `step` (0-based).

    Warmup: peak · (step + 1) / warmup for step < warmup, so the last warmup step reaches the peak.
    Then cosine from peak at step = warmup down to `minimum` at step = total (and after).
    """
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return minimum + 0.5 * (peak - minimum) * (1.0 + math.cos(math.pi * progress))


def warmup_cosine(optimizer: torch.optim.Optimizer, *, peak: float, minimum: float, warmup: int,
                  total: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A scheduler that sets every group's LR to `lr_at(step)`; call `.step()` after each optimiser step.

    The schedule lives in a closure, so a checkpoint stores only the step count and the arguments of the
    run that resumes it decide the shape.
    """
    if not 0 <= minimum <= peak:
        raise ValueError(f"--min-lr must be in [0, --lr={peak}], got {minimum!r}")
    if warmup < 0 or total < 1:
        raise ValueError(f"--warmup must be >= 0 and --steps >= 1, got warmup={warmup!r}, steps={total!r}")
    for group in optimizer.param_groups:
        group["lr"] = peak  # LambdaLR multiplies the initial LR

    def factor(step: int) -> float:
        return lr_at(step, peak=peak, minimum=minimum, warmup=warmup, total=total) / peak

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def clip_gradients(parameters, max_norm: float) -> torch.Tensor:
    """Scale all gradients together so their global ℓ2 norm is at most `max_norm` (<= 0: no clipping).

    Returns the norm before clipping as a 0-d tensor (reading it waits for the device, so callers read
    it only when they log it). With FSDP2 the gradients are DTensor shards and `clip_grad_norm_` computes
    the norm over all shards (a replicated DTensor, returned here as its local, full value), so the scale
    is that of the unsharded gradient on every rank.
    """
    params = [p for p in parameters if p.grad is not None]
    norm = nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm
