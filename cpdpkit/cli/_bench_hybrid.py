"""``cpdpkit bench hybrid``: options to a HybridBenchConfig, progress, the table, the goals and --json.

Torch-free at import (``cpdpkit bench --help`` imports it); the suite's modules load when it runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cpdpkit._outputs import PLOT_SUFFIXES, check_output_dir, write_output
from cpdpkit.bench.hybrid.goals import goal_lines
from cpdpkit.cli._app import out_console, prepare_output
from cpdpkit.cli._bench_sharding import _f, fill_table, run_and_print

if TYPE_CHECKING:
    from rich.table import Table

    from cpdpkit.bench.hybrid.suite import HybridBenchConfig, HybridReport

__all__ = ["run_hybrid_suite", "hybrid_config", "goal_lines"]


def hybrid_config(*, strategies: str | None, quick: bool, profile: str | None, **kw: Any) -> HybridBenchConfig:
    """The suite's config: the options given (not None), else ``--quick``'s reduced defaults, else the config's."""
    from cpdpkit.bench.hybrid.suite import HybridBenchConfig

    args: dict[str, Any] = {name: value for name, value in kw.items() if value is not None}
    if strategies is not None:
        args["strategies"] = tuple(s.strip() for s in strategies.split(",") if s.strip())
    if quick:  # one period timed after one period of warm-up
        args["steps"] = args.get("period", HybridBenchConfig.period)
    return HybridBenchConfig(profile_dir=profile, **args)


def run_hybrid_suite(config: HybridBenchConfig, *, json_out: str | None, plot: str | None,
                     work_dir: str | None) -> None:
    """Run the suite (validating first: a bad config raises before any launch); print and write."""
    from cpdpkit.bench.hybrid.suite import prepare, run_hybrid_bench

    prepared = prepare(config)  # once: a bad topology fails before the output paths are touched
    prepare_output(json_out, "--json")  # a bad path fails now, not after every run
    prepare_output(plot, "--plot", suffixes=PLOT_SUFFIXES)
    check_output_dir(config.profile_dir, "--profile")

    report = run_and_print(lambda work, emit: run_hybrid_bench(config, work, emit, prepared=prepared),
                           work_dir=work_dir, prefix="cpdpkit-bench-hybrid-", table=_table, goal_lines=goal_lines)
    data = report.to_dict()
    if json_out:
        write_output(json_out, json.dumps(data, indent=1).encode(), "--json")
        out_console.print(f"wrote {json_out}")
    if plot:
        write_output(plot, lambda tmp: plot_loss_curves(data, tmp), "--plot")
        out_console.print(f"wrote {plot}")


def _table(report: HybridReport) -> Table:
    from rich.table import Table

    cfg = report.config
    tiers = sorted({t for r in report.results for t in (r.get("tier_bytes_per_step") or {})})
    table = Table(title=f"{cfg['model']}, {cfg['world_size']} ranks ({cfg['num_sites']} sites x "
                        f"{cfg['ranks_per_site']}), topology {cfg['topology']}, adamw, K={cfg['period']}, "
                        f"{cfg['steps']} timed steps after {cfg['warmup_steps']}")
    cols = ["strategy", "status", "step ms", "median ms", "exposed ms", "WAN exp. ms", *[f"{t} MB" for t in tiers],
            "shard MB", "state MB", "RSS MB", "final loss"]

    def row(r: dict[str, Any]) -> list[str]:
        tb = r["tier_bytes_per_step"]
        ms = [r["step_s"], r["step_s_median"], r["exposed_comm_s_per_step"],
              r["exposed_comm_s_per_step_by_tier"].get("WAN", 0.0)]
        return [r["strategy"], "ok", *[_f(v * 1e3, ".1f") for v in ms],
                *[_f(tb.get(t, 0) / 1e6, ".3f") for t in tiers], _f(r["param_shard_bytes_per_rank"] / 1e6, ".3f"),
                _f(r["training_state_bytes_per_rank"] / 1e6, ".3f"), _f(r["peak_mem_bytes"] / 1e6, ".0f"),
                _f(r["final_loss"], ".4f")]

    fill_table(table, cols, report.results, row)
    table.caption = ("per step and rank: step time (mean; median = the median over periods of K steps of each "
                     "period's mean step time on its slowest rank, what the goal compares); exposed = training "
                     "thread blocked on communication (the emulated backend's Work.wait(); ddp-global: DDP's "
                     "all-reduce waits), WAN exp. = the part on the WAN; IB/WAN MB = bytes sent per rank by tier "
                     "under the network model. Per rank: shard = parameters held; state = parameters + gradients + "
                     "AdamW moments + the sync optimizer's state (SlowMo anchor, slow momentum, an average in "
                     "flight); RSS = peak RSS minus RSS before the model was built. The network model's WAN ms per "
                     "step if none of it overlapped compute: "
                     + ", ".join(f"{name} {s * 1e3:.1f}" for name, s in cfg["modeled_wan_s_per_step"].items()))
    return table




def plot_loss_curves(report: dict[str, Any], path: Path) -> None:
    """The loss of every step (mean over ranks), one line per strategy; the timed steps start at the dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = report["config"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = ("-", "--", ":", "-.")
    for i, r in enumerate(report["results"]):
        curve = r.get("loss_curve_rank_mean") or []
        if curve:  # wide solid lines first, narrower dashed ones over them: equal curves stay visible
            ax.plot(range(1, len(curve) + 1), curve, marker=".", label=r["strategy"], linestyle=styles[i % 4],
                    linewidth=max(0.8, 3.0 - 0.5 * i))
    if cfg["warmup_steps"]:
        ax.axvline(cfg["warmup_steps"] + 0.5, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean over ranks)")
    ax.set_title(f"{cfg['model']} on {cfg['topology']}, {cfg['world_size']} ranks, K={cfg['period']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
