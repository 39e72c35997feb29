"""Fine-grained sharding planner for FSDP2 (pure Python; no process group needed).

:func:`plan_sharding` turns a model (``nn.Module`` on the meta device, a preset such as
``llama-70b`` or ``package.module:factory``) and a :class:`~cpdpkit.topology.Topology` into a
frozen, JSON-serialisable :class:`ShardingPlan`: ``fully_shard`` units, an HSDP/FSDP mesh,
per-parameter ``Shard(dim)`` placements, optimizer-state sharding across the replicate axis,
per-rank bytes and per-tier traffic priced with the topology's α-β model, and (with state
sharding) the two-stage schedule of the updated-parameter exchanges (:func:`plan_two_stage`).
It also weighs *partially sharded data parallelism* (``param_sharding = "replicated"``,
strategy ``partial``: parameters replicated, gradients and optimizer state sharded over the
world, node first) and keeps every candidate it evaluated and why it chose (``candidates``,
``choice_reason``). With ``PlannerConfig.reconcile_period = K`` on a topology of several sites
(CPDP across sites) the site is the sharding domain and the replicate axis crosses the WAN only
at a reconciliation every K steps (the plan's :class:`Reconciliation`, priced per step as 1/K).
Training a plan (:func:`~cpdpkit.shard.apply_plan`, the executors) is :mod:`cpdpkit.shard`'s.

Imports point one way, all at module level: records that import no algorithm (``config``;
``model_spec``; ``timeline``, the schedule's records; ``plan``, which carries a ``timeline``
schedule) <- ``presets`` (shapes, and :func:`load_model_spec` for any model input) and the
algorithms ``_cost`` and ``schedule`` <- ``planner`` (the search). No module here imports torch
at module level (``model_spec`` imports it inside the function that reads an ``nn.Module``).
"""

from __future__ import annotations

from cpdpkit.planner.config import PlannerConfig, PlannerError, format_bytes, parse_bytes
from cpdpkit.planner.model_spec import BlockSpec, ModelSpec, ParamSpec
from cpdpkit.planner.plan import (
    CandidateSummary,
    CommPhase,
    MeshPlan,
    ParamPlacement,
    RankBytes,
    Reconciliation,
    ShardingPlan,
    StateSharding,
    UnitPlan,
)
from cpdpkit.planner.planner import fsdp2_default_plan, plan_sharding, planning_summary
from cpdpkit.planner.presets import MODEL_PRESETS, load_model_spec, model_preset
from cpdpkit.planner.schedule import estimate_unit_timings, plan_two_stage, schedule_two_stage
from cpdpkit.planner.timeline import ExchangeSlot, LinkInterval, TwoStageSchedule, UnitTiming

__all__ = [
    "BlockSpec",
    "CandidateSummary",
    "CommPhase",
    "ExchangeSlot",
    "LinkInterval",
    "MODEL_PRESETS",
    "MeshPlan",
    "ModelSpec",
    "ParamPlacement",
    "ParamSpec",
    "PlannerConfig",
    "PlannerError",
    "RankBytes",
    "Reconciliation",
    "ShardingPlan",
    "StateSharding",
    "TwoStageSchedule",
    "UnitPlan",
    "UnitTiming",
    "estimate_unit_timings",
    "format_bytes",
    "fsdp2_default_plan",
    "load_model_spec",
    "model_preset",
    "parse_bytes",
    "plan_sharding",
    "plan_two_stage",
    "planning_summary",
    "schedule_two_stage",
]
