"""One timeline of every rank of a run on one clock, as a Chrome trace (``--timeline FILE``).

Each rank's trace has its own clock (pytorch/pytorch#128292); this puts them on the clock the
cross-rank analysis aligns them on (:func:`cpdpkit.profiler.crossrank.align`: the wall clock
``baseTimeNanoseconds / 1000 + ts``, rank position 0's trace clock as the reference, the
earliest rank at 0), so a rank that reaches a collective late is seen to be late. One Chrome
trace "process" per rank (``<run> rank <R>``), with one "thread" per track:

``steps``
    the ``ProfilerStep#N`` windows of the training thread;
``compute``, ``communication``, ``exposed``, ``hidden``
    the intervals the overlap analysis measured (exposed = communication ∖ compute, hidden =
    communication ∩ compute; on CPU traces communication is only counted while the training
    thread computes or is blocked, so exposed is its blocked time);
``skew``
    the exposed part of the windows in which the rank waits for the last rank of a matched
    collective (what ``skew_us`` sums);
``collectives``
    every collective the cross-rank analysis considered, from its arrival to the end of its
    extent, named by its kind, with ``match`` (its index among the run's matched collectives),
    ``seq``, ``process_group``, ``step`` and, for matched ones, ``straggler`` (the rank that
    arrived last by more than ``LATE_MARGIN_US``, ``null`` for a tie); the straggler's own entry
    has ``late: true`` and an instant event ``straggler`` at its arrival.

Runs are apart: each run's ranks get their own processes, each run's clock starts at 0.
``otherData.cpdpkit_timeline`` says per run whether the clocks were aligned (``aligned``;
else ``problem`` and the ranks each on their own clock) and per rank its process id, trace file,
``offset_us`` (added to its trace clock) and, with wall clocks, ``wall_origin_us``: the Unix
time in µs of the timeline's 0. All numbers are finite (the JSON has no NaN or Infinity).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cpdpkit.profiler import intervals as iv
from cpdpkit.profiler._record import record
from cpdpkit.profiler.crossrank import Alignment, RankCollectives, align
from cpdpkit.profiler.report import OverlapReport, RankReport

__all__ = ["RunTimeline", "TRACKS", "TIMELINE_VERSION", "run_timeline", "timeline_doc"]

TIMELINE_VERSION = 1
TRACKS = ("steps", "compute", "communication", "exposed", "hidden", "skew", "collectives")
_TID = {name: k + 1 for k, name in enumerate(TRACKS)}


@record(eq=False)
class RunTimeline:
    """What the timeline of one run needs, kept by ``analyze(..., timeline=True)`` before the
    per-collective data is dropped: per rank position its rank, trace path and collectives, and
    the alignment (``None``: one rank)."""

    ranks: tuple[int, ...]
    paths: tuple[str, ...]
    cols: tuple[RankCollectives, ...]
    alignment: Alignment | None


def run_timeline(ranks: Sequence[RankReport]) -> RunTimeline | None:
    """The timeline data of ``ranks`` (sorted, collectives attached); ``None`` without collectives."""
    if not ranks or any(r.collectives is None for r in ranks):
        return None
    return RunTimeline(tuple(r.rank for r in ranks), tuple(r.path for r in ranks),
                       tuple(r.collectives for r in ranks), align(ranks))


def _spans(out: list[dict[str, Any]], pid: int, track: str, name: str, x: iv.Intervals, shift: float) -> None:
    tid = _TID[track]
    for a, b in zip(x.starts, x.ends):
        out.append({"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": a + shift, "dur": b - a})


def _meta(pid: int, label: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [
        {"ph": "M", "pid": pid, "tid": 0, "name": "process_name", "args": {"name": label}},
        {"ph": "M", "pid": pid, "tid": 0, "name": "process_sort_index", "args": {"sort_index": pid}},
    ]
    for track, tid in _TID.items():
        out.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": track}})
        out.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}})
    return out


def _collectives(out: list[dict[str, Any]], pid: int, t: RunTimeline, i: int, shift: float,
                 match_of: dict[tuple[int, int], int]) -> None:
    c, al = t.cols[i], t.alignment
    tid = _TID["collectives"]
    for j in range(len(c)):
        a, b = c.arrival_us[j], c.extent_end_us[j]
        args: dict[str, Any] = {"seq": c.seq[j], "process_group": c.pg[j], "step": c.step[j]}
        k = match_of.get((i, j))
        args["match"] = k
        if k is not None and al is not None:
            late = al.late[k]
            args["straggler"] = t.ranks[late] if late >= 0 else None
            args["late"] = late == i
            if late == i:
                out.append({"ph": "i", "s": "p", "pid": pid, "tid": tid, "name": "straggler", "ts": a + shift,
                            "args": {"match": k, "kind": c.kind[j]}})
        out.append({"ph": "X", "pid": pid, "tid": tid, "name": c.kind[j], "ts": a + shift,
                    "dur": max(b - a, 0.0), "args": args})


def _skew(c: RankCollectives, his: Sequence[float], mine: Sequence[int]) -> iv.Intervals:
    windows = iv.merge([c.arrival_us[j] for j in mine], [his[j] for j in mine])
    return iv.intersect(windows, c.blocked) if c.blocked is not None else iv.subtract(windows, c.compute)


def _run_events(t: RunTimeline, run: str, first_pid: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    al = t.alignment
    offsets = list(al.offsets_us) if al is not None and al.problem is None else [0.0] * len(t.cols)
    low = min(offsets)
    match_of = {e: k for k, entries in enumerate(al.entries) for e in entries} if al is not None else {}
    events: list[dict[str, Any]] = []
    ranks_info = []
    for i, (rank, c) in enumerate(zip(t.ranks, t.cols)):
        pid, shift = first_pid + i, offsets[i] - low
        events += _meta(pid, f"{run} rank {rank}")
        for num, lo, hi in c.steps:
            events.append({"ph": "X", "pid": pid, "tid": _TID["steps"], "name": f"ProfilerStep#{num}",
                           "ts": lo + shift, "dur": hi - lo})
        _spans(events, pid, "compute", "compute", c.compute, shift)
        _spans(events, pid, "communication", "communication", c.comm, shift)
        _spans(events, pid, "exposed", "exposed", iv.subtract(c.comm, c.compute), shift)
        _spans(events, pid, "hidden", "hidden", iv.intersect(c.comm, c.compute), shift)
        if al is not None and al.entries:
            mine = [j for (p, j) in match_of if p == i]
            _spans(events, pid, "skew", "skew", _skew(c, al.skew_end_us[i], sorted(mine)), shift)
        _collectives(events, pid, t, i, shift, match_of)
        wall = c.base_ns / 1000.0 + c.origin_us - shift if c.wall_clock else None
        ranks_info.append({"rank": rank, "pid": pid, "path": t.paths[i], "offset_us": shift, "wall_origin_us": wall})
    aligned = al is not None and al.problem is None
    info = {"aligned": aligned, "problem": al.problem if al is not None else None,
            "matched_collectives": len(al.entries) if al is not None else 0, "ranks": ranks_info}
    return events, info


def timeline_doc(report: OverlapReport) -> dict[str, Any]:
    """The Chrome trace (a JSON object) of every run of ``report`` analysed with ``timeline=True``."""
    events: list[dict[str, Any]] = []
    runs = []
    pid = 1
    for run in report.runs:
        t = run.timeline
        if t is None:
            continue
        mine, info = _run_events(t, run.name, pid)
        events += mine
        runs.append({"name": run.name, "path": run.path, **info})
        pid += len(t.cols)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"cpdpkit_timeline": {"version": TIMELINE_VERSION, "clock_us": "aligned per run",
                                               "runs": runs}}}
