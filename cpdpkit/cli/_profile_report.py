"""What ``cpdpkit profile`` prints, writes and returns, without typer or rich.

``cpdpkit profile`` is timed as a whole process against Holistic Trace Analysis, so it runs
through :mod:`cpdpkit.cli._fast_profile` (no typer, no rich: ~0.15 s less per run) when its
arguments are plain, and through the typer command in :mod:`cpdpkit.cli.profile` otherwise
(``--help``, a mistyped option); both call :func:`run_profile`, so the output is the same.

Reads run folders (per-rank Kineto traces + ``run.json``) with :mod:`cpdpkit.profiler`,
prints one row per run (per-step means over complete steps and ranks), optionally a
per-step table, a JSON file and a bar chart. Bad files are reported one line each; the
other runs are still shown and written, and the exit code is 2.

CI mode (``--baseline OLD --max-regression PCT``): every other run is compared with its
baseline run (:mod:`cpdpkit.profiler.compare`); one line per regression and exit code 1, or
one ``no regression`` line and 0. Input errors win: exit code 2 even with a regression.
"""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from cpdpkit._outputs import PLOT_SUFFIXES, check_output_file, write_output
from cpdpkit.cli._exit import EXIT_OK, EXIT_REGRESSION, EXIT_USER_ERROR
from cpdpkit.cli._table import Justify, TextTable
from cpdpkit.errors import ConfigError

if TYPE_CHECKING:  # cpdpkit.profiler loads when the command runs, not for every `cpdpkit --help`
    from cpdpkit.profiler import OverlapReport, RunReport, StepReport
    from cpdpkit.profiler.compare import Comparison, RegressionCheck

__all__ = ["ProfileArgs", "run_profile", "render_summary_table", "render_step_table", "write_plot", "pick_baseline",
           "resolve_baseline", "parse_max_regression", "regression_line", "no_regression_line", "what_if_lines",
           "error_line", "EXIT_OK", "EXIT_REGRESSION", "EXIT_USER_ERROR"]

NO_COMMUNICATION = "no communication"


def _ms(us: float) -> str:
    return f"{us / 1e3:,.2f}"


def _overlap(pct: float | None, none: str = NO_COMMUNICATION) -> str:
    return none if pct is None else f"{pct:.1f}"


def pick_baseline(report: OverlapReport, name: str | None) -> RunReport | None:
    """The run other runs are compared with: ``name``, else the run named ``ddp``, else none."""
    if name is not None:
        for run in report.runs:
            if run.name == name or run.strategy == name:
                return run
        names = ", ".join(r.name for r in report.runs) or "(none loaded)"
        raise ConfigError(f"--baseline {name!r} is not one of the runs: {names}")
    for run in report.runs:
        if run.name.lower() == "ddp" or (run.strategy or "").lower() == "ddp":
            return run
    return None


def _within(path: str, folder: str) -> bool:
    inner, outer = os.path.realpath(path), os.path.realpath(folder)
    return inner == outer or inner.startswith(outer.rstrip(os.sep) + os.sep)


def resolve_baseline(report: OverlapReport, value: str | None,
                     limits: Any = None) -> tuple[list[RunReport], OverlapReport | None]:
    """The baseline runs, and the report of a baseline path analysed on its own (else ``None``).

    ``value`` is, first that fits: a run's name (or strategy) among ``report``'s runs; a path
    holding some of them (those runs); a run folder, trace file or folder of run folders,
    analysed here. ``None``: the run named ``ddp``, if any.
    """
    if value is None:
        run = pick_baseline(report, None)
        return ([run] if run is not None else []), None
    for run in report.runs:
        if run.name == value or run.strategy == value:
            return [run], None
    if os.path.exists(value):
        inside = [r for r in report.runs if _within(r.path, value)]
        if inside:
            return inside, None
        from cpdpkit.profiler import analyze

        base = analyze([value]) if limits is None else analyze([value], limits=limits)
        return list(base.runs), base
    names = ", ".join(r.name for r in report.runs) or "(none loaded)"
    raise ConfigError(f"--baseline {value!r} is not one of the runs: {names}, nor a file or folder; pass a "
                      "run's name or the path of the baseline's traces (a run folder or trace file)")


_SIZE = re.compile(r"(\d[\d_]*)\s*(KiB|MiB|GiB|TiB)?", re.IGNORECASE)
_UNIT = {None: 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_limits(max_trace_bytes: str | None, max_events: str | None) -> Any:
    """``--max-trace-bytes`` (``8GiB``, ``500MiB``, a byte count) and ``--max-events`` as TraceLimits."""
    from cpdpkit.profiler import TraceLimits

    values: dict[str, int] = {}
    m = _SIZE.fullmatch(max_trace_bytes.strip()) if max_trace_bytes is not None else None
    if max_trace_bytes is not None:
        if m is None or int(m.group(1)) < 1:
            raise ConfigError(f"--max-trace-bytes {max_trace_bytes!r} is invalid; use a size >= 1 such as 8GiB, "
                              "500MiB or 1000000 (bytes)")
        values["max_bytes"] = int(m.group(1)) * _UNIT[(m.group(2) or "").lower() or None]
    if max_events is not None:
        if not re.fullmatch(r"\d[\d_]*", max_events.strip()) or int(max_events) < 1:
            raise ConfigError(f"--max-events {max_events!r} is invalid; use a whole number >= 1, e.g. 50000000")
        values["max_events"] = int(max_events)
    return TraceLimits(**values)


def parse_max_regression(text: str | None) -> float | None:
    """``--max-regression``'s value as a percentage >= 0 (``10``, ``2.5``, ``10%``)."""
    if text is None:
        return None
    try:
        value = float(text.strip().removesuffix("%"))
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise ConfigError(f"--max-regression {text!r} is not a percentage >= 0; pass one such as 10 "
                          "(exit 1 when exposed communication per step grows by more than 10 %)")
    return value


def _relative(run: RunReport, baseline: RunReport | None) -> str:
    if baseline is None:
        return "-"
    if run is baseline:
        return "baseline"
    base = baseline.summary.per_step["exposed_us"]
    mine = run.summary.per_step["exposed_us"]
    if base <= 0:
        return "n/a"
    return f"{mine / base:.2f}× ({(mine - base) / base * 100:+.0f} %)"


def _names(report: OverlapReport, bases: Sequence[RunReport]) -> dict[int, str]:
    """Run names for the tables: a baseline run named like another run gets `` (baseline)``."""
    base_ids = {id(b) for b in bases}
    new_names = {r.name for r in report.runs if id(r) not in base_ids}
    return {id(r): f"{r.name} (baseline)" if id(r) in base_ids and r.name in new_names else r.name
            for r in report.runs}


def render_summary_table(report: OverlapReport, baseline: RunReport | Sequence[RunReport] | None,
                         pairs: Sequence[tuple[RunReport, RunReport]] | None = None) -> TextTable:
    """One row per run: per-step means of step time, compute, comm, exposed, hidden.

    ``baseline``: the baseline run(s), marked ``baseline``; ``pairs``: (run, its baseline run)
    for the last column (default: every run against the one baseline run).
    """
    bases = list(baseline) if isinstance(baseline, (list, tuple)) else ([baseline] if baseline is not None else [])
    base_ids = {id(b) for b in bases}
    if pairs is not None:
        against = {id(run): base for run, base in pairs}
    else:
        against = {id(run): bases[0] for run in report.runs} if len(bases) == 1 else {}
    names = _names(report, bases)
    title = "Communication per step (ms, mean over complete steps and ranks)"
    table = TextTable(title=title)
    table.add_column("run")
    table.add_column("ranks", "right")
    table.add_column("mode")
    for head in ("step", "compute", "comm", "exposed", "skew", "transfer", "hidden", "overlap %"):
        table.add_column(head, "right")
    table.add_column(f"exposed vs {bases[0].name}" if len(bases) == 1 else "exposed vs baseline", "right")
    for run in report.runs:
        p = run.summary.per_step
        modes = "/".join(sorted({r.mode for r in run.ranks}))
        is_base = id(run) in base_ids
        table.add_row(
            names[id(run)],
            str(run.summary.num_ranks),
            modes,
            _ms(p["step_time_us"]),
            _ms(p["compute_us"]),
            _ms(p["comm_us"]),
            _ms(p["exposed_us"]),
            _ms_or_dash(p.get("skew_us")),
            _ms_or_dash(p.get("transfer_us")),
            _ms(p["hidden_us"]),
            _overlap(run.summary.overlap_pct),
            "baseline" if is_base else _relative(run, against.get(id(run))),
        )
    return table


def _ms_or_dash(us: float | None) -> str:
    return "-" if us is None else _ms(us)


def straggler_lines(report: OverlapReport) -> list[str]:
    """Per run with a cross-rank split: the worst straggler, or that none was found."""
    lines = []
    for run in report.runs:
        stragglers = run.summary.stragglers
        if stragglers is None:
            continue  # no split (one rank, unmatched collectives, or clocks named in the errors)
        if not stragglers:
            lines.append(f"{run.name}: no straggler")
            continue
        s = stragglers[0]
        lines.append(f"{run.name}: straggler rank {s['rank']} arrived last at {s['late_frac'] * 100:.0f} % of "
                     f"collectives ({s['late_count']}); the others waited {_ms(s['caused_wait_us_per_step'])} "
                     "ms/step for it")
    return lines


def what_if_lines(report: OverlapReport) -> list[str]:
    """Per run with a prediction: ``what-if cpdp K=4 on wan: step 21.1 -> 35.2 ms, exposed 11.3 ->
    24.0 ms (per step, measured -> predicted)``, and how many collectives kept their measured time."""
    lines = []
    for run in report.runs:
        w = run.what_if
        if w is None:
            continue
        p = run.summary.per_step
        line = (f"what-if {run.name} on {w.topology}: step {p['step_time_us'] / 1e3:.1f} -> "
                f"{w.step_time_us / 1e3:.1f} ms, exposed {p['exposed_us'] / 1e3:.1f} -> {w.exposed_us / 1e3:.1f} ms "
                "(per step, measured -> predicted)")
        if w.unmodeled_collectives:
            line += f"; {w.unmodeled_collectives} collectives of unknown size kept their measured time"
        lines.append(line)
    return lines


def render_step_table(report: OverlapReport, baseline: Sequence[RunReport] = ()) -> TextTable:
    """One row per run and ``ProfilerStep#N``: means over ranks, and the worst rank's exposed."""
    names = _names(report, baseline)
    table = TextTable(title="Per step (ms, mean over ranks)")
    columns: tuple[tuple[str, Justify], ...] = (
        ("run", "left"), ("step", "right"), ("duration", "right"), ("compute", "right"), ("comm", "right"),
        ("exposed", "right"), ("hidden", "right"), ("overlap %", "right"), ("max exposed (rank)", "right"))
    for head, justify in columns:
        table.add_column(head, justify)
    silent = False
    for run in report.runs:
        by_step: dict[int, list[tuple[int, StepReport]]] = {}
        for r in run.ranks:
            for s in r.steps:
                by_step.setdefault(s.step, []).append((r.rank, s))
        for num in sorted(by_step):
            rows = by_step[num]
            n = len(rows)
            mean = {k: sum(getattr(s, k) for _, s in rows) / n
                    for k in ("duration_us", "compute_us", "comm_us", "exposed_us", "hidden_us")}
            worst_rank, worst = max(rows, key=lambda rs: rs[1].exposed_us)
            overlap = 100 * mean["hidden_us"] / mean["comm_us"] if mean["comm_us"] > 0 else None
            silent = silent or overlap is None
            partial = " (partial)" if any(s.partial for _, s in rows) else ""
            table.add_row(names[id(run)], f"{num}{partial}", _ms(mean["duration_us"]), _ms(mean["compute_us"]),
                          _ms(mean["comm_us"]), _ms(mean["exposed_us"]), _ms(mean["hidden_us"]),
                          _overlap(overlap, "-"), f"{_ms(worst.exposed_us)} ({worst_rank})")
    if silent:
        table.caption = f"overlap % '-': {NO_COMMUNICATION} in that step"
    return table


def write_plot(report: OverlapReport, path: Path) -> None:
    """Stacked bars per run: exposed and hidden communication per step (ms)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.name for r in report.runs]
    exposed = [r.summary.per_step["exposed_us"] / 1e3 for r in report.runs]
    hidden = [r.summary.per_step["hidden_us"] / 1e3 for r in report.runs]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(names) + 2), 4))
    ax.bar(names, exposed, label="exposed", color="#d62728")
    ax.bar(names, hidden, bottom=exposed, label="hidden", color="#2ca02c")
    for i, run in enumerate(report.runs):
        if run.summary.overlap_pct is None:  # an empty bar would read as "all hidden" or "free"
            ax.text(i, 0, NO_COMMUNICATION, ha="center", va="bottom", rotation=90, fontsize=8)
    ax.set_ylabel("communication per step (ms)")
    ax.set_title("Exposed vs hidden communication")
    ax.legend()
    fig.tight_layout()
    try:
        write_output(path, fig.savefig, "--plot")
    finally:
        plt.close(fig)


def _write_json(data: dict[str, Any], path: Path) -> None:
    import orjson

    encoded = orjson.dumps(data, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY)
    write_output(path, encoded + b"\n", "--json")


def _report_dict(report: OverlapReport, per_step: bool, base_ids: set[int],
                 check: RegressionCheck | None) -> dict[str, Any]:
    data = report.to_dict(per_step=per_step)
    for entry, run in zip(data["runs"], report.runs):
        entry["baseline"] = id(run) in base_ids
    data["regression"] = check.to_dict() if check is not None else None
    return data


def _ms_text(us: float) -> str:
    ms = us / 1e3
    return f"{ms:.1f} ms" if ms >= 1 else f"{ms:.3f} ms"


def _where(c: Comparison) -> str:
    return f"rank {c.rank}" if c.rank is not None else "mean over ranks"


def regression_line(c: Comparison) -> str:
    """``regression: exposed communication per step of run X (path) rank 1 grew 23.4 % over ...``."""
    grew = f"grew {c.change_pct:.1f} %" if c.change_pct is not None else "grew from 0"
    return (f"regression: exposed communication per step of run {c.run} ({c.run_path}) {_where(c)} {grew} "
            f"over baseline {c.baseline} ({c.baseline_path}): {_ms_text(c.value_us)} vs "
            f"{_ms_text(c.baseline_us)} (limit {c.max_regression_pct:g} %)")


def no_regression_line(check: RegressionCheck) -> str:
    """``no regression over baseline ddp (runs/old): ... (limit 10 %)``: the passing verdict."""
    bases = dict.fromkeys(f"{c.baseline} ({c.baseline_path})" for c in check.comparisons)
    runs = dict.fromkeys((c.run, c.run_path) for c in check.comparisons)
    worst = max(check.comparisons, key=lambda c: c.change_pct or 0.0)
    plural = "" if len(runs) == 1 else "s"
    return (f"no regression over baseline {', '.join(bases)}: exposed communication per step of {len(runs)} "
            f"run{plural}, largest change {worst.change_pct or 0.0:+.1f} % (run {worst.run} {_where(worst)}) "
            f"(limit {check.max_regression_pct:g} %)")


def _check(new: list[RunReport], bases: list[RunReport], limit: float | None,
           baseline: str | None) -> tuple[list[tuple[RunReport, RunReport]], RegressionCheck | None, list[str]]:
    """Pairs for the table, the regression check (with ``--max-regression``) and problems (exit 2)."""
    if not bases:
        if limit is None:
            return [], None, []
        if baseline is None:
            return [], None, ["--max-regression needs a baseline: pass --baseline RUN or PATH (no run is named ddp)"]
        return [], None, [f"--baseline {baseline!r}: no run could be analysed there, so there is nothing to "
                          "compare with (its errors are above)"]
    if limit is not None and not new:
        names = ", ".join(f"{b.name} ({b.path})" for b in bases)
        return [], None, [f"--max-regression: no run to compare with the baseline {names}; pass the new "
                          "runs' folders as well"]
    from cpdpkit.profiler.compare import check_regression, pair_runs  # with a baseline only

    try:
        pairs, notes = pair_runs(new, bases)
    except ConfigError as exc:
        return [], None, ([str(exc)] if limit is not None else [])
    if limit is None:
        return pairs, None, []
    return pairs, check_regression(pairs, limit, notes=notes), []



@dataclass(frozen=True)
class ProfileArgs:
    """``cpdpkit profile``'s arguments, as both entries parse them."""

    run_dirs: tuple[Path, ...]
    json_path: Path | None = None
    per_step: bool = False
    baseline: str | None = None
    max_regression: str | None = None
    plot: Path | None = None
    what_if: str | None = None
    max_trace_bytes: str | None = None
    max_events: str | None = None
    strict: bool = False
    timeline: Path | None = None
    debug: bool = False  # ``cpdpkit --debug profile``: the traceback behind each collected error too


_STYLE = {"error": "1;31", "regression": "1;31", "note": "33", "warning": "33"}


def error_line(kind: str, text: str, stream: TextIO) -> str:
    """``error: text`` (``regression:``, ``note:``), the prefix coloured on a terminal unless NO_COLOR is set."""
    if stream.isatty() and not os.environ.get("NO_COLOR"):
        return f"\x1b[{_STYLE[kind]}m{kind}:\x1b[0m {text}"
    return f"{kind}: {text}"


def _say(kind: str, text: str) -> None:
    print(error_line(kind, text, sys.stderr), file=sys.stderr)


def run_profile(args: ProfileArgs) -> int:
    """Analyse, print, write; the exit code: 0 fine, 1 a regression, 2 bad input (which wins).

    A :class:`~cpdpkit.errors.CpdpkitError` raised before anything is shown (a bad option)
    propagates: the caller prints it as one line and exits 2.
    """
    from cpdpkit.profiler import OverlapReport, analyze

    limit = parse_max_regression(args.max_regression)
    limits = parse_limits(args.max_trace_bytes, args.max_events)
    inputs = (*args.run_dirs, args.baseline, args.what_if)
    check_output_file(args.json_path, "--json", inputs=inputs)  # before reading any trace
    check_output_file(args.plot, "--plot", inputs=inputs, suffixes=PLOT_SUFFIXES)
    if args.json_path is not None and args.plot is not None and args.json_path.resolve() == args.plot.resolve():
        raise ConfigError(f"--json and --plot are both {str(args.json_path)!r}: pass two different files")
    from cpdpkit.cli._profile_flightrec import may_hold_dumps

    trace_paths: list[Path | str] = list(args.run_dirs)
    dump_runs: list[tuple[str, list[str]]] = []
    if may_hold_dumps(args.run_dirs):
        from cpdpkit.profiler.flightrec import split_inputs

        dump_runs, trace_paths = split_inputs(args.run_dirs)  # mixed folders: one line, exit 2, before any output
    if args.timeline is not None:
        from cpdpkit.cli._profile_timeline import check_timeline_path, refuse_dumps

        refuse_dumps(args.timeline, [folder for folder, _ in dump_runs])
        baseline = [Path(args.baseline)] if args.baseline is not None and os.path.exists(args.baseline) else []
        check_timeline_path(args.timeline, (*args.run_dirs, *baseline))
        check_output_file(args.timeline, "--timeline", inputs=inputs)
    dumps = []
    if dump_runs:
        from cpdpkit.profiler.flightrec import analyze_dumps

        dumps = [analyze_dumps(folder, files) for folder, files in dump_runs]  # a bad dump: one line, exit 2
    report = (analyze(trace_paths, what_if=args.what_if, limits=limits, timeline=args.timeline is not None)
              if trace_paths or not dumps else OverlapReport(runs=(), errors=()))
    bases, base_report = resolve_baseline(report, args.baseline, limits)
    base_ids = {id(b) for b in bases}
    shown = OverlapReport(
        runs=(*(base_report.runs if base_report else ()), *report.runs),
        errors=(*report.errors, *(base_report.errors if base_report else ())),
    )
    new = [r for r in report.runs if id(r) not in base_ids]
    pairs, check, problems = _check(new, bases, limit, args.baseline)
    if shown.runs:
        lines = [render_summary_table(shown, bases, pairs).render(), *what_if_lines(shown)]
        if args.per_step:
            lines.append(render_step_table(shown, bases).render())
        print("\n".join([*lines, *straggler_lines(shown)]))
    if dumps:
        from cpdpkit.cli._profile_flightrec import flight_recorder_lines

        print("\n".join(line for d in dumps for line in flight_recorder_lines(d)))
    if args.json_path is not None:
        data = _report_dict(shown, args.per_step, base_ids, check)
        data["flight_recorder"] = [d.to_dict() for d in dumps]
        _write_json(data, args.json_path)
    if args.plot is not None and shown.runs:
        write_plot(shown, args.plot)
    if args.timeline is not None and report.runs:
        from cpdpkit.cli._profile_timeline import write_timeline

        write_timeline(report, args.timeline)
    sys.stdout.flush()
    for issue in shown.errors:
        if args.debug and issue.traceback:
            print(issue.traceback, end="", file=sys.stderr)
        _say("warning" if issue.warning else "error", issue.error)
    for text in problems:
        _say("error", text)
    if check is not None:
        for note in check.notes:
            _say("note", note)
        for c in check.regressions:
            _say("regression", regression_line(c).removeprefix("regression: "))
        if check.passed:
            print(no_regression_line(check))
    if any(args.strict or not e.warning for e in shown.errors) or problems or not (report.runs or dumps):
        return EXIT_USER_ERROR
    if check is not None and not check.passed:
        return EXIT_REGRESSION
    return EXIT_OK
