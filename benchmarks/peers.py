"""Peer libraries for the GPU run, behind one call shape: op(q, k, v, gate) with q, k, v [B, H, T, D].

flash-sparse-attn (PyPI `flash-sparse-attn`, pure Triton; https://github.com/HKUSTDial/flash-sparse-attention):
`flash_dense_attn_func(q, k, v, is_causal, window_sizes=...)` takes q, k, v [B, T, H, D] (fp16/bf16 only)
and, per key/value head, `window_sizes` int32 [H_kv, 4] = [sink, far band, gap, near band]: causal query i
sees keys at distance d = i - j with 0 <= d < near, or near + gap <= d < near + gap + far, or j < sink. With
near = k + 1, gap = π - k - 1 and far = 1 that is π-Attention's "union" variant (window k plus the one key π
back, one softmax, no prior and no clamp), which needs π > k + 1.

The wheel travels in `.whl/` (benchmarks/gpu_wheels.sh); the GPU machine has no network, so `install_wheels`
unpacks it with pip's --no-index into a folder put on sys.path.
"""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import torch

SITE = Path("/tmp/piattn-site")
# Imported at the top of flash_sparse_attn's interface for its projection kernels (not the attention ones):
# Triton's in-repo `triton_kernels`, which no registry ships (PyPI's `triton-kernels` is another project).
PROJECTION_IMPORTS = {"triton_kernels.matmul_ogs": ("matmul_ogs", "PrecisionConfig", "FlexCtx"),
                      "triton_kernels.numerics": ("InFlexData", "OutFlexData")}


def install_wheels(whl_dir: Path, target: Path = SITE) -> dict:
    """pip-install every wheel in whl_dir into target (no index, no deps) and put target first on sys.path.

    Returns {status: "installed" | "not carried" | "error", wheels: [names], error?}.
    """
    wheels = sorted(whl_dir.glob("*.whl")) if whl_dir.is_dir() else []
    if not wheels:
        return dict(status="not carried", wheels=[], note=f"no wheels in {whl_dir} (run benchmarks/gpu_wheels.sh)")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--upgrade", "--target", str(target), *map(str, wheels)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    names = [w.name for w in wheels]
    if proc.returncode != 0:
        return dict(status="error", wheels=names, error=(proc.stderr or proc.stdout)[-500:])
    if str(target) not in sys.path:
        sys.path.insert(0, str(target))
    return dict(status="installed", wheels=names)


def _stub_projection_imports() -> list[str]:
    """Put placeholder modules for PROJECTION_IMPORTS in sys.modules where the real ones are missing; their
    names raise when called (only flash_sparse_attn's projection kernels call them, never attention)."""

    def missing(*args, **kwargs):
        raise RuntimeError("triton_kernels is not installed: flash_sparse_attn's projection kernels cannot run")

    stubbed = []
    for name, attrs in PROJECTION_IMPORTS.items():
        try:
            __import__(name)
        except ImportError:
            parent = sys.modules.setdefault("triton_kernels", types.ModuleType("triton_kernels"))
            module = types.ModuleType(name)
            for attr in attrs:
                setattr(module, attr, missing)
            sys.modules[name] = module
            setattr(parent, name.rsplit(".", 1)[1], module)
            stubbed.append(name)
    return stubbed


def load_flash_sparse() -> tuple[object | None, dict]:
    """(flash_dense_attn_func or None, record {status, version?, stubbed?, error?})."""
    try:
        import flash_sparse_attn  # noqa: F401  (absent: the wheel was not carried)
    except ImportError as exc:
        if "triton_kernels" not in str(exc):
            return None, dict(status="not installed", error=str(exc))
    stubbed = _stub_projection_imports()
    try:
        import flash_sparse_attn
        from flash_sparse_attn import flash_dense_attn_func
    except Exception as exc:  # a wheel built for another Triton: report, do not crash the run
        return None, dict(status="error", error=f"{type(exc).__name__}: {exc}", stubbed=stubbed)
    return flash_dense_attn_func, dict(status="ok", version=flash_sparse_attn.__version__, stubbed=stubbed)


def window_sizes(window: int, period: int, n_kv_heads: int, device, *, skip: bool = True) -> torch.Tensor:
    """int32 [n_kv_heads, 4] = [sink 0, far 1, gap π - k - 1, near k + 1]: π's causal union pattern; without
    the skip key (skip=False) [0, 0, 0, k + 1], a sliding window of k + 1 keys (π's "local")."""
    if not skip:
        return torch.tensor([[0, 0, 0, window + 1]] * n_kv_heads, dtype=torch.int32, device=device)
    if period <= window + 1:
        raise ValueError(f"flash-sparse-attn needs a gap before the far band: period {period} > window {window} + 1")
    row = [0, 1, period - window - 1, window + 1]
    return torch.tensor([row] * n_kv_heads, dtype=torch.int32, device=device)


def emulated_mask(T: int, sizes: torch.Tensor) -> torch.Tensor:
    """bool [T, T] (query, key) of one head's window_sizes row, by the library's documented rule (see the
    module docstring), for checking the mapping where its kernels cannot run (a CPU)."""
    sink, far, gap, near = (int(x) for x in sizes)
    d = torch.arange(T)[:, None] - torch.arange(T)[None, :]
    band = ((d >= 0) & (d < near)) | ((d >= near + gap) & (d < near + gap + far))
    return band | ((torch.arange(T)[None, :] < sink) & (d >= 0))


class FlashSparseOp:
    """flash-sparse-attn as π's causal union variant (or, skip=False, as a sliding window of window + 1 keys):
    op(q, k, v, gate) -> [B, H, T, D], gate ignored.

    Fixed 64×64 tiles, no autotuning: its autotuner compiles 54 configurations per kernel and shape, more than
    the run's budget. q, k, v may be any [B, H, T, D] tensors; `prepare` gives them [B, T, H, D] storage so the
    timed call copies nothing.
    """

    def __init__(self, func, window: int, period: int, skip: bool = True):
        self.func, self.window, self.period, self.skip = func, window, period, skip

    def __call__(self, q, k, v, gate=None):
        sizes = window_sizes(self.window, self.period, k.shape[1], q.device, skip=self.skip)
        y = self.func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                      window_sizes=sizes, is_autotune=False)
        return y.transpose(1, 2)

    @staticmethod
    def prepare(inputs):
        """(q, k, v, gate, dy) with q, k, v, dy laid out [B, T, H, D] in memory, still shaped [B, H, T, D]."""
        q, k, v, gate, dy = inputs

        def relaid(t):
            return t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(t.requires_grad)

        return relaid(q), relaid(k), relaid(v), gate, relaid(dy)
