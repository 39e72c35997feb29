"""Apply a :class:`~cpdpkit.planner.plan.ShardingPlan` with FSDP2 (the only place cpdpkit calls
``fully_shard`` or builds the data-parallel ``DeviceMesh``).

What FSDP2 executes: the mesh (1-D ``("shard",)`` or 2-D ``("replicate", "shard")`` HSDP), one
``fully_shard`` per unit (a list of modules for merged neighbours; the root last), each
parameter's ``Shard(dim)`` through ``shard_placement_fn``, and each unit's
``reshard_after_forward`` (bool or int). What it cannot: optimizer-state sharding across the
replicate axis (FSDP2's HSDP all-reduces gradients and every replica steps its whole shard).
For such plans :func:`apply_plan` applies the rest and emits :class:`StateShardingNotApplied`
(a ``UserWarning``) with the memory that costs; :class:`~cpdpkit.shard.executor.TwoStageExecutor`
runs such plans.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard

from cpdpkit.errors import DistributedSetupError
from cpdpkit.planner.config import PlannerError, format_bytes
from cpdpkit.planner.plan import ShardingPlan

__all__ = ["apply_plan", "StateShardingNotApplied"]


class StateShardingNotApplied(UserWarning):
    """The plan shards optimizer state across the replicate axis, which FSDP2 cannot execute."""


def _mesh_for(plan: ShardingPlan, mesh: DeviceMesh | None, model: nn.Module) -> DeviceMesh:
    if not dist.is_available() or not dist.is_initialized():
        raise DistributedSetupError("apply_plan needs an initialised process group; call "
                                    "cpdpkit.init_distributed() (or dist.init_process_group) first")
    world = dist.get_world_size()
    if mesh is None:
        if world != plan.world_size:
            raise DistributedSetupError(f"the plan is for {plan.world_size} ranks but the world size is {world}; "
                                        f"re-plan with --world-size {world}")
        device = next((p.device.type for p in model.parameters() if p.device.type != "meta"), None)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        return init_device_mesh(device, plan.mesh.shape, mesh_dim_names=plan.mesh.dim_names)
    if tuple(mesh.shape) != plan.mesh.shape:
        raise DistributedSetupError(f"mesh shape {tuple(mesh.shape)} differs from the plan's {plan.mesh.shape} "
                                    f"{plan.mesh.dim_names}; pass mesh=None to build it from the plan")
    return mesh


def _placement_dims(model: nn.Module, plan: ShardingPlan) -> dict[int, int]:
    """id(param) -> Shard dim, after checking that the model has exactly the plan's parameters."""
    params = dict(model.named_parameters())
    planned = {p.fqn: p for p in plan.placements}
    for fqn, param in params.items():
        placement = planned.get(fqn)
        if placement is None:
            raise PlannerError(f"parameter {fqn!r} of the model is not in the plan for {plan.model_name!r}; "
                               "plan this model (or a meta-device copy of it) and apply that plan")
        if tuple(param.shape) != placement.shape:
            raise PlannerError(f"parameter {fqn!r} has shape {tuple(param.shape)} but the plan has "
                               f"{placement.shape}; re-plan for this model")
    int_units = [u for u in plan.units if not isinstance(u.reshard_after_forward, bool)]
    for unit in int_units:
        for fqn in unit.param_fqns:
            if planned[fqn].dim != 0:
                raise PlannerError(
                    f"unit {unit.name!r} has reshard_after_forward = {unit.reshard_after_forward} but parameter "
                    f"{fqn!r} is Shard({planned[fqn].dim}); FSDP2 supports an int only with Shard(0): re-plan")
    missing = sorted(set(planned) - set(params))
    if missing:
        raise PlannerError(f"the plan has parameter {missing[0]!r} which the model lacks; re-plan for this model")
    return {id(params[fqn]): planned[fqn].dim for fqn in params}


def apply_plan(model: nn.Module, plan: ShardingPlan, mesh: DeviceMesh | None = None, *,
               mp_policy: Any = None, offload_policy: Any = None) -> nn.Module:
    """Shard ``model`` in place as ``plan`` says and return it (now an ``FSDPModule``).

    ``mesh`` defaults to ``init_device_mesh(device, plan.mesh.shape, mesh_dim_names=...)`` on
    the model's device type (CUDA when the model is on the meta device and CUDA exists).
    ``mp_policy`` / ``offload_policy`` pass through to every ``fully_shard`` call. A plan with a
    cross-site ``reconciliation`` (``reconcile_period``) is sharded over the mesh's ``shard``
    sub-mesh only; wrap its optimizer in ``PeriodicSyncOptimizer(inner, model=model,
    group=mesh["replicate"].get_group(), period=plan.reconciliation.period)``.
    """
    if not isinstance(plan, ShardingPlan):
        raise TypeError(f"plan = {type(plan).__name__} must be a ShardingPlan (ShardingPlan.load(path) reads a file)")
    if plan.param_sharding == "replicated":
        raise PlannerError(f"plan {plan.strategy!r} keeps parameters replicated, so there is nothing for FSDP2 to "
                           "shard: train it with cpdpkit.shard.PartialShardExecutor")
    dims = _placement_dims(model, plan)
    mesh = _mesh_for(plan, mesh, model)
    if plan.reconciliation is not None:
        # CPDP across sites: FSDP2 inside the site only; PeriodicSyncOptimizer crosses the replicate axis
        mesh = mesh["shard"]
    extra: dict[str, Any] = {}
    if mp_policy is not None:
        extra["mp_policy"] = mp_policy
    if offload_policy is not None:
        extra["offload_policy"] = offload_policy

    def placement(param: nn.Parameter) -> Shard | None:
        dim = dims.get(id(param))
        return None if dim is None else Shard(dim)

    root = None
    for unit in plan.units:
        if unit.is_root:
            root = unit
            continue
        modules = [model.get_submodule(fqn) for fqn in unit.module_fqns]
        fully_shard(modules if len(modules) > 1 else modules[0], mesh=mesh,
                    reshard_after_forward=unit.reshard_after_forward, shard_placement_fn=placement, **extra)
    fully_shard(model, mesh=mesh, reshard_after_forward=root.reshard_after_forward if root else None,
                shard_placement_fn=placement, **extra)
    if plan.state_sharding.axis is not None:
        rb = plan.rank_bytes
        warnings.warn(
            f"plan {plan.strategy!r} shards optimizer state {plan.state_sharding.num_partitions} ways across the "
            f"replicate axis; FSDP2 cannot execute that, so each replica keeps its whole shard's state "
            f"(peak about {format_bytes(rb.fsdp2_peak_bytes)} per rank instead of {format_bytes(rb.peak_bytes)}). "
            "Mesh, units, placements and reshard_after_forward are applied.",
            StateShardingNotApplied, stacklevel=2)
    return model
