"""cpdpkit.profiler: exposed vs hidden communication from PyTorch profiler (Kineto) traces.

Torch- and numpy-free on purpose (the standard library, orjson and msgspec only), so it runs
wherever the traces land and starts fast (numpy's import alone takes longer than analysing a
small trace)::

    from cpdpkit.profiler import analyze
    report = analyze(["runs/ddp", "runs/localsgd", "runs/cpdp"])
    for run in report.runs:
        print(run.name, run.summary.per_step["exposed_us"], run.summary.overlap_pct)
    report.to_dict()          # the JSON that ``cpdpkit profile --json`` writes

Exposed communication is ``|comm ∖ compute|`` (a rank's compute timeline waits for it),
hidden is ``|comm ∩ compute|``; the rules for what is comm and compute on GPU and CPU
traces are in :mod:`cpdpkit.profiler.overlap` and :mod:`cpdpkit.profiler.classify`. On GPU
traces the overlap percentage equals Holistic Trace Analysis' ``get_comm_comp_overlap``.
Across a run's ranks, :mod:`cpdpkit.profiler.crossrank` matches the collectives and splits
exposed time into waiting for the last rank (``skew_us``) and the rest (``transfer_us``),
and names the stragglers (``run.summary.stragglers``).
"""

from __future__ import annotations

from cpdpkit.profiler._reader import TraceLimits
from cpdpkit.profiler.classify import KINDS, canonical_kind
from cpdpkit.profiler.errors import TraceError, TraceFileError
from cpdpkit.profiler.intervals import Intervals
from cpdpkit.profiler.overlap import analyze_trace
from cpdpkit.profiler.report import (
    CommTotals,
    OverlapReport,
    RankReport,
    RunReport,
    RunSummary,
    StepReport,
    TraceIssue,
    WaitSplit,
    WhatIf,
)
from cpdpkit.profiler.runs import analyze, analyze_run, expand_paths, find_trace_files, read_run_info
from cpdpkit.profiler.trace import RankTrace, load_trace

__all__ = [
    "analyze",
    "analyze_run",
    "analyze_trace",
    "load_trace",
    "expand_paths",
    "find_trace_files",
    "read_run_info",
    "OverlapReport",
    "RunReport",
    "RunSummary",
    "RankReport",
    "StepReport",
    "CommTotals",
    "TraceIssue",
    "WaitSplit",
    "WhatIf",
    "RankTrace",
    "TraceLimits",
    "Intervals",
    "KINDS",
    "canonical_kind",
    "TraceError",
    "TraceFileError",
]
