"""Checks of plain arguments shared by every part of piattn, at the bottom of the package (imports nothing of it)."""

from __future__ import annotations

from numbers import Integral


def is_int(value) -> bool:
    """An integer (Python's or numpy's) that is not a bool: True would otherwise pass as 1."""
    return isinstance(value, Integral) and not isinstance(value, bool)
