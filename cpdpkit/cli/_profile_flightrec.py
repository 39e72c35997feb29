"""``cpdpkit profile`` on flight-recorder dumps: the lines it prints (analysis in
:mod:`cpdpkit.profiler.flightrec`)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cpdpkit.profiler.flightrec import Collective, FlightRecorderReport

__all__ = ["flight_recorder_lines", "may_hold_dumps"]

_DUMP_NAME = re.compile(r"^[^.]*\d$")  # cpdpkit.profiler.flightrec.is_dump's names


def may_hold_dumps(paths: Iterable[os.PathLike[str] | str]) -> bool:
    """Whether any path is, or is a folder holding, a file named like a dump (``<prefix><rank>``,
    no extension): only then does the flight-recorder reader load (startup of the trace path)."""
    for raw in paths:
        path = os.fspath(raw)
        if os.path.isfile(path) and _DUMP_NAME.match(os.path.basename(path)):
            return True
        if os.path.isdir(path):
            try:
                with os.scandir(path) as it:
                    if any(_DUMP_NAME.match(e.name) and e.is_file() for e in it):
                        return True
            except OSError:
                continue
    return False


def _ranks(ranks: tuple[int, ...]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _where(c: Collective) -> str:
    return f"process group {c.process_group!r} seq {c.seq} ({c.kind})"


def flight_recorder_lines(report: FlightRecorderReport) -> list[str]:
    """A header, where the job hangs (a rank that never entered a collective is named), the
    mismatches, and the worst straggler, in the words of the trace report."""
    lines = [f"{report.path}: flight recorder {report.version}, {_ranks(report.ranks)}, "
             f"{len(report.collectives)} collectives"]
    h = report.hang
    if h is not None:
        missing = f"; no dump from {_ranks(h.missing_dump)}" if h.missing_dump else ""
        lines.append(f"{report.path}: hang at {_where(h)}: {_ranks(h.entered)} entered, {_ranks(h.never_entered)} "
                     f"never did{missing}")
    gap = next((c for c in report.collectives if c.missing_dump), None)
    if h is None and gap is not None:
        lines.append(f"{report.path}: no dump from {_ranks(gap.missing_dump)}, a member of process group "
                     f"{gap.process_group!r}: whether it entered seq {gap.seq} ({gap.kind}) and later ones cannot "
                     "be told")
    for c in report.mismatches:
        lines.append(f"{report.path}: mismatch at {_where(c)}: {' | '.join(c.mismatch)}")
    if report.stragglers:
        s = report.stragglers[0]
        lines.append(f"{report.path}: straggler rank {s['rank']} arrived last at {s['late_frac'] * 100:.0f} % of "
                     f"collectives ({s['late_count']}); the others waited "
                     f"{s['caused_wait_us_per_step'] / 1e3:,.2f} ms in all for it")
    elif h is None:
        lines.append(f"{report.path}: no straggler")
    return lines
