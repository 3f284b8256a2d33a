"""The accumulation dtype: what scores, softmax and weighted sums are computed in, for inputs of a dtype.

One rule, written once here: fp64 inputs compute in fp64, everything else (fp32, bf16, fp16) in fp32. The
"torch" backend, the slot weights, the decoding step, the gate and the baseline layers that compute in
"at least fp32" all read it from here. (Backends with their own kernels state their precision themselves:
"fused" and "triton" accumulate inside the kernel, "flex" always in fp32.)
"""

from __future__ import annotations

import torch


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """What inputs of `dtype` are computed in: fp64 for fp64, else fp32 (bf16 and fp16 are widened)."""
    return torch.float64 if dtype == torch.float64 else torch.float32
