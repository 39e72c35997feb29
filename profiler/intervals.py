"""Interval algebra on numpy arrays: merge, intersect, subtract, clip and measure.

An *interval set* is a pair ``(starts, ends)`` of float64 arrays, sorted by start, pairwise
disjoint and with ``starts <= ends``; :func:`merge` makes one from arbitrary (possibly
overlapping, unsorted) intervals. Everything is vectorised: merge is a sort plus a running
maximum of the ends; intersection and difference are one sweep over the sorted boundary
points of both sets with a coverage counter (weights 1 and 2 tell the sets apart).
Intervals that only touch are merged, as Holistic Trace Analysis does.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = [
    "Intervals",
    "EMPTY",
    "merge",
    "union",
    "intersect",
    "subtract",
    "clip",
    "total_us",
    "measure_in_windows",
]


class Intervals(NamedTuple):
    """A disjoint, start-sorted set of half-open time intervals (microseconds)."""

    starts: np.ndarray
    ends: np.ndarray

    def __len__(self) -> int:  # number of intervals, not a tuple length
        return int(self.starts.shape[0])


def _empty() -> Intervals:
    return Intervals(np.empty(0, dtype=np.float64), np.empty(0, dtype=np.float64))


EMPTY = _empty()


def merge(starts: np.ndarray, ends: np.ndarray) -> Intervals:
    """Merge arbitrary intervals into a disjoint sorted set (touching intervals join)."""
    s = np.asarray(starts, dtype=np.float64)
    e = np.asarray(ends, dtype=np.float64)
    if s.shape != e.shape or s.ndim != 1:
        raise ValueError(f"starts and ends must be 1-D of equal length, got {s.shape} and {e.shape}")
    if s.size == 0:
        return _empty()
    order = np.argsort(s, kind="stable")
    s = s[order]
    e = np.maximum(e[order], s)
    run_end = np.maximum.accumulate(e)
    # a new group starts where the start lies beyond every earlier end
    new_group = np.empty(s.size, dtype=bool)
    new_group[0] = True
    np.greater(s[1:], run_end[:-1], out=new_group[1:])
    first = np.flatnonzero(new_group)
    last = np.empty_like(first)
    last[:-1] = first[1:] - 1
    last[-1] = s.size - 1
    return Intervals(s[first], run_end[last])


def union(*sets: Intervals) -> Intervals:
    """Union of interval sets."""
    live = [iv for iv in sets if len(iv)]
    if not live:
        return _empty()
    if len(live) == 1:
        return live[0]
    return merge(np.concatenate([iv.starts for iv in live]), np.concatenate([iv.ends for iv in live]))


def _sweep(a: Intervals, b: Intervals, wanted: int) -> Intervals:
    """Regions where the coverage code equals ``wanted`` (a counts 1, b counts 2)."""
    na, nb = len(a), len(b)
    points = np.concatenate([a.starts, a.ends, b.starts, b.ends])
    deltas = np.concatenate(
        [np.ones(na, np.int8), -np.ones(na, np.int8), np.full(nb, 2, np.int8), np.full(nb, -2, np.int8)]
    )
    order = np.argsort(points, kind="stable")
    points = points[order]
    code = np.cumsum(deltas[order], dtype=np.int16)
    hit = np.flatnonzero(code[:-1] == wanted)
    starts, ends = points[hit], points[hit + 1]
    keep = ends > starts
    if not keep.all():
        starts, ends = starts[keep], ends[keep]
    if starts.size < 2:
        return Intervals(starts, ends)
    return merge(starts, ends)


def intersect(a: Intervals, b: Intervals) -> Intervals:
    """``a ∩ b`` for two disjoint sorted sets."""
    if not len(a) or not len(b):
        return _empty()
    return _sweep(a, b, 3)


def subtract(a: Intervals, b: Intervals) -> Intervals:
    """``a ∖ b`` for two disjoint sorted sets."""
    if not len(a) or not len(b):
        return a
    return _sweep(a, b, 1)


def clip(a: Intervals, lo: float, hi: float) -> Intervals:
    """The part of ``a`` inside ``[lo, hi]``."""
    if not len(a) or hi <= lo:
        return _empty()
    i = int(np.searchsorted(a.ends, lo, side="right"))
    j = int(np.searchsorted(a.starts, hi, side="left"))
    if j <= i:
        return _empty()
    s = np.maximum(a.starts[i:j], lo)
    e = np.minimum(a.ends[i:j], hi)
    return Intervals(s, e)


def total_us(a: Intervals) -> float:
    """Total length of a disjoint set."""
    return float(np.sum(a.ends - a.starts)) if len(a) else 0.0


def measure_in_windows(a: Intervals, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Length of ``a ∩ [lo[k], hi[k]]`` for every window ``k`` (vectorised)."""
    lo = np.asarray(lo, dtype=np.float64)
    hi = np.asarray(hi, dtype=np.float64)
    if not len(a):
        return np.zeros(lo.shape, dtype=np.float64)
    cum = np.concatenate([[0.0], np.cumsum(a.ends - a.starts)])

    def covered_before(x: np.ndarray) -> np.ndarray:
        k = np.searchsorted(a.starts, x, side="right")  # intervals starting at or before x
        idx = np.maximum(k - 1, 0)
        partial = np.clip(x - a.starts[idx], 0.0, a.ends[idx] - a.starts[idx])
        return np.where(k > 0, cum[idx] + partial, 0.0)

    return np.maximum(covered_before(hi) - covered_before(lo), 0.0)
