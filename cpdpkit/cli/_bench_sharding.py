"""``cpdpkit bench --suite sharding``: options to a ShardingBenchConfig, progress, the table and --json."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any

from rich.table import Table

from cpdpkit.bench.sharding import ShardingBenchConfig, ShardingReport, run_sharding_bench
from cpdpkit.cli.app import out_console

__all__ = ["run_sharding_suite"]


def _config(given: set[str], *, quick: bool, steps: int, **kw: Any) -> ShardingBenchConfig:
    args: dict[str, Any] = {"steps": steps, "optimizer": kw["optimizer"], "memory_budget": kw["memory_budget"],
                            "max_grad_norm": kw["max_grad_norm"], "profile_dir": kw["profile"]}
    if "strategies" in given:
        args["strategies"] = tuple(s.strip() for s in kw["strategies"].split(",") if s.strip())
    for name in ("model", "world_size", "topology", "batch_size", "lr"):
        if name in given:
            args[name] = kw[name]
    if quick:
        args.setdefault("model", "gpt-micro")
        args["steps"], args["warmup_steps"] = min(steps, 4), 1
    return ShardingBenchConfig(**args)


def run_sharding_suite(*, given: set[str], quick: bool, json_out: str | None, work_dir: str | None,
                       **kw: Any) -> None:
    config = _config(given, quick=quick, **kw)

    def emit(event: tuple[Any, ...]) -> None:
        if event[0] == "done":
            r = event[2]
            out_console.print(f"{event[1]}: {r['status']} in {r['launch_s']:.1f} s"
                              + (f" ({r.get('reason')})" if r["status"] != "ok" else ""))

    with tempfile.TemporaryDirectory(prefix="cpdpkit-bench-sharding-") as tmp:
        report = run_sharding_bench(config, Path(work_dir or tmp), emit)
    out_console.print(_table(report))
    for line in _goal_lines(report.goals):
        out_console.print(line)
    if json_out:
        Path(json_out).write_text(json.dumps(report.to_dict(), indent=1))
        out_console.print(f"wrote {json_out}")


def _f(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def _table(report: ShardingReport) -> Table:
    cfg = report.config
    tiers = sorted({t for r in report.results for t in (r.get("tier_bytes_per_step") or {})})
    table = Table(title=f"{cfg['model']}, {cfg['world_size']} ranks ({cfg['num_replicas']} nodes x "
                        f"{cfg['ranks_per_node']}), topology {cfg['topology']}, {cfg['optimizer']}, "
                        f"{cfg['steps']} timed steps; plan {cfg['plan']['strategy']} mesh {cfg['plan']['mesh']}")
    cols = ["strategy", "status", "step ms", "exposed ms/step", *[f"{t} MB/step" for t in tiers],
            "optim state MB/rank", "peak RSS MB", "final loss"]
    for col in cols:
        table.add_column(col, justify="left" if col in ("strategy", "status") else "right", no_wrap=True)
    for r in report.results:
        if r.get("status") != "ok":
            table.add_row(r["strategy"], r.get("status", "failed"), *["-"] * (len(cols) - 2))
            continue
        tb = r["tier_bytes_per_step"]
        table.add_row(r["strategy"], "ok", _f(r["step_s"] * 1e3, ".1f"), _f(r["exposed_comm_s_per_step"] * 1e3, ".1f"),
                      *[_f(tb.get(t, 0) / 1e6, ".2f") for t in tiers],
                      _f(r["optimizer_state_bytes_per_rank"] / 1e6, ".3f"), _f(r["peak_mem_bytes"] / 1e6, ".0f"),
                      _f(r["final_loss"], ".6f"))
    table.caption = ("exposed = training thread blocked in the emulated backend's Work.wait(); tier MB = bytes sent "
                     "per rank under the ring model; peak RSS = ru_maxrss minus RSS before the model was built")
    return table


def _goal_lines(goals: dict[str, Any]) -> list[str]:
    if not goals:
        return ["goals: hsdp or two-stage did not run; nothing to compare"]

    def mark(ok: bool) -> str:
        return "[green]met[/green]" if ok else "[red]not met[/red]"

    return [
        f"two-stage vs hsdp: step time x{goals['step_time_ratio']:.3f} (target <= 0.85) {mark(goals['step_time_met'])}",
        f"two-stage vs hsdp: exposed comm x{goals['exposed_comm_ratio']:.3f} (target <= 0.5) "
        f"{mark(goals['exposed_comm_met'])}",
        f"two-stage optimizer state {goals['optimizer_state_bytes']} B/rank (target hsdp / replicas = "
        f"{goals['optimizer_state_target']:.0f}) {mark(goals['optimizer_state_met'])}",
        f"two-stage final loss |diff| {goals['final_loss_abs_diff']:.2e} vs hsdp (target <= 1e-4) "
        f"{mark(goals['final_loss_met'])}",
    ]
