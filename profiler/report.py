"""The profiler's results: frozen dataclasses that serialise to the documented JSON schema.

``OverlapReport.to_dict()`` produces::

    {"runs": [{"name", "path", "strategy", "run_info", "summary", "what_if",
               "ranks": [{"rank", "path", "mode", "comm_us", "exposed_us", "hidden_us",
                          "compute_us", "overlap_pct", "by_kind", "by_process_group",
                          "by_tier", "skew_us", "transfer_us", "skew_by_kind",
                          "steps": [...]}]}],
     "errors": [{"path", "error"}]}

All times are microseconds; ``overlap_pct`` is ``None`` (JSON ``null``) where there is no
communication. Reports hold data only; rendering lives in the CLI.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import field
from types import MappingProxyType
from typing import Any

from cpdpkit.profiler._record import record
from cpdpkit.profiler._stats import fmean, median

__all__ = [
    "CommTotals",
    "WaitSplit",
    "StepReport",
    "RankReport",
    "RunSummary",
    "RunReport",
    "TraceIssue",
    "WhatIf",
    "OverlapReport",
    "summarize_ranks",
]


def _frozen_map(value: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType(dict(value or {}))


def _pct(part: float, whole: float) -> float | None:
    """``part / whole`` in %; ``None`` without communication (HTA: NaN), never a misleading 0 %."""
    return 100.0 * part / whole if whole > 0 else None


@record
class CommTotals:
    """Communication time of one slice (a kind, a process group, a tier), split in two."""

    comm_us: float
    exposed_us: float
    hidden_us: float

    @property
    def overlap_pct(self) -> float | None:
        """Hidden share of this slice's communication in %; ``None`` when it has none."""
        return _pct(self.hidden_us, self.comm_us)

    def to_dict(self) -> dict[str, float]:
        return {"comm_us": self.comm_us, "exposed_us": self.exposed_us, "hidden_us": self.hidden_us}


def _totals_dict(items: Mapping[str, CommTotals]) -> dict[str, dict[str, float]]:
    return {key: value.to_dict() for key, value in items.items()}


@record
class WaitSplit:
    """Exposed communication split in two (:mod:`cpdpkit.profiler.crossrank`): ``skew_us``
    waiting for the last rank to arrive, ``transfer_us`` the rest."""

    skew_us: float
    transfer_us: float

    def to_dict(self) -> dict[str, float]:
        return {"skew_us": self.skew_us, "transfer_us": self.transfer_us}


@record
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
    skew_us: float | None = None  # the cross-rank split of exposed_us (None: not made)
    transfer_us: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_kind", _frozen_map(self.by_kind))

    @property
    def overlap_pct(self) -> float | None:
        """Hidden share of the step's communication in %; ``None`` when the step has none."""
        return _pct(self.hidden_us, self.comm_us)

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
            "skew_us": self.skew_us,
            "transfer_us": self.transfer_us,
        }


@record
class RankReport:
    """Exposed and hidden communication of one rank's trace.

    ``mode`` is ``"gpu"`` (GPU kernels: NCCL vs compute kernels, HTA's definition) or
    ``"cpu"`` (gloo and annotated communication vs the training thread's ops).
    ``by_process_group`` maps a process-group name to its totals plus ``desc``/``ranks``.
    ``skew_us``/``transfer_us`` (and per kind ``skew_by_kind``) split ``exposed_us`` into
    waiting for the last rank and the rest (:mod:`cpdpkit.profiler.crossrank`; ``None``/``{}``
    when the run's ranks could not be matched); ``collectives`` is that analysis' input,
    dropped once the run is analysed.
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
    skew_us: float | None = None
    transfer_us: float | None = None
    skew_by_kind: Mapping[str, WaitSplit] = field(default_factory=dict)
    collectives: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("by_kind", "by_process_group", "by_tier", "process_groups"):
            object.__setattr__(self, name, _frozen_map(getattr(self, name)))
        object.__setattr__(self, "skew_by_kind", _frozen_map(self.skew_by_kind))

    @property
    def overlap_pct(self) -> float | None:
        """Hidden share of communication, ``hidden / comm × 100`` (HTA's overlap %);
        ``None`` ("no communication") for a rank without any, where HTA gives NaN."""
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
            "skew_us": self.skew_us,
            "transfer_us": self.transfer_us,
            "skew_by_kind": {kind: split.to_dict() for kind, split in self.skew_by_kind.items()},
        }
        if per_step:
            out["steps"] = [s.to_dict() for s in self.steps]
        return out


def _spread(values: list[float]) -> dict[str, float]:
    if not values:
        return {"min": 0.0, "median": 0.0, "max": 0.0}
    return {"min": min(values), "median": float(median(values)), "max": max(values)}


def _overlap_spread(ranks: tuple[RankReport, ...]) -> dict[str, float | None]:
    """Min/median/max overlap % over the ranks that communicate; ``None`` each when none does."""
    values = [r.overlap_pct for r in ranks if r.overlap_pct is not None]
    return _spread(values) if values else {"min": None, "median": None, "max": None}


@record
class RunSummary:
    """Across the ranks of one run.

    ``per_step`` holds per-step means (over the complete steps of every rank, then over
    ranks) of ``step_time_us``, ``compute_us``, ``comm_us``, ``exposed_us``, ``hidden_us``;
    without ``ProfilerStep`` markers, whole-trace totals stand in. ``spread`` holds
    min/median/max across ranks of the rank totals; ``exposed_skew_us`` is max − min of
    exposed time; ``slowest_rank`` is the rank with the most compute (the one the others
    wait for) and ``most_exposed_rank`` the one that waits longest.

    The cross-rank split (:mod:`cpdpkit.profiler.crossrank`) adds ``skew_us`` (waiting for the
    last rank to arrive) and ``transfer_us`` (the rest of ``exposed_us``) to ``per_step``, and
    ``stragglers``: ``{"rank", "late_count", "late_frac", "caused_wait_us_per_step"}`` per rank
    that arrived last, worst first. Without the split those are ``None``.
    """

    num_ranks: int
    per_step: Mapping[str, float]
    spread: Mapping[str, Mapping[str, float]]
    exposed_skew_us: float
    slowest_rank: int | None
    most_exposed_rank: int | None
    stragglers: tuple[Mapping[str, Any], ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "per_step", _frozen_map(self.per_step))
        if self.stragglers is not None:
            object.__setattr__(self, "stragglers", tuple(_frozen_map(s) for s in self.stragglers))
        object.__setattr__(self, "spread", _frozen_map({k: _frozen_map(v) for k, v in self.spread.items()}))

    @property
    def overlap_pct(self) -> float | None:
        """Hidden share of the per-step communication in %; ``None`` when no rank communicates."""
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
            "stragglers": None if self.stragglers is None else [dict(s) for s in self.stragglers],
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


def _rank_split_per_step(r: RankReport) -> tuple[float, float] | None:
    """Per-step means of the rank's skew/transfer split; ``None`` when it was not made."""
    steps = r.full_steps
    if not steps:
        return None if r.skew_us is None or r.transfer_us is None else (r.skew_us, r.transfer_us)
    skews = [s.skew_us for s in steps if s.skew_us is not None]
    transfers = [s.transfer_us for s in steps if s.transfer_us is not None]
    if len(skews) < len(steps) or len(transfers) < len(steps):
        return None
    return sum(skews) / len(steps), sum(transfers) / len(steps)


def summarize_ranks(ranks: tuple[RankReport, ...], *,
                    stragglers: tuple[Mapping[str, Any], ...] | None = None) -> RunSummary:
    """Cross-rank summary of one run (``stragglers`` from :func:`cpdpkit.profiler.crossrank.cross_rank`)."""
    if not ranks:
        return RunSummary(0, {**{k: 0.0 for k in _PER_STEP_KEYS}, "skew_us": None, "transfer_us": None},
                          {}, 0.0, None, None)
    per_rank = [_rank_per_step(r) for r in ranks]
    per_step: dict[str, Any] = {k: fmean(p[k] for p in per_rank) for k in _PER_STEP_KEYS}
    splits = [split for r in ranks if (split := _rank_split_per_step(r)) is not None]
    for i, key in enumerate(("skew_us", "transfer_us")):
        per_step[key] = fmean(s[i] for s in splits) if len(splits) == len(ranks) else None
    spread = {
        key: _overlap_spread(ranks) if key == "overlap_pct" else _spread([getattr(r, key) for r in ranks])
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
        stragglers=stragglers,
    )


@record
class TraceIssue:
    """A file or folder that could not be analysed, with the one-line reason."""

    path: str
    error: str
    warning: bool = False  # the rest was analysed (missing ranks); ``cpdpkit profile --strict`` exits 2 anyway
    # the traceback of the exception behind the issue, if one was raised (``cpdpkit --debug
    # profile`` prints it); not in the JSON, not compared
    traceback: str | None = field(default=None, compare=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "error": self.error, **({"warning": True} if self.warning else {})}


@record
class WhatIf:
    """The run's step predicted on another topology (:mod:`cpdpkit.profiler.whatif`): per-step
    means over complete steps and ranks, as ``RunSummary.per_step``; ``unmodeled_collectives``
    counts the collectives that kept their measured duration (bytes or group unknown)."""

    topology: str
    step_time_us: float
    exposed_us: float
    unmodeled_collectives: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"topology": self.topology,
                "per_step": {"step_time_us": self.step_time_us, "exposed_us": self.exposed_us},
                "unmodeled_collectives": self.unmodeled_collectives}


@record
class RunReport:
    """One run folder (or a single trace file): its ranks and their cross-rank summary;
    ``what_if`` only when asked (``analyze(..., what_if=TOPOLOGY)``), ``timeline`` (a
    :class:`cpdpkit.profiler.timeline.RunTimeline`, not in the JSON) with ``timeline=True``."""

    name: str
    path: str
    strategy: str | None
    run_info: Mapping[str, Any]
    ranks: tuple[RankReport, ...]
    summary: RunSummary
    what_if: WhatIf | None = None
    timeline: Any = field(default=None, compare=False, repr=False)

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
            "what_if": self.what_if.to_dict() if self.what_if is not None else None,
        }


@record
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
