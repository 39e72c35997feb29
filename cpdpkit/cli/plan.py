"""``cpdpkit plan``: plan FSDP2 sharding for a model on a topology and compare it with FSDP2's default.

Rendering only: the numbers come from :mod:`cpdpkit.planner` (pure Python, no process group).
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from itertools import groupby
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import typer
from rich.table import Table

from cpdpkit._outputs import check_output_file, write_output
from cpdpkit.cli._app import app, out_console
from cpdpkit.errors import ConfigError

if TYPE_CHECKING:  # cpdpkit.planner (numpy) loads when the command runs, not for every `cpdpkit --help`
    from cpdpkit.planner import ShardingPlan, TwoStageSchedule

__all__ = ["plan", "DEFAULT_BUDGET"]

# One 80 GB accelerator (the cluster preset's A100 class); without a budget the fastest plan keeps
# every layer unsharded after forward, which is rarely what anyone can run.
DEFAULT_BUDGET = "80GiB"
# --help shows these; the values are cpdpkit.planner.schedule's DEFAULT_TOKENS_PER_RANK and
# DEFAULT_FLOPS_PER_S (in TFLOP/s), read when the command runs (tests/test_cli_plan.py checks they agree).
_TOKENS_PER_RANK_SHOWN = "4096"
_TFLOPS_SHOWN = "125"


@app.command()
def plan(
    model: str = typer.Option(..., "--model",
                              help="Preset (resnet50, vit-s, llama-7b, llama-70b) or package.module:factory."),
    topology: str = typer.Option("cluster", "--topology",
                                 help="Topology preset (lan, wan, wan-variable, cluster, multisite) or a .toml path."),
    world_size: int = typer.Option(..., "--world-size", help="Number of ranks."),
    ranks_per_node: int | None = typer.Option(None, "--ranks-per-node", help="Override the topology's node size."),
    memory_budget: str = typer.Option(DEFAULT_BUDGET, "--memory-budget",
                                      help="Per-rank budget for model states and FSDP2 buffers (not activations); "
                                      "'none': no limit."),
    param_dtype: str = typer.Option("bfloat16", "--param-dtype", help="Dtype of sharded parameters (and all-gathers)."),
    grad_dtype: str = typer.Option("bfloat16", "--grad-dtype", help="Dtype of gradients (and reductions)."),
    optim_bytes: int = typer.Option(12, "--optim-bytes-per-param",
                                    help="Optimizer state per parameter (Adam + fp32 master: 12)."),
    shard_size: int | None = typer.Option(None, "--shard-size",
                                          help="Fix the shard axis size (default: planner's choice)."),
    state_sharding: bool = typer.Option(True, "--state-sharding/--no-state-sharding",
                                        help="Allow optimizer-state sharding across replicas "
                                        "(FSDP2 alone cannot run it)."),
    param_sharding: Literal["any", "sharded", "replicated"] = typer.Option(
        "any", "--param-sharding", help="Parameters sharded (FSDP2-style plans), replicated (partially sharded "
        "data parallelism: gradients and optimizer state sharded, node first), or any: consider both."),
    tokens_per_rank: int | None = typer.Option(None, "--tokens-per-rank", show_default=_TOKENS_PER_RANK_SHOWN,
                                               help="Tokens per rank per step, for the schedule's compute-time "
                                               "estimate."),
    tflops: float | None = typer.Option(None, "--tflops", show_default=_TFLOPS_SHOWN,
                                        help="Achieved TFLOP/s per rank, for the schedule's compute-time estimate."),
    reconcile_period: int | None = typer.Option(
        None, "--reconcile-period", metavar="K",
        help="CPDP across sites: shard inside each site and cross the WAN only every K steps (gradient all-reduce + "
        "parameter average of each rank's shard, priced per step as its cost / K; SlowMo's float32 anchor and "
        "momentum in the memory). Needs a topology of several sites (multisite, wan). Default: all-reduce across "
        "sites every step."),
    show_schedule: bool = typer.Option(True, "--schedule/--no-schedule",
                                       help="Print the two-stage exchange schedule (it stays in --json either way)."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the plan and a summary to this JSON file."),
) -> None:
    """Plan units, mesh, placements and state sharding; show them beside FSDP2's default and say why."""
    from cpdpkit.planner import (
        PlannerConfig,
        estimate_unit_timings,
        fsdp2_default_plan,
        parse_bytes,
        plan_sharding,
        plan_two_stage,
        planning_summary,
    )
    from cpdpkit.planner.planner import resolve_inputs
    from cpdpkit.planner.schedule import DEFAULT_FLOPS_PER_S, DEFAULT_TOKENS_PER_RANK

    check_output_file(json_out, "--json", inputs=(model, topology))
    tokens_per_rank = DEFAULT_TOKENS_PER_RANK if tokens_per_rank is None else tokens_per_rank
    tflops = DEFAULT_FLOPS_PER_S / 1e12 if tflops is None else tflops
    if world_size < 1:
        raise ConfigError(f"--world-size must be >= 1, got {world_size}: pass --world-size 64")
    config = PlannerConfig(param_dtype=param_dtype, grad_dtype=grad_dtype, optim_state_bytes_per_param=optim_bytes,
                           memory_budget_bytes=None if memory_budget.lower() == "none" else parse_bytes(memory_budget),
                           shard_size=shard_size, allow_state_sharding=state_sharding,
                           param_sharding=None if param_sharding == "any" else param_sharding,
                           reconcile_period=reconcile_period)
    spec, topo = resolve_inputs(model, topology, world_size, ranks_per_node)
    start = time.perf_counter()
    chosen = plan_sharding(spec, topo, config=config)
    plan_s = time.perf_counter() - start
    if chosen.schedule is not None:
        timings = estimate_unit_timings(chosen, tokens_per_rank=tokens_per_rank, flops_per_s=tflops * 1e12)
        chosen = replace(chosen, schedule=plan_two_stage(chosen, timings=timings))
    baseline = fsdp2_default_plan(spec, topo, config=config)
    summary = planning_summary(chosen, baseline, plan_s)
    _render(chosen, baseline, summary)
    if show_schedule and chosen.schedule is not None:
        _render_schedule(chosen.schedule, f"estimated: {tokens_per_rank} tokens/rank at {tflops:g} TFLOP/s")
    if json_out is not None:
        write_output(json_out, (json.dumps({"plan": chosen.to_dict(), "summary": summary}, indent=1) + "\n").encode(),
                     "--json")
        out_console.print(f"[dim]wrote {json_out}[/dim]")


# ---- rendering -----------------------------------------------------------------------------------
def _count(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def _placements(p: ShardingPlan, names: tuple[str, ...]) -> str:
    if p.param_sharding == "replicated":
        return "replicated"
    dims = {x.fqn: x.dim for x in p.placements}
    counts: dict[int, int] = {}
    for fqn in names:
        counts[dims[fqn]] = counts.get(dims[fqn], 0) + 1
    return " ".join(f"Shard({d})x{c}" for d, c in sorted(counts.items())) or "-"


def _units_table(p: ShardingPlan, baseline: ShardingPlan) -> Table:
    kind = "units (parameters replicated)" if p.param_sharding == "replicated" else "fully_shard units"
    table = Table(title=f"{kind}: {len(p.units)} (FSDP2 default: {len(baseline.units)})")
    for col in ("units", "count", "modules", "params each", "padded each", "reshard_after_forward", "placements"):
        table.add_column(col, justify="left" if col in ("units", "placements") else "right")
    key = lambda u: (u.numel, u.padded_numel, len(u.module_fqns), u.reshard_after_forward, u.is_root)  # noqa: E731
    for _, group in groupby(p.units, key=key):
        members = list(group)
        first, last = members[0], members[-1]
        label = first.name if len(members) == 1 else f"{first.name} ... {last.name}"
        table.add_row(label, str(len(members)), str(len(first.module_fqns)), _count(first.numel),
                      _count(first.padded_numel), str(first.reshard_after_forward), _placements(p, first.param_fqns))
    return table


def _change(new: float, old: float) -> str:
    if old == new:
        return "="
    if old == 0:
        return "new"
    return f"{(new - old) / old * 100:+.1f} %"


def _compare_table(p: ShardingPlan, b: ShardingPlan, summary: dict[str, Any]) -> Table:
    from cpdpkit.planner import format_bytes

    base = summary["baseline"]
    table = Table(title="plan vs FSDP2 default (per rank, per step)")
    for col in ("", "plan", "FSDP2 default", "change"):
        table.add_column(col, justify="left" if not col else "right")

    def row(label: str, new: float, old: float, fmt: Any = format_bytes) -> None:
        table.add_row(label, fmt(new), fmt(old), _change(new, old))

    table.add_row("strategy", p.strategy, b.strategy, "")
    table.add_row("mesh", _mesh_label(p), _mesh_label(b), "")
    if p.reconciliation is not None:
        table.add_row("across sites", f"every {p.reconciliation.period} steps", "every step", "")
    row("units", len(p.units), len(b.units), str)
    row("model states max", summary["max_rank_bytes"], base["max_rank_bytes"])
    row("model states mean", summary["mean_rank_bytes"], base["mean_rank_bytes"])
    row("model states min", summary["min_rank_bytes"], base["min_rank_bytes"])
    row("model states padded", summary["padded_rank_bytes"], base["padded_rank_bytes"])
    ratio = lambda s: s["max_rank_bytes"] / s["mean_rank_bytes"]  # noqa: E731
    row("imbalance max/mean", ratio(summary), ratio(base), lambda v: f"{v:.4f}")
    pct = lambda s: f"{s['padding_bytes'] / s['model_bytes'] * 100:.3f} %"  # noqa: E731
    table.add_row("padding", f"{format_bytes(summary['padding_bytes'])} ({pct(summary)})",
                  f"{format_bytes(base['padding_bytes'])} ({pct(base)})",
                  _change(summary["padding_bytes"], base["padding_bytes"]))
    for tier in p.topology.tier_names:
        row(f"{tier} bytes sent", summary["tier_bytes_per_step"][tier], base["tier_bytes_per_step"][tier])
        row(f"{tier} time", _tier_time(p, tier), _tier_time(b, tier), lambda v: f"{v:.4f} s")
    row("predicted comm time", summary["predicted_comm_s_per_step"], base["predicted_comm_s_per_step"],
        lambda v: f"{v:.4f} s")
    row("peak memory", summary["peak_memory_bytes"], base["peak_memory_bytes"])
    if p.param_sharding == "replicated":
        row("peak memory, plain DDP", summary["fsdp2_peak_memory_bytes"], base["peak_memory_bytes"])
    elif p.state_sharding.axis is not None:
        row("peak memory, FSDP2 alone", summary["fsdp2_peak_memory_bytes"], base["peak_memory_bytes"])
    budget = p.config.memory_budget_bytes
    if budget is not None:
        fits = lambda ok: "yes" if ok else "NO"  # noqa: E731
        table.add_row(f"fits {format_bytes(budget)}", fits(summary["fits_budget"]), fits(base["fits_budget"]), "")
    return table


def _mesh_label(p: ShardingPlan) -> str:
    m = p.mesh
    if m.replicate_size == 1:
        return f"shard {m.shard_size} ({m.shard_tier})"
    return f"replicate {m.replicate_size} ({m.replicate_tier}) x shard {m.shard_size} ({m.shard_tier})"


def _tier_time(p: ShardingPlan, tier: str) -> float:
    rec = p.reconciliation
    amortised = rec.amortised_s_per_step if rec is not None and rec.tier == tier else 0.0
    return sum(c.time_s for c in p.comm if c.tier == tier) + amortised


def _reconcile_table(p: ShardingPlan) -> Table:
    from cpdpkit.planner import format_bytes

    rec = p.reconciliation
    assert rec is not None
    table = Table(title=f"cross-site reconciliation every {rec.period} steps ({rec.tier}; {rec.num_groups} "
                        f"group(s) of {rec.num_ranks} ranks, one per shard)")
    for col in ("phase", "op", "tier", "ranks", "collectives", "bytes sent", "time", "per step"):
        table.add_column(col, justify="left" if col in ("phase", "op", "tier") else "right")
    for c in rec.phases:
        table.add_row(c.name, c.op, str(c.tier), str(c.num_ranks), str(c.num_collectives),
                      format_bytes(c.wire_bytes_per_rank), f"{c.time_s:.4f} s", f"{c.time_s / rec.period:.4f} s")
    table.add_row("reconciliation", "", str(rec.tier), "", "", format_bytes(rec.wire_bytes_per_rank),
                  f"{rec.time_s:.4f} s", f"{rec.amortised_s_per_step:.4f} s")
    return table


def _multisite_hint(p: ShardingPlan) -> str | None:
    """A hint for a plan whose replicate axis crosses sites every step (no --reconcile-period)."""
    topo = p.topology
    if p.reconciliation is not None or (topo.num_sites or 1) < 2 or p.mesh.replicate_tier != topo.inter_site_tier:
        return None
    site_s = sum(c.time_s for c in p.comm if c.tier == topo.inter_site_tier)
    return (f"the replicate axis crosses the {topo.inter_site_tier} every step ({site_s:.4f} s/step); "
            "--reconcile-period K shards inside each site and reconciles across sites every K steps (CPDP)")


def _comm_table(p: ShardingPlan) -> Table:
    from cpdpkit.planner import format_bytes

    table = Table(title="the plan's collectives per step (alpha-beta model of the topology)")
    for col in ("phase", "op", "axis", "tier", "ranks", "collectives", "bytes sent", "time"):
        table.add_column(col, justify="left" if col in ("phase", "op", "axis", "tier") else "right")
    for c in p.comm:
        table.add_row(c.name, c.op, c.axis, str(c.tier), str(c.num_ranks), str(c.num_collectives),
                      format_bytes(c.wire_bytes_per_rank), f"{c.time_s:.4f} s")
    return table


def _candidates_table(p: ShardingPlan) -> Table:
    from cpdpkit.planner import format_bytes

    budget = p.config.memory_budget_bytes
    title = f"candidates evaluated: {len(p.candidates)}, fastest first (* = chosen"
    table = Table(title=title + (f"; fits {format_bytes(budget)})" if budget is not None else ")"))
    for col in ("", "strategy", "params", "shard", "reshard_after_forward", "state", "time/step", "vs chosen",
                "peak memory", "fits"):
        table.add_column(col, justify="left" if col in ("", "strategy", "params", "state") else "right")
    chosen = next((c for c in p.candidates if c.chosen), None)
    for c in sorted(p.candidates, key=lambda c: (c.time_s, c.peak_bytes)):
        state = ("world" if c.param_sharding == "replicated" else "replicate") if c.state_sharded else "-"
        raf = "-" if c.param_sharding == "replicated" else str(c.reshard_after_forward)
        vs = "" if chosen is None or c.chosen else _change(c.time_s, chosen.time_s)
        table.add_row("*" if c.chosen else "", c.strategy, c.param_sharding, str(c.shard_size), raf, state,
                      f"{c.time_s * 1e3:.2f} ms", vs, format_bytes(c.peak_bytes), "yes" if c.fits_budget else "NO")
    return table


def _render(p: ShardingPlan, baseline: ShardingPlan, summary: dict[str, Any]) -> None:
    topo = p.topology
    out_console.print(
        f"[bold]{p.model_name}[/bold] ({_count(p.num_params)} params) on {p.world_size} ranks of "
        f"[bold]{topo.name}[/bold] ({topo.num_sites} site(s) x {topo.nodes_per_site} node(s) x "
        f"{topo.ranks_per_node} ranks): [bold]{p.strategy}[/bold], planned in {summary['plan_seconds'] * 1e3:.1f} ms")
    out_console.print(_units_table(p, baseline))
    out_console.print(_compare_table(p, baseline, summary))
    out_console.print(_comm_table(p))
    if p.reconciliation is not None:
        out_console.print(_reconcile_table(p))
    if p.candidates:
        out_console.print(_candidates_table(p))
    if p.choice_reason:
        out_console.print(f"[bold]why {p.strategy}:[/bold] {p.choice_reason}", soft_wrap=True)
    for note in p.notes:
        out_console.print(f"[dim]note: {note}[/dim]", soft_wrap=True)
    hint = _multisite_hint(p)
    if hint is not None:
        out_console.print(f"hint: {hint}", soft_wrap=True)


_SCHEDULE_HEAD_ROWS = 4  # with more than twice this many units, show the first and last few


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def _schedule_table(sched: TwoStageSchedule) -> Table:
    from cpdpkit.planner import format_bytes

    table = Table(title=f"two-stage exchange schedule on the {sched.tier} link "
                        "(times in ms from the start of backward)")
    for col in ("unit", "bytes", "tier", "ready", "deadline", "start", "end", "stage", "order", "forward waits"):
        table.add_column(col, justify="left" if col in ("unit", "tier") else "right")
    slots = list(sched.slots)
    k = _SCHEDULE_HEAD_ROWS
    shown: list = slots if len(slots) <= 2 * k + 1 else [*slots[:k], None, *slots[-k:]]
    for s in shown:
        if s is None:
            table.add_row(f"... {len(slots) - 2 * k} more", *[""] * 9)
            continue
        stage = f"{s.stage}" + (" late" if s.late_s > 1e-12 else "")
        table.add_row(s.unit, format_bytes(s.num_bytes), str(s.tier), _ms(s.release_s), _ms(s.deadline_s),
                      _ms(s.start_s), _ms(s.end_s), stage, str(s.order), _ms(s.wait_s) if s.wait_s > 0 else "-")
    return table


def _render_schedule(sched: TwoStageSchedule, timing_note: str) -> None:
    out_console.print(_schedule_table(sched))
    misses = sched.deadline_misses
    missed = ", ".join(f"{s.unit} +{_ms(s.late_s)} ms" for s in misses[:3]) + (" ..." if len(misses) > 3 else "")
    out_console.print(
        f"schedule: {sched.num_stage1} unit(s) in stage 1 (during backward), {sched.num_stage2} in stage 2 "
        f"(during the next forward); {len(misses)} deadline miss(es){f' ({missed})' if misses else ''}; "
        f"exposed tail naive {_ms(sched.naive_exposed_s)} ms -> two-stage {_ms(sched.exposed_s)} ms "
        f"(floor {_ms(sched.lower_bound_exposed_s)} ms); backward {_ms(sched.backward_s)} ms, forward "
        f"{_ms(sched.forward_s)} ms ({timing_note})", soft_wrap=True)
    out_console.print(f"[dim]algorithm: {sched.algorithm}[/dim]")
