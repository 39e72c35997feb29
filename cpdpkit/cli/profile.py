"""``cpdpkit profile`` as a typer command: its options, help and ``--help``.

The work is :func:`cpdpkit.cli._profile_report.run_profile`; plain invocations skip typer
altogether through :mod:`cpdpkit.cli._fast_profile` (the options there must match these:
``tests/test_cli_profile_fast.py`` checks both lists and both outputs).
"""

from __future__ import annotations

from pathlib import Path

import typer

from cpdpkit.cli._app import app
from cpdpkit.cli._profile_report import EXIT_OK, ProfileArgs, run_profile

__all__ = ["profile"]


@app.command("profile")
def profile(
    ctx: typer.Context,
    run_dirs: list[Path] = typer.Argument(..., help="Run folders (per-rank traces + run.json), trace files, "
                                          "folders of run folders, or folders of torch flight-recorder dumps.",
                                          show_default=False),
    json_path: Path | None = typer.Option(None, "--json", help="Write the full report as JSON here."),
    per_step: bool = typer.Option(False, "--per-step", help="Add a per-step table (and steps to the JSON)."),
    baseline: str | None = typer.Option(None, "--baseline", help="Run to compare with: a run's name among "
                                        "RUN_DIRS, or a run folder, trace file or folder of runs analysed as the "
                                        "baseline (default: the run named ddp, if any)."),
    max_regression: str | None = typer.Option(None, "--max-regression", metavar="PCT", help="CI mode: exit 1 "
                                              "when exposed communication per step (a run's mean over ranks, or "
                                              "any rank's) grew by more than PCT % over its baseline run."),
    plot: Path | None = typer.Option(None, "--plot", help="Draw exposed vs hidden per run to this PNG."),
    what_if: str | None = typer.Option(None, "--what-if", metavar="TOPOLOGY", help="Predict each run's step on "
                                       "this topology (a preset name or a TOML file): every collective re-timed "
                                       "by the network model, measured compute and order kept."),
    max_trace_bytes: str | None = typer.Option(None, "--max-trace-bytes", metavar="SIZE", help="The most "
                                               "decompressed bytes one trace file may hold (default 4GiB; "
                                               "e.g. 16GiB, 500MiB): a limit against gzip bombs."),
    max_events: str | None = typer.Option(None, "--max-events", metavar="N", help="The most events one "
                                          "trace file may hold (default 10000000)."),
    strict: bool = typer.Option(False, "--strict", help="Exit 2 on warnings too (a run with ranks missing: "
                                "by default the present ranks are analysed, with a warning, and exit 0)."),
    timeline: Path | None = typer.Option(None, "--timeline", metavar="FILE", help="Write one Chrome trace (Perfetto, "
                                         "chrome://tracing) of every rank on one clock: compute, communication, "
                                         "exposed, hidden and skew tracks, stragglers marked."),
) -> None:
    """Exposed vs hidden communication per run, from PyTorch profiler traces.

    Each run is compared with its baseline run: the same-named one (strategy label) when the
    baseline has it, else the baseline's only run.

    Exit codes: 0 fine; 1 a regression beyond --max-regression; 2 bad input (unreadable
    traces, traces of another run, bad options; missing ranks with --strict), also when
    there is a regression too. Everything that could be analysed is still shown and written.
    """
    code = run_profile(ProfileArgs(tuple(run_dirs), json_path, per_step, baseline, max_regression, plot, what_if,
                                   max_trace_bytes, max_events, strict, timeline,
                                   debug=isinstance(ctx.obj, dict) and bool(ctx.obj.get("debug"))))
    if code != EXIT_OK:
        raise typer.Exit(code)
