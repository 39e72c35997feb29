"""The profiler's median and mean equal the statistics module's (which it no longer imports: startup)."""

from __future__ import annotations

import random
import statistics

import pytest

from cpdpkit.profiler._stats import fmean, median


def test_equal_to_statistics_on_random_data():
    rng = random.Random(5)
    for n in range(1, 60):
        for values in ([rng.uniform(-1e6, 1e6) for _ in range(n)], [rng.randrange(-50, 50) for _ in range(n)],
                       [rng.choice([0.1, 0.2, 0.3, 1e16, -1e16]) for _ in range(n)]):
            assert median(values) == statistics.median(values)
            assert median(iter(values)) == statistics.median(values)
            assert fmean(values) == statistics.fmean(values)


def test_no_values_is_an_error_as_in_statistics():
    for fn in (median, fmean):
        with pytest.raises(ValueError):
            fn([])
