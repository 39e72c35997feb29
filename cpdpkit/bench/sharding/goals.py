"""The sharding suite's goal targets and the lines ``cpdpkit bench sharding`` prints for its goals.

The suite judges its results against these targets (:func:`cpdpkit.bench.sharding.suite._goals`, into the
``--json`` ``goals`` block); :func:`goal_lines` renders that block as the CLI prints it, and
``tools/docs_tables.py`` prints the same lines from a saved file. Torch-free.
"""

from __future__ import annotations

from typing import Any

from cpdpkit.bench.report import verdict as _mark

__all__ = ["STEP_TARGET", "HSDP_COMM_TARGET", "LOSS_TARGET", "BYTES_TARGET", "STAGE1_TARGET", "goal_lines"]

# two-stage's step time vs the fastest peer; its exposed communication vs hsdp's; every loss vs hsdp's;
# partial's bytes per link vs one DDP all-reduce; stage-1 exchanges measured vs predicted
STEP_TARGET, HSDP_COMM_TARGET, LOSS_TARGET, BYTES_TARGET, STAGE1_TARGET = 0.85, 0.5, 1e-4, 1.01, 1.0
_LOSS = f"{LOSS_TARGET:.0e}".replace("e-0", "e-")  # "1e-4"


def goal_lines(goals: dict[str, Any]) -> list[str]:
    """The goals block ``cpdpkit bench sharding`` prints: each goal's measured ratio beside its target."""
    if not goals:
        return ["goals: none to judge (two-stage, partial or hsdp did not run)"]
    lines = []
    if "step_time_ratio" in goals:
        lines += [
            f"two-stage vs hsdp: step time x{goals['step_time_ratio']:.3f} (target <= {STEP_TARGET}) "
            f"{_mark(goals['step_time_met'])}",
            f"two-stage vs hsdp: exposed comm x{goals['exposed_comm_ratio']:.3f} (target <= {HSDP_COMM_TARGET}) "
            f"{_mark(goals['exposed_comm_met'])}",
            *(["  of which by tier (evidence): " + ", ".join(
                f"{tier} x{ratio:.3f}" for tier, ratio in goals["exposed_comm_ratio_by_tier"].items())]
              if goals.get("exposed_comm_ratio_by_tier") else []),
            f"two-stage optimizer state {goals['optimizer_state_bytes']} B/rank (target hsdp / replicas = "
            f"{goals['optimizer_state_target']:.0f}) {_mark(goals['optimizer_state_met'])}",
            f"two-stage final loss |diff| {goals['final_loss_abs_diff']:.2e} vs hsdp (target <= {_LOSS}) "
            f"{_mark(goals['final_loss_met'])}",
        ]
    if vs := goals.get("two_stage_vs_peers"):
        lines.append(f"two-stage vs fastest peer ({vs['fastest_peer']} of {', '.join(vs['peers'])}): step time "
                     f"x{vs['step_time_ratio']:.3f} (target <= {vs['step_time_target']}) {_mark(vs['step_time_met'])}")
        lines += [f"two-stage vs {peer}: exposed comm x{c['ratio']:.3f} (target <= {c['target']}) {_mark(c['met'])}"
                  for peer, c in vs["exposed_comm"].items() if peer != "hsdp"]
    lines += [f"{name} final loss |diff| {g['abs_diff']:.2e} vs hsdp (target <= {_LOSS}) {_mark(g['met'])}"
              for name, g in (goals.get("final_loss_vs_hsdp") or {}).items()]
    if p := goals.get("partial"):
        tiers = ", ".join(f"{t} x{g['ratio']:.3f}" for t, g in p["tier_bytes"].items())
        lines.append(f"partial bytes/step per link vs one DDP all-reduce ({p['allreduce_wire_bytes']} B/rank): {tiers} "
                     f"(target <= {p['bytes_target']}) {_mark(p['bytes_met'])}")
        if "optimizer_state_ratio" in p:
            lines.append(f"partial optimizer state {p['optimizer_state_bytes']} B/rank = "
                         f"x{p['optimizer_state_ratio']:.3f} of hsdp / world x ranks per node "
                         f"({p['optimizer_state_target']:.0f}; target <= 1) "
                         f"{_mark(p['optimizer_state_met'])}")
    lines += [f"{name} stage-1 exchanges per step: measured {g['measured']:.2f} vs predicted {g['predicted']} of "
              f"{g['num_units']} (target |diff| <= {STAGE1_TARGET:g}) {_mark(g['met'])}"
              for name, g in (goals.get("stage1") or {}).items()]
    return lines
