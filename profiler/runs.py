"""Finding runs and their rank files, and analysing them into one :class:`OverlapReport`.

A *run* is a folder of per-rank trace files (``*.json`` / ``*.json.gz``, torch-tb-profiler's
``<worker>.pt.trace.json[.gz]`` or any other name; ``run.json`` and hidden files are not
traces) with an optional ``run.json`` (strategy, period, topology, world size). A path
given to :func:`analyze` may be a run folder, a single trace file (a run of one rank), or a
folder whose sub-folders are runs. Rank files are read one at a time and reduced to a
:class:`RankReport` before the next is read, so memory holds one trace at a time. A bad
file or folder becomes a :class:`TraceIssue` and never hides the other results. Which rank a
file holds (``distributedInfo``, run.json's ``"ranks"``, the file name), and the checks for
traces of other runs and missing ranks, are in :mod:`cpdpkit.profiler._ranks`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import orjson

from cpdpkit.profiler._ranks import RankHint, rank_hint, run_json_ranks, settle_ranks
from cpdpkit.profiler._reader import DEFAULT_LIMITS, TraceLimits
from cpdpkit.profiler.crossrank import cross_rank
from cpdpkit.profiler.errors import TraceFileError
from cpdpkit.profiler.overlap import analyze_trace
from cpdpkit.profiler.report import OverlapReport, RankReport, RunReport, TraceIssue, summarize_ranks
from cpdpkit.profiler.trace import load_trace, world_size_in_meta

if TYPE_CHECKING:  # the what-if (and the network model) load only with what_if=
    from cpdpkit.profiler.whatif import RankTimeline

__all__ = ["RUN_JSON", "find_trace_files", "read_run_info", "analyze_run", "analyze", "expand_paths"]

RUN_JSON = "run.json"


def _is_trace_name(name: str) -> bool:
    return (
        not name.startswith(".")
        and name != RUN_JSON
        and (name.endswith(".json") or name.endswith(".json.gz"))
    )


def find_trace_files(folder: str | os.PathLike[str]) -> list[str]:
    """Trace files directly inside ``folder``, sorted by name."""
    folder = os.fspath(folder)
    with os.scandir(folder) as entries:
        return sorted(os.path.join(folder, e.name) for e in entries if e.is_file() and _is_trace_name(e.name))


def read_run_info(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """``folder/run.json`` as a dict ({} when absent); :class:`TraceFileError` if unreadable."""
    path = os.path.join(os.fspath(folder), RUN_JSON)
    if not os.path.exists(path):
        return {}
    try:
        with open(path, "rb") as fh:
            info = orjson.loads(fh.read())
    except OSError as exc:
        raise TraceFileError(path, f"cannot read the file ({exc.strerror or exc})") from None
    except orjson.JSONDecodeError as exc:
        raise TraceFileError(path, f"not valid JSON ({exc})") from None
    if not isinstance(info, dict):
        raise TraceFileError(path, "run.json must hold a JSON object")
    return info


def expand_paths(paths: Iterable[str | os.PathLike[str]]) -> tuple[list[tuple[str, list[str]]], list[TraceIssue]]:
    """Turn user paths into ``(run_path, trace_files)`` pairs, plus issues for bad paths."""
    runs: list[tuple[str, list[str]]] = []
    issues: list[TraceIssue] = []
    for raw in paths:
        path = os.fspath(raw)
        if os.path.isfile(path):
            runs.append((path, [path]))
            continue
        if not os.path.isdir(path):
            issues.append(TraceIssue(path, f"{path}: no such file or folder"))
            continue
        try:
            files = find_trace_files(path)
            subdirs = sorted(e.path for e in os.scandir(path) if e.is_dir() and not e.name.startswith("."))
        except OSError as exc:
            issues.append(_issue(path, f"{path}: cannot list the folder ({exc.strerror or exc})", exc))
            continue
        if files:
            runs.append((path, files))
            continue
        nested = [(d, find_trace_files(d)) for d in subdirs]
        nested = [(d, f) for d, f in nested if f]
        if nested:
            runs.extend(nested)
        else:
            issues.append(TraceIssue(path, f"{path}: no trace files (*.json, *.json.gz) in this folder"))
    return runs, issues


def _with_what_if(report: RunReport, timelines: dict[str, RankTimeline], spec: str,
                  world_sizes: list[int]) -> tuple[RunReport, list[TraceIssue]]:
    """``report`` with its step predicted on the topology ``spec`` (:mod:`cpdpkit.profiler.whatif`).

    World size: run.json's ``world_size``, else the traces' most common one, else the highest
    rank + 1. A topology that cannot be placed at that size is one issue, and no prediction."""
    from cpdpkit.errors import TopologyError
    from cpdpkit.profiler.whatif import predict_run
    from cpdpkit.topology import resolve_topology

    size = report.run_info.get("world_size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        size = max(set(world_sizes), key=world_sizes.count) if world_sizes else max(r.rank for r in report.ranks) + 1
    try:
        topology = resolve_topology(spec, world_size=size)
    except TopologyError as exc:
        return report, [_issue(report.path, f"{report.path}: --what-if {spec}: {exc}", exc)]
    mine = [timelines[r.path] for r in report.ranks if r.path in timelines]
    return dataclasses.replace(report, what_if=predict_run(mine, topology, name=spec, world_size=size)), []


def _issue(path: str, text: str, exc: BaseException) -> TraceIssue:
    """The issue of a caught exception, with its traceback for ``cpdpkit --debug profile``."""
    import traceback  # only when something failed: not on the command's startup path

    return TraceIssue(path, text, traceback="".join(traceback.format_exception(exc)))


def analyze_run(run_path: str, files: Sequence[str], *, name: str | None = None, what_if: str | None = None,
                limits: TraceLimits = DEFAULT_LIMITS,
                timeline: bool = False) -> tuple[RunReport | None, list[TraceIssue]]:
    """Analyse one run's rank files; a run whose every file fails is ``None``. ``what_if``: a
    topology (preset name or TOML path) to predict the run's step on (``RunReport.what_if``);
    ``limits``: the most one trace file may cost (:class:`~cpdpkit.profiler.TraceLimits`);
    ``timeline``: keep what :func:`cpdpkit.profiler.timeline.timeline_doc` needs (``RunReport.timeline``)."""
    issues: list[TraceIssue] = []
    folder = run_path if os.path.isdir(run_path) else os.path.dirname(run_path) or "."
    try:
        info = read_run_info(folder)
    except TraceFileError as exc:
        issues.append(_issue(exc.path, str(exc), exc))
        info = {}
    files = [os.fspath(f) for f in files]
    run_json = os.path.join(folder, RUN_JSON)
    rank_map, map_issues = run_json_ranks(info, run_json, files)
    issues.extend(map_issues)
    ranks: list[RankReport] = []
    hints: list[RankHint] = []
    timelines: dict[str, RankTimeline] = {}  # what-if input, read while each trace is loaded
    world_sizes: list[int] = []
    for index, path in enumerate(files):
        try:
            trace = load_trace(path, limits=limits)
            if trace.num_events == 0:
                raise TraceFileError(path, "no events in 'traceEvents': the profiler recorded nothing (check its "
                                           "schedule's active steps, and that prof.step() is called)")
            hint = rank_hint(path, trace.meta, rank_map)
            ranks.append(analyze_trace(trace, rank=hint.rank if hint.rank is not None else index))
            if not ranks[-1].full_steps:
                issues.append(TraceIssue(path, f"{path}: no complete ProfilerStep#N event, so no step was found: the "
                                               "per-step figures are empty (call prof.step() once per step)",
                                         warning=True))
            if what_if is not None:
                from cpdpkit.profiler.whatif import rank_timeline

                timelines[ranks[-1].path] = rank_timeline(trace, ranks[-1])
                world_sizes.extend(w for w in [world_size_in_meta(trace.meta)] if w is not None)
            hints.append(hint)
        except TraceFileError as exc:
            issues.append(_issue(exc.path, str(exc), exc))
        except MemoryError as exc:
            issues.append(_issue(path, f"{path}: out of memory while reading the trace", exc))
        except Exception as exc:  # noqa: BLE001 - one bad file must not lose the other ranks
            issues.append(_issue(path, f"{path}: cannot analyse the trace ({type(exc).__name__}: {exc})", exc))
    loaded = {h.path for h in hints}
    final, rank_issues = settle_ranks(hints, run_path=run_path, info=info, run_json=run_json,
                                      failed=[p for p in files if p not in loaded], ranks=rank_map)
    issues.extend(rank_issues)
    ranks = [r if r.rank == final[r.path] else dataclasses.replace(r, rank=final[r.path])
             for r in ranks if r.path in final]
    if not ranks:
        return None, issues
    ranks.sort(key=lambda r: (r.rank, r.path))
    kept = None
    if timeline:
        from cpdpkit.profiler.timeline import run_timeline

        kept = run_timeline(ranks)
    split, stragglers, split_issues = cross_rank(ranks, run_path)  # who waits for whom
    issues.extend(split_issues)
    strategy = info.get("strategy") if isinstance(info.get("strategy"), str) else None
    default_name = os.path.basename(os.path.normpath(run_path))
    label = strategy
    period = info.get("period")
    periodic = strategy is not None and strategy.lower() != "ddp"  # ddp has no period
    if periodic and isinstance(period, int) and not isinstance(period, bool):
        label = f"{strategy} K={period}"  # the same strategy at several K stays apart
    report = RunReport(
        name=name or label or default_name,
        path=run_path,
        strategy=strategy,
        run_info=info,
        ranks=split,
        summary=summarize_ranks(split, stragglers=stragglers),
        timeline=kept,
    )
    if what_if is not None:
        report, what_if_issues = _with_what_if(report, timelines, what_if, world_sizes)
        issues.extend(what_if_issues)
    return report, issues


def analyze(paths: Iterable[str | os.PathLike[str]], *, what_if: str | None = None,
            limits: TraceLimits = DEFAULT_LIMITS, timeline: bool = False) -> OverlapReport:
    """Analyse run folders, trace files, or folders of run folders into one report.

    ``what_if``: a topology (preset name or TOML path) on which to predict each run's step
    (``RunReport.what_if``); an unknown one raises :class:`~cpdpkit.errors.TopologyError`
    before any trace is read. ``timeline``: keep each run's :class:`~cpdpkit.profiler.timeline.RunTimeline`
    (``RunReport.timeline``) for :func:`~cpdpkit.profiler.timeline.timeline_doc`.

    Run names are the ``strategy`` from ``run.json`` (with ``K=<period>`` when it names one,
    except for ddp), else the folder name; a repeated name gets the folder appended
    (``ddp (runs/b)``).
    """
    if what_if is not None:
        from cpdpkit.topology import resolve_topology

        resolve_topology(what_if)  # fail fast, in one line, on a name that is no topology
    runs, issues = expand_paths(paths)
    reports: list[RunReport] = []
    seen: set[str] = set()
    for run_path, files in runs:
        report, run_issues = analyze_run(run_path, files, what_if=what_if, limits=limits, timeline=timeline)
        issues.extend(run_issues)
        if report is None:
            continue
        if report.name in seen:
            report = dataclasses.replace(report, name=f"{report.name} ({run_path})")
        seen.add(report.name)
        reports.append(report)
    return OverlapReport(runs=tuple(reports), errors=tuple(issues))
