"""``cpdpkit profile --timeline FILE``: check the path before any trace is read, write the file after.

The timeline itself (a Chrome trace of every rank on one clock) is
:func:`cpdpkit.profiler.timeline.timeline_doc`; this module only guards and writes it. The
file is written beside its final name and renamed into place, so a reader never sees half of it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from cpdpkit._outputs import write_output
from cpdpkit.errors import ConfigError

if TYPE_CHECKING:
    from cpdpkit.profiler import OverlapReport

__all__ = ["check_timeline_path", "refuse_dumps", "write_timeline"]


def check_timeline_path(path: Path, inputs: Sequence[Path]) -> None:
    """:class:`ConfigError` when ``path`` is one of the inputs: a path given, a file of a run
    read (trace or ``run.json``), or a ``*.json`` file in a run folder, which would be read as a
    rank's trace next time."""
    from cpdpkit.profiler.runs import RUN_JSON, expand_paths

    target = os.path.realpath(path)
    runs, _ = expand_paths(inputs)
    given = {os.path.realpath(p): os.fspath(p) for p in inputs}
    what = None
    if target in given:
        what = f"it is the input {given[target]!r}"
    for run_path, files in runs:
        folder = os.path.realpath(run_path if os.path.isdir(run_path) else os.path.dirname(run_path) or ".")
        if what is None and target in {os.path.realpath(f) for f in files}:
            what = f"it is a trace file of the run {run_path!r}"
        elif what is None and os.path.dirname(target) == folder and (
                target.endswith((".json", ".json.gz")) or os.path.basename(target) == RUN_JSON):
            what = f"it is in the run folder {run_path!r}, where it would be read as a rank's trace"
    if what is not None:
        raise ConfigError(f"--timeline {os.fspath(path)!r}: {what}; write the timeline outside the run "
                          "folders (e.g. --timeline timeline.json)")


def refuse_dumps(path: Path, dump_inputs: Sequence[str]) -> None:
    """:class:`ConfigError` when an input is a flight-recorder dump (or a folder of them): a
    dump records when each collective was entered and completed, not the ranks' compute, so
    there is no timeline to draw from it (the report still names who entered and who did not)."""
    if dump_inputs:
        raise ConfigError(f"--timeline {os.fspath(path)!r}: {dump_inputs[0]!r} holds flight-recorder dumps, which "
                          "record collectives only, not the ranks' compute, so no timeline is drawn from them; "
                          "drop --timeline for dumps, or pass the run's profiler trace folders")


def write_timeline(report: OverlapReport, path: Path) -> None:
    """Write the timeline of ``report``'s runs to ``path`` (a temporary file renamed into place)."""
    import orjson

    from cpdpkit.profiler.timeline import timeline_doc

    write_output(path, orjson.dumps(timeline_doc(report)) + b"\n", "--timeline")
