"""The π-Attention gate: α = ε + (1 − 2ε)·σ(MLP(x)) per token and head (Eqs. gate, app_gate).

One definition for the `PiAttention` layer and for models converted by `piattn.integrations.hf`.
"""

from __future__ import annotations

import functools
import math
import struct

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.modules import module as _module

from ..caching import untainted
from ..ops.pi.decode_torch import gate_tail
from ..ops.pi.dtypes import accumulation_dtype


def gate_mlp(d_model: int, n_heads: int, hidden: int | None = None) -> nn.Sequential:
    """Linear(d, hidden) → GELU → Linear(hidden, H) → Sigmoid, hidden d/2 by default (the paper's).

    Indices 0 and 2 are the linear layers: the parameter names `gate.0`, `gate.2` of the seed's appendix.
    """
    hidden = hidden or d_model // 2
    return nn.Sequential(nn.Linear(d_model, hidden), nn.GELU(), nn.Linear(hidden, n_heads), nn.Sigmoid())


def start_gate_at(gate: nn.Sequential, alpha: float) -> None:
    """Make `gate` output σ = alpha for every input: last weight zero, last bias logit(alpha)."""
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"gate_init_alpha must lie in (0, 1), got {alpha!r}")
    nn.init.zeros_(gate[2].weight)
    nn.init.constant_(gate[2].bias, math.log(alpha / (1 - alpha)))


@functools.lru_cache(maxsize=64)
@untainted
def _clip(eps: float, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """ε and 1 − 2ε as 0-dim tensors: addcmul(ε, σ, 1 − 2ε) is the clip in one op."""
    return torch.tensor(eps, dtype=dtype, device=device), torch.tensor(1 - 2 * eps, dtype=dtype, device=device)


def global_hooks() -> bool:
    """Whether forward hooks are registered for every module (`nn.modules.module.register_module_forward_hook`
    and its pre-hook): then the fast paths call the modules they would otherwise bypass (the projections, the
    gate MLP), as `AttentionLayer.heads` does."""
    return bool(_module._global_forward_hooks or _module._global_forward_pre_hooks)


def gate_hooked(gate: nn.Sequential) -> bool:
    """Whether someone registered forward hooks on the gate MLP or its layers, or on every module (then it is
    called as a module)."""
    return global_hooks() or any(m._forward_hooks or m._forward_pre_hooks for m in (gate, *gate))


def gate_sigmoid(gate: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """x [B, T, d] -> σ(MLP(x)) [B, T, H], in at least fp32: the gate before its clip to [ε, 1 − ε].

    The MLP's layers are applied as functions (`gate_tail` after the first linear), which computes what
    calling the modules does without their per-call overhead (a decoding step is made of such small
    calls); a gate with hooks registered on it (someone wants them called) is called as a module.
    """
    if gate_hooked(gate):
        s = gate(x)
        return s.to(accumulation_dtype(s.dtype))
    hidden, head = gate_hidden(gate, x)
    return gate_tail(hidden, *head)


def gate_hidden(gate: nn.Sequential, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """x [B, T, d] -> (the MLP's hidden pre-activation [B, T, n_hidden], (its last layer's weight [H, n_hidden],
    bias [H])): the gate split where the decoding steps take it over (`gate_tail`: GELU, linear, σ)."""
    first, _, last, _ = gate._modules.values()
    return F.linear(x, first.weight, first.bias), (last.weight, last.bias)


def clip_gate(s: torch.Tensor, eps: float) -> torch.Tensor:
    """σ [B, T, H] -> α̃ = ε + (1 − 2ε)·σ [B, H, T], in [ε, 1 − ε].

    σ in at least fp32 because in bf16, ε + (1 − 2ε)·σ rounds to exactly 1 once σ > 0.998, outside (0, 1).
    """
    if torch.compiler.is_compiling():
        # Inductor fuses the two ops; the cached constants (one op in eager) would be an lru_cache call,
        # which dynamo traces through with a warning that the cache is ignored.
        return (s * (1 - 2 * eps) + eps).transpose(1, 2)
    floor, width = _clip(eps, s.dtype, s.device)
    return torch.addcmul(floor, s, width).transpose(1, 2)


def clip_stays_open(eps: float) -> bool:  # not cached: torch.compile traces it, and ignores a cache, warning
    """Whether ε + (1 − 2ε)·σ, in fp32 (the least `gate_sigmoid` computes in), stays inside (0, 1) for every σ
    in [0, 1]: its ends are ε > 0 and fl(fl(ε) + fl(1 − 2ε)), which rounds to 1 for ε below about 3e-8."""
    def f32(x: float) -> float:
        return struct.unpack("f", struct.pack("f", x))[0]

    return f32(eps) > 0.0 and f32(f32(eps) + f32(1 - 2 * eps)) < 1.0


def gate_values(gate: nn.Sequential, x: torch.Tensor, eps: float) -> torch.Tensor:
    """x [B, T, d] -> α̃ [B, H, T] in [ε, 1 − ε], in at least fp32 (`gate_sigmoid`, then `clip_gate`)."""
    return clip_gate(gate_sigmoid(gate, x), eps)
