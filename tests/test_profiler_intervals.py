"""Interval algebra: hand-computed cases (pure, no traces)."""

from __future__ import annotations

import numpy as np
import pytest

from cpdpkit.profiler import intervals as iv

pytestmark = pytest.mark.timeout(30)


def _set(*pairs: tuple[float, float]) -> iv.Intervals:
    return iv.merge(np.array([p[0] for p in pairs], float), np.array([p[1] for p in pairs], float))


def _pairs(x: iv.Intervals) -> list[tuple[float, float]]:
    return list(zip(x.starts.tolist(), x.ends.tolist()))


def test_merge_sorts_joins_overlapping_and_touching() -> None:
    assert _pairs(_set((5, 7), (0, 2), (1, 3), (3, 4), (10, 12), (11, 11.5))) == [(0, 4), (5, 7), (10, 12)]


def test_merge_nested_and_empty() -> None:
    assert _pairs(_set((0, 10), (2, 3), (4, 9))) == [(0, 10)]
    assert len(iv.merge(np.empty(0), np.empty(0))) == 0


def test_merge_rejects_shape_mismatch() -> None:
    with pytest.raises(ValueError, match="equal length"):
        iv.merge(np.zeros(2), np.zeros(3))


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


def test_union_clip_and_windows() -> None:
    u = iv.union(_set((0, 2)), _set((1, 5)), iv.EMPTY, _set((8, 9)))
    assert _pairs(u) == [(0, 5), (8, 9)]
    assert _pairs(iv.clip(u, 3, 8.5)) == [(3, 5), (8, 8.5)]
    got = iv.measure_in_windows(u, np.array([0, 3, 5, -10, 100]), np.array([10, 8.5, 8, 0.5, 200]))
    assert got.tolist() == [6, 2.5, 0, 0.5, 0]


def test_random_against_bitmap() -> None:
    rng = np.random.default_rng(0)
    for _ in range(30):
        def rand_set() -> tuple[iv.Intervals, np.ndarray]:
            s = rng.integers(0, 200, 15)
            e = s + rng.integers(0, 30, 15)
            bits = np.zeros(260, bool)
            for a, b in zip(s, e):
                bits[a:b] = True
            return iv.merge(s, e), bits
        (a, abits), (b, bbits) = rand_set(), rand_set()
        assert iv.total_us(a) == abits.sum()
        assert iv.total_us(iv.intersect(a, b)) == (abits & bbits).sum()
        assert iv.total_us(iv.subtract(a, b)) == (abits & ~bbits).sum()
        assert iv.total_us(iv.union(a, b)) == (abits | bbits).sum()
