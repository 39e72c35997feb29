"""``cpdpkit profile``: exposed vs hidden communication of one or more runs, side by side.

Reads run folders (per-rank Kineto traces + ``run.json``) with :mod:`cpdpkit.profiler`,
prints one row per run (per-step means over complete steps and ranks), optionally a
per-step table, a JSON file and a bar chart. Bad files are reported one line each; the
other runs are still shown and written, and the exit code is 2.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.markup import escape
from rich.table import Table

from cpdpkit.cli.app import EXIT_USER_ERROR, app, err_console, out_console
from cpdpkit.errors import ConfigError

if TYPE_CHECKING:  # cpdpkit.profiler (numpy) loads when the command runs, not for every `cpdpkit --help`
    from cpdpkit.profiler import OverlapReport, RunReport, StepReport

__all__ = ["profile", "render_summary_table", "render_step_table", "write_plot", "pick_baseline"]


def _ms(us: float) -> str:
    return f"{us / 1e3:,.2f}"


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


def _relative(run: RunReport, baseline: RunReport | None) -> str:
    if baseline is None:
        return "-"
    base = baseline.summary.per_step["exposed_us"]
    mine = run.summary.per_step["exposed_us"]
    if run is baseline:
        return "baseline"
    if base <= 0:
        return "n/a"
    return f"{mine / base:.2f}× ({(mine - base) / base * 100:+.0f} %)"


def render_summary_table(report: OverlapReport, baseline: RunReport | None) -> Table:
    """One row per run: per-step means of step time, compute, comm, exposed, hidden."""
    title = "Communication per step (ms, mean over complete steps and ranks)"
    table = Table(title=title, title_justify="left")
    table.add_column("run")
    table.add_column("ranks", justify="right")
    table.add_column("mode")
    for head in ("step", "compute", "comm", "exposed", "hidden", "overlap %"):
        table.add_column(head, justify="right")
    table.add_column(f"exposed vs {baseline.name}" if baseline else "exposed vs baseline", justify="right")
    for run in report.runs:
        p = run.summary.per_step
        modes = "/".join(sorted({r.mode for r in run.ranks}))
        table.add_row(
            escape(run.name),
            str(run.summary.num_ranks),
            modes,
            _ms(p["step_time_us"]),
            _ms(p["compute_us"]),
            _ms(p["comm_us"]),
            _ms(p["exposed_us"]),
            _ms(p["hidden_us"]),
            f"{run.summary.overlap_pct:.1f}",
            _relative(run, baseline),
        )
    return table


def render_step_table(report: OverlapReport) -> Table:
    """One row per run and ``ProfilerStep#N``: means over ranks, and the worst rank's exposed."""
    table = Table(title="Per step (ms, mean over ranks)", title_justify="left")
    for head, justify in (("run", "left"), ("step", "right"), ("duration", "right"), ("compute", "right"),
                          ("comm", "right"), ("exposed", "right"), ("hidden", "right"),
                          ("overlap %", "right"), ("max exposed (rank)", "right")):
        table.add_column(head, justify=justify)  # type: ignore[arg-type]
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
            overlap = 100 * mean["hidden_us"] / mean["comm_us"] if mean["comm_us"] > 0 else 0.0
            partial = " (partial)" if any(s.partial for _, s in rows) else ""
            table.add_row(escape(run.name), f"{num}{partial}", _ms(mean["duration_us"]), _ms(mean["compute_us"]),
                          _ms(mean["comm_us"]), _ms(mean["exposed_us"]), _ms(mean["hidden_us"]),
                          f"{overlap:.1f}", f"{_ms(worst.exposed_us)} ({worst_rank})")
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
    ax.set_ylabel("communication per step (ms)")
    ax.set_title("Exposed vs hidden communication")
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as exc:
        raise ConfigError(f"--plot {os.fspath(path)!r}: cannot write the file ({exc.strerror or exc})") from None
    finally:
        plt.close(fig)


def _write_json(report: OverlapReport, path: Path, per_step: bool) -> None:
    import orjson

    data = orjson.dumps(report.to_dict(per_step=per_step), option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY)
    try:
        path.write_bytes(data + b"\n")
    except OSError as exc:
        raise ConfigError(f"--json {os.fspath(path)!r}: cannot write the file ({exc.strerror or exc})") from None


@app.command("profile")
def profile(
    run_dirs: list[Path] = typer.Argument(..., help="Run folders (per-rank traces + run.json), trace files, "
                                          "or folders of run folders.", show_default=False),
    json_path: Path | None = typer.Option(None, "--json", help="Write the full report as JSON here."),
    per_step: bool = typer.Option(False, "--per-step", help="Add a per-step table (and steps to the JSON)."),
    baseline: str | None = typer.Option(None, "--baseline", help="Run to compare exposed time with "
                                        "(default: the run named ddp, if any)."),
    plot: Path | None = typer.Option(None, "--plot", help="Draw exposed vs hidden per run to this PNG."),
) -> None:
    """Exposed vs hidden communication per run, from PyTorch profiler traces."""
    from cpdpkit.profiler import analyze

    report = analyze(run_dirs)
    if report.runs:
        base = pick_baseline(report, baseline)
        out_console.print(render_summary_table(report, base))
        if per_step:
            out_console.print(render_step_table(report))
    if json_path is not None:
        _write_json(report, json_path, per_step)
    if plot is not None and report.runs:
        write_plot(report, plot)
    for issue in report.errors:
        err_console.print(f"[bold red]error:[/bold red] {escape(issue.error)}", soft_wrap=True)
    if report.errors or not report.runs:
        raise typer.Exit(EXIT_USER_ERROR)
