"""Interval algebra: hand-computed cases, and random sets against a bitmap (pure, no traces)."""

from __future__ import annotations

import random

import pytest

from cpdpkit.profiler import intervals as iv

pytestmark = pytest.mark.timeout(30)


def _set(*pairs: tuple[float, float]) -> iv.Intervals:
    return iv.merge([float(p[0]) for p in pairs], [float(p[1]) for p in pairs])


def _pairs(x: iv.Intervals) -> list[tuple[float, float]]:
    return list(zip(x.starts, x.ends))


def test_merge_sorts_joins_overlapping_and_touching() -> None:
    assert _pairs(_set((5, 7), (0, 2), (1, 3), (3, 4), (10, 12), (11, 11.5))) == [(0, 4), (5, 7), (10, 12)]


def test_merge_nested_and_empty() -> None:
    assert _pairs(_set((0, 10), (2, 3), (4, 9))) == [(0, 10)]
    assert len(iv.merge([], [])) == 0


def test_merge_keeps_isolated_points_and_clamps_reversed_ends() -> None:
    assert _pairs(_set((3, 3), (0, 1), (1, 1), (5, 4))) == [(0, 1), (3, 3), (5, 5)]


def test_merge_rejects_shape_mismatch() -> None:
    with pytest.raises(ValueError, match="equal length"):
        iv.merge([0.0, 0.0], [0.0, 0.0, 0.0])


def test_intersect_and_subtract() -> None:
    comm = _set((0, 10), (20, 30))
    comp = _set((5, 25), (28, 40))
    assert _pairs(iv.intersect(comm, comp)) == [(5, 10), (20, 25), (28, 30)]
    assert _pairs(iv.subtract(comm, comp)) == [(0, 5), (25, 28)]
    assert iv.total_us(iv.intersect(comm, comp)) + iv.total_us(iv.subtract(comm, comp)) == iv.total_us(comm)


def test_touching_boundaries_have_no_zero_length_pieces() -> None:
    a, b = _set((0, 5)), _set((5, 10))
    assert len(iv.intersect(a, b)) == 0
    assert _pairs(iv.subtract(a, b)) == [(0, 5)]
    assert _pairs(iv.subtract(_set((0, 10)), _set((0, 10)))) == []
    # a zero-length interval of b cuts nothing; one of a leaves nothing
    assert _pairs(iv.subtract(_set((0, 10)), _set((4, 4), (20, 30)))) == [(0, 10)]
    assert _pairs(iv.subtract(_set((2, 2), (5, 6)), _set((0, 1)))) == [(5, 6)]
    assert _pairs(iv.intersect(_set((2, 2), (5, 6)), _set((0, 10)))) == [(5, 6)]


def test_union_clip_and_windows() -> None:
    u = iv.union(_set((0, 2)), _set((1, 5)), iv.EMPTY, _set((8, 9)))
    assert _pairs(u) == [(0, 5), (8, 9)]
    assert _pairs(iv.clip(u, 3, 8.5)) == [(3, 5), (8, 8.5)]
    got = iv.measure_in_windows(u, [0, 3, 5, -10, 100], [10, 8.5, 8, 0.5, 200])
    assert got == [6, 2.5, 0, 0.5, 0]
    assert iv.measure_in_windows(iv.EMPTY, [0, 1], [2, 3]) == [0.0, 0.0]


def _runs(bits: list[bool]) -> list[tuple[float, float]]:
    """The set a bitmap of unit cells holds, as maximal intervals."""
    out: list[tuple[float, float]] = []
    for k, on in enumerate(bits):
        if on and out and out[-1][1] == k:
            out[-1] = (out[-1][0], k + 1.0)
        elif on:
            out.append((float(k), k + 1.0))
    return out


@pytest.mark.parametrize("sizes", [(15, 15), (3, 40), (40, 3), (1, 60)])
def test_random_against_bitmap(sizes: tuple[int, int]) -> None:
    rng = random.Random(0)
    for _ in range(30):
        def rand_set(n: int) -> tuple[iv.Intervals, list[bool]]:
            s = [rng.randrange(200) for _ in range(n)]
            e = [x + rng.randrange(30) for x in s]  # zero-length and touching intervals included
            bits = [False] * 260
            for a, b in zip(s, e):
                bits[a:b] = [True] * (b - a)
            return iv.merge([float(x) for x in s], [float(x) for x in e]), bits
        (a, abits), (b, bbits) = rand_set(sizes[0]), rand_set(sizes[1])
        both = [x and y for x, y in zip(abits, bbits)]
        only_a = [x and not y for x, y in zip(abits, bbits)]
        either = [x or y for x, y in zip(abits, bbits)]
        assert iv.total_us(a) == sum(abits)
        # intersection and difference come out in the one canonical form: the bitmap's runs
        assert _pairs(iv.intersect(a, b)) == _runs(both)
        assert _pairs(iv.intersect(b, a)) == _runs(both)
        assert _pairs(iv.subtract(a, b)) == _runs(only_a)
        assert iv.total_us(iv.union(a, b)) == sum(either)
        lo = [float(rng.randrange(-10, 250)) for _ in range(8)]
        hi = [x + rng.randrange(0, 60) for x in lo]
        assert iv.measure_in_windows(a, lo, hi) == [sum(abits[max(int(x), 0):max(int(y), 0)]) for x, y in zip(lo, hi)]
