"""Predicates on values a user hands a config, shared by every config's validation (torch-free, no imports)."""

from __future__ import annotations

from typing import Any

__all__ = ["is_int", "refuse_nonfinite"]


def is_int(value: Any) -> bool:
    """Whether ``value`` is a whole number given as an ``int`` (``True`` and ``False`` are not: bool is an int)."""
    return isinstance(value, int) and not isinstance(value, bool)


def refuse_nonfinite(config: Any, error: type[Exception], *, options: bool = False) -> None:
    """Raise ``error`` naming the first float field of dataclass ``config`` (or float in a tuple/list field)
    that is NaN or infinite: such a value passes ``x > 0`` and ``x <= 0`` checks alike (both are False for
    NaN), so every config calls this first. ``options``: name the field as a CLI option (``--slowmo-lr``)."""
    import dataclasses
    import math

    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        items = value if isinstance(value, (tuple, list)) else (value,)
        for item in items:
            if isinstance(item, float) and not math.isfinite(item):
                name = f"--{f.name.replace('_', '-')} {value!r}" if options else f"{f.name} = {value!r}"
                raise error(f"{name} is not a finite number; pass a real value (NaN and infinities "
                            "are refused)")
