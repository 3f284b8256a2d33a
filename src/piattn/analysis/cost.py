"""The seed's hierarchy-aware online cost C_online(n) (Eq. online_cost), per (batch, head):

    C = c_tc·n·|W|·d_h / γ_tc + Σ_ℓ b_ℓ / γ_ℓ,   ℓ ∈ {reg, sram, hbm, net}
    b_reg = n·|W|·d_h,  b_sram = n_tile·|W|·d_h,  b_hbm = n·(k+1)·d_h,  b_net = n_remote(π)·d_h

(element counts; times `dtype_bytes` gives bytes). The seed's k+1 is the causal local window; for
bidirectional attention we use its 2k+1 local keys. The Θ(·) constants of the seed are taken as 1, and
c_tc = 4 FLOPs per (query, key, head-dim element): 2 for q·k and 2 for p·v, forward only. This is a
back-of-the-envelope model, not a measurement: the seed's b_sram is a per-tile figure that does not grow
with n, and its b_hbm (k+1 keys per query, no reuse between neighbouring queries) ignores the skip key,
q, v and the output. Benchmarks, not this model, decide what is fast.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..masks import local_mask, pi_mask

LEVELS = ("reg", "sram", "hbm", "net")
C_TC = 4


@dataclass(frozen=True)
class HardwareProfile:
    """Effective throughputs: γ_tc in FLOP/s (16-bit inputs, dense), the γ_ℓ in bytes/s.

    net_bw is None where there is no interconnect (a single device).
    """

    name: str
    tc_flops: float
    reg_bw: float
    sram_bw: float
    hbm_bw: float
    net_bw: float | None


# NVIDIA datasheets give γ_tc (dense BF16, i.e. half the "with sparsity" figure), HBM and NVLink bandwidth.
# Register and shared-memory bandwidths are not published; they are estimated from the SM count, boost
# clock and per-SM width: SRAM 128 B/clk/SM, registers 3 operands × 4 B × FP32 lanes per clk per SM.
PROFILES: dict[str, HardwareProfile] = {
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): BF16 312 TFLOPS, HBM2e 2,039 GB/s, NVLink 600 GB/s.
    # 108 SMs, 1.41 GHz, 64 FP32 lanes/SM -> SRAM ≈ 19.5 TB/s, registers ≈ 117 TB/s.
    "a100": HardwareProfile("a100", 312e12, 117e12, 19.5e12, 2.039e12, 600e9),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): BF16 1,979 TFLOPS with sparsity -> 989 dense,
    # HBM3 3.35 TB/s, NVLink 900 GB/s. 132 SMs, 1.98 GHz, 128 FP32 lanes/SM -> SRAM ≈ 33 TB/s,
    # registers ≈ 400 TB/s.
    "h100-sxm": HardwareProfile("h100-sxm", 989e12, 400e12, 33e12, 3.35e12, 900e9),
    # NVIDIA H200 Tensor Core GPU product page (SXM): the H100 SXM compute with HBM3e at 4.8 TB/s,
    # NVLink 900 GB/s.
    "h200": HardwareProfile("h200", 989e12, 400e12, 33e12, 4.8e12, 900e9),
    # The 2-core KVM Xeon (AVX-512, AMX) these tests run on, measured with torch: bf16 2048² matmul
    # ≈ 0.36 TFLOP/s, large-tensor copy ≈ 8 GB/s (read + write; shared machine, noisy). L1 (reg) and L2
    # (sram) from 2 × 64 B/clk and 64 B/clk per core at 2 GHz. No interconnect.
    "cpu-2core": HardwareProfile("cpu-2core", 0.36e12, 512e9, 256e9, 8e9, None),
}


def working_set_size(window: int, period: int | None, causal: bool = True) -> int:
    """|W|: the keys one query sees away from the sequence ends (period=None: local only).

    Read off the mask itself: a query at position c = max(window, period) of a length-(2c+1) sequence
    has every offset of the pattern inside the sequence.
    """
    mod = local_mask(window, causal) if period is None else pi_mask(window, period, causal)
    c = max(window, period or 0)
    return int(mod(0, 0, torch.tensor(c), torch.arange(2 * c + 1)).sum())


def mean_keys(mask: torch.Tensor) -> float:
    """Keys per query of a one-layer pattern: the mean number of True cells per row of a bool [n, n] mask
    (0.0 for n = 0). Near the sequence's (or an image's) borders queries see fewer keys than inside, and a
    causal query fewer than a bidirectional one; the mean counts them all, as the work of a layer does."""
    return mask.sum(1, dtype=torch.float64).mean().item() if mask.numel() else 0.0


def skip_pairs(n: int, period: int | None, causal: bool = True) -> int:
    """How many (query, skip key) pairs fall inside a length-n sequence."""
    if period is None:
        return 0
    return max(0, n - period) * (1 if causal else 2)


def _hierarchy_cost(n, keys, hbm_keys, remote, d_head, profile, dtype_bytes, n_tile) -> dict:
    elements = {"reg": n * keys * d_head, "sram": n_tile * keys * d_head,
                "hbm": n * hbm_keys * d_head, "net": remote * d_head}
    nbytes = {lvl: e * dtype_bytes for lvl, e in elements.items()}
    if nbytes["net"] > 0 and profile.net_bw is None:
        raise ValueError(f"profile {profile.name!r} has no interconnect, but {remote} keys are remote")
    bw = {"reg": profile.reg_bw, "sram": profile.sram_bw, "hbm": profile.hbm_bw, "net": profile.net_bw}
    flops = C_TC * n * keys * d_head
    seconds = {"compute": flops / profile.tc_flops}
    seconds.update({lvl: nbytes[lvl] / bw[lvl] if nbytes[lvl] else 0.0 for lvl in LEVELS})
    return {"working_set": keys, "flops": flops, "bytes": nbytes, "seconds": seconds,
            "total_seconds": sum(seconds.values())}


def _profile(profile: HardwareProfile | str) -> HardwareProfile:
    if isinstance(profile, HardwareProfile):
        return profile
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; known: {', '.join(PROFILES)}")
    return PROFILES[profile]


def online_cost(n: int, window: int, period: int | None, d_head: int, profile: HardwareProfile | str, *,
                causal: bool = True, dtype_bytes: int = 2, n_tile: int = 128,
                remote_fraction: float = 0.0) -> dict:
    """Eq. (online_cost) for one (batch, head) stream of n tokens.

    remote_fraction: share of the skip partners that live on another device (n_remote = fraction × number
    of in-range skip pairs). period=None costs local-window attention the same way.
    Returns {"working_set": |W|, "flops", "bytes": {reg, sram, hbm, net}, "seconds": {compute, reg, sram,
    hbm, net}, "total_seconds"}.
    """
    if not 0.0 <= remote_fraction <= 1.0:
        raise ValueError(f"remote_fraction must be in [0, 1], got {remote_fraction}")
    keys = working_set_size(window, period, causal)
    local_keys = working_set_size(window, None, causal)
    remote = remote_fraction * skip_pairs(n, period, causal)
    return _hierarchy_cost(n, keys, local_keys, remote, d_head, _profile(profile), dtype_bytes, n_tile)


def dense_cost(n: int, d_head: int, profile: HardwareProfile | str, *, causal: bool = True,
               dtype_bytes: int = 2, n_tile: int = 128) -> dict:
    """The same accounting for dense attention: |W| = n keys per query ((n+1)/2 on average if causal),
    each read from HBM once per query like the seed's b_hbm. A tiled (FlashAttention-style) dense kernel
    reuses keys across a query tile and moves far less; this is the untiled comparison the formula implies.
    """
    keys = (n + 1) / 2 if causal else n
    return _hierarchy_cost(n, keys, keys, 0, d_head, _profile(profile), dtype_bytes, n_tile)
