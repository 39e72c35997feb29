"""The per-unit slice pipeline shared by :class:`~cpdpkit.shard.executor.TwoStageExecutor` and
:class:`~cpdpkit.shard.partial.PartialShardExecutor`.

Both executors hand this pipeline, per unit and per step, one flat gradient vector whose
elements every member of the replicate group holds the same way (FSDP2's shard of the unit, or
the partial executor's node slice). From there the pipeline is one piece of code: the
replicate-axis reduce-scatter (mean), the wait, the clipping norm, the update of this rank's
fp32 slice with the inner optimizer, the replicate-axis all-gather of the updated slice, and
the hand-back of the gathered vector to the executor (``_apply_gathered``), which writes it
into the model. When each of those happens (stage 1 during backward at a schedule-derived
trigger, stage 2 in :meth:`SliceExecutor.step`), speculative clipping, the measurements behind
:meth:`SliceExecutor.calibrate` and the statistics are described in
:mod:`cpdpkit.shard.executor`.

A subclass builds its :class:`SliceUnit` list and calls :meth:`SliceExecutor._setup_pipeline`;
it calls :meth:`SliceExecutor._grad_ready` from its gradient-ready hook with the padded
replicate-axis gradient and implements ``_apply_gathered`` and ``_model_values``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.profiler import record_function
from torch.utils._pytree import tree_leaves

from cpdpkit.contracts import OuterSync
from cpdpkit.errors import DistributedSetupError
from cpdpkit.labels import SHARD
from cpdpkit.planner.config import PlannerError
from cpdpkit.planner.plan import ShardingPlan
from cpdpkit.planner.schedule import plan_two_stage
from cpdpkit.planner.timeline import TwoStageSchedule, UnitTiming
from cpdpkit.shard._executor_state import ExecutorStateMixin
from cpdpkit.shard._slice_schedule import END, UnitClock, apply_slots, stage1_triggers

__all__ = ["ELEMENTWISE_OPTIMIZERS", "optimizer_state_bytes", "SliceUnit", "SliceExecutor", "check_inputs",
           "build_mesh", "chunk_of", "slice_bounds", "REDUCE_SCATTER", "ALL_GATHER", "MP_DTYPES", "mp_dtypes"]

ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.Adadelta, torch.optim.Rprop,
)

# torch >= 2.13 names these *_single; older releases *_tensor / *_into_tensor.
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

OptimizerFactory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of an optimizer's per-element state on this rank (DTensors: local part; 0-d step counters excluded)."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.numel() * local.element_size()
    return total


def _refuse(optimizer: torch.optim.Optimizer, who: str) -> None:
    if type(optimizer) in ELEMENTWISE_OPTIMIZERS:
        return
    name = type(optimizer).__name__
    allowed = ", ".join(o.__name__ for o in ELEMENTWISE_OPTIMIZERS)
    raise PlannerError(
        f"{who} cannot run optimizer {name}: each replica updates only a 1/R slice of its shard, so "
        f"the update of one element must depend only on that element's gradient and state (an elementwise "
        f"optimizer); {name} is not one of the known elementwise optimizers ({allowed})")


MP_DTYPES = (torch.float32, torch.bfloat16)


def mp_dtypes(who: str, mp_policy: Any, *, check_param: bool = False) -> tuple[torch.dtype, torch.dtype]:
    """``(param_dtype, reduce_dtype)`` of a ``MixedPrecisionPolicy`` (``None``: float32 both), checked.

    The reduce dtype must be float32 or bfloat16; with ``check_param`` the param dtype too (the
    partial executor keeps the replicated parameters in it)."""
    if mp_policy is None:
        return torch.float32, torch.float32
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise PlannerError(f"mp_policy = {type(mp_policy).__name__} must be a "
                           "torch.distributed.fsdp.MixedPrecisionPolicy or None")
    param = mp_policy.param_dtype or torch.float32
    if check_param and param not in MP_DTYPES:
        raise PlannerError(f"mp_policy computes in param_dtype = {param}; {who} supports float32 or bfloat16 "
                           "parameters: set param_dtype=torch.bfloat16 (or torch.float32)")
    dtype = mp_policy.reduce_dtype or mp_policy.param_dtype or torch.float32
    if dtype not in MP_DTYPES:
        raise PlannerError(f"mp_policy reduces gradients in {dtype}; {who} supports float32 or "
                           "bfloat16 reductions: set reduce_dtype=torch.float32 (or torch.bfloat16)")
    return param, dtype


def check_inputs(who: str, model: nn.Module, optimizer_factory: OptimizerFactory, max_grad_norm: Any,
                 update_in_backward: Any) -> None:
    """The checks both executors make before touching the model or any process group."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model = {type(model).__name__} must be a torch.nn.Module")
    if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
        raise PlannerError(f"max_grad_norm = {max_grad_norm!r} is invalid; use a positive number or None")
    if not isinstance(update_in_backward, bool):
        raise PlannerError(f"update_in_backward = {update_in_backward!r} must be True or False")
    bad = next(((n, p.dtype) for n, p in model.named_parameters() if p.dtype != torch.float32), None)
    if bad is not None:
        raise PlannerError(f"{who} needs float32 model parameters (its slices are the fp32 masters) but "
                           f"{bad[0]!r} is {bad[1]}; keep the model in float32 and pass mp_policy for bf16 compute")
    _refuse(optimizer_factory([{"params": [nn.Parameter(torch.zeros(1))]}]), who)


def build_mesh(who: str, model: nn.Module, plan: ShardingPlan, mesh: DeviceMesh | None) -> DeviceMesh:
    """The plan's ``(replicate, shard)`` mesh (checked, or built), after checking the process group."""
    if not dist.is_available() or not dist.is_initialized():
        raise DistributedSetupError(f"{who} needs an initialised process group; call "
                                    "cpdpkit.init_distributed() (or dist.init_process_group) first")
    if mesh is None:
        if dist.get_world_size() != plan.world_size:
            raise DistributedSetupError(f"the plan is for {plan.world_size} ranks but the world size is "
                                        f"{dist.get_world_size()}; re-plan with --world-size {dist.get_world_size()}")
        device = next((p.device.type for p in model.parameters() if p.device.type != "meta"), "cpu")
        return init_device_mesh(device, plan.mesh.shape, mesh_dim_names=("replicate", "shard"))
    # a given mesh may be a part of the world (one site's sub-mesh, under PeriodicSyncOptimizer)
    if tuple(mesh.shape) != plan.mesh.shape or tuple(mesh.mesh_dim_names or ()) != ("replicate", "shard"):
        raise DistributedSetupError(f"mesh {tuple(mesh.shape)} {mesh.mesh_dim_names} must be the plan's "
                                    f"{plan.mesh.shape} ('replicate', 'shard'); pass mesh=None to build it")
    return mesh


def chunk_of(numel: int, parts: int) -> int:
    """``ceil(numel / parts)``, at least 1."""
    return max(1, math.ceil(numel / parts))


def slice_bounds(numel: int, chunk: int, rank: int) -> tuple[int, int]:
    """``[lo, hi)``: the real elements of chunk ``rank`` (size ``chunk``) of a ``numel``-element vector."""
    return min(numel, rank * chunk), min(numel, (rank + 1) * chunk)


@dataclasses.dataclass(kw_only=True, eq=False)
class SliceUnit:
    """One unit's slice of the replicate-axis vector (``numel`` real elements, chunks of ``chunk``)."""

    name: str
    plan_index: int
    modules: list[nn.Module]
    params: list[nn.Parameter]
    numel: int
    chunk: int
    lo: int
    hi: int
    slice_param: nn.Parameter
    stage: int = 2
    order: int = 0
    # this step's state (reset by step())
    ready: bool = False  # its replicate-axis reduce-scatter was launched
    launched: bool = False  # its updated slice's all-gather was launched
    pending_rs: tuple[Any, torch.Tensor, torch.Tensor] | None = None
    grad: torch.Tensor | None = None  # the reduced fp32 gradient slice (kept for a clipping redo)
    sq: torch.Tensor | None = None  # its squared norm (float64) when clipping
    backup: tuple[torch.Tensor, dict[str, Any] | None] | None = None  # before a speculative update
    pending_ag: tuple[Any, torch.Tensor, torch.Tensor] | None = None  # lives until the next forward

    def reset_step(self) -> None:
        self.ready = self.launched = False
        self.pending_rs = self.grad = self.sq = self.backup = None


def _clone_state(state: dict[str, Any] | None) -> dict[str, Any] | None:
    if not state:
        return None
    return {k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in state.items()}


class SliceExecutor(ExecutorStateMixin):
    """The shared pipeline (module docstring); not used directly."""

    plan: ShardingPlan
    mesh: DeviceMesh
    model: nn.Module
    optimizer: torch.optim.Optimizer
    schedule: TwoStageSchedule | None

    # ---- setup -----------------------------------------------------------------------------
    def _setup_axes(self, plan: ShardingPlan, mesh: DeviceMesh, max_grad_norm: float | None,
                    update_in_backward: bool) -> None:
        self.plan = plan
        self.mesh = mesh
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.update_in_backward = update_in_backward
        self._rep_group = mesh.get_group("replicate")
        self._rep_size = mesh.size(0)
        self._rep_rank = mesh.get_local_rank("replicate")
        self._gather_dtype = torch.float32  # what the updated slices travel in (the partial executor: param_dtype)
        if self.max_grad_norm is not None and mesh.size() != dist.get_world_size():
            raise PlannerError(f"max_grad_norm with a mesh of {mesh.size()} of the world's {dist.get_world_size()} "
                               "ranks: the norm is all-reduced over the world; clip with a mesh of the whole world")
        self._outer: OuterSync | None = None  # across replicas of this executor (attach_periodic_sync)

    def _setup_pipeline(self, units: list[SliceUnit], optimizer_factory: OptimizerFactory) -> None:
        """Build the inner optimizer over the slices, adopt the plan's schedule, register the hooks."""
        self._units = [u for u in units if u.params]
        self.optimizer = optimizer_factory([{"params": [u.slice_param]} for u in self._units])
        _refuse(self.optimizer, type(self).__name__)
        self._device = self._units[0].slice_param.device if self._units else torch.device("cpu")
        self._adopt(self.plan.schedule)
        self._clock = UnitClock(len(self.plan.units))
        self._sync = True
        self._speculate = True
        self._in_backward = False
        self._carry: list[SliceUnit] = []
        self._spec_units: list[SliceUnit] = []
        self._bwd_launched: list[SliceUnit] = []
        self._untaken: list[SliceUnit] = []  # ready units whose gradient is not taken yet, in hook order
        self._norm: float | None = None
        self._coef: float | None = None
        self._mispredicted = False
        self.reset_stats()
        for u in self._units:
            for module in u.modules:  # in front of FSDP2's pre-forward all-gather of this unit
                module.register_forward_pre_hook(lambda *_, u=u: self._before_forward(u), prepend=True)
        self.model.register_forward_pre_hook(lambda *_: self._clock.forward_begin(), prepend=True)
        self.model.register_forward_hook(self._after_model_forward)

    def _adopt(self, schedule: TwoStageSchedule | None) -> None:
        self.schedule = schedule
        apply_slots(self._units, schedule)
        self._exec_order = sorted(self._units, key=lambda u: u.order)
        self._triggers = stage1_triggers(self._units, schedule)

    # ---- subclass interface ------------------------------------------------------------------
    def _apply_gathered(self, unit: SliceUnit, gathered: torch.Tensor) -> None:
        """Write the all-gathered replicate-axis vector (``R·chunk`` elements) into the model."""
        raise NotImplementedError

    def _before_step(self) -> None:
        """Checks a subclass makes at the start of :meth:`step` (after backward)."""

    def _set_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """Forward the gradient-sync switch to whatever reduces gradients below the pipeline."""

    # ---- forward ---------------------------------------------------------------------------
    def _before_forward(self, unit: SliceUnit) -> None:
        first = self._clock.unit_forward_enter(unit.plan_index, time.perf_counter())
        self._finish(unit)
        if first:
            self._clock.unit_forward_exit(unit.plan_index, time.perf_counter())

    def _after_model_forward(self, _module: nn.Module, _args: Any, output: Any) -> None:
        self._clock.forward_end(time.perf_counter())
        if not torch.is_grad_enabled():
            return
        tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:  # the first gradient of the model's output marks the start of backward
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda _grad: self._clock.backward_begin(time.perf_counter()), mode="any")

    # ---- backward: the replicate-axis reduce-scatter and the stage-1 triggers ---------------------
    def _rs_buffer(self, unit: SliceUnit, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed reduce-scatter input for ``unit``: its vector goes into the first ``numel`` elements."""
        return torch.zeros(unit.chunk * self._rep_size, dtype=dtype, device=self._device)

    def _grad_ready(self, unit: SliceUnit, send: torch.Tensor) -> None:
        """``unit``'s gradient is ready (its hook): launch its reduce-scatter, then this point's exchanges."""
        self._clock.unit_backward_enter(unit.plan_index, time.perf_counter())
        self._check_first_backward(unit)
        self._begin_backward()
        recv = send.new_empty(unit.chunk)
        with record_function(SHARD.GRAD_REDUCE_SCATTER.label):
            work = self._reduce_scatter(unit, recv, send)
        unit.pending_rs = (work, recv, send)
        unit.ready = True
        if self._outer is not None and self._outer.gradient_sync_due():
            # Across replicas, one hook behind: the units ready before this one take their gradients
            # now and hand them to the outer optimizer's buckets, in hook order (the same on every
            # rank); a full bucket crosses the sites under the rest of backward.
            self._take_untaken()
            self._untaken.append(unit)
        self._fire(unit.name)
        self._clock.unit_backward_exit(time.perf_counter())

    def _check_first_backward(self, unit: SliceUnit) -> None:
        if unit.ready:
            raise PlannerError(f"{type(self).__name__}: a second synced backward before step() (unit {unit.name!r} "
                               "already has its gradient); call step() after each synced backward, or use "
                               "set_requires_gradient_sync(False) for the micro-batches that only accumulate")

    def _reduce_scatter(self, unit: SliceUnit, recv: torch.Tensor, send: torch.Tensor) -> Any:
        """Launch ``unit``'s gradient reduce-scatter (mean) of ``send`` into ``recv`` (its ``chunk``
        elements): over the replicate group here; the partial executor's over the world group."""
        return REDUCE_SCATTER(recv, send, op=dist.ReduceOp.AVG, group=self._rep_group, async_op=True)

    def _all_gather(self, unit: SliceUnit, recv: torch.Tensor, send: torch.Tensor) -> Any:
        """Launch the all-gather of ``unit``'s updated slice ``send`` into ``recv`` (:meth:`_ag_buffer`)."""
        return ALL_GATHER(recv, send, group=self._rep_group, async_op=True)

    def _fire(self, point: str) -> None:
        """The stage-1 exchanges due at gradient-ready point ``point`` (a unit's name)."""
        if self.update_in_backward:
            self._trigger(self._triggers.get(point, []))

    def _begin_backward(self) -> None:
        """At the first hook of a synced backward: queue the end-of-backward callback."""
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _trigger(self, due: list[SliceUnit]) -> None:
        """At a gradient-ready point: update and launch the due stage-1 units (speculatively when clipping).

        A unit not ready yet, or any unit while clipping does not speculate this step, is carried
        to the next point (decided by hook order and the step's clipping state, the same on every rank).
        """
        if self._defers():  # periodic sync work goes between the updates and the exchanges: all in step()
            self._carry.extend(due)
            return
        clip = self.max_grad_norm is not None
        carry, self._carry = self._carry, []
        for u in sorted(carry + due, key=lambda x: x.order):
            if not u.ready or (clip and not self._speculate):
                self._carry.append(u)
                continue
            self._update(u, None, speculative=clip)
            self._launch(u)
            self._bwd_launched.append(u)

    def _end_of_backward(self) -> None:
        """The autograd engine's callback after the last gradient hook of a synced backward."""
        self._clock.backward_end(time.perf_counter())
        self._take_untaken()  # the last bucket across replicas leaves before backward() returns
        self._in_backward = False
        # measured only, never used to decide: which exchanges launched during backward are done
        self._num_completed += sum(1 for u in self._bwd_launched
                                   if u.pending_ag is not None and u.pending_ag[0].is_completed())
        self._num_launched += len(self._bwd_launched)
        if not self.update_in_backward or self._defers():
            return
        if self.max_grad_norm is not None:
            self._clip_norm()
        carry, self._carry = self._carry, []
        for u in sorted(carry + self._triggers.get(END, []), key=lambda x: x.order):
            if u.ready and not u.launched:
                self._update(u, self._coef)
                self._launch(u)

    # ---- reduce, clip, update, exchange ---------------------------------------------------------
    def _take_untaken(self) -> None:
        untaken, self._untaken = self._untaken, []
        for u in untaken:
            if u.pending_rs is not None:
                self._take_grad(u)

    def _take_grad(self, unit: SliceUnit) -> None:
        work, recv, _send = unit.pending_rs
        with record_function(SHARD.GRAD_WAIT.label):
            work.wait()
        unit.pending_rs = None
        grad = recv[:unit.hi - unit.lo]
        unit.grad = grad if grad.dtype == torch.float32 else grad.float()
        if self._outer is not None:  # across replicas of the executor, on the steps that sync gradients
            self._outer.reduce_gradient(unit.slice_param, unit.grad)  # averaged in place before step() updates
        if self.max_grad_norm is not None:
            unit.sq = unit.grad.double().pow(2).sum()

    def _clip_norm(self) -> None:
        """Wait every reduce-scatter, all-reduce the squared norm once, redo mispredicted speculation."""
        backward_order = sorted(self._units, key=lambda x: -x.plan_index)
        for u in backward_order:
            if u.pending_rs is not None:
                self._take_grad(u)
        sq = torch.zeros((), dtype=torch.float64, device=self._device)
        for u in backward_order:  # a fixed order: the same sum whichever path updated the units
            if u.sq is not None:
                sq += u.sq
        with record_function(SHARD.GRAD_NORM.label):
            dist.all_reduce(sq, op=dist.ReduceOp.SUM)
        self._norm = float(sq.sqrt())
        self._coef = min(1.0, self.max_grad_norm / (self._norm + 1e-6))
        if self._coef < 1.0 and self._spec_units:
            self._mispredicted = True
            for u in self._spec_units:  # in their launch order
                self._discard(u)
                self._restore(u)
                self._update(u, self._coef)
                self._launch(u)
        for u in self._spec_units:  # the speculation is settled: free its backups
            u.backup = u.grad = None

    def _update(self, unit: SliceUnit, scale: float | None, *, speculative: bool = False) -> None:
        if unit.grad is None:
            self._take_grad(unit)
        if speculative:
            unit.backup = (unit.slice_param.detach().clone(), _clone_state(self.optimizer.state.get(unit.slice_param)))
            self._spec_units.append(unit)
        unit.slice_param.grad = unit.grad if scale is None else unit.grad * scale
        with record_function(SHARD.UPDATE.label):
            start = time.perf_counter()
            self.optimizer.step()
            self._clock.add_update(time.perf_counter() - start)
        unit.slice_param.grad = None
        if not speculative:
            unit.grad = None

    def _restore(self, unit: SliceUnit) -> None:
        values, state = unit.backup
        unit.backup = None
        with torch.no_grad():
            unit.slice_param.copy_(values)
        if state is None:
            self.optimizer.state.pop(unit.slice_param, None)
        else:
            self.optimizer.state[unit.slice_param] = state

    def _launch(self, unit: SliceUnit) -> None:
        self._finish(unit)  # an exchange of an earlier step that no forward has consumed
        send = unit.slice_param.new_zeros(unit.chunk, dtype=self._gather_dtype)
        send[:unit.hi - unit.lo].copy_(unit.slice_param.detach())
        recv = self._ag_buffer(unit, send)
        with record_function(SHARD.PARAM_ALL_GATHER.label):
            work = self._all_gather(unit, recv, send)
        unit.pending_ag = (work, recv, send)
        unit.launched = True

    def _ag_buffer(self, unit: SliceUnit, send: torch.Tensor) -> torch.Tensor:
        """Where the replicate-axis all-gather of ``unit`` lands (``R·chunk`` elements)."""
        return send.new_empty(unit.chunk * self._rep_size)

    def _finish(self, unit: SliceUnit, *, wait_model: bool = True) -> None:
        """Wait ``unit``'s pending exchange and hand it to the model; ``wait_model=False`` (what
        :meth:`step` passes for the stage-1 units) lets an executor leave the exchange in flight until
        the unit's next forward (the partial executor, whose all-gather lands in the parameters)."""
        if unit.pending_ag is None:
            return
        work, recv, _send = unit.pending_ag
        with record_function(SHARD.PARAM_WAIT.label):
            work.wait()
        unit.pending_ag = None
        self._apply_gathered(unit, recv)

    def _discard(self, unit: SliceUnit) -> None:
        """Wait for a mispredicted speculative exchange and drop what it gathered."""
        work = unit.pending_ag[0]
        with record_function(SHARD.PARAM_WAIT.label):
            work.wait()
        unit.pending_ag = None

    # ---- public step API -------------------------------------------------------------------
    def step(self) -> float | None:
        """Finish the step: (clip,) update and exchange what backward has not; returns the global norm when clipping."""
        self._before_step()
        for u in self._units:  # a slice holds a .grad only while it is updated (one inner step() each);
            u.slice_param.grad = None  # an outer optimizer's gradient buckets may have left theirs there
        if self.max_grad_norm is not None and self._coef is None:
            self._clip_norm()
        outer = self._outer if self._defers() else None
        for u in self._exec_order:
            if u.ready and not u.launched:
                self._update(u, self._coef)
                if outer is None:
                    self._launch(u)
        if outer is not None:
            outer.after_updates()  # e.g. a reconciliation of the slices across replicas
            for u in self._exec_order:
                if u.ready and not u.launched:
                    self._launch(u)
        for u in self._exec_order:
            if u.stage == 1:
                self._finish(u, wait_model=False)
        norm = self._norm
        self._num_steps += 1
        if self.max_grad_norm is not None:
            self._num_speculated += bool(self._spec_units)
            self._num_mispredicted += self._mispredicted
            self._speculate = self._coef >= 1.0  # a step that clipped: do not speculate the next one
        self._reset_step()
        return norm

    def _reset_step(self) -> None:
        for u in self._units:
            u.reset_step()
        self._carry, self._spec_units, self._bwd_launched, self._untaken = [], [], [], []
        self._norm = self._coef = None
        self._mispredicted = False
        self._in_backward = False  # a backward that raised never reached its end-of-backward callback

    def zero_grad(self) -> None:
        """Drop the model's gradients and any reduced slices not yet used (only before anything was updated)."""
        if any(u.launched for u in self._units):
            raise PlannerError(f"{type(self).__name__}.zero_grad() after a synced backward whose slices were already "
                               "updated during backward; call step() after each synced backward (use "
                               "set_requires_gradient_sync(False) for micro-batches that only accumulate)")
        for u in self._units:
            if u.pending_rs is not None:
                with record_function(SHARD.GRAD_WAIT.label):
                    u.pending_rs[0].wait()
            u.slice_param.grad = None
        self._reset_step()
        self.model.zero_grad(set_to_none=True)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """``False`` for micro-batches that only accumulate gradients; ``True`` (default) for the one before step()."""
        if not isinstance(requires_gradient_sync, bool):
            raise PlannerError(f"requires_gradient_sync = {requires_gradient_sync!r} must be True or False")
        self._sync = requires_gradient_sync
        self._set_gradient_sync(requires_gradient_sync)

    # ---- periodic sync across replicas of the whole executor -------------------------------------
    def attach_periodic_sync(self, outer: OuterSync) -> list[nn.Parameter]:
        """Let ``outer`` (a :class:`~cpdpkit.sync.PeriodicSyncOptimizer`) synchronise this executor across sites.

        The contract, both ways, is :mod:`cpdpkit.contracts` (``outer`` must be an ``OuterSync``).

        On the backwards for which ``outer.gradient_sync_due()``, each slice gradient, once reduced inside
        the mesh, goes to ``outer.reduce_gradient(slice_param, grad)`` one gradient hook later, in hook
        order (the same on every rank, whatever schedule each site runs): the outer optimizer buckets
        them and averages them in place across replicas, a full bucket under the rest of backward, the
        rest before :meth:`step`. ``outer.defers_exchange()`` is true for such a step and for one that
        changes the slices after their update: then every update happens in :meth:`step`, then
        ``outer.after_updates()``, then the exchanges. Returns the slice parameters.
        """
        if not isinstance(outer, OuterSync):
            raise TypeError(f"outer = {type(outer).__name__} is not a cpdpkit.contracts.OuterSync: attach a "
                            "PeriodicSyncOptimizer (PeriodicSyncOptimizer(executor.optimizer, model=executor, ...))")
        if self.max_grad_norm is not None:
            raise PlannerError(f"{type(self).__name__} with max_grad_norm under PeriodicSyncOptimizer: the norm would "
                               "be taken before the gradients are synchronised across sites; clip without it, or "
                               "pass max_grad_norm=None")
        if self._outer is not None:
            raise PlannerError(f"{type(self).__name__} is already wrapped by a PeriodicSyncOptimizer: wrap it once")
        self._outer = outer
        return self.slice_params

    def _defers(self) -> bool:
        return self._outer is not None and self._outer.defers_exchange()

    def publish_slices(self) -> None:
        """Exchange every unit's slice now and write it into the model (every rank of the mesh calls it)."""
        self.wait_exchanges()
        for u in self._units:
            self._launch(u)
        for u in self._units:
            self._finish(u)
            u.launched = False

    def wait_exchanges(self) -> None:
        """Finish every pending all-gather (the next forward does this unit by unit by itself)."""
        for u in self._exec_order:
            self._finish(u)

    @property
    def slice_params(self) -> list[nn.Parameter]:
        """This rank's flat slice of each unit (what the inner optimizer updates)."""
        return [u.slice_param for u in self._units]

    def state_bytes(self) -> int:
        return optimizer_state_bytes(self.optimizer)

    # ---- evidence and calibration --------------------------------------------------------------
    @property
    def stats(self) -> dict[str, float | int]:
        """What the executor did since :meth:`reset_stats` (per-step means unless a count)."""
        steps = self._num_steps
        _fwd, _bwd, update_s = self._clock.means()
        return {
            "steps": steps,
            "stage1_scheduled": sum(u.stage == 1 for u in self._units),
            "stage1_launched": self._num_launched / steps if steps else 0.0,
            "stage1_units": self._num_completed / steps if steps else 0.0,
            "backward_s": self._clock.mean_backward_s,
            "update_s": update_s,
            "clip_speculated": self._num_speculated,
            "clip_mispredicted": self._num_mispredicted,
        }

    def reset_stats(self) -> None:
        """Start measuring (statistics and the timings behind :meth:`calibrate`) from here."""
        self._num_steps = self._num_launched = self._num_completed = 0
        self._num_speculated = self._num_mispredicted = 0
        self._clock.reset()

    def _measured(self) -> tuple[tuple[UnitTiming, ...], float]:
        """The per-unit timings and the update time, each the maximum over the world (a collective)."""
        if self._clock.backward_n == 0:
            raise PlannerError(f"{type(self).__name__}: no synced backward was measured since reset_stats(); "
                               "train at least one step before measuring or calibrating")
        fwd, bwd, update_s = self._clock.means()
        vec = torch.tensor([*fwd, *bwd, update_s], dtype=torch.float64, device=self._device)
        with record_function(SHARD.TIMINGS.label):
            dist.all_reduce(vec, op=dist.ReduceOp.MAX)
        values = vec.tolist()
        n = len(self.plan.units)
        timings = tuple(UnitTiming(name=u.name, forward_s=values[i], backward_s=values[n + i])
                        for i, u in enumerate(self.plan.units))
        return timings, values[-1]

    def measured_timings(self) -> tuple[UnitTiming, ...]:
        """Per-unit forward/backward seconds measured since :meth:`reset_stats`, max over the world (collective)."""
        return self._measured()[0]

    def measured_schedule(self) -> TwoStageSchedule | None:
        """The two-stage schedule for the measured timings and update time (collective; not adopted)."""
        timings, update_s = self._measured()
        return plan_two_stage(self.plan, timings=timings, update_s=update_s)

    def calibrate(self) -> TwoStageSchedule | None:
        """Adopt :meth:`measured_schedule` (collective: every rank calls it at the same point, between steps)."""
        if any(u.ready for u in self._units):
            raise PlannerError(f"{type(self).__name__}.calibrate() between a backward and its step(); call it "
                               "after step() (every rank at the same point)")
        schedule = self.measured_schedule()
        self._adopt(schedule)
        return schedule
