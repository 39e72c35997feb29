"""``cpdpkit bench sharding``: FSDP2, FSDP2 HSDP, the planner's plan and the two-stage
executor on one small GPT over an emulated two-tier cluster.

Strategies (each its own torchrun job over the emulated topology; same model, data, seed and
optimizer):

* ``fsdp2``: ``fully_shard`` on every block and the root over all ranks (1-D mesh).
* ``hsdp``: FSDP2's HSDP as torch ships it: 2-D mesh ``(replicate = nodes, shard = ranks per node)``.
* ``planned``: :func:`~cpdpkit.planner.plan_sharding`'s plan applied with
  :func:`~cpdpkit.planner.apply_plan` and a whole-shard optimizer (no state sharding).
* ``two-stage``: the same plan run by :class:`~cpdpkit.planner.executor.TwoStageExecutor`.

Everything is validated and planned here, in the parent, before any process starts: a world
size that does not fit the topology, a non-elementwise optimizer or a unit too large for the
memory budget is one :class:`~cpdpkit.errors.ConfigError` line.

Default topology ``cluster-slow-ib`` (:data:`CLUSTER_SLOW_IB`): nodes of 2 ranks joined by an
"IB" tier of 1 ms latency and 150 MB/s. A real HDR link is 5 us / 25 GB/s, but a GPU computes
about 1,000x faster than the two CPU cores this runs on; scaling the link down by ~170x keeps
communication a comparable share of a step (a gradient shard of the default model takes ~10 ms
on it against a step's tens of ms of compute), so the strategies' differences show.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cpdpkit.bench.gpt import gpt_preset
from cpdpkit.errors import ConfigError
from cpdpkit.topology import Tier, Topology, resolve_topology

if TYPE_CHECKING:
    from cpdpkit.planner import ShardingPlan

__all__ = ["SHARDING_STRATEGIES", "CLUSTER_SLOW_IB", "ShardingBenchConfig", "ShardingReport",
           "prepare", "run_sharding_bench"]

SHARDING_STRATEGIES = ("fsdp2", "hsdp", "planned", "two-stage")
CLUSTER_SLOW_IB = Topology(
    name="cluster-slow-ib",
    tiers=(Tier(name="NVLINK", latency_s=3e-6, bandwidth_bytes_per_s=300e9),
           Tier(name="IB", latency_s=1e-3, bandwidth_bytes_per_s=150e6)),
    intra_node_tier="NVLINK", inter_node_tier="IB", ranks_per_node=2, nodes_per_site=None, num_sites=1,
    description="nodes of 2 ranks: NVLINK inside (3 us, 300 GB/s), IB between scaled to CPU compute "
                "(1 ms, 150 MB/s)",
)
# Optimizers by name: elementwise ones (TwoStageExecutor can run them) and known others (refused).
_ELEMENTWISE = ("adamw", "adam", "sgd")
_NOT_ELEMENTWISE = ("adafactor", "lbfgs")
_STATE_BYTES_PER_PARAM = {"adamw": 8, "adam": 8, "sgd": 4}  # fp32 moments / momentum buffer


@dataclass(frozen=True, kw_only=True)
class ShardingBenchConfig:
    """What ``cpdpkit bench sharding`` runs (defaults: the 4-rank 2x2 comparison)."""

    strategies: tuple[str, ...] = SHARDING_STRATEGIES
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
    max_grad_norm: float | None = None  # clip by global norm (clip_grad_norm_ / the executor's)
    profile_dir: str | None = None

    def __post_init__(self) -> None:
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
    """The placed topology: ``cluster-slow-ib`` (this module's), a preset or a TOML path.

    Raises a one-line ConfigError when the world size does not factor into >= 2 nodes.
    """
    if name == CLUSTER_SLOW_IB.name:
        if world_size % CLUSTER_SLOW_IB.ranks_per_node:
            raise ConfigError(f"world size {world_size} does not factor into topology {name!r} (nodes of "
                              f"{CLUSTER_SLOW_IB.ranks_per_node} ranks): use an even --world-size such as 4")
        topo = CLUSTER_SLOW_IB.place(world_size)
    else:
        topo = resolve_topology(name, world_size=world_size)
    rpn = topo.ranks_per_node
    if rpn is None or world_size % rpn or world_size // rpn < 2:
        raise ConfigError(f"world size {world_size} on topology {name!r} gives {world_size // (rpn or world_size)} "
                          f"node(s) of {rpn} ranks: the sharding suite needs >= 2 nodes (replicas) of equal size; "
                          "use e.g. --world-size 4 --topology cluster-slow-ib")
    return topo


@dataclass(frozen=True)
class Prepared:
    topology: Topology  # placed on the suite's world size, >= 2 nodes
    plan: ShardingPlan

    @property
    def ranks_per_node(self) -> int:
        return self.topology.ranks_per_node  # type: ignore[return-value]

    @property
    def num_replicas(self) -> int:
        return self.topology.world_size // self.ranks_per_node  # type: ignore[operator]


def prepare(config: ShardingBenchConfig) -> Prepared:
    """Validate against the topology and plan (pure Python, no process group, no torch collective)."""
    import torch

    from cpdpkit.bench.gpt import TinyGPT
    from cpdpkit.planner import PlannerConfig, parse_bytes, plan_sharding

    topo = resolve_bench_topology(config.topology, config.world_size)
    budget = parse_bytes(config.memory_budget) if config.memory_budget is not None else None
    pconf = PlannerConfig(param_dtype="float32", grad_dtype="float32",
                          optim_state_bytes_per_param=_STATE_BYTES_PER_PARAM[config.optimizer],
                          memory_budget_bytes=budget)
    with torch.device("meta"):
        model = TinyGPT(gpt_preset(config.model))
    plan = plan_sharding(model, topo, world_size=config.world_size, config=pconf)
    if "two-stage" in config.strategies and (plan.state_sharding.axis != "replicate" or len(plan.mesh.shape) != 2):
        raise ConfigError(f"the planner chose {plan.strategy!r} (mesh {plan.mesh.shape}) without optimizer-state "
                          "sharding across replicas, which two-stage needs: drop two-stage from --strategies "
                          "or use a topology with a slow inter-node tier")
    return Prepared(topology=topo, plan=plan)


@dataclass(frozen=True)
class ShardingReport:
    config: dict[str, Any]
    results: tuple[dict[str, Any], ...]
    goals: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config, "results": list(self.results), "goals": self.goals}


def _goals(results: list[dict[str, Any]], num_replicas: int) -> dict[str, Any]:
    by = {r["strategy"]: r for r in results if r.get("status") == "ok"}
    hsdp, two = by.get("hsdp"), by.get("two-stage")
    if hsdp is None or two is None:
        return {}
    step_ratio = two["step_s"] / hsdp["step_s"]
    comm_ratio = (two["exposed_comm_s_per_step"] / hsdp["exposed_comm_s_per_step"]
                  if hsdp["exposed_comm_s_per_step"] > 0 else float("nan"))
    state_target = hsdp["optimizer_state_bytes_per_rank"] / num_replicas
    loss_diff = abs(two["final_loss"] - hsdp["final_loss"])
    return {
        "step_time_ratio": step_ratio, "step_time_target": 0.85, "step_time_met": step_ratio <= 0.85,
        "exposed_comm_ratio": comm_ratio, "exposed_comm_target": 0.5, "exposed_comm_met": comm_ratio <= 0.5,
        "optimizer_state_bytes": two["optimizer_state_bytes_per_rank"], "optimizer_state_target": state_target,
        "optimizer_state_met": two["optimizer_state_bytes_per_rank"] == state_target,
        "final_loss_abs_diff": loss_diff, "final_loss_target": 1e-4, "final_loss_met": loss_diff <= 1e-4,
    }


def run_sharding_bench(config: ShardingBenchConfig, work_dir: Path,
                       emit: Callable[[tuple[Any, ...]], None] = lambda e: None) -> ShardingReport:
    """Run every strategy of ``config`` as its own launched job; collect their results.

    Validates and plans first (:func:`prepare`): a bad configuration raises before any launch
    and before ``work_dir`` is created.
    """
    from cpdpkit.bench import sharding_worker as worker
    from cpdpkit.launch import LaunchConfig, launch

    prep = prepare(config)
    work_dir.mkdir(parents=True, exist_ok=True)
    topo_path = work_dir / "topology.toml"
    topo_path.write_text(prep.topology.to_toml())
    results = []
    for strategy in config.strategies:
        run_dir = work_dir / strategy
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / worker.RESULT_FILE).unlink(missing_ok=True)
        spec = {**config.to_dict(), "strategy": strategy, "plan": prep.plan.to_dict(),
                "ranks_per_node": prep.ranks_per_node, "num_replicas": prep.num_replicas}
        (run_dir / worker.SPEC_FILE).write_text(json.dumps(spec, indent=1))
        emit(("start", strategy))
        t0 = time.perf_counter()
        res = launch(LaunchConfig(nproc_per_node=config.world_size, topology=str(topo_path),
                                  log_dir=str(run_dir / "logs")), worker.__file__, [str(run_dir)])
        launch_s = time.perf_counter() - t0
        path = run_dir / worker.RESULT_FILE
        if res.ok and path.exists():
            result = json.loads(path.read_text())
        else:
            result = {"strategy": strategy, "status": "failed",
                      "reason": f"rank {res.failed_rank}: {res.error}" if not res.ok else "no result written"}
        result["launch_s"] = launch_s
        results.append(result)
        emit(("done", strategy, result))
    cfg = {**config.to_dict(), "topology_tiers": {t.name: t.to_dict() for t in prep.topology.tiers},
           "ranks_per_node": prep.ranks_per_node, "num_replicas": prep.num_replicas,
           "plan": {"strategy": prep.plan.strategy, "mesh": list(prep.plan.mesh.shape),
                    "units": [u.name for u in prep.plan.units],
                    "state_sharding_axis": prep.plan.state_sharding.axis}}
    return ShardingReport(config=cfg, results=tuple(results), goals=_goals(results, prep.num_replicas))
