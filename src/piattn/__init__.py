"""piattn: π-Attention, a local window plus one long-range key π positions away under one softmax.

The public names load on first use (PEP 562), so that `import piattn` (and the `piattn` command's start-up,
`--help` and `--version`) does not import torch until something needs it.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"  # the package's one version: pyproject.toml reads it from here

# public name -> the module that defines it
_EXPORTS = {
    "BACKENDS": "piattn.ops.pi",
    "pi_attention": "piattn.ops.pi",
    "pi_attention_weights": "piattn.ops.pi",
    "PiAttention": "piattn.layers",
    "load": "piattn.loading",
}
__all__ = ["BACKENDS", "PiAttention", "layers", "load", "pi_attention", "pi_attention_weights"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name == "layers":
        return importlib.import_module("piattn.layers")
    raise AttributeError(f"module 'piattn' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
