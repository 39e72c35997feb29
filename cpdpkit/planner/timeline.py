"""The records of the two-stage exchange schedule: one step's timeline on the slow link.

:class:`TwoStageSchedule` (a :class:`~cpdpkit.planner.plan.ShardingPlan` carries one) and its
parts: the per-unit compute times it was built from (:class:`UnitTiming`), each unit's
scheduled exchange (:class:`ExchangeSlot`) and the link's busy intervals (:class:`LinkInterval`).
Data only, JSON round-trippable; :mod:`cpdpkit.planner.schedule` holds the timeline model and
the algorithm that fills these in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cpdpkit.planner.config import PlannerError, Record

__all__ = ["UnitTiming", "ExchangeSlot", "LinkInterval", "TwoStageSchedule", "EPS_S", "check_seconds"]

EPS_S = 1e-12  # float slack when comparing times, in seconds


def check_seconds(name: str, value: Any) -> None:
    """Raise :class:`PlannerError` unless ``value`` is a finite number of seconds >= 0."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
    if not ok:
        raise PlannerError(f"{name} = {value!r} is invalid; use a finite number of seconds >= 0")


@dataclass(frozen=True, kw_only=True)
class UnitTiming(Record):
    """Measured or estimated compute seconds of one unit's forward and backward on one rank."""

    name: str
    forward_s: float
    backward_s: float

    def __post_init__(self) -> None:
        check_seconds(f"{self.name}.forward_s", self.forward_s)
        check_seconds(f"{self.name}.backward_s", self.backward_s)


@dataclass(frozen=True, kw_only=True)
class ExchangeSlot(Record):
    """One unit's updated-parameter all-gather across replicas, as scheduled.

    ``release_s``: its update is done (reduce-scatter end + update; with clipping, the last
    reduce-scatter's end + the norm's all-reduce + update); ``deadline_s``: its next
    forward starts if nothing waits; ``stage`` 1 ends by the end of backward, 2 during the next
    forward; ``order``: position on the link among exchanges; ``wait_s``: how long the next
    forward actually waits for it (the exposed time it causes).
    """

    unit: str
    num_bytes: int
    tier: str | None
    grad_ready_s: float
    release_s: float
    deadline_s: float
    duration_s: float
    start_s: float
    end_s: float
    stage: int
    order: int
    wait_s: float

    @property
    def late_s(self) -> float:
        """How far the exchange ends past its deadline (0 when on time)."""
        return max(0.0, self.end_s - self.deadline_s)


@dataclass(frozen=True, kw_only=True)
class LinkInterval(Record):
    """A busy interval of the slow link: ``kind`` is ``reduce_scatter`` or ``all_gather``."""

    kind: str
    unit: str
    start_s: float
    end_s: float


@dataclass(frozen=True, kw_only=True)
class TwoStageSchedule(Record):
    """The exchange schedule of one step (see :mod:`cpdpkit.planner.schedule` for the model).

    ``slots`` are in plan (forward) order; ``link_intervals`` in time order. ``*_exposed_s`` is
    what the next forward waits on exchanges; ``*_makespan_s`` the end of the next forward.
    ``clip``: the step clips the gradient (every release waits for the last reduce-scatter and
    the ``norm_s`` scalar all-reduce of the global norm).
    """

    algorithm: str
    tier: str | None
    update_s: float
    backward_s: float
    forward_s: float
    timings: tuple[UnitTiming, ...]
    slots: tuple[ExchangeSlot, ...]
    link_intervals: tuple[LinkInterval, ...]
    exposed_s: float
    makespan_s: float
    naive_exposed_s: float
    naive_makespan_s: float
    lower_bound_exposed_s: float
    clip: bool = False
    norm_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("timings", "slots", "link_intervals"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    @property
    def num_stage1(self) -> int:
        return sum(s.stage == 1 for s in self.slots)

    @property
    def num_stage2(self) -> int:
        return sum(s.stage == 2 for s in self.slots)

    @property
    def deadline_misses(self) -> tuple[ExchangeSlot, ...]:
        """Slots that end after their deadline (the forward may wait on them)."""
        return tuple(s for s in self.slots if s.late_s > EPS_S)

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        for name in ("timings", "slots", "link_intervals"):
            out[name] = [x.to_dict() for x in out[name]]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TwoStageSchedule:
        return cls(**{**data, "timings": tuple(UnitTiming.from_dict(t) for t in data["timings"]),
                      "slots": tuple(ExchangeSlot.from_dict(s) for s in data["slots"]),
                      "link_intervals": tuple(LinkInterval.from_dict(i) for i in data["link_intervals"])})
