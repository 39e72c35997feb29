"""Regression check of exposed communication per step, new runs against baseline runs.

What ``cpdpkit profile NEW --baseline OLD --max-regression PCT`` decides with:

* pairing (:func:`pair_runs`): a new run is compared with the baseline run of the same name
  (strategy label, e.g. ``cpdp K=4``) when there is one; else with the baseline run when there
  is exactly one. With several baseline runs and no name in common at all, pairing is refused
  (:class:`~cpdpkit.errors.ConfigError`); with some names in common, a new run without a
  same-named baseline run is left out with a note.
* metric: exposed communication per step (``exposed_us``, the mean over complete steps;
  whole-trace totals for a trace without ``ProfilerStep#N``): the run's mean over ranks
  (``RunSummary.per_step["exposed_us"]``) and every rank present on both sides. A rank present
  on one side only is noted and compared through the run's mean only.
* a value regresses when it grew by more than the limit: ``new > baseline × (1 + PCT / 100)``;
  from a baseline of 0, any exposed time regresses (growth without bound).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cpdpkit.errors import ConfigError
from cpdpkit.profiler._ranks import ranks_text
from cpdpkit.profiler._record import record
from cpdpkit.profiler.report import RankReport, RunReport

__all__ = ["Comparison", "RegressionCheck", "pair_runs", "check_regression", "exposed_per_step_us", "METRIC"]

METRIC = "exposed_us_per_step"


def exposed_per_step_us(rank: RankReport) -> float:
    """Mean exposed communication over the rank's complete steps (whole trace without steps)."""
    steps = rank.full_steps
    return sum(s.exposed_us for s in steps) / len(steps) if steps else rank.exposed_us


@record
class Comparison:
    """One value of a new run against its baseline run: a rank, or the mean over ranks (``rank=None``)."""

    run: str
    run_path: str
    baseline: str
    baseline_path: str
    rank: int | None
    value_us: float
    baseline_us: float
    max_regression_pct: float

    @property
    def change_pct(self) -> float | None:
        """Growth in % of the baseline; ``None`` from a baseline of 0 to more (no finite growth)."""
        if self.baseline_us > 0:
            return (self.value_us - self.baseline_us) / self.baseline_us * 100.0
        return 0.0 if self.value_us <= 0 else None

    @property
    def regressed(self) -> bool:
        return self.value_us > self.baseline_us * (1.0 + self.max_regression_pct / 100.0)

    def to_dict(self) -> dict[str, Any]:
        return {"run": self.run, "run_path": self.run_path, "baseline": self.baseline,
                "baseline_path": self.baseline_path, "rank": self.rank, "exposed_us": self.value_us,
                "baseline_exposed_us": self.baseline_us, "change_pct": self.change_pct,
                "regressed": self.regressed}


@record
class RegressionCheck:
    """Every comparison made, and notes on what could not be compared."""

    max_regression_pct: float
    comparisons: tuple[Comparison, ...]
    notes: tuple[str, ...] = ()

    @property
    def regressions(self) -> tuple[Comparison, ...]:
        return tuple(c for c in self.comparisons if c.regressed)

    @property
    def passed(self) -> bool:
        return not self.regressions

    def to_dict(self) -> dict[str, Any]:
        return {"metric": METRIC, "max_regression_pct": self.max_regression_pct, "passed": self.passed,
                "comparisons": [c.to_dict() for c in self.comparisons], "notes": list(self.notes)}


def _label(run: RunReport) -> str:
    return f"{run.name} ({run.path})"


def pair_runs(new: Sequence[RunReport],
              baseline: Sequence[RunReport]) -> tuple[list[tuple[RunReport, RunReport]], list[str]]:
    """``(new run, its baseline run)`` pairs, and notes on new runs left out (module doc)."""
    if not baseline:
        raise ConfigError("no baseline run to compare with; pass --baseline RUN or PATH")
    by_name = {b.name: b for b in baseline}
    matched = [n for n in new if n.name in by_name]
    if len(baseline) > 1 and not matched:
        names = ", ".join(_label(b) for b in baseline)
        others = ", ".join(n.name for n in new) or "none"
        raise ConfigError(f"{len(baseline)} baseline runs ({names}) and none is named like a run to check "
                          f"({others}); pass one baseline run, or baseline runs named like the new ones")
    pairs: list[tuple[RunReport, RunReport]] = []
    notes: list[str] = []
    for n in new:
        if n.name in by_name:
            pairs.append((n, by_name[n.name]))
        elif len(baseline) == 1:
            pairs.append((n, baseline[0]))
        else:
            notes.append(f"run {_label(n)} not compared: no baseline run is named {n.name!r} "
                         f"(baseline runs: {', '.join(b.name for b in baseline)})")
    return pairs, notes


def _compare_pair(new: RunReport, base: RunReport, limit: float) -> tuple[list[Comparison], list[str]]:
    def one(rank: int | None, value: float, reference: float) -> Comparison:
        return Comparison(new.name, new.path, base.name, base.path, rank, value, reference, limit)

    out = [one(None, new.summary.per_step["exposed_us"], base.summary.per_step["exposed_us"])]
    base_ranks = {r.rank: r for r in base.ranks}
    new_ranks = {r.rank: r for r in new.ranks}
    for rank in sorted(set(new_ranks) & set(base_ranks)):
        out.append(one(rank, exposed_per_step_us(new_ranks[rank]), exposed_per_step_us(base_ranks[rank])))
    notes = []
    only_new = sorted(set(new_ranks) - set(base_ranks))
    only_base = sorted(set(base_ranks) - set(new_ranks))
    if only_new:
        notes.append(f"{ranks_text(only_new)} of run {_label(new)} not in baseline {_label(base)}: "
                     "compared through the mean over ranks only")
    if only_base:
        notes.append(f"{ranks_text(only_base)} of baseline {_label(base)} not in run {_label(new)}: "
                     "compared through the mean over ranks only")
    return out, notes


def check_regression(pairs: Sequence[tuple[RunReport, RunReport]], max_regression_pct: float, *,
                     notes: Sequence[str] = ()) -> RegressionCheck:
    """Compare every pair's exposed communication per step: the mean over ranks, then each common
    rank. ``notes`` (from :func:`pair_runs`) come first in the result's notes."""
    if not max_regression_pct >= 0:
        raise ConfigError(f"max_regression_pct {max_regression_pct!r} must be a percentage >= 0, such as 10")
    comparisons: list[Comparison] = []
    remarks = list(notes)
    for new, base in pairs:
        found, more = _compare_pair(new, base, max_regression_pct)
        comparisons.extend(found)
        remarks.extend(more)
    return RegressionCheck(max_regression_pct, tuple(comparisons), tuple(remarks))
