"""Execute a plan that shards optimizer state across the replicate axis (the two-stage executor).

FSDP2's HSDP reduce-scatters gradients inside the shard group, all-reduces them across
replicas, and every replica steps its whole shard. :class:`TwoStageExecutor` gives the same
numbers with ``1/R`` of the optimizer state per rank (``R`` = replicate size), and overlaps the
exchange of updated parameters with backward (stage 1) and the next forward (stage 2):

1. **Shard axis: FSDP2.** :func:`~cpdpkit.shard.apply.apply_plan` shards the model over the
   mesh's ``"shard"`` dimension only (a 1-D sub-mesh of the plan's ``(replicate, shard)``
   mesh), so FSDP2 does the intra-group all-gathers and reduce-scatters (mean over ``S``).
   (FSDP2's own HSDP with ``set_requires_all_reduce(False)`` cannot be used: in torch 2.13
   that path only accumulates a partial reduce-scatter output and assigns no gradient.)
2. **Replicate-axis reduce-scatter, during backward.** Each unit gets FSDP2's official
   ``FSDPModule.set_all_reduce_hook``: it receives the unit's reduce-scatter output (the flat
   padded shard gradient) right after FSDP2's reduce-scatter. The hook copies the real
   elements into a compact flat buffer (padded to a multiple of ``R``) and launches an
   ``async_op=True`` ``reduce_scatter_single(op=AVG)`` over the replicate group; rank ``r`` of
   the replicate axis keeps elements ``[r·L, (r+1)·L)`` (``L = ceil(n/R)``), now averaged over
   the whole world. This hook is the unit's *gradient-ready point*.
3. **Update and exchange: stage 1 during backward, stage 2 in step().** A unit's update (the
   inner optimizer, one param group per unit, on this rank's flat fp32 slice) is followed by
   an ``async_op=True`` all-gather of the updated slice over the same replicate group.

**Stage 1.** Every rank holds the same :class:`~cpdpkit.planner.timeline.TwoStageSchedule`
(``plan.schedule``, or the one :meth:`~TwoStageExecutor.calibrate` adopted), so the launch
points are derived from it, never from thread timing (gloo matches collectives by issue
order; deciding by ``work.is_completed()`` would let ranks disagree and hang). The trigger
points of a backward are the gradient-ready hooks in backward order plus the end of backward
(an autograd-engine callback queued from the first hook, which runs after FSDP2's own final
callback and so after the root unit's hook). **Trigger rule:** the schedule itself starts an
exchange no earlier than the first point at or after its release (its reduce-scatter's end plus
the update: :func:`~cpdpkit.planner.schedule.plan_two_stage` schedules ``at_points``), and a
stage-1 slot is launched at the last point whose predicted time (the schedule's
``grad_ready_s`` of that point's unit; ``backward_s`` for the end) lies between its release and
its ``start_s``; several slots at one point go in the schedule's ``order``, after the
reduce-scatter of the unit that just became ready (reduce-scatters have priority, as in the
schedule, so an exchange launched there queues behind it on the link where the schedule starts it
after it). At its trigger a unit waits for its reduce-scatter (``grad_wait``, predicted done), is
updated (``update``) and its all-gather is launched (``param_all_gather``) while backward
continues on earlier units. Units the schedule puts in stage 2 are updated and launched in
:meth:`~TwoStageExecutor.step` in the schedule's order. The points are as coarse as the units:
the root unit's gradient is ready at the end of backward and the last block's exchange is
released only after it, so neither can be in stage 1, and with few units nothing is (the
planner's unit sizes come from this schedule; ``stats["stage1_units"]`` shows what did overlap).
With ``update_in_backward=False`` every
update and launch happens in :meth:`~TwoStageExecutor.step` (the earlier executor's path); both
paths give bit-identical parameters.

**Writing the gathered values into FSDP2's sharded parameters** happens, for stage-1 units, at
the end of :meth:`~TwoStageExecutor.step` (the exchange is predicted done by then, so the wait
is free, its receive buffer is freed before the next forward's activations, and the model's
parameters are current after ``step()``) and, for stage-2 units, in a forward pre-hook on the
unit's modules registered in front of FSDP2's pre-forward all-gather. Both are after the
unit's backward is done with its parameters (its gradient-ready hook has fired) and before
FSDP2 all-gathers them again.

**Clipping** (``max_grad_norm``), exact: the result equals ``clip_grad_norm_`` on the full
gradient. Each unit's squared norm is taken when its reduce-scatter is waited; units updated
at a gradient-ready point are updated *speculatively* with the unclipped gradient after a
backup (a clone of the slice and of its optimizer state) is saved. At the end of backward the
squared norm is all-reduced once over the world (``grad_norm_allreduce``) and the coefficient
is ``min(1, max_norm / (norm + 1e-6))``, as ``clip_grad_norm_``. Coefficient 1: the speculation
was exact (``clip_grad_norm_`` multiplies by 1.0) and nothing changes. Below 1: the speculative
units' stale all-gathers are waited and discarded, their backups restored, their updates redone
with the clipped gradient and their exchanges launched again, in their original launch order.
Adaptive: after a step that clipped (known identically on every rank) the next step does not
speculate (every update waits for the norm, at the end of backward), so a run that always
clips costs what non-speculative clipping costs, and one that never clips costs what no
clipping costs. *Memory:* while speculating, each unit updated during backward holds a backup
of its slice and optimizer state plus its fp32 gradient slice until the norm is known at the end
of backward: for AdamW ``4·(1 + 2 + 1)`` bytes per element of those slices, i.e. at most about
4/3 of this rank's optimizer state of the stage-1 units, freed before ``step()`` returns. *Time:*
a correct speculation costs the backup copies; a wrong one additionally the discarded
all-gathers and the repeated updates, and the next step does not speculate.

**Evidence and calibration.** :attr:`~TwoStageExecutor.stats`: ``steps``; ``stage1_scheduled``
(units the adopted schedule puts in stage 1); ``stage1_launched`` (exchanges launched during
backward, mean per step); ``stage1_units`` (of those, the ones whose all-gather had *completed*
when backward ended, checked with ``is_completed()`` in the end-of-backward callback, a
measurement that decides nothing); ``backward_s``; ``update_s`` (mean seconds per unit update);
``clip_speculated`` / ``clip_mispredicted`` (steps). :meth:`~TwoStageExecutor.calibrate`
(collective) takes the per-unit forward and backward compute times measured since
:meth:`~TwoStageExecutor.reset_stats` (see :class:`~cpdpkit.shard._slice_schedule.UnitClock`:
forward between consecutive units' pre-hooks, backward between consecutive gradient-ready
hooks, both without the executor's own time in its hooks), their maximum over the world (one
small all-reduce, ``timings_allreduce``), re-plans with :func:`~cpdpkit.planner.schedule.plan_two_stage`
and the measured mean update time, and adopts the result.

**Gradient accumulation.** :meth:`~TwoStageExecutor.set_requires_gradient_sync` (``False``) for
micro-batches that only accumulate (FSDP2's switch); the synced backward must be followed by
``step()``: a second synced backward, or ``zero_grad()`` once slices were updated, raises.

**Across sites** (``PeriodicSyncOptimizer(ex.optimizer, model=ex, group=<cross-site group>)``, the
executor built on one site's sub-mesh of a ``("site", "replicate", "shard")`` mesh): the wrapper
attaches itself (:meth:`~cpdpkit.shard._slices.SliceExecutor.attach_periodic_sync`); each slice
gradient, once reduced inside the site, is averaged across sites on the wrapper's gradient-sync
steps, and on a step that reconciles (or applies an overlapped average) every update runs in
:meth:`step`, then the wrapper's reconciliation of the slices, then the exchanges. Other steps keep
stage 1. ``max_grad_norm`` is refused there, and with any mesh smaller than the world.

**Mixed precision** (``mp_policy``, FSDP2's ``MixedPrecisionPolicy``): FSDP2 computes in
``param_dtype`` and keeps fp32 sharded parameters; the replicate reduce-scatter runs in the
dtype FSDP2 hands the hook (the policy's ``reduce_dtype``, float32 or bfloat16, as HSDP's
all-reduce would), the slices, the update and the all-gather are fp32.

**On CPU/gloo** FSDP2's streams are stubs; overlap comes from gloo's worker threads running the
``async_op=True`` collectives while the training thread computes. ``work.wait()`` blocks the
host there, so a stage-1 update waits on the host for its reduce-scatter (predicted done).
**On GPU/NCCL** (not tested here; no GPU): the same code is ordered by streams, not the host.
An NCCL collective runs on NCCL's stream after waiting for the issuing stream;
``work.wait()`` makes the *current* stream wait for it (the host does not block). In the
gradient-ready hook the current stream is FSDP2's all-reduce-hook stream, so the compact copy,
the reduce-scatter's wait, the update kernels and the all-gather's launch queue there in that
order (the all-gather waits for the update by stream order, no event needed), and the
end-of-backward and ``step()`` work runs on the default stream; clipping reads the norm on the
host there (one synchronisation per step: keeping or redoing the speculation is a host-side
branch, where ``clip_grad_norm_`` scales by a device tensor). The forward pre-hook's
``wait()`` makes the default stream wait for the all-gather before the copy into the sharded
parameters and FSDP2's all-gather. Not done: running the update on a separate side stream
(it would need a ``torch.cuda.Stream``, ``wait_stream`` on the reduce-scatter's stream, an
event after the update that the all-gather's stream waits on, and ``record_stream`` on the
slices), and ``is_completed()`` only measures.

**Trace labels** (:data:`cpdpkit.labels.SHARD`): every replicate-axis collective the executor
issues runs inside a ``cpdpkit::shard::<phase>`` span; the shard-axis collectives are FSDP2's
own (``FSDP::`` spans). Only elementwise optimizers are valid (:data:`ELEMENTWISE_OPTIMIZERS`).
Gradients FSDP2 leaves in ``param.grad`` are only averaged within the shard group: read
gradients (and clip) through the executor. Limits: one param group per unit with the factory's
hyperparameters; float32 model parameters; a backward must reach every unit on every rank;
:meth:`state_dict` / :meth:`load_state_dict` (``torch.distributed.checkpoint``) need the same
plan and mesh (no resharding).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from cpdpkit.planner.config import PlannerError
from cpdpkit.planner.plan import ShardingPlan
from cpdpkit.shard._slices import (
    ELEMENTWISE_OPTIMIZERS,
    OptimizerFactory,
    SliceExecutor,
    SliceUnit,
    build_mesh,
    check_inputs,
    chunk_of,
    mp_dtypes,
    optimizer_state_bytes,
    slice_bounds,
)
from cpdpkit.shard.apply import apply_plan

__all__ = ["TwoStageExecutor", "ELEMENTWISE_OPTIMIZERS", "optimizer_state_bytes"]



@dataclasses.dataclass(kw_only=True, eq=False)
class _ShardUnit(SliceUnit):
    local_numels: list[int]
    padded_offsets: list[int]  # offset of each parameter's local shard in FSDP2's reduce-scatter output
    padded_total: int
    check_copy: torch.Tensor | None = None  # the first step's compact gradient, for the layout check


def _reduce_dtype(mp_policy: Any) -> torch.dtype:
    """The dtype FSDP2 reduces gradients in under ``mp_policy`` (checked)."""
    return mp_dtypes("TwoStageExecutor", mp_policy)[1]


class TwoStageExecutor(SliceExecutor):
    """Train ``model`` as ``plan`` says, with optimizer state sharded across the replicate axis.

    ``optimizer_factory(param_groups)`` builds the inner optimizer (e.g.
    ``lambda groups: torch.optim.AdamW(groups, lr=1e-3)``); it receives one param group per
    unit, each holding that unit's flat slice. ``mesh``: the plan's 2-D ``(replicate, shard)``
    mesh (default: built from the plan). ``update_in_backward``: stage-1 updates and exchanges
    during backward (default) or all of them in ``step()``. ``mp_policy``: FSDP2's
    ``MixedPrecisionPolicy``. Use as ``ex.zero_grad(); loss.backward(); ex.step()``.
    """

    def __init__(self, model: nn.Module, plan: ShardingPlan, optimizer_factory: OptimizerFactory, *,
                 mesh: DeviceMesh | None = None, max_grad_norm: float | None = None,
                 update_in_backward: bool = True, mp_policy: Any = None) -> None:
        if not isinstance(plan, ShardingPlan):
            raise TypeError(f"plan = {type(plan).__name__} must be a ShardingPlan")
        if getattr(plan, "param_sharding", "sharded") == "replicated":
            raise PlannerError(f"plan {plan.strategy!r} keeps parameters replicated (partial sharding); "
                               "use PartialShardExecutor for it")
        if plan.state_sharding.axis != "replicate" or len(plan.mesh.shape) != 2:
            raise PlannerError(f"plan {plan.strategy!r} does not shard optimizer state across a replicate axis; "
                               "use apply_plan and a plain optimizer for it")
        self._reduce_dtype = _reduce_dtype(mp_policy)
        check_inputs("TwoStageExecutor", model, optimizer_factory, max_grad_norm, update_in_backward)
        mesh = build_mesh("TwoStageExecutor", model, plan, mesh)
        self._setup_axes(plan, mesh, max_grad_norm, update_in_backward)
        # FSDP2 over the shard axis only: the same plan, on the 1-D "shard" sub-mesh.
        shard_plan = dataclasses.replace(
            plan, mesh=dataclasses.replace(plan.mesh, shape=(plan.mesh.shard_size,), dim_names=("shard",),
                                           replicate_size=1, replicate_tier=None),
            state_sharding=dataclasses.replace(plan.state_sharding, axis=None, num_partitions=1), schedule=None)
        self.model = apply_plan(model, shard_plan, mesh["shard"], mp_policy=mp_policy)
        units: list[SliceUnit] = []
        claimed: set[int] = set()
        index = {u.name: i for i, u in enumerate(plan.units)}
        for unit_plan in (u for u in plan.units if not u.is_root):
            modules = [model.get_submodule(f) for f in unit_plan.module_fqns]
            units.append(self._make_unit(unit_plan.name, index[unit_plan.name], modules, claimed))
        root = next((u for u in plan.units if u.is_root), None)  # claims what the other units left
        units.append(self._make_unit(root.name if root else "<root>", index[root.name] if root else len(index),
                                     [model], claimed))
        self._checked_layout = False
        self._setup_pipeline(units, optimizer_factory)

    # ---- setup -----------------------------------------------------------------------------
    def _make_unit(self, name: str, plan_index: int, modules: list[nn.Module], claimed: set[int]) -> _ShardUnit:
        params: list[nn.Parameter] = []
        for module in modules:  # FSDP2's order: module.parameters() in DFS order, minus other units'
            for p in module.parameters():
                if id(p) not in claimed:
                    claimed.add(id(p))
                    params.append(p)
        s = self.plan.mesh.shard_size
        local_numels, offsets, off = [], [], 0
        for p in params:
            shape = tuple(p.shape)
            numel = math.prod(shape)
            padded = math.ceil(shape[0] / s) * math.prod(shape[1:]) if p.placements[0].dim == 0 else numel // s
            offsets.append(off)
            local_numels.append(p.to_local().numel())
            off += padded
        n = sum(local_numels)
        chunk = chunk_of(n, self._rep_size)
        lo, hi = slice_bounds(n, chunk, self._rep_rank)
        with torch.no_grad():
            flat = torch.cat([p.to_local().reshape(-1) for p in params]) if params else torch.zeros(0)
            slice_param = nn.Parameter(flat[lo:hi].clone())
        unit = _ShardUnit(name=name, plan_index=plan_index, modules=modules, params=params, numel=n, chunk=chunk,
                          lo=lo, hi=hi, slice_param=slice_param, local_numels=local_numels, padded_offsets=offsets,
                          padded_total=off)
        if params:
            modules[0].set_all_reduce_hook(lambda out, u=unit: self._on_grad_shard(u, out))
        return unit

    # ---- the gradient-ready point: FSDP2's all-reduce hook ----------------------------------------
    def _on_grad_shard(self, unit: _ShardUnit, reduce_output: torch.Tensor) -> None:
        if reduce_output.numel() != unit.padded_total or reduce_output.dtype != self._reduce_dtype:
            raise PlannerError(f"unit {unit.name!r}: FSDP2's reduce-scatter output has {reduce_output.numel()} "
                               f"{reduce_output.dtype} elements, expected {unit.padded_total} {self._reduce_dtype}; "
                               "this FSDP2 layout is not supported by TwoStageExecutor")
        send = self._rs_buffer(unit, reduce_output.dtype)
        torch.cat([reduce_output.narrow(0, o, k) for o, k in zip(unit.padded_offsets, unit.local_numels)],
                  out=send[:unit.numel])
        if not self._checked_layout:
            unit.check_copy = send[:unit.numel].clone()
        self._grad_ready(unit, send)

    def _before_step(self) -> None:
        """Once: each parameter's gradient must be where the layout expects it in FSDP2's output."""
        if self._checked_layout:
            return
        for u in self._units:
            if u.check_copy is None:
                continue
            for p, piece in zip(u.params, u.check_copy.split(u.local_numels)):
                g = p.grad.to_local() if p.grad is not None else None
                if g is not None and not torch.equal(g.reshape(-1), piece.to(g.dtype)):
                    raise PlannerError(f"unit {u.name!r}: FSDP2's gradient layout differs from the executor's for "
                                       "a parameter; this torch version is not supported by TwoStageExecutor")
            u.check_copy = None
        self._checked_layout = True

    def _set_gradient_sync(self, requires_gradient_sync: bool) -> None:
        self.model.set_requires_gradient_sync(requires_gradient_sync)

    # ---- the model side of an exchange ------------------------------------------------------
    def _apply_gathered(self, unit: SliceUnit, gathered: torch.Tensor) -> None:
        with torch.no_grad():
            for p, piece in zip(unit.params, gathered[:unit.numel].split(unit.local_numels)):
                local = p.to_local()
                local.copy_(piece.view(local.shape))

    def _model_values(self, unit: SliceUnit) -> torch.Tensor:
        return torch.cat([p.to_local().reshape(-1) for p in unit.params])
