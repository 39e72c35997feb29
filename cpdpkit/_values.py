"""Predicates on values a user hands a config, shared by every config's validation (torch-free, no imports)."""

from __future__ import annotations

from typing import Any

__all__ = ["is_int"]


def is_int(value: Any) -> bool:
    """Whether ``value`` is a whole number given as an ``int`` (``True`` and ``False`` are not: bool is an int)."""
    return isinstance(value, int) and not isinstance(value, bool)
