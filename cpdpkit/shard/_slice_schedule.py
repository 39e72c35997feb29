"""What the two-stage schedule means at run time, and the measurements that recalibrate it.

Private to the slice executors (:mod:`cpdpkit.shard._slices`). Two parts:

* :func:`stage1_triggers`: from a :class:`~cpdpkit.planner.timeline.TwoStageSchedule` (the
  same on every rank), the point at which each stage-1 exchange is launched: a unit's
  gradient-ready hook during backward, or the end of backward. The rule (see
  :mod:`cpdpkit.shard.executor`, "Stage 1"): the last point in backward order whose
  predicted time (the schedule's ``grad_ready_s`` of that point's unit, ``backward_s`` for the
  end) lies between the slot's ``release_s`` and its ``start_s``. It depends only on the
  schedule, never on thread timing, so every rank issues the replicate group's collectives in
  the same order.
* :class:`UnitClock`: per-unit forward and backward compute seconds and per-unit update
  seconds, measured from the executors' hooks, excluding the time spent inside those hooks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cpdpkit.planner.timeline import EPS_S, TwoStageSchedule

__all__ = ["END", "apply_slots", "stage1_triggers", "UnitClock"]

END = "<end of backward>"  # the trigger key of the end-of-backward point


def apply_slots(units: Sequence[Any], schedule: TwoStageSchedule | None) -> None:
    """Set each unit's ``stage`` and ``order`` from its slot (no slot: stage 2, plan order)."""
    slots = {s.unit: s for s in schedule.slots} if schedule is not None else {}
    for u in units:
        slot = slots.get(u.name)
        u.stage = slot.stage if slot else 2
        u.order = slot.order if slot else len(slots) + u.plan_index


def stage1_triggers(units: Sequence[Any], schedule: TwoStageSchedule | None) -> dict[str, list[Any]]:
    """Trigger point (a unit name or :data:`END`) -> the stage-1 units launched there, in schedule order.

    Points run in backward order: units by increasing ``grad_ready_s`` (ties: later plan
    position first, as backward runs), then :data:`END` at ``backward_s``. A stage-1 slot goes
    to the last point at or after its ``release_s`` and at or before its ``start_s`` (a schedule
    built with ``at_points``, as :func:`~cpdpkit.planner.schedule.plan_two_stage` builds them,
    always has one: the exchange is launched where the schedule starts it, its reduce-scatter
    predicted done); in a schedule without one, the first point at or after ``start_s``.
    """
    out: dict[str, list[Any]] = {}
    if schedule is None:
        return out
    slots = {s.unit: s for s in schedule.slots}
    present = [u for u in units if u.name in slots]
    points = [(p.name, slots[p.name].grad_ready_s)
              for p in sorted(present, key=lambda u: (slots[u.name].grad_ready_s, -u.plan_index))]
    points.append((END, schedule.backward_s))
    for u in sorted((u for u in present if u.stage == 1), key=lambda u: u.order):
        slot = slots[u.name]
        inside = [name for name, t in points if slot.release_s - EPS_S <= t <= slot.start_s + EPS_S]
        point = inside[-1] if inside else next((name for name, t in points if t >= slot.start_s - EPS_S), END)
        out.setdefault(point, []).append(u)
    return out


class UnitClock:
    """Per-unit compute seconds measured from hooks (indexes are plan positions).

    * forward of unit ``i``: from the end of ``i``'s forward pre-hook (after any exchange wait)
      to the start of the next unit's pre-hook, or to the end of the root module's forward for
      the last unit. Only a unit's first pre-hook in a forward counts (merged units have
      several modules). The interval includes FSDP2's shard-axis all-gather of the unit.
    * backward of unit ``i``: from the start of backward (the gradient of the model's output)
      or the end of the previous gradient-ready hook, to the start of ``i``'s gradient-ready
      hook; only synced backwards (those that reach the hooks) count.
    * update: the inner optimizer's step on one unit's slice (mean over all updates).
    * backward (whole): from the start of backward to the end-of-backward callback.
    """

    def __init__(self, num_units: int) -> None:
        self.num_units = num_units
        self.reset()

    def reset(self) -> None:
        n = self.num_units
        self.fwd = [0.0] * n
        self.fwd_n = [0] * n
        self.bwd = [0.0] * n
        self.bwd_n = [0] * n
        self.update_total = 0.0
        self.update_n = 0
        self.backward_total = 0.0
        self.backward_n = 0
        self._open: tuple[int, float] | None = None
        self._seen: set[int] = set()
        self._bwd_start: float | None = None
        self._bwd_mark: float | None = None

    # ---- forward --------------------------------------------------------------------------
    def forward_begin(self) -> None:
        self._open = None
        self._seen.clear()

    def unit_forward_enter(self, i: int, t: float) -> bool:
        """A unit's pre-hook starts; ``False`` when the unit was already seen in this forward."""
        if i in self._seen:
            return False
        self._close_forward(t)
        return True

    def unit_forward_exit(self, i: int, t: float) -> None:
        self._seen.add(i)
        self._open = (i, t)

    def forward_end(self, t: float) -> None:
        self._close_forward(t)

    def _close_forward(self, t: float) -> None:
        if self._open is not None:
            i, start = self._open
            self.fwd[i] += t - start
            self.fwd_n[i] += 1
            self._open = None

    # ---- backward -------------------------------------------------------------------------
    def backward_begin(self, t: float) -> None:
        self._bwd_start = self._bwd_mark = t

    def unit_backward_enter(self, i: int, t: float) -> None:
        if self._bwd_mark is not None:
            self.bwd[i] += t - self._bwd_mark
            self.bwd_n[i] += 1

    def unit_backward_exit(self, t: float) -> None:
        self._bwd_mark = t

    def backward_end(self, t: float) -> None:
        if self._bwd_start is not None:
            self.backward_total += t - self._bwd_start
            self.backward_n += 1
        self._bwd_start = self._bwd_mark = None

    def add_update(self, seconds: float) -> None:
        self.update_total += seconds
        self.update_n += 1

    # ---- means ----------------------------------------------------------------------------
    def means(self) -> tuple[list[float], list[float], float]:
        """Mean forward and backward seconds per unit, and the mean update seconds."""
        fwd = [t / n if n else 0.0 for t, n in zip(self.fwd, self.fwd_n)]
        bwd = [t / n if n else 0.0 for t, n in zip(self.bwd, self.bwd_n)]
        return fwd, bwd, self.update_total / self.update_n if self.update_n else 0.0

    @property
    def mean_backward_s(self) -> float:
        return self.backward_total / self.backward_n if self.backward_n else 0.0
