"""Interval algebra on lists of floats: merge, intersect, subtract, clip and measure.

An *interval set* is a pair ``(starts, ends)`` of float sequences, sorted by start, pairwise
disjoint and with ``starts <= ends`` (so the ends are sorted too); :func:`merge` makes one
from arbitrary (possibly overlapping, unsorted) intervals: a sort plus one pass keeping the
running maximum of the ends. Intersection and difference walk the smaller set and find the
intervals of the other with :mod:`bisect`, so a small set against a large one costs little;
intervals of the larger set that nothing touches are copied as whole slices. Their results
have no zero-length pieces, and intervals that only touch are merged, as Holistic Trace
Analysis does: the result is the one canonical form of the set. Sums use :func:`math.fsum`.
Standard library only: the profiler imports no numpy (its import alone costs more than
analysing a small trace).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from itertools import accumulate, compress, islice
from math import fsum, inf
from operator import eq, gt, le, lt, ne, sub
from typing import NamedTuple

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
    """A disjoint, start-sorted set of time intervals (microseconds): ``starts[k] <= ends[k]
    <= starts[k + 1]``. Every function here returns lists; :data:`EMPTY` holds tuples."""

    starts: Sequence[float]
    ends: Sequence[float]

    def __len__(self) -> int:  # number of intervals, not a tuple length
        return len(self.starts)


EMPTY = Intervals((), ())


def _empty() -> Intervals:
    return Intervals([], [])


def merge(starts: Sequence[float], ends: Sequence[float]) -> Intervals:
    """Merge arbitrary intervals into a disjoint sorted set (touching intervals join; an end
    before its start counts as the start)."""
    n = len(starts)
    if n != len(ends):
        raise ValueError(f"starts and ends must be of equal length, got {n} and {len(ends)}")
    if not n:
        return _empty()
    if all(map(le, starts, islice(starts, 1, None))):
        if all(map(lt, ends, islice(starts, 1, None))) and all(map(le, starts, ends)):
            return Intervals(list(starts), list(ends))  # sorted and apart already (checked in C)
        pairs = zip(starts, ends)
    else:  # trace rows come nearly sorted: timsort on the pairs costs little (equal starts may
        pairs = sorted(zip(starts, ends))  # come in any order: they join one group whatever their ends)
    out_s: list[float] = []
    out_e: list[float] = []
    put_s, put_e = out_s.append, out_e.append
    run = -inf
    for x, y in pairs:
        if x > run:  # a new group starts beyond every earlier end
            put_e(run)
            put_s(x)
            run = y if y > x else x
        elif y > run:
            run = y
    out_e.append(run)
    del out_e[0]
    return Intervals(out_s, out_e)


def union(*sets: Intervals) -> Intervals:
    """Union of interval sets."""
    live = [iv for iv in sets if len(iv)]
    if not live:
        return _empty()
    if len(live) == 1:
        return live[0]
    starts: list[float] = []
    ends: list[float] = []
    for iv in live:
        starts += iv.starts
        ends += iv.ends
    return merge(starts, ends)


def _canonical(s: list[float], e: list[float]) -> Intervals:
    """``(s, e)`` (sorted pieces that do not overlap) without zero-length pieces and with
    touching pieces joined: the checks and the repairs run in C."""
    if any(map(eq, s, e)):
        keep = list(map(ne, s, e))
        s, e = list(compress(s, keep)), list(compress(e, keep))
    if len(s) > 1:
        apart = list(map(gt, islice(s, 1, None), e))  # False where a piece touches the next
        if not all(apart):
            if any(map(lt, islice(s, 1, None), e)):  # overlapping pieces: inputs not disjoint
                return merge(s, e)
            apart.append(True)
            s, e = list(compress(s, [True, *apart])), list(compress(e, apart))
    return Intervals(s, e)


def _overlaps(a: Intervals, b: Intervals) -> tuple[list[float], list[float]]:
    """The pieces of ``a ∩ b`` (zero-length ones included), walking ``a`` and slicing ``b``."""
    bs, be = b.starts, b.ends
    out_s: list[float] = []
    out_e: list[float] = []
    for s, e in zip(a.starts, a.ends):
        k0 = bisect_right(be, s)  # b[k0:k1]: the intervals of b that end after s and start before e
        k1 = bisect_left(bs, e, k0)
        if k1 > k0:
            x, y = bs[k0], be[k1 - 1]
            out_s.append(x if x > s else s)
            out_s += bs[k0 + 1 : k1]
            out_e += be[k0 : k1 - 1]
            out_e.append(y if y < e else e)
    return out_s, out_e


def intersect(a: Intervals, b: Intervals) -> Intervals:
    """``a ∩ b`` for two disjoint sorted sets."""
    if not len(a) or not len(b):
        return _empty()
    return _canonical(*(_overlaps(a, b) if len(a) <= len(b) else _overlaps(b, a)))


def _minus_walk_a(a: Intervals, b: Intervals) -> tuple[list[float], list[float]]:
    """Pieces of ``a ∖ b`` (zero-length ones included), walking ``a`` and slicing ``b`` (``a``
    the smaller set): the gaps between the intervals of ``b`` inside each interval of ``a``."""
    bs, be = b.starts, b.ends
    out_s: list[float] = []
    out_e: list[float] = []
    for s, e in zip(a.starts, a.ends):
        k0 = bisect_right(be, s)
        k1 = bisect_left(bs, e, k0)
        if k1 == k0:
            out_s.append(s)
            out_e.append(e)
            continue
        x, y = bs[k0], be[k1 - 1]
        if x > s:
            out_s.append(s)
            out_e.append(x)
        out_s += be[k0 : k1 - 1]
        out_e += bs[k0 + 1 : k1]
        if e > y:
            out_s.append(y)
            out_e.append(e)
    return out_s, out_e


def _minus_walk_b(a: Intervals, b: Intervals) -> tuple[list[float], list[float]]:
    """Pieces of ``a ∖ b``, walking ``b`` and bisecting ``a`` (``b`` the smaller set): the
    intervals of ``a`` between two of ``b`` are copied as slices."""
    a_s, a_e = a.starts, a.ends
    na = len(a_s)
    out_s: list[float] = []
    out_e: list[float] = []
    i = 0
    lead = None  # where a[i] resumes when an earlier interval of b cut its front off
    for x, y in zip(b.starts, b.ends):
        if y <= x:
            continue  # a zero-length cut leaves two touching pieces: nothing
        j = bisect_right(a_e, x, i)  # a[i:j] ends at or before x
        if j > i:
            if lead is not None:
                out_s.append(lead)
                out_e.append(a_e[i])
                lead = None
                i += 1
            out_s += a_s[i:j]
            out_e += a_e[i:j]
            i = j
        while i < na:
            s = a_s[i] if lead is None else lead
            if s >= y:
                break
            if s < x:
                out_s.append(s)
                out_e.append(x)
            if a_e[i] > y:
                lead = y  # a[i] goes on past this interval of b
                break
            lead = None
            i += 1
    if lead is not None:
        out_s.append(lead)
        out_e.append(a_e[i])
        i += 1
    out_s += a_s[i:]
    out_e += a_e[i:]
    return out_s, out_e


def subtract(a: Intervals, b: Intervals) -> Intervals:
    """``a ∖ b`` for two disjoint sorted sets."""
    if not len(a) or not len(b):
        return a
    return _canonical(*(_minus_walk_a(a, b) if len(a) <= len(b) else _minus_walk_b(a, b)))


def clip(a: Intervals, lo: float, hi: float) -> Intervals:
    """The part of ``a`` inside ``[lo, hi]``."""
    if not len(a) or hi <= lo:
        return _empty()
    i = bisect_right(a.ends, lo)
    j = bisect_left(a.starts, hi)
    if j <= i:
        return _empty()
    return Intervals([x if x > lo else lo for x in a.starts[i:j]], [x if x < hi else hi for x in a.ends[i:j]])


def total_us(a: Intervals) -> float:
    """Total length of a disjoint set (summed exactly, :func:`math.fsum`)."""
    return fsum(map(sub, a.ends, a.starts)) if len(a) else 0.0


def measure_in_windows(a: Intervals, lo: Sequence[float], hi: Sequence[float]) -> list[float]:
    """Length of ``a ∩ [lo[k], hi[k]]`` for every window ``k``."""
    if not len(a):
        return [0.0] * len(lo)
    starts, ends = a.starts, a.ends
    widths = list(map(sub, ends, starts))
    cum = list(accumulate(widths, initial=0.0))  # cum[k]: length of the first k intervals

    def covered_before(x: float) -> float:
        k = bisect_right(starts, x)  # intervals starting at or before x
        if not k:
            return 0.0
        k -= 1
        partial = x - starts[k]
        return cum[k] + (0.0 if partial < 0.0 else partial if partial < widths[k] else widths[k])

    out = []
    for x, y in zip(lo, hi):
        d = covered_before(y) - covered_before(x)
        out.append(d if d > 0.0 else 0.0)
    return out
