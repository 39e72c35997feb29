"""Partially sharded data parallelism: replicated parameters, gradients and optimizer state
sharded finely and hierarchically (:class:`PartialShardExecutor`).

The sharding paper's *partial sharding*: every rank keeps the whole model (a plain
``nn.Module``, no FSDP2: no forward or backward all-gathers), while each unit's gradient and
optimizer state are split over all ``W = R·S`` ranks of the plan's ``(replicate, shard)`` mesh
(``S`` ranks per node on the ``"shard"`` axis, ``R`` nodes on the ``"replicate"`` axis). Per
unit of ``n`` elements (``c = ceil(n/S)``, ``d = ceil(c/R)``), every step:

1. **Gradient ready.** A ``register_post_accumulate_grad_hook`` on each of the unit's
   parameters counts them; when the last one is accumulated the unit's gradient is flattened
   (``n`` elements, zero-padded to ``S·c``) and the parameters' ``.grad`` freed.
2. **Reduce-scatter inside the node** (mean over ``S``, the fast tier; *synchronous* on the
   training thread, so backward waits for it, ``grad_reduce_scatter``): rank ``i`` of the node
   keeps node slice ``i``, elements ``[i·c, (i+1)·c)``.
3. **Reduce-scatter of the node slice across nodes** (mean over ``R``, async) and from there
   the slice pipeline shared with :class:`~cpdpkit.shard.executor.TwoStageExecutor`
   (:mod:`cpdpkit.shard._slices`): rank ``(j, i)`` owns chunk ``j`` (``d`` elements) of node
   slice ``i``, the layout :func:`cpdpkit.planner._cost.partial_owned` prices, updates it in
   fp32 with the inner optimizer and all-gathers it across nodes; stage 1 during backward at
   the schedule-derived trigger, stage 2 in :meth:`~PartialShardExecutor.step`; the same
   exact speculative clipping, ``stats``, ``calibrate()`` and checkpointing. See
   :mod:`cpdpkit.shard.executor` for the trigger rule, clipping, its memory and the GPU notes.
4. **All-gather inside the node** (synchronous, fast tier, ``param_all_gather``) of the node
   slice the cross-node all-gather delivered, and the copy into the replicated parameters:
   for stage-1 units at the end of ``step()``, for stage-2 units in the unit's forward
   pre-hook (after backward no longer needs the old values, before the next forward reads them).

Per step a rank sends on each link at most what a ring all-reduce of the model sends
(``2(S-1)/S·M`` in the node, ``2(R-1)/R·M/S`` across nodes, against ``2(W-1)/W·M``): less
memory without more communication. The in-node collectives are synchronous because they ride
the fast tier and chaining them asynchronously would need one more wait point per unit; on GPU
they would run on NCCL's stream ordered by the current stream as described for the two-stage
executor.

Limits: the model must start identical on every rank (seeded init or a loaded checkpoint; the
executor does not broadcast); every trainable parameter must receive a gradient in every
synced backward on every rank (a unit whose parameters are only partly reached is reduced at
the end of backward with zeros for the missing ones); float32 parameters (no mixed precision);
elementwise optimizers only.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.profiler import record_function

from cpdpkit.labels import SHARD
from cpdpkit.planner.config import PlannerError
from cpdpkit.planner.plan import ShardingPlan
from cpdpkit.shard._slices import (
    ALL_GATHER,
    REDUCE_SCATTER,
    OptimizerFactory,
    SliceExecutor,
    SliceUnit,
    build_mesh,
    check_inputs,
    chunk_of,
    slice_bounds,
)

__all__ = ["PartialShardExecutor"]


@dataclasses.dataclass(kw_only=True, eq=False)
class _PartialUnit(SliceUnit):
    numels: list[int]
    total: int  # n: the unit's elements
    node_chunk: int  # c = ceil(n / S)
    offset: int  # i·c: where this rank's node slice starts in the flat unit
    num_accumulated: int = 0  # parameters whose gradient this backward has accumulated


class PartialShardExecutor(SliceExecutor):
    """Train ``model`` (replicated) as a partial ``plan`` says: gradients and optimizer state sharded over all ranks.

    Same use as :class:`~cpdpkit.shard.executor.TwoStageExecutor`:
    ``ex.zero_grad(); loss.backward(); ex.step()``; ``optimizer_factory(param_groups)``
    receives one param group per unit holding this rank's flat fp32 slice. ``mesh``: the plan's
    ``(replicate, shard)`` mesh (default: built from the plan). ``max_grad_norm``: exact global
    clipping (speculative, as the two-stage executor). ``update_in_backward``: stage-1 updates
    and exchanges during backward (default) or all of them in ``step()`` (bit-identical).
    Public methods as the two-stage executor: ``zero_grad``, ``step``, ``set_requires_gradient_sync``,
    ``wait_exchanges``, ``calibrate``, ``measured_schedule``, ``measured_timings``, ``stats``,
    ``reset_stats``, ``state_bytes``, ``slice_params``, ``state_dict``, ``load_state_dict``.
    """

    def __init__(self, model: nn.Module, plan: ShardingPlan, optimizer_factory: OptimizerFactory, *,
                 mesh: DeviceMesh | None = None, max_grad_norm: float | None = None,
                 update_in_backward: bool = True) -> None:
        if not isinstance(plan, ShardingPlan):
            raise TypeError(f"plan = {type(plan).__name__} must be a ShardingPlan")
        kind = getattr(plan, "param_sharding", None)
        if kind != "replicated" or len(plan.mesh.shape) != 2:
            raise PlannerError(f"plan {plan.strategy!r} has param_sharding = {kind!r}; PartialShardExecutor runs "
                               "partial plans: plan with PlannerConfig(param_sharding='replicated'), or run this "
                               "plan with TwoStageExecutor / apply_plan")
        check_inputs("PartialShardExecutor", model, optimizer_factory, max_grad_norm, update_in_backward)
        if any(hasattr(p, "placements") for p in model.parameters()):
            raise PlannerError("PartialShardExecutor needs the plain (unsharded) model, but its parameters are "
                               "DTensors; pass the module before fully_shard/apply_plan")
        units = self._unit_params(model, plan)
        mesh = build_mesh("PartialShardExecutor", model, plan, mesh)
        self._setup_axes(plan, mesh, max_grad_norm, update_in_backward)
        self.model = model
        self._shard_group = mesh.get_group("shard")
        self._shard_size = mesh.size(1)
        self._shard_rank = mesh.get_local_rank("shard")
        self._setup_pipeline([self._make_unit(*args) for args in units], optimizer_factory)

    # ---- setup -----------------------------------------------------------------------------
    @staticmethod
    def _unit_params(model: nn.Module, plan: ShardingPlan) -> list[tuple[str, int, list[nn.Module], list]]:
        """Per plan unit: name, plan position, modules and trainable parameters (checked against the model)."""
        named = dict(model.named_parameters())
        seen: set[str] = set()
        out = []
        for i, unit in enumerate(plan.units):
            missing = [f for f in unit.param_fqns if f not in named]
            if missing:
                raise PlannerError(f"the plan has parameter {missing[0]!r} which the model lacks; re-plan for this "
                                   "model")
            seen.update(unit.param_fqns)
            modules = [model.get_submodule(f) for f in unit.module_fqns]
            out.append((unit.name, i, modules, [named[f] for f in unit.param_fqns if named[f].requires_grad]))
        extra = [n for n in named if n not in seen]
        if extra:
            raise PlannerError(f"parameter {extra[0]!r} of the model is not in the plan for {plan.model_name!r}; "
                               "plan this model (or a meta-device copy of it) and run that plan")
        return out

    def _make_unit(self, name: str, plan_index: int, modules: list[nn.Module], params: list) -> _PartialUnit:
        numels = [p.numel() for p in params]
        n = sum(numels)
        c = chunk_of(n, self._shard_size)
        d = chunk_of(c, self._rep_size)
        offset = self._shard_rank * c
        m = max(0, min(c, n - offset))  # the real elements of this rank's node slice
        lo, hi = slice_bounds(m, d, self._rep_rank)
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in params]) if params else torch.zeros(0)
            slice_param = nn.Parameter(flat[offset + lo:offset + hi].clone())
        unit = _PartialUnit(name=name, plan_index=plan_index, modules=modules, params=params, numel=m, chunk=d,
                            lo=lo, hi=hi, slice_param=slice_param, numels=numels, total=n, node_chunk=c,
                            offset=offset)
        for p in params:
            p.register_post_accumulate_grad_hook(lambda _p, u=unit: self._on_param_grad(u))
        return unit

    # ---- the gradient-ready point ----------------------------------------------------------------
    def _on_param_grad(self, unit: _PartialUnit) -> None:
        if not self._sync:
            return
        self._begin_backward()
        unit.num_accumulated += 1
        if unit.num_accumulated == len(unit.params):
            unit.num_accumulated = 0
            self._on_unit_grad(unit)

    def _on_unit_grad(self, unit: _PartialUnit) -> None:
        """Flatten and free the unit's gradient, reduce-scatter it in the node, hand the node slice on."""
        flat = unit.slice_param.new_zeros(self._shard_size * unit.node_chunk)
        for p, piece in zip(unit.params, flat[:unit.total].split(unit.numels)):
            if p.grad is not None:
                piece.copy_(p.grad.reshape(-1))
                p.grad = None
        send = self._rs_buffer(unit, flat.dtype)
        with record_function(SHARD.GRAD_REDUCE_SCATTER.label):  # in the node: synchronous, fast tier
            REDUCE_SCATTER(send[:unit.node_chunk], flat, op=dist.ReduceOp.AVG, group=self._shard_group)
        self._grad_ready(unit, send)

    def _end_of_backward(self) -> None:
        for u in reversed(self._units):  # units only partly reached by this backward
            if u.num_accumulated:
                u.num_accumulated = 0
                self._on_unit_grad(u)
        super()._end_of_backward()

    def zero_grad(self) -> None:
        super().zero_grad()
        for u in self._units:
            u.num_accumulated = 0

    # ---- the model side of an exchange ------------------------------------------------------
    def _apply_gathered(self, unit: _PartialUnit, gathered: torch.Tensor) -> None:
        out = gathered.new_empty(self._shard_size * unit.node_chunk)
        with record_function(SHARD.PARAM_ALL_GATHER.label):  # in the node: synchronous, fast tier
            ALL_GATHER(out, gathered[:unit.node_chunk], group=self._shard_group)
        with torch.no_grad():
            for p, piece in zip(unit.params, out[:unit.total].split(unit.numels)):
                p.copy_(piece.view_as(p))

    def _model_values(self, unit: _PartialUnit) -> torch.Tensor:
        flat = torch.cat([p.detach().reshape(-1) for p in unit.params])
        return flat[unit.offset:unit.offset + unit.numel]
