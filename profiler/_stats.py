"""``median`` and ``fmean`` as :mod:`statistics` computes them, without importing it.

``import statistics`` (which loads ``fractions`` and ``decimal``) costs ~6 ms of every
``cpdpkit profile`` process; these two are all the profiler uses. Same results: ``median`` is
the middle value, or the mean of the two middle values; ``fmean`` is ``math.fsum`` over ``n``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["median", "fmean"]


def median(values: Iterable[float]) -> float:
    """The middle of the sorted values (the mean of the two middle ones for an even count)."""
    data = sorted(values)
    n = len(data)
    if n == 0:
        raise ValueError("median of no values")
    mid = n // 2
    return data[mid] if n % 2 else (data[mid - 1] + data[mid]) / 2


def fmean(values: Iterable[float]) -> float:
    """The arithmetic mean, summed with ``math.fsum``."""
    data = list(values)
    if not data:
        raise ValueError("mean of no values")
    return math.fsum(data) / len(data)
