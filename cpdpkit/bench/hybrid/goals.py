"""The hybrid suite's goal targets and the lines ``cpdpkit bench hybrid`` prints for its goals.

The suite judges each of ours against ``hsdp-global`` with these targets
(:func:`cpdpkit.bench.hybrid.suite._goals`, into the ``--json`` ``goals`` block); :func:`goal_lines`
renders that block as the CLI prints it. Torch-free.
"""

from __future__ import annotations

from typing import Any

from cpdpkit.bench.report import verdict as _mark

__all__ = ["STEP_TARGET", "LOSS_REL_TARGET", "MEMORY_SHARDS", "goal_lines"]

STEP_TARGET, LOSS_REL_TARGET = 0.5, 0.02  # step time vs hsdp-global's (median over periods); final loss, relative
MEMORY_SHARDS = 2  # SlowMo's anchor and slow momentum: one fp32 copy of the parameter shard each, over hsdp-global's


def goal_lines(goals: dict[str, Any]) -> list[str]:
    """The goals block ``cpdpkit bench hybrid`` prints: each of ours against hsdp-global."""
    if not goals:
        return ["goals: none to judge (hsdp-global or a cpdp-over-* strategy did not run)"]
    lines = []
    for name, g in goals.items():
        lines += [
            f"{name} vs hsdp-global: step time x{g['step_time_ratio']:.3f} (median over periods; target <= "
            f"{g['step_time_target']}) {_mark(g['step_time_met'])}",
            f"{name} vs hsdp-global: training state {g['training_state_bytes']} B/rank = hsdp-global's + "
            f"{g['training_state_over_hsdp_in_shards']:.2f} x its parameter shard (target <= {MEMORY_SHARDS}) "
            f"{_mark(g['training_state_met'])}",
            f"{name} vs hsdp-global: final loss differs by {g['final_loss_rel_diff'] * 100:.2f} % (target <= "
            f"{g['final_loss_target'] * 100:.0f} %) {_mark(g['final_loss_met'])}",
            f"  evidence: mean step time x{g['step_time_mean_ratio']:.3f}, exposed comm "
            f"x{g['exposed_comm_ratio']:.3f}, WAN bytes x{g['wan_bytes_ratio']:.3f}, "
            f"peak RSS {g['peak_mem_bytes_diff'] / 1e6:+.1f} MB",
        ]
    return lines
