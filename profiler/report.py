"""The profiler's results: frozen dataclasses that serialise to the documented JSON schema.

``OverlapReport.to_dict()`` produces::

    {"runs": [{"name", "path", "strategy", "run_info", "summary",
               "ranks": [{"rank", "path", "mode", "comm_us", "exposed_us", "hidden_us",
                          "compute_us", "overlap_pct", "by_kind", "by_process_group",
                          "by_tier", "steps": [...]}]}],
     "errors": [{"path", "error"}]}

All times are microseconds. Reports hold data only; rendering lives in the CLI.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = [
    "CommTotals",
    "StepReport",
    "RankReport",
    "RunSummary",
    "RunReport",
    "TraceIssue",
    "OverlapReport",
    "summarize_ranks",
]


def _frozen_map(value: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType(dict(value or {}))


def _pct(part: float, whole: float) -> float:
    return 100.0 * part / whole if whole > 0 else 0.0


@dataclass(frozen=True)
class CommTotals:
    """Communication time of one slice (a kind, a process group, a tier), split in two."""

    comm_us: float
    exposed_us: float
    hidden_us: float

    @property
    def overlap_pct(self) -> float:
        return _pct(self.hidden_us, self.comm_us)

    def to_dict(self) -> dict[str, float]:
        return {"comm_us": self.comm_us, "exposed_us": self.exposed_us, "hidden_us": self.hidden_us}


def _totals_dict(items: Mapping[str, CommTotals]) -> dict[str, dict[str, float]]:
    return {key: value.to_dict() for key, value in items.items()}


@dataclass(frozen=True)
class StepReport:
    """One ``ProfilerStep#N`` of one rank. ``partial`` marks the step left open at exit."""

    step: int
    duration_us: float
    compute_us: float
    comm_us: float
    exposed_us: float
    hidden_us: float
    by_kind: Mapping[str, CommTotals] = field(default_factory=dict)
    partial: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_kind", _frozen_map(self.by_kind))

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "duration_us": self.duration_us,
            "compute_us": self.compute_us,
            "comm_us": self.comm_us,
            "exposed_us": self.exposed_us,
            "hidden_us": self.hidden_us,
            "by_kind": _totals_dict(self.by_kind),
            "partial": self.partial,
        }


@dataclass(frozen=True)
class RankReport:
    """Exposed and hidden communication of one rank's trace.

    ``mode`` is ``"gpu"`` (GPU kernels: NCCL vs compute kernels, HTA's definition) or
    ``"cpu"`` (gloo and annotated communication vs the training thread's ops).
    ``by_process_group`` maps a process-group name to its totals plus ``desc``/``ranks``.
    """

    rank: int
    path: str
    mode: str
    span_us: float
    compute_us: float
    comm_us: float
    exposed_us: float
    hidden_us: float
    by_kind: Mapping[str, CommTotals]
    by_process_group: Mapping[str, CommTotals]
    by_tier: Mapping[str, CommTotals]
    steps: tuple[StepReport, ...] = ()
    process_groups: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("by_kind", "by_process_group", "by_tier", "process_groups"):
            object.__setattr__(self, name, _frozen_map(getattr(self, name)))

    @property
    def overlap_pct(self) -> float:
        """Hidden share of communication, ``hidden / comm × 100`` (HTA's overlap %)."""
        return _pct(self.hidden_us, self.comm_us)

    @property
    def full_steps(self) -> tuple[StepReport, ...]:
        return tuple(s for s in self.steps if not s.partial)

    def to_dict(self, *, per_step: bool = True) -> dict[str, Any]:
        pgs = {}
        for name, totals in self.by_process_group.items():
            pgs[name] = {**dict(self.process_groups.get(name, {})), **totals.to_dict()}
        out: dict[str, Any] = {
            "rank": self.rank,
            "path": self.path,
            "mode": self.mode,
            "span_us": self.span_us,
            "compute_us": self.compute_us,
            "comm_us": self.comm_us,
            "exposed_us": self.exposed_us,
            "hidden_us": self.hidden_us,
            "overlap_pct": self.overlap_pct,
            "num_steps": len(self.full_steps),
            "by_kind": _totals_dict(self.by_kind),
            "by_process_group": pgs,
            "by_tier": _totals_dict(self.by_tier),
        }
        if per_step:
            out["steps"] = [s.to_dict() for s in self.steps]
        return out


def _spread(values: list[float]) -> dict[str, float]:
    if not values:
        return {"min": 0.0, "median": 0.0, "max": 0.0}
    return {"min": min(values), "median": float(statistics.median(values)), "max": max(values)}


@dataclass(frozen=True)
class RunSummary:
    """Across the ranks of one run.

    ``per_step`` holds per-step means (over the complete steps of every rank, then over
    ranks) of ``step_time_us``, ``compute_us``, ``comm_us``, ``exposed_us``, ``hidden_us``;
    without ``ProfilerStep`` markers, whole-trace totals stand in. ``spread`` holds
    min/median/max across ranks of the rank totals; ``exposed_skew_us`` is max − min of
    exposed time; ``slowest_rank`` is the rank with the most compute (the one the others
    wait for) and ``most_exposed_rank`` the one that waits longest.
    """

    num_ranks: int
    per_step: Mapping[str, float]
    spread: Mapping[str, Mapping[str, float]]
    exposed_skew_us: float
    slowest_rank: int | None
    most_exposed_rank: int | None

    def __post_init__(self) -> None:
        object.__setattr__(self, "per_step", _frozen_map(self.per_step))
        object.__setattr__(self, "spread", _frozen_map({k: _frozen_map(v) for k, v in self.spread.items()}))

    @property
    def overlap_pct(self) -> float:
        return _pct(self.per_step.get("hidden_us", 0.0), self.per_step.get("comm_us", 0.0))

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_ranks": self.num_ranks,
            "per_step": dict(self.per_step),
            "overlap_pct": self.overlap_pct,
            "spread": {k: dict(v) for k, v in self.spread.items()},
            "exposed_skew_us": self.exposed_skew_us,
            "slowest_rank": self.slowest_rank,
            "most_exposed_rank": self.most_exposed_rank,
        }


_PER_STEP_KEYS = ("step_time_us", "compute_us", "comm_us", "exposed_us", "hidden_us")


def _rank_per_step(r: RankReport) -> dict[str, float]:
    steps = r.full_steps
    if not steps:
        return {"step_time_us": r.span_us, "compute_us": r.compute_us, "comm_us": r.comm_us,
                "exposed_us": r.exposed_us, "hidden_us": r.hidden_us}
    n = len(steps)
    return {
        "step_time_us": sum(s.duration_us for s in steps) / n,
        "compute_us": sum(s.compute_us for s in steps) / n,
        "comm_us": sum(s.comm_us for s in steps) / n,
        "exposed_us": sum(s.exposed_us for s in steps) / n,
        "hidden_us": sum(s.hidden_us for s in steps) / n,
    }


def summarize_ranks(ranks: tuple[RankReport, ...]) -> RunSummary:
    """Cross-rank summary of one run."""
    if not ranks:
        return RunSummary(0, {k: 0.0 for k in _PER_STEP_KEYS}, {}, 0.0, None, None)
    per_rank = [_rank_per_step(r) for r in ranks]
    per_step = {k: statistics.fmean(p[k] for p in per_rank) for k in _PER_STEP_KEYS}
    spread = {
        key: _spread([getattr(r, key) for r in ranks])
        for key in ("compute_us", "comm_us", "exposed_us", "hidden_us", "overlap_pct")
    }
    spread["step_time_us"] = _spread([p["step_time_us"] for p in per_rank])
    exposed = [r.exposed_us for r in ranks]
    return RunSummary(
        num_ranks=len(ranks),
        per_step=per_step,
        spread=spread,
        exposed_skew_us=max(exposed) - min(exposed),
        slowest_rank=max(ranks, key=lambda r: r.compute_us).rank,
        most_exposed_rank=max(ranks, key=lambda r: r.exposed_us).rank,
    )


@dataclass(frozen=True)
class TraceIssue:
    """A file or folder that could not be analysed, with the one-line reason."""

    path: str
    error: str

    def to_dict(self) -> dict[str, str]:
        return {"path": self.path, "error": self.error}


@dataclass(frozen=True)
class RunReport:
    """One run folder (or a single trace file): its ranks and their cross-rank summary."""

    name: str
    path: str
    strategy: str | None
    run_info: Mapping[str, Any]
    ranks: tuple[RankReport, ...]
    summary: RunSummary

    def __post_init__(self) -> None:
        object.__setattr__(self, "run_info", _frozen_map(self.run_info))

    def to_dict(self, *, per_step: bool = True) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": self.path,
            "strategy": self.strategy,
            "run_info": dict(self.run_info),
            "summary": self.summary.to_dict(),
            "ranks": [r.to_dict(per_step=per_step) for r in self.ranks],
        }


@dataclass(frozen=True)
class OverlapReport:
    """Everything ``cpdpkit profile`` reports: one :class:`RunReport` per run, plus errors."""

    runs: tuple[RunReport, ...]
    errors: tuple[TraceIssue, ...] = ()

    def run(self, name: str) -> RunReport:
        """The run called ``name`` (its strategy or folder name)."""
        for r in self.runs:
            if r.name == name:
                return r
        raise KeyError(f"no run named {name!r}; runs: {[r.name for r in self.runs]}")

    def to_dict(self, *, per_step: bool = True) -> dict[str, Any]:
        return {
            "runs": [r.to_dict(per_step=per_step) for r in self.runs],
            "errors": [e.to_dict() for e in self.errors],
        }
