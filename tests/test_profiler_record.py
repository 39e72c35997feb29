"""``cpdpkit.profiler._record.record`` behaves as ``@dataclass(frozen=True)``: the same class,
declared both ways, gives the same results and the same errors (the profiler's report classes
use ``record`` so that importing them compiles no generated methods)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import pytest

from cpdpkit.profiler import RankReport, StepReport
from cpdpkit.profiler._record import record


def _declare(decorate: Any) -> type:
    @decorate
    class Row:
        x: int
        y: str = "a"
        z: dict = field(default_factory=dict)
        note: Any = field(default=None, compare=False, repr=False)

        def __post_init__(self) -> None:
            if self.x < 0:
                raise ValueError(f"x = {self.x} is negative")

    return Row


PAIR = (_declare(dataclass(frozen=True)), _declare(record))
CALLS = [((), {}), ((1, "b", {}, None, 5), {}), ((1,), {"w": 1}), ((1,), {"x": 2}), ((-1,), {})]


def _outcome(cls: type, args: tuple, kwargs: dict) -> str:
    try:
        return repr(cls(*args, **kwargs))
    except (TypeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"


@pytest.mark.parametrize(("args", "kwargs"), CALLS)
def test_same_errors_for_bad_arguments(args: tuple, kwargs: dict) -> None:
    assert _outcome(PAIR[1], args, kwargs) == _outcome(PAIR[0], args, kwargs)
    assert "Error" in _outcome(PAIR[1], args, kwargs)


def test_same_values_repr_equality_hash_and_dataclass_helpers() -> None:
    made = [(cls(1, y="b"), cls(1, "b", note="ignored"), cls(2)) for cls in PAIR]
    for (a, same, other), (ra, rsame, rother) in zip(made[:1], made[1:]):
        assert repr(ra) == repr(a) and "note" not in repr(ra)
        assert (ra == rsame, ra == rother, ra != rother) == (a == same, a == other, a != other) == (True, False, True)
        assert ra != a  # other classes never compare equal, as with dataclasses
        assert dataclasses.asdict(ra) == dataclasses.asdict(a)
        assert repr(dataclasses.replace(ra, x=5)) == repr(dataclasses.replace(a, x=5))
        assert [f.name for f in dataclasses.fields(ra)] == [f.name for f in dataclasses.fields(a)]
        assert ra.z is not rother.z  # a fresh default per instance
    hashed = [cls(1, z=None) for cls in PAIR]  # type: ignore[arg-type]
    assert hash(hashed[1]) == hash(PAIR[1](1, z=None)) and hash(hashed[0]) == hash(PAIR[0](1, z=None))


def test_frozen_and_keyword_only() -> None:
    row = PAIR[1](1)
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'x'"):
        row.x = 2
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot delete field 'x'"):
        del row.x

    @record(kw_only=True)
    class Limits:
        low: int = 1
        high: int

    with pytest.raises(TypeError, match=r"missing 1 required keyword-only argument: 'high'"):
        Limits()
    with pytest.raises(TypeError, match="takes 1 positional argument but 2 were given"):
        Limits(3)  # type: ignore[misc]
    assert Limits(high=3) == Limits(low=1, high=3)


def test_the_profiler_reports_are_records() -> None:
    step = StepReport(1, 10.0, 4.0, 6.0, 5.0, 1.0)
    assert dataclasses.replace(step, partial=True).partial and not step.partial
    for cls in (StepReport, RankReport):  # the shared __init__, not one that dataclasses generated
        assert cls.__init__.__qualname__ == "_make_init.<locals>.__init__"
