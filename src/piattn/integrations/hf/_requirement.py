"""The transformers this integration needs, checked when `piattn.integrations.hf` is imported (first, before
the modules that use it)."""

from __future__ import annotations

import re

import transformers

MIN_TRANSFORMERS = (5, 24)  # the models' and generate's `cache` argument (its name before: past_key_values)


def check_transformers(version: str) -> None:
    """Refuse a transformers older than MIN_TRANSFORMERS, naming the installed version and the fix: there a
    `cache=PiCache(...)` argument would never reach the attention modules, and decoding would go on without the
    bounded cache instead of failing."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or tuple(int(n) for n in found.groups()) < MIN_TRANSFORMERS:
        need = ".".join(map(str, MIN_TRANSFORMERS))
        raise ImportError(f"piattn.integrations.hf needs transformers >= {need} (installed: {version}); "
                          f"pip install -U 'transformers>={need}'")


check_transformers(transformers.__version__)
