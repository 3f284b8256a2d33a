"""Checks of plain arguments shared by every part of piattn, at the bottom of the package (imports nothing of it)."""

from __future__ import annotations

import os
from numbers import Integral

# The spellings an on/off environment variable takes (case and surrounding spaces ignored).
SWITCH_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False,
                "off": False}


def is_int(value) -> bool:
    """An integer (Python's or numpy's) that is not a bool: True would otherwise pass as 1."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def env_switch(name: str, default: bool = True) -> bool:
    """The on/off environment variable `name` (`default` when unset): 1/0, true/false, yes/no, on/off in any
    case; anything else (an empty value included) is a one-line ValueError naming the variable and the words."""
    value = os.environ.get(name)
    if value is None:
        return default
    word = value.strip().lower()
    if word not in SWITCH_WORDS:
        raise ValueError(f"{name}={value!r} is not an on/off value: use 1/0, true/false, yes/no or on/off, or unset "
                         f"it for the default ({'on' if default else 'off'})")
    return SWITCH_WORDS[word]
