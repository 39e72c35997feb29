"""How fast and how good the sharding planner is, from 64 to 1,024 ranks.

    python benchmarks/planner_scale.py [--model llama-70b] [--topology cluster] [--memory-budget 80GiB]

Prints one JSON object. For each world size: the planning time (cold: the shape cache is
cleared first; median of ``--repeats``), the plan's strategy and mesh, max/mean per-rank model
state bytes, padding as a fraction of the model bytes, the predicted communication time per step
and peak memory, the same figures for FSDP2's default, and whether the goals hold:
planned in <= 1 s at 64 ranks, max/mean <= 1.01, padding <= 0.1 % of model bytes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

GOAL_PLAN_S_AT_64 = 1.0
GOAL_IMBALANCE = 1.01
GOAL_PADDING_FRAC = 0.001


def _figures(summary: dict) -> dict:
    return {
        "strategy": summary["strategy"],
        "num_units": summary["num_units"],
        "imbalance": summary["max_rank_bytes"] / summary["mean_rank_bytes"],
        "max_rank_bytes": summary["max_rank_bytes"],
        "padding_frac": summary["padding_bytes"] / summary["model_bytes"],
        "predicted_comm_s_per_step": summary["predicted_comm_s_per_step"],
        "tier_bytes_per_step": summary["tier_bytes_per_step"],
        "peak_memory_bytes": summary["peak_memory_bytes"],
    }


def _one(model: str, topology: str, world_size: int, config, repeats: int) -> dict:
    from cpdpkit.planner import fsdp2_default_plan, plan_sharding, planning_summary
    from cpdpkit.planner._cost import shard_layout

    times = []
    for _ in range(repeats):
        shard_layout.cache_clear()
        start = time.perf_counter()
        plan = plan_sharding(model, topology, world_size=world_size, config=config)
        times.append(time.perf_counter() - start)
    baseline = fsdp2_default_plan(model, topology, world_size=world_size, config=config)
    summary = planning_summary(plan, baseline, statistics.median(times))
    out = {"world_size": world_size, "plan_seconds": summary["plan_seconds"], "mesh": list(plan.mesh.shape),
           "state_sharding": plan.state_sharding.axis, "fits_budget": summary["fits_budget"], **_figures(summary)}
    out["baseline"] = {**_figures(summary["baseline"]), "fits_budget": summary["baseline"]["fits_budget"]}
    out["goals_met"] = (out["imbalance"] <= GOAL_IMBALANCE and out["padding_frac"] <= GOAL_PADDING_FRAC
                        and (world_size != 64 or out["plan_seconds"] <= GOAL_PLAN_S_AT_64))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-70b")
    parser.add_argument("--topology", default="cluster")
    parser.add_argument("--memory-budget", default="80GiB")
    parser.add_argument("--world-sizes", default="64,128,256,512,1024")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from cpdpkit.planner import PlannerConfig, parse_bytes

    config = PlannerConfig(memory_budget_bytes=parse_bytes(args.memory_budget))
    rows = [_one(args.model, args.topology, int(w), config, args.repeats) for w in args.world_sizes.split(",")]
    others = {name: _one(name, args.topology, 1024, PlannerConfig(), 3) for name in ("resnet50", "vit-s", "llama-7b")}
    print(json.dumps({
        "benchmark": "planner_scale", "model": args.model, "topology": args.topology,
        "memory_budget": args.memory_budget,
        "goals": {"plan_seconds_at_64": GOAL_PLAN_S_AT_64, "imbalance": GOAL_IMBALANCE,
                  "padding_frac": GOAL_PADDING_FRAC},
        "results": rows, "other_models_at_1024": others,
        "all_goals_met": all(r["goals_met"] for r in rows),
    }, indent=1))


if __name__ == "__main__":
    main()
