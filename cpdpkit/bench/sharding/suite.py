"""``cpdpkit bench sharding``: FSDP2, FSDP2 HSDP, torch's ZeRO-1 over DDP, the planner's plan, the
two-stage executor and partially sharded data parallelism on one small GPT over an emulated
two-tier cluster.

Strategies (each its own torchrun job over the emulated topology; same model, data, seed and
optimizer):

* ``fsdp2``: ``fully_shard`` on every block and the root over all ranks (1-D mesh).
* ``hsdp``: FSDP2's HSDP as torch ships it: 2-D mesh ``(replicate = nodes, shard = ranks per node)``.
* ``zero1``: torch's ``ZeroRedundancyOptimizer`` over ``DistributedDataParallel`` on the world
  group; ``zero1-overlap``: the same with ``overlap_with_ddp=True`` and DDP's
  ``hook_with_zero_step`` (see :mod:`cpdpkit.bench.sharding.zero_peers`: bucketing, priming, gloo, and why
  it cannot clip: with ``--max-grad-norm`` it is reported ``unsupported`` and not launched).
* ``planned``: :func:`~cpdpkit.planner.plan_sharding`'s plan (``param_sharding="sharded"``)
  applied with :func:`~cpdpkit.shard.apply_plan` and a whole-shard optimizer (no state sharding).
* ``two-stage``: the same plan run by :class:`~cpdpkit.shard.executor.TwoStageExecutor`.
* ``partial``: the planner's partially sharded plan (``param_sharding="replicated"``: parameters
  replicated, gradients and optimizer state sharded inside the node, then across nodes) run by
  :class:`~cpdpkit.shard.partial.PartialShardExecutor`.

``two-stage`` and ``partial`` calibrate their exchange schedule on this machine after the warm-up
steps and report how many exchanges finished during backward (stage 1), measured and predicted
(:mod:`cpdpkit.bench.sharding.worker`).

Goals (:func:`_goals`; a strategy that did not run leaves its goals out): ``two-stage`` against
``hsdp`` (step time, exposed communication <= 0.5x, optimizer state = hsdp's / replicas, final
loss), against every peer that ran (``fsdp2``, ``hsdp``, ``zero1``, ``zero1-overlap``: step time
<= 0.85x the fastest, exposed communication <= each ZeRO peer's); ``partial``'s bytes on every
tier <= 1.01x the per-rank wire bytes of one DDP all-reduce of the model's gradients over the world
(:mod:`cpdpkit.network`), its optimizer state <= hsdp's / world x ranks per node; measured stage-1
exchanges within 1 of predicted; the final loss of the ZeRO peers and ``partial`` equal to
``hsdp``'s within 1e-4.

Everything is validated and planned here, in the parent, before any process starts: a world
size that does not fit the topology, a non-elementwise optimizer or a unit too large for the
memory budget is one :class:`~cpdpkit.errors.ConfigError` line.

Default topology ``cluster-slow-ib`` (a preset of :mod:`cpdpkit.topology`): nodes of 2 ranks joined by an
"IB" tier of 1 ms latency and 150 MB/s. A real HDR link is 5 us / 25 GB/s, but a GPU computes
about 1,000x faster than the two CPU cores this runs on; scaling the link down by ~170x keeps
communication a comparable share of a step (a gradient shard of the default model takes ~10 ms
on it against a step's tens of ms of compute), so the strategies' differences show.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cpdpkit._values import refuse_nonfinite
from cpdpkit.bench.models.gpt import gpt_preset
from cpdpkit.bench.report import SuiteReport
from cpdpkit.bench.sharding.goals import BYTES_TARGET, HSDP_COMM_TARGET, LOSS_TARGET, STAGE1_TARGET, STEP_TARGET
from cpdpkit.errors import ConfigError
from cpdpkit.topology import Topology, resolve_topology

if TYPE_CHECKING:
    from cpdpkit.planner import ShardingPlan

__all__ = ["SHARDING_STRATEGIES", "DEFAULT_STRATEGIES", "ShardingBenchConfig", "ShardingReport",
           "prepare", "run_sharding_bench", "unsupported_reason"]

SHARDING_STRATEGIES = ("fsdp2", "hsdp", "zero1", "zero1-overlap", "planned", "two-stage", "partial")
# All of them: one default run (gpt-tiny, 10 steps) took about 3 minutes on 2 loaded CPU cores, most
# of it the 7 jobs' start-up (~15 s each); --strategies picks a subset.
DEFAULT_STRATEGIES = SHARDING_STRATEGIES
_PEERS = ("fsdp2", "hsdp", "zero1", "zero1-overlap")  # torch's own; two-stage's step time is compared with them
# Optimizers by name: elementwise ones (TwoStageExecutor can run them) and known others (refused).
_ELEMENTWISE = ("adamw", "adam", "sgd")
_NOT_ELEMENTWISE = ("adafactor", "lbfgs")
_STATE_BYTES_PER_PARAM = {"adamw": 8, "adam": 8, "sgd": 4}  # fp32 moments / momentum buffer


@dataclass(frozen=True, kw_only=True)
class ShardingBenchConfig:
    """What ``cpdpkit bench sharding`` runs (defaults: the 4-rank 2x2 comparison)."""

    strategies: tuple[str, ...] = DEFAULT_STRATEGIES
    model: str = "gpt-tiny"
    world_size: int = 4
    topology: str = "cluster-slow-ib"
    steps: int = 10  # timed steps
    warmup_steps: int = 2  # untimed steps before them
    batch_size: int = 4  # sequences per rank per step
    lr: float = 3e-3
    optimizer: str = "adamw"
    seed: int = 0
    memory_budget: str | None = None
    # None (--min-unit-bytes 0): the planner's own units (it merges blocks below a latency-bound size;
    # on gpt-tiny: the root and one unit of the 4 blocks). 1: every block its own unit, as the peers
    # shard: more exchanges can overlap backward, but each unit pays its collectives' fixed costs.
    min_unit_bytes: int | None = None
    max_grad_norm: float | None = None  # clip by global norm (clip_grad_norm_ / the executor's)
    profile_dir: str | None = None

    def __post_init__(self) -> None:
        refuse_nonfinite(self, ConfigError, options=True)
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ConfigError(f"--max-grad-norm must be > 0, got {self.max_grad_norm!r}: e.g. --max-grad-norm 1.0")
        for s in self.strategies:
            if s not in SHARDING_STRATEGIES:
                raise ConfigError(f"unknown strategy {s!r} for cpdpkit bench sharding: choose from "
                                  f"{', '.join(SHARDING_STRATEGIES)}")
        if not self.strategies:
            raise ConfigError("--strategies is empty: e.g. --strategies hsdp,two-stage")
        gpt_preset(self.model)
        for name, value in (("--world-size", self.world_size), ("--steps", self.steps),
                            ("--batch-size", self.batch_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a whole number >= 1, got {value!r}")
        if self.warmup_steps < 0:
            raise ConfigError(f"warm-up steps must be >= 0, got {self.warmup_steps!r}")
        if self.min_unit_bytes is not None and (not isinstance(self.min_unit_bytes, int) or self.min_unit_bytes < 1):
            raise ConfigError(f"--min-unit-bytes must be a whole number >= 0, got {self.min_unit_bytes!r}: "
                              "e.g. --min-unit-bytes 1 (one unit per block) or 0 (the planner's choice)")
        if not self.lr > 0:
            raise ConfigError(f"--lr must be > 0, got {self.lr!r}")
        if self.optimizer in _NOT_ELEMENTWISE:
            raise ConfigError(
                f"optimizer {self.optimizer!r} is not elementwise (its update of one element depends on "
                f"others), so the two-stage executor cannot shard its state: use one of {', '.join(_ELEMENTWISE)}")
        if self.optimizer not in _ELEMENTWISE:
            raise ConfigError(f"unknown optimizer {self.optimizer!r}: choose one of {', '.join(_ELEMENTWISE)}")

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["strategies"] = list(self.strategies)
        return out


def resolve_bench_topology(name: str, world_size: int) -> Topology:
    """The placed topology (a preset such as ``cluster-slow-ib``, or a TOML path).

    Raises one line when the world size does not place on it, or not into >= 2 nodes.
    """
    topo = resolve_topology(name, world_size=world_size)
    rpn = topo.ranks_per_node
    if world_size // rpn < 2:
        raise ConfigError(f"world size {world_size} on topology {name!r} gives {world_size // rpn} "
                          f"node(s) of {rpn} ranks: the sharding suite needs >= 2 nodes (replicas) of equal size; "
                          "use e.g. --world-size 4 --topology cluster-slow-ib")
    return topo


@dataclass(frozen=True)
class Prepared:
    topology: Topology  # placed on the suite's world size, >= 2 nodes
    plan: ShardingPlan  # param_sharding="sharded": planned and two-stage run it
    partial_plan: ShardingPlan | None = None  # param_sharding="replicated", when "partial" runs

    def plan_for(self, strategy: str) -> ShardingPlan:
        return self.partial_plan if strategy == "partial" and self.partial_plan is not None else self.plan

    def allreduce_wire_bytes(self) -> int:
        """Per-rank wire bytes of one all-reduce of the model's gradients over the world (DDP's step)."""
        grad_bytes = self.plan.num_params * self.plan.config.grad_bytes
        return self.topology.group(range(self.topology.world_size)).cost("all_reduce", grad_bytes).wire_bytes


def prepare(config: ShardingBenchConfig) -> Prepared:
    """Validate against the topology and plan (pure Python, no process group, no torch collective)."""
    import torch

    from cpdpkit.bench.models.gpt import TinyGPT
    from cpdpkit.planner import PlannerConfig, parse_bytes, plan_sharding

    topo = resolve_bench_topology(config.topology, config.world_size)
    budget = parse_bytes(config.memory_budget) if config.memory_budget is not None else None
    common = {"param_dtype": "float32", "grad_dtype": "float32", "memory_budget_bytes": budget,
              "min_unit_bytes": config.min_unit_bytes,
              "optim_state_bytes_per_param": _STATE_BYTES_PER_PARAM[config.optimizer]}
    with torch.device("meta"):
        model = TinyGPT(gpt_preset(config.model))
    plan = plan_sharding(model, topo, world_size=config.world_size,
                         config=PlannerConfig(**common, param_sharding="sharded"))
    if "two-stage" in config.strategies and (plan.state_sharding.axis != "replicate" or len(plan.mesh.shape) != 2):
        raise ConfigError(f"the planner chose {plan.strategy!r} (mesh {plan.mesh.shape}) without optimizer-state "
                          "sharding across replicas, which two-stage needs: drop two-stage from --strategies "
                          "or use a topology with a slow inter-node tier")
    partial = None
    if "partial" in config.strategies:
        partial = plan_sharding(model, topo, world_size=config.world_size,
                                config=PlannerConfig(**common, param_sharding="replicated"))
        if partial.strategy != "partial":
            raise ConfigError(f"the planner returned {partial.strategy!r} for param_sharding='replicated' instead of "
                              "a partially sharded plan: drop partial from --strategies")
    return Prepared(topology=topo, plan=plan, partial_plan=partial)


def unsupported_reason(strategy: str, config: ShardingBenchConfig) -> str | None:
    """Why ``strategy`` cannot run under ``config`` (it is then reported, not launched), else None."""
    if strategy == "zero1-overlap" and config.max_grad_norm is not None:
        from cpdpkit.bench.sharding.zero_peers import OVERLAP_CLIP_REASON

        return OVERLAP_CLIP_REASON
    return None


ShardingReport = SuiteReport  # {"config", "results", "goals"}: docs/json.md




def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def _two_stage_vs_hsdp(two: dict[str, Any], hsdp: dict[str, Any], num_replicas: int) -> dict[str, Any]:
    step_ratio = _ratio(two["step_s"], hsdp["step_s"])
    comm_ratio = _ratio(two["exposed_comm_s_per_step"], hsdp["exposed_comm_s_per_step"])
    state_target = hsdp["optimizer_state_bytes_per_rank"] / num_replicas
    loss_diff = abs(two["final_loss"] - hsdp["final_loss"])
    return {
        "step_time_ratio": step_ratio, "step_time_target": STEP_TARGET, "step_time_met": step_ratio <= STEP_TARGET,
        "exposed_comm_ratio": comm_ratio, "exposed_comm_target": HSDP_COMM_TARGET,
        "exposed_comm_met": comm_ratio <= HSDP_COMM_TARGET,
        "optimizer_state_bytes": two["optimizer_state_bytes_per_rank"], "optimizer_state_target": state_target,
        "optimizer_state_met": two["optimizer_state_bytes_per_rank"] == state_target,
        "final_loss_abs_diff": loss_diff, "final_loss_target": LOSS_TARGET,
        "final_loss_met": loss_diff <= LOSS_TARGET,
        # evidence, not a goal: the exposed time on each tier (the exchanges ride the slow one)
        "exposed_comm_ratio_by_tier": {
            tier: _ratio(two.get("exposed_comm_s_per_step_by_tier", {}).get(tier, 0.0), seconds)
            for tier, seconds in sorted(hsdp.get("exposed_comm_s_per_step_by_tier", {}).items()) if seconds > 0},
    }


def _two_stage_vs_peers(two: dict[str, Any], by: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Step time against the fastest peer that ran; exposed communication against hsdp (0.5x) and each ZeRO peer."""
    peers = [p for p in _PEERS if p in by]
    if not peers:
        return {}
    fastest = min(peers, key=lambda p: by[p]["step_s"])
    step_ratio = _ratio(two["step_s"], by[fastest]["step_s"])
    comm = {}
    for peer in (p for p in ("hsdp", "zero1", "zero1-overlap") if p in by):
        ratio = _ratio(two["exposed_comm_s_per_step"], by[peer]["exposed_comm_s_per_step"])
        target = HSDP_COMM_TARGET if peer == "hsdp" else 1.0
        comm[peer] = {"ratio": ratio, "target": target, "met": ratio <= target}
    return {"peers": peers, "fastest_peer": fastest, "step_time_ratio": step_ratio, "step_time_target": STEP_TARGET,
            "step_time_met": step_ratio <= STEP_TARGET, "exposed_comm": comm,
            "exposed_comm_met": all(c["met"] for c in comm.values()) if comm else None}


def _partial_goals(partial: dict[str, Any], hsdp: dict[str, Any] | None, *, allreduce_wire_bytes: int,
                   world_size: int, ranks_per_node: int) -> dict[str, Any]:
    """Bytes per link vs one DDP ring all-reduce of the gradients; optimizer state vs hsdp's / world x shard size."""
    limit = BYTES_TARGET * allreduce_wire_bytes
    tiers = {t: {"bytes": b, "ratio": _ratio(b, allreduce_wire_bytes), "met": b <= limit}
             for t, b in sorted(partial["tier_bytes_per_step"].items())}
    out: dict[str, Any] = {"allreduce_wire_bytes": allreduce_wire_bytes, "bytes_target": BYTES_TARGET,
                           "tier_bytes": tiers, "bytes_met": all(t["met"] for t in tiers.values())}
    if hsdp is not None:
        target = hsdp["optimizer_state_bytes_per_rank"] / world_size * ranks_per_node
        state = partial["optimizer_state_bytes_per_rank"]
        out.update({"optimizer_state_bytes": state, "optimizer_state_target": target,
                    "optimizer_state_ratio": _ratio(state, target), "optimizer_state_met": state <= target})
    return out


def _stage1_goals(by: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for name in ("two-stage", "partial"):
        r = by.get(name) or {}
        measured, predicted = r.get("stage1_units"), r.get("stage1_units_predicted")
        if measured is None or predicted is None:
            continue
        diff = abs(measured - predicted)
        out[name] = {"measured": measured, "predicted": predicted, "num_units": r.get("num_units"),
                     "abs_diff": diff, "target": STAGE1_TARGET, "met": diff <= STAGE1_TARGET}
    return out


def _goals(results: list[dict[str, Any]], *, num_replicas: int, ranks_per_node: int,
           allreduce_wire_bytes: int) -> dict[str, Any]:
    """Every goal whose strategies ran ok (see the module docstring); ``{}`` when none can be judged.

    The flat keys compare ``two-stage`` with ``hsdp`` (kept as they were); the rest are blocks.
    """
    by = {r["strategy"]: r for r in results if r.get("status") == "ok"}
    hsdp, two, partial = by.get("hsdp"), by.get("two-stage"), by.get("partial")
    goals: dict[str, Any] = {}
    if hsdp is not None and two is not None:
        goals.update(_two_stage_vs_hsdp(two, hsdp, num_replicas))
    if two is not None and (vs := _two_stage_vs_peers(two, by)):
        goals["two_stage_vs_peers"] = vs
    if hsdp is not None:
        losses = {name: abs(by[name]["final_loss"] - hsdp["final_loss"])
                  for name in ("zero1", "zero1-overlap", "partial") if name in by}
        if losses:
            goals["final_loss_vs_hsdp"] = {name: {"abs_diff": d, "target": LOSS_TARGET, "met": d <= LOSS_TARGET}
                                           for name, d in losses.items()}
    if partial is not None:
        goals["partial"] = _partial_goals(partial, hsdp, allreduce_wire_bytes=allreduce_wire_bytes,
                                          world_size=num_replicas * ranks_per_node, ranks_per_node=ranks_per_node)
    if stage1 := _stage1_goals(by):
        goals["stage1"] = stage1
    return goals


def run_sharding_bench(config: ShardingBenchConfig, work_dir: Path,
                       emit: Callable[[tuple[Any, ...]], None] = lambda e: None) -> ShardingReport:
    """Run every strategy of ``config`` as its own launched job; collect their results.

    Validates and plans first (:func:`prepare`): a bad configuration raises before any launch
    and before ``work_dir`` is created. A strategy with an :func:`unsupported_reason` is reported
    ``unsupported`` without a launch.
    """
    from cpdpkit.bench.launcher import run_per_strategy
    from cpdpkit.bench.sharding import worker

    prep = prepare(config)

    def spec_for(strategy: str) -> dict[str, Any]:
        return {**config.to_dict(), "strategy": strategy, "plan": prep.plan_for(strategy).to_dict(),
                "ranks_per_node": prep.topology.ranks_per_node, "num_replicas": prep.topology.num_nodes}

    results = run_per_strategy(config.strategies, work_dir=work_dir, topology=prep.topology,
                               world_size=config.world_size, worker_file=worker.__file__, spec_for=spec_for, emit=emit,
                               unsupported=lambda strategy: unsupported_reason(strategy, config))
    topo = prep.topology
    return ShardingReport(config=_report_config(config, prep), results=tuple(results),
                          goals=_goals(results, num_replicas=topo.num_nodes, ranks_per_node=topo.ranks_per_node,
                                       allreduce_wire_bytes=prep.allreduce_wire_bytes()))


def _report_config(config: ShardingBenchConfig, prep: Prepared) -> dict[str, Any]:
    def summary(plan: ShardingPlan) -> dict[str, Any]:
        return {"strategy": plan.strategy, "mesh": list(plan.mesh.shape), "units": [u.name for u in plan.units],
                "state_sharding_axis": plan.state_sharding.axis}

    return {**config.to_dict(), "topology_tiers": {t.name: t.to_dict() for t in prep.topology.tiers},
            "ranks_per_node": prep.topology.ranks_per_node, "num_replicas": prep.topology.num_nodes,
            "model_grad_bytes": prep.plan.num_params * prep.plan.config.grad_bytes,
            "allreduce_wire_bytes": prep.allreduce_wire_bytes(), "plan": summary(prep.plan),
            **({"partial_plan": summary(prep.partial_plan)} if prep.partial_plan is not None else {})}
