"""The π-Attention neighbourhood U(i) = N_r(i) ∪ N_π(i) (Eqs. Nr, Npi, U) and its priors (Eq. omega).

Every backend orders the candidate keys of a query the same way, so that per-candidate tensors
(weights, dropout masks) line up across backends:

    slot m < n_local   : local key i - window + m      (m = 0 … window for causal, 0 … 2·window otherwise)
    slot m ≥ n_local   : skip keys, i - period first, then i + period (bidirectional only)

A skip offset that is already local (period ≤ window) is not repeated: it stays local, with the local prior.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Re-exported: the variant names live in piattn.config.pi, with the operator's other settings.
from ...config.pi import GATED_VARIANTS, VARIANTS

__all__ = ["GATED_VARIANTS", "VARIANTS", "Pattern", "log_priors"]


@dataclass(frozen=True)
class Pattern:
    """Offsets of U(i) relative to the query position i."""

    window: int
    period: int
    causal: bool

    @property
    def local_offsets(self) -> tuple[int, ...]:
        right = 0 if self.causal else self.window
        return tuple(range(-self.window, right + 1))

    @property
    def skip_offsets(self) -> tuple[int, ...]:
        if self.period <= self.window:
            return ()
        return (-self.period,) if self.causal else (-self.period, self.period)

    @property
    def offsets(self) -> tuple[int, ...]:
        return self.local_offsets + self.skip_offsets

    @property
    def n_local(self) -> int:
        return len(self.local_offsets)

    @property
    def n_slots(self) -> int:
        return len(self.offsets)

    def valid(self, T: int, device: torch.device | str | None = None) -> torch.Tensor:
        """bool [T, n_slots]: slot m of query i points inside [0, T)."""
        pos = torch.arange(T, device=device)[:, None] + torch.tensor(self.offsets, device=device)
        return (pos >= 0) & (pos < T)


def log_priors(
    variant: str, gate: torch.Tensor | None, prior: float, eps: float
) -> tuple[torch.Tensor | float, torch.Tensor | float]:
    """log ω for local and skip slots (Eqs. delta, omega): log max(α, ε) and log max(1 − α, ε).

    Returns floats for the constant variants, tensors shaped and typed like `gate` for "adaptive" (the
    caller casts it to the accumulation dtype), and zeros for
    "union" and "separate" (the separate variant mixes with α after normalising, not inside the logits).
    """
    if variant == "adaptive":
        a = gate
        return a.clamp_min(eps).log(), (1 - a).clamp_min(eps).log()
    if variant == "fixed":
        return math.log(max(prior, eps)), math.log(max(1 - prior, eps))
    return 0.0, 0.0
