"""``cpdpkit bench sharding``: options to a ShardingBenchConfig, progress, the table and --json.

Torch-free at import (``cpdpkit bench --help`` imports it); the suite's modules load when it runs.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cpdpkit._outputs import check_output_dir, write_output
from cpdpkit.bench.sharding.goals import goal_lines
from cpdpkit.cli._app import out_console, prepare_output

if TYPE_CHECKING:
    from rich.table import Table

    from cpdpkit.bench.sharding.suite import ShardingBenchConfig, ShardingReport

__all__ = ["run_sharding_suite", "sharding_config", "run_and_print", "fill_table"]

_QUICK_MODEL = "gpt-micro"
_QUICK_MAX_STEPS = 4
_QUICK_WARMUP_STEPS = 1


def sharding_config(*, strategies: str | None, quick: bool, profile: str | None, **kw: Any) -> ShardingBenchConfig:
    """The suite's config: the options given (not None), else ``--quick``'s reduced defaults, else the config's."""
    from cpdpkit.bench.sharding.suite import ShardingBenchConfig

    args: dict[str, Any] = {name: value for name, value in kw.items() if value is not None}
    if args.get("min_unit_bytes") == 0:  # 0: the planner's own unit size
        args["min_unit_bytes"] = None
    if strategies is not None:
        args["strategies"] = tuple(s.strip() for s in strategies.split(",") if s.strip())
    if quick:
        args.setdefault("model", _QUICK_MODEL)
        args["steps"] = min(args.get("steps", _QUICK_MAX_STEPS), _QUICK_MAX_STEPS)
        args["warmup_steps"] = _QUICK_WARMUP_STEPS
    return ShardingBenchConfig(profile_dir=profile, **args)


def run_sharding_suite(config: ShardingBenchConfig, *, json_out: str | None, work_dir: str | None) -> None:
    """Run the suite (validating and planning first: a bad config raises before any launch); print and write."""
    from cpdpkit.bench.sharding.suite import run_sharding_bench

    prepare_output(json_out, "--json")  # a bad path fails now, not after every run
    check_output_dir(config.profile_dir, "--profile")
    report = run_and_print(lambda work, emit: run_sharding_bench(config, work, emit), work_dir=work_dir,
                           prefix="cpdpkit-bench-sharding-", table=_table, goal_lines=goal_lines)
    if json_out:
        write_output(json_out, json.dumps(report.to_dict(), indent=1).encode(), "--json")
        out_console.print(f"wrote {json_out}")


def run_and_print(run: Callable[[Path, Callable[[tuple[Any, ...]], None]], Any], *, work_dir: str | None, prefix: str,
                  table: Callable[[Any], Table], goal_lines: Callable[[dict[str, Any]], list[str]]) -> Any:
    """Run a one-job-per-strategy suite in ``work_dir`` (else a temp dir) with a line per finished job; print its
    table, its failures and its goals; return its report."""

    def emit(event: tuple[Any, ...]) -> None:
        if event[0] == "done":
            r = event[2]
            out_console.print(f"{event[1]}: {r['status']} in {r['launch_s']:.1f} s"
                              + (f" ({r.get('reason')})" if r["status"] != "ok" else ""))

    check_output_dir(work_dir, "--work-dir", keep=False)  # before any launch: a file there would fail after planning
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        report = run(Path(work_dir or tmp), emit)
    out_console.print(table(report))
    for r in report.results:
        if r.get("status") != "ok":
            out_console.print(f"{r['strategy']} {r.get('status', 'failed')}: {r.get('reason')}")
    for line in goal_lines(report.goals):
        out_console.print(colour_marks(line))
    return report


def _f(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def _stage1(r: dict[str, Any]) -> str:
    if r.get("stage1_units") is None:
        return "-"
    return f"{r['stage1_units']:.2f}/{_f(r.get('stage1_units_predicted'), 'd')} of {_f(r.get('num_units'), 'd')}"


def _table(report: ShardingReport) -> Table:
    from rich.table import Table

    cfg = report.config
    tiers = sorted({t for r in report.results for t in (r.get("tier_bytes_per_step") or {})})
    stage1 = any(r.get("stage1_units") is not None for r in report.results)
    partial = cfg.get("partial_plan")
    table = Table(title=f"{cfg['model']}, {cfg['world_size']} ranks ({cfg['num_replicas']} nodes x "
                        f"{cfg['ranks_per_node']}), topology {cfg['topology']}, {cfg['optimizer']}, "
                        f"{cfg['steps']} timed steps; plan {cfg['plan']['strategy']} mesh {cfg['plan']['mesh']}"
                        + (f", partial mesh {partial['mesh']}" if partial else ""))
    cols = ["strategy", "status", "step ms", "exposed ms/step", *[f"{t} MB/step" for t in tiers],
            "optim state MB/rank", "peak RSS MB", "final loss", *(["stage1 meas/pred"] if stage1 else [])]

    def row(r: dict[str, Any]) -> list[str]:
        tb = r["tier_bytes_per_step"]
        return [*_step_cells(r), *[_f(tb.get(t, 0) / 1e6, ".2f") for t in tiers],
                _f(r["optimizer_state_bytes_per_rank"] / 1e6, ".3f"), _f(r["peak_mem_bytes"] / 1e6, ".0f"),
                _f(r["final_loss"], ".6f"), *([_stage1(r)] if stage1 else [])]

    fill_table(table, cols, report.results, row)
    table.caption = ("exposed = training thread blocked on communication (the emulated backend's Work.wait(); the "
                     "ZeRO peers also DDP's all-reduce futures); tier MB = bytes sent per rank under the network "
                     "model; peak RSS = ru_maxrss minus RSS before the model was built"
                     + ("; stage1 = exchanges done during backward per step, measured/predicted from this run's "
                        "timings, of all units" if stage1 else ""))
    return table


def _step_cells(r: dict[str, Any]) -> list[str]:
    return [r["strategy"], "ok", _f(r["step_s"] * 1e3, ".1f"), _f(r["exposed_comm_s_per_step"] * 1e3, ".1f")]


def fill_table(table: Table, cols: list[str], results: Any, row: Any) -> None:
    """``cols`` (strategy and status left-aligned, the rest right) and a row per result: ``row(r)`` for one that
    ran ok (its cells start with :func:`_step_cells`), dashes after the status for the others."""
    for col in cols:
        table.add_column(col, justify="left" if col in ("strategy", "status") else "right", no_wrap=True)
    for r in results:
        if r.get("status") != "ok":
            table.add_row(r["strategy"], r.get("status", "failed"), *["-"] * (len(cols) - 2))
        else:
            table.add_row(*row(r))


def _mark(ok: bool | None) -> str:
    return "[green]met[/green]" if ok else "[red]not met[/red]"


def colour_marks(line: str) -> str:
    """A goal line with its closing verdict coloured (the suites' goal lines end in "met" or "not met")."""
    for verdict, colour in ((" not met", "red"), (" met", "green")):
        if line.endswith(verdict):
            return f"{line[: -len(verdict)]} [{colour}]{verdict.strip()}[/{colour}]"
    return line
