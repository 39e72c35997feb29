"""``cpdpkit bench sharding``: FSDP2 (with and without resharding after forward), FSDP2 HSDP, torch's
ZeRO-1 over DDP, the planner's plan, the two-stage executor and partially sharded data parallelism on
one small GPT over an emulated two-tier cluster.

Strategies (each its own torchrun job over the emulated topology; same model, data, seed and
optimizer):

* ``fsdp2``: ``fully_shard`` on every block and the root over all ranks (1-D mesh).
* ``fsdp2-zero2``: the same with ``reshard_after_forward=False``: parameters stay unsharded from
  forward to backward, so a step all-gathers once and reduce-scatters once (ZeRO-2's volume, DDP's),
  per block as DDP's buckets below.
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

The planner plans for this run's compute (``tokens_per_rank`` = batch x sequence length,
``flops_per_s`` = :data:`RANK_FLOPS_PER_S`), so the unit sizes it picks are those whose exchanges
its two-stage schedule can overlap here. ``two-stage`` and ``partial`` calibrate their exchange
schedule on this machine after the warm-up steps and report how many exchanges finished during
backward (stage 1), measured and predicted (:mod:`cpdpkit.bench.sharding.worker`).

Goals: :mod:`cpdpkit.bench.sharding.goals` (against the fastest partially sharded peer, bytes per
link against each peer's on that link; a strategy that did not run leaves its goals out).

Everything is validated and planned here, in the parent, before any process starts: a world
size that does not fit the topology, a non-elementwise optimizer or a unit too large for the
memory budget is one :class:`~cpdpkit.errors.ConfigError` line.

Default topology ``cluster-slow-ib`` (a preset of :mod:`cpdpkit.topology`; ``cluster-slower-ib`` is the
communication-dominated scenario): nodes of 2 ranks joined by an
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
from cpdpkit.bench.sharding.goals import judge
from cpdpkit.errors import ConfigError
from cpdpkit.topology import Topology, resolve_topology

if TYPE_CHECKING:
    from cpdpkit.planner import ShardingPlan

__all__ = ["SHARDING_STRATEGIES", "DEFAULT_STRATEGIES", "ShardingBenchConfig", "ShardingReport",
           "prepare", "run_sharding_bench", "unsupported_reason"]

SHARDING_STRATEGIES = ("fsdp2", "fsdp2-zero2", "hsdp", "zero1", "zero1-overlap", "planned", "two-stage", "partial")
# All of them: one default run (gpt-tiny, 10 steps) took about 3-4 minutes on 2 loaded CPU cores, most
# of it the jobs' start-up (~15 s each); --strategies picks a subset.
DEFAULT_STRATEGIES = SHARDING_STRATEGIES
# The compute model the planner chooses unit sizes with (PlannerConfig.flops_per_s): one rank of this
# suite, 4 ranks sharing 2 CPU cores (benchmarks/sharding_rank_flops.py: ~9 GFLOP/s on one thread, halved).
# Its A100 default would price gpt-tiny's step at 0.2 ms of compute, under which nothing overlaps a 1 ms link
# and one merged unit wins (docs/results.md).
RANK_FLOPS_PER_S = 4.5e9
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

    @property
    def inter_node_tier(self) -> str:
        tier = self.topology.tier_of(range(0, 2 * self.topology.ranks_per_node, self.topology.ranks_per_node))
        return tier.name if tier is not None else "?"

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
              "optim_state_bytes_per_param": _STATE_BYTES_PER_PARAM[config.optimizer],
              "tokens_per_rank": config.batch_size * gpt_preset(config.model).seq_len,
              "flops_per_s": RANK_FLOPS_PER_S}
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
                          goals=judge(results, topology=config.topology, inter_node_tier=prep.inter_node_tier,
                                      num_replicas=topo.num_nodes))


def _report_config(config: ShardingBenchConfig, prep: Prepared) -> dict[str, Any]:
    def summary(plan: ShardingPlan) -> dict[str, Any]:
        return {"strategy": plan.strategy, "mesh": list(plan.mesh.shape), "units": [u.name for u in plan.units],
                "state_sharding_axis": plan.state_sharding.axis}

    return {**config.to_dict(), "topology_tiers": {t.name: t.to_dict() for t in prep.topology.tiers},
            "ranks_per_node": prep.topology.ranks_per_node, "num_replicas": prep.topology.num_nodes,
            "model_grad_bytes": prep.plan.num_params * prep.plan.config.grad_bytes,
            "allreduce_wire_bytes": prep.allreduce_wire_bytes(), "plan": summary(prep.plan),
            **({"partial_plan": summary(prep.partial_plan)} if prep.partial_plan is not None else {})}
