"""Execute a plan that shards optimizer state across the replicate axis (the two-stage executor).

FSDP2's HSDP reduce-scatters gradients inside the shard group, all-reduces them across
replicas, and every replica steps its whole shard. :class:`TwoStageExecutor` gives the same
numbers with ``1/R`` of the optimizer state per rank (``R`` = replicate size):

1. **Shard axis: FSDP2.** :func:`~cpdpkit.planner.apply.apply_plan` shards the model over the
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
   the whole world. Backward of the remaining units continues meanwhile.
3. **Partial step.** The inner optimizer (built by ``optimizer_factory`` over one flat slice
   parameter per unit, one param group per unit) steps each unit's slice separately in
   :meth:`TwoStageExecutor.step`, in the order of the plan's exchange schedule.
4. **Replicate-axis all-gather of updated slices.** Launched (``async_op=True``) right after
   each unit's update, in the schedule's order. Stage-1 exchanges are waited (and copied into
   the FSDP2 sharded parameters) at the end of :meth:`step`; stage-2 exchanges are waited in a
   forward pre-hook on the unit's modules, registered in front of FSDP2's pre-forward hook (so
   before FSDP2 all-gathers that unit), so the next forward's earlier units compute meanwhile.

**Clipping** (``max_grad_norm``): the global norm needs every unit's reduced slice, so
:meth:`step` first waits for all replicate reduce-scatters, sums the squares of its slices (the
slices of all ranks partition the gradient exactly), all-reduces that one scalar over the world
and scales every slice by ``min(1, max_norm / (norm + 1e-6))`` as
``torch.nn.utils.clip_grad_norm_`` does. Cost: the first update (and so the first exchange)
waits for the last reduce-scatter plus one scalar all-reduce; without clipping a unit's update
waits only for its own reduce-scatter. The reduce-scatters still overlap backward and the
stage-2 exchanges still overlap the next forward.

**Overlap on CPU/gloo**: FSDP2's streams are stubs on CPU, so overlap comes only from gloo's
worker threads running ``async_op=True`` collectives: the replicate reduce-scatters run while
backward computes the remaining units, and stage-2 all-gathers run while the next forward
computes the units before theirs. Not overlapped: the copy into the compact buffer (in the hook,
on the training thread), the updates themselves (each waits for its reduce-scatter inside
:meth:`step`), and stage-1 exchanges, which :meth:`step` waits for before it returns.
The inner optimizer's ``step()`` runs once per unit (only that unit's slice has a gradient),
so optimizer step hooks fire once per unit.

**Trace labels** (:data:`cpdpkit.labels.SHARD`): every replicate-axis collective the executor
issues runs inside a ``cpdpkit::shard::<phase>`` span (launching the reduce-scatter and the
all-gather, waiting for each, the clipping norm's all-reduce); the per-unit update is labelled
as local work. The shard-axis collectives are FSDP2's own (``FSDP::`` spans).

Only elementwise optimizers are valid (the update of an element may depend only on that
element's gradient and state), see :data:`ELEMENTWISE_OPTIMIZERS`. Parameter gradients that
FSDP2 leaves in ``param.grad`` are only averaged within the shard group: read gradients (and
clip) through the executor, not through ``param.grad``.

Limits: one param group per unit with the factory's hyperparameters (no per-parameter
groups); gradients and parameters in float32 (no ``mp_policy``). :meth:`state_dict` /
:meth:`load_state_dict` round-trip through ``torch.distributed.checkpoint`` (``dcp.save`` /
``dcp.load``): the model's FSDP2 DTensor parameters plus each rank's slice state under a key
holding its replicate and shard coordinates, so a run resumes exactly; loading needs the same
plan and mesh (no resharding to another mesh or world size: a different layout is refused).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.profiler import record_function

from cpdpkit.errors import DistributedSetupError
from cpdpkit.labels import SHARD
from cpdpkit.planner.apply import apply_plan
from cpdpkit.planner.config import PlannerError
from cpdpkit.planner.plan import ShardingPlan

__all__ = ["TwoStageExecutor", "ELEMENTWISE_OPTIMIZERS", "optimizer_state_bytes"]

ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.Adadelta, torch.optim.Rprop,
)


# torch >= 2.13 names these *_single; older releases *_tensor / *_into_tensor.
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of an optimizer's per-element state on this rank (DTensors: local part; 0-d step counters excluded)."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.numel() * local.element_size()
    return total


def _refuse(optimizer: torch.optim.Optimizer) -> None:
    if type(optimizer) in ELEMENTWISE_OPTIMIZERS:
        return
    name = type(optimizer).__name__
    allowed = ", ".join(o.__name__ for o in ELEMENTWISE_OPTIMIZERS)
    raise PlannerError(
        f"TwoStageExecutor cannot run optimizer {name}: each replica updates only a 1/R slice of its shard, so "
        f"the update of one element must depend only on that element's gradient and state (an elementwise "
        f"optimizer); {name} is not one of the known elementwise optimizers ({allowed})")


@dataclasses.dataclass
class _Unit:
    name: str
    stage: int
    order: int
    modules: list[nn.Module]
    params: list[nn.Parameter]  # FSDP2's sharded DTensor parameters, in FSDP2's order
    local_numels: list[int]
    padded_offsets: list[int]  # offset of each parameter's local shard in FSDP2's reduce-scatter output
    padded_total: int
    numel: int  # real local elements of the unit (compact)
    chunk: int  # L = ceil(numel / R)
    lo: int
    hi: int
    slice_param: nn.Parameter
    pending_rs: list[tuple[Any, torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=list)
    pending_ag: tuple[Any, torch.Tensor, torch.Tensor] | None = None
    last_output_ptr: int | None = None


class TwoStageExecutor:
    """Train ``model`` as ``plan`` says, with optimizer state sharded across the replicate axis.

    ``optimizer_factory(param_groups)`` builds the inner optimizer (e.g.
    ``lambda groups: torch.optim.AdamW(groups, lr=1e-3)``); it receives one param group per
    unit, each holding that unit's flat slice. ``mesh``: the plan's 2-D ``(replicate, shard)``
    mesh (default: built from the plan). Use as ``ex.zero_grad(); loss.backward(); ex.step()``.
    """

    def __init__(self, model: nn.Module, plan: ShardingPlan,
                 optimizer_factory: Callable[[list[dict[str, Any]]], torch.optim.Optimizer], *,
                 mesh: DeviceMesh | None = None, max_grad_norm: float | None = None) -> None:
        if not isinstance(plan, ShardingPlan):
            raise TypeError(f"plan = {type(plan).__name__} must be a ShardingPlan")
        if plan.state_sharding.axis != "replicate" or len(plan.mesh.shape) != 2:
            raise PlannerError(f"plan {plan.strategy!r} does not shard optimizer state across a replicate axis; "
                               "use apply_plan and a plain optimizer for it")
        if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
            raise PlannerError(f"max_grad_norm = {max_grad_norm!r} is invalid; use a positive number or None")
        # refuse a non-elementwise optimizer before touching the model or the process group
        _refuse(optimizer_factory([{"params": [nn.Parameter(torch.zeros(1))]}]))
        if not dist.is_available() or not dist.is_initialized():
            raise DistributedSetupError("TwoStageExecutor needs an initialised process group; call "
                                        "cpdpkit.init_distributed() (or dist.init_process_group) first")
        if dist.get_world_size() != plan.world_size:
            raise DistributedSetupError(f"the plan is for {plan.world_size} ranks but the world size is "
                                        f"{dist.get_world_size()}; re-plan with --world-size {dist.get_world_size()}")
        if mesh is None:
            device = next((p.device.type for p in model.parameters() if p.device.type != "meta"), "cpu")
            mesh = init_device_mesh(device, plan.mesh.shape, mesh_dim_names=("replicate", "shard"))
        elif tuple(mesh.shape) != plan.mesh.shape or tuple(mesh.mesh_dim_names or ()) != ("replicate", "shard"):
            raise DistributedSetupError(f"mesh {tuple(mesh.shape)} {mesh.mesh_dim_names} must be the plan's "
                                        f"{plan.mesh.shape} ('replicate', 'shard'); pass mesh=None to build it")
        self.mesh = mesh
        self.plan = plan
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self._rep_group = mesh.get_group("replicate")
        self._rep_size = mesh.size(0)
        self._rep_rank = mesh.get_local_rank("replicate")

        # FSDP2 over the shard axis only: the same plan, on the 1-D "shard" sub-mesh.
        shard_plan = dataclasses.replace(
            plan, mesh=dataclasses.replace(plan.mesh, shape=(plan.mesh.shard_size,), dim_names=("shard",),
                                           replicate_size=1, replicate_tier=None),
            state_sharding=dataclasses.replace(plan.state_sharding, axis=None, num_partitions=1), schedule=None)
        self.model = apply_plan(model, shard_plan, mesh["shard"])

        slots = {s.unit: s for s in plan.schedule.slots} if plan.schedule is not None else {}
        self._units: list[_Unit] = []
        claimed: set[int] = set()
        for i, unit_plan in enumerate(u for u in plan.units if not u.is_root):
            self._units.append(self._make_unit(unit_plan.name, [model.get_submodule(f) for f in unit_plan.module_fqns],
                                               claimed, slots, i))
        root = next((u for u in plan.units if u.is_root), None)
        self._units.append(self._make_unit(root.name if root else "<root>", [model], claimed, slots, len(plan.units)))
        self._units = [u for u in self._units if u.params]
        self._exec_order = sorted(self._units, key=lambda u: u.order)
        self.optimizer = optimizer_factory([{"params": [u.slice_param]} for u in self._units])
        _refuse(self.optimizer)
        self._checked_layout = False

    # ---- setup -----------------------------------------------------------------------------
    def _make_unit(self, name: str, modules: list[nn.Module], claimed: set[int], slots: dict[str, Any],
                   default_order: int) -> _Unit:
        params: list[nn.Parameter] = []
        for module in modules:  # FSDP2's order: module.parameters() in DFS order, minus other units'
            for p in module.parameters():
                if id(p) not in claimed:
                    claimed.add(id(p))
                    params.append(p)
        # the root's fully_shard does not own other units' parameters (claimed before the root)
        s = self.plan.mesh.shard_size
        local_numels, offsets, off = [], [], 0
        for p in params:
            placement = p.placements[0]
            dim = placement.dim
            shape = tuple(p.shape)
            numel = math.prod(shape)
            padded = math.ceil(shape[0] / s) * math.prod(shape[1:]) if dim == 0 else numel // s
            offsets.append(off)
            local_numels.append(p.to_local().numel())
            off += padded
        n = sum(local_numels)
        r, big_r = self._rep_rank, self._rep_size
        chunk = max(1, math.ceil(n / big_r))
        lo, hi = min(n, r * chunk), min(n, (r + 1) * chunk)
        with torch.no_grad():
            flat = torch.cat([p.to_local().reshape(-1) for p in params]) if params else torch.zeros(0)
            slice_param = nn.Parameter(flat[lo:hi].clone())
        slot = slots.get(name)
        unit = _Unit(name=name, stage=slot.stage if slot else 2, order=slot.order if slot else default_order,
                     modules=modules, params=params, local_numels=local_numels, padded_offsets=offsets,
                     padded_total=off, numel=n, chunk=chunk, lo=lo, hi=hi, slice_param=slice_param)
        if params:
            modules[0].set_all_reduce_hook(lambda out, u=unit: self._on_grad_shard(u, out))
            for module in modules:  # in front of FSDP2's pre-forward all-gather of this unit
                module.register_forward_pre_hook(lambda *_, u=unit: self._finish_exchange(u), prepend=True)
        return unit

    # ---- step 2: reduce-scatter across replicas, launched from FSDP2's hook ------------------
    def _on_grad_shard(self, unit: _Unit, reduce_output: torch.Tensor) -> None:
        if reduce_output.numel() != unit.padded_total or reduce_output.dtype != torch.float32:
            raise PlannerError(f"unit {unit.name!r}: FSDP2's reduce-scatter output has {reduce_output.numel()} "
                               f"{reduce_output.dtype} elements, expected {unit.padded_total} float32; "
                               "TwoStageExecutor supports float32 gradients without mp_policy")
        unit.last_output_ptr = reduce_output.data_ptr()
        send = torch.zeros(unit.chunk * self._rep_size, dtype=reduce_output.dtype)
        torch.cat([reduce_output.narrow(0, o, k) for o, k in zip(unit.padded_offsets, unit.local_numels)],
                  out=send[:unit.numel])
        recv = torch.empty(unit.chunk, dtype=reduce_output.dtype)
        with record_function(SHARD.GRAD_REDUCE_SCATTER.label):
            work = _REDUCE_SCATTER(recv, send, op=dist.ReduceOp.AVG, group=self._rep_group, async_op=True)
        unit.pending_rs.append((work, recv, send))

    def _check_layout(self) -> None:
        """Once: each parameter's gradient must be the view of FSDP2's output where the layout expects it."""
        for u in self._units:
            if u.last_output_ptr is None:
                continue
            for p, o in zip(u.params, u.padded_offsets):
                g = p.grad.to_local() if p.grad is not None else None
                if g is not None and g.numel() and g.data_ptr() != u.last_output_ptr + o * g.element_size():
                    raise PlannerError(f"unit {u.name!r}: FSDP2's gradient layout differs from the executor's for "
                                       "a parameter; this torch version is not supported by TwoStageExecutor")
        self._checked_layout = True

    def _take_grad(self, unit: _Unit) -> torch.Tensor | None:
        grad = None
        for work, recv, _send in unit.pending_rs:
            with record_function(SHARD.GRAD_WAIT.label):
                work.wait()
            grad = recv if grad is None else grad + recv
        unit.pending_rs.clear()
        return None if grad is None else grad[:unit.hi - unit.lo]

    # ---- step 4: all-gather of updated slices ----------------------------------------------
    def _launch_exchange(self, unit: _Unit) -> None:
        send = torch.zeros(unit.chunk, dtype=unit.slice_param.dtype)
        send[:unit.hi - unit.lo].copy_(unit.slice_param.detach())
        recv = torch.empty(unit.chunk * self._rep_size, dtype=send.dtype)
        with record_function(SHARD.PARAM_ALL_GATHER.label):
            work = _ALL_GATHER(recv, send, group=self._rep_group, async_op=True)
        unit.pending_ag = (work, recv, send)

    def _finish_exchange(self, unit: _Unit) -> None:
        if unit.pending_ag is None:
            return
        work, recv, _send = unit.pending_ag
        with record_function(SHARD.PARAM_WAIT.label):
            work.wait()
        unit.pending_ag = None
        with torch.no_grad():
            for p, piece in zip(unit.params, recv[:unit.numel].split(unit.local_numels)):
                local = p.to_local()
                local.copy_(piece.view(local.shape))

    def wait_exchanges(self) -> None:
        """Finish every pending all-gather (the next forward does this unit by unit by itself)."""
        for u in self._exec_order:
            self._finish_exchange(u)

    # ---- public step API -------------------------------------------------------------------
    def step(self) -> float | None:
        """Reduce, (clip,) update and exchange; returns the global gradient norm when clipping."""
        self.wait_exchanges()
        if not self._checked_layout:
            self._check_layout()
        scale, norm = None, None
        grads: dict[int, torch.Tensor | None] = {}
        if self.max_grad_norm is not None:
            # backward order = the order the reduce-scatters were issued (the root last)
            sq = torch.zeros((), dtype=torch.float64)
            for u in reversed(self._units):
                grads[id(u)] = g = self._take_grad(u)
                if g is not None:
                    sq += g.double().pow(2).sum()
            with record_function(SHARD.GRAD_NORM.label):
                dist.all_reduce(sq, op=dist.ReduceOp.SUM)
            norm = float(sq.sqrt())
            scale = min(1.0, self.max_grad_norm / (norm + 1e-6))
        for u in self._exec_order:
            g = grads[id(u)] if id(u) in grads else self._take_grad(u)
            if g is None:
                continue
            u.slice_param.grad = g if scale is None else g * scale
            with record_function(SHARD.UPDATE.label):
                self.optimizer.step()
            u.slice_param.grad = None
            self._launch_exchange(u)
        for u in self._exec_order:
            if u.stage == 1:
                self._finish_exchange(u)
        return norm

    def zero_grad(self) -> None:
        """Drop the model's (FSDP2's) gradients and any reduced slices not yet stepped."""
        self.model.zero_grad(set_to_none=True)
        for u in self._units:
            for work, _recv, _send in u.pending_rs:
                with record_function(SHARD.GRAD_WAIT.label):
                    work.wait()
            u.pending_rs.clear()
            u.slice_param.grad = None

    @property
    def slice_params(self) -> list[nn.Parameter]:
        """This rank's flat slice of each unit (what the inner optimizer updates)."""
        return [u.slice_param for u in self._units]

    def state_bytes(self) -> int:
        return optimizer_state_bytes(self.optimizer)

    def _layout(self) -> list[dict[str, Any]]:
        return [{"unit": u.name, "numel": u.numel, "lo": u.lo, "hi": u.hi} for u in self._units]

    def _coords_key(self) -> str:
        return (f"rep{self._rep_rank}of{self._rep_size}_"
                f"shard{self.mesh.get_local_rank('shard')}of{self.mesh.size(1)}")

    def _materialized_state(self) -> tuple[dict[int, dict[str, Any]], set[int]]:
        """The inner optimizer's per-slice state with every slice present (for DCP's load template).

        Slices that have not been stepped yet get their state created by a zero-lr step on zero
        gradients (what ``torch.distributed.checkpoint.state_dict`` does for optimizers); that
        state is returned but removed from the optimizer again, so training is unaffected.
        Returns ``(state by slice index, indices of slices that really have state)``.
        """
        opt = self.optimizer
        stepped = {i for i, u in enumerate(self._units) if opt.state.get(u.slice_param)}
        missing = [u for i, u in enumerate(self._units) if i not in stepped]
        if missing:
            saved_lrs, saved_vals = [], [u.slice_param.detach().clone() for u in missing]
            for group in opt.param_groups:
                saved_lrs.append(group.get("lr"))
                if "lr" in group:
                    group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
            try:
                for u in missing:
                    u.slice_param.grad = torch.zeros_like(u.slice_param)
                    opt.step()
                    u.slice_param.grad = None
            finally:
                for group, lr in zip(opt.param_groups, saved_lrs):
                    if "lr" in group:
                        group["lr"] = lr
                with torch.no_grad():
                    for u, v in zip(missing, saved_vals):
                        u.slice_param.copy_(v)
        state = {i: dict(opt.state[u.slice_param]) for i, u in enumerate(self._units)}
        for u in missing:  # keep the optimizer exactly as it was
            opt.state.pop(u.slice_param, None)
        return state, stepped

    def state_dict(self, *, include_model: bool = True) -> dict[str, Any]:
        """A ``torch.distributed.checkpoint`` (DCP) state dict of the model and this rank's optimizer slices.

        ``{"model": ..., "optim": {"rep<r>of<R>_shard<s>of<S>": {"layout": ..., "units": {...}}}}``:

        * ``"model"`` (unless ``include_model=False``): FSDP2's sharded DTensor parameters from
          :func:`torch.distributed.checkpoint.state_dict.get_model_state_dict`; DCP deduplicates the
          identical shards the replicas hold.
        * ``"optim"``: one entry per rank, keyed by its replicate and shard coordinates (so every
          rank saves distinct entries): per unit the inner optimizer's state tensors of this
          rank's flat slice (``"state"``) and the unit's param-group hyperparameters
          (``"group"``), plus the slice ``"layout"`` (a JSON string) that :meth:`load_state_dict`
          checks. Slices not stepped yet are given state (so a fresh executor's dict can be
          DCP's load template) and marked as not stepped in the layout.

        Use ``dcp.save(ex.state_dict(), ...)``; ``sd = ex.state_dict(); dcp.load(sd, ...);
        ex.load_state_dict(sd)`` to resume (or pass the executor itself, a DCP ``Stateful``).
        Pending exchanges are finished first.
        """
        self.wait_exchanges()
        state, stepped = self._materialized_state()
        groups = self.optimizer.state_dict()["param_groups"]
        units = {u.name: {"state": state[i], "group": {k: v for k, v in groups[i].items() if k != "params"}}
                 for i, u in enumerate(self._units)}
        layout = [{**entry, "stepped": i in stepped} for i, entry in enumerate(self._layout())]
        meta = json.dumps({"replicate_size": self._rep_size, "shard_size": self.mesh.size(1),
                           "replicate_rank": self._rep_rank, "shard_rank": self.mesh.get_local_rank("shard"),
                           "units": layout})
        out: dict[str, Any] = {"optim": {self._coords_key(): {"layout": meta, "units": units}}}
        if include_model:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict
            out["model"] = get_model_state_dict(self.model)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` (e.g. after ``dcp.load`` into it) saved with the same plan and mesh.

        Restores the model's sharded parameters (``"model"``, if present, through
        :func:`~torch.distributed.checkpoint.state_dict.set_model_state_dict`), this rank's
        optimizer state and hyperparameters, and the slices from the model. Resharding to another
        mesh or plan is not supported: ``dcp.load`` itself fails with a missing
        ``optim.rep<r>of<R>_shard<s>of<S>...`` key when the mesh differs, and this method raises
        :class:`PlannerError` when the entry for this rank's coordinates is missing or its slice
        layout differs.
        """
        self.wait_exchanges()
        key = self._coords_key()
        entry = state.get("optim", {}).get(key)
        if entry is None:
            raise PlannerError(f"the checkpoint has no optimizer state for this rank's mesh coordinates ({key}); "
                               f"it holds {sorted(state.get('optim', {}))}. TwoStageExecutor cannot reshard: load it "
                               "with the same plan on the same (replicate, shard) mesh")
        try:
            saved = json.loads(entry["layout"])
        except (KeyError, TypeError, ValueError) as exc:
            raise PlannerError(f"optimizer entry {key} has no readable slice layout") from exc
        mine = self._layout()
        theirs = [{k: v for k, v in u.items() if k != "stepped"} for u in saved.get("units", [])]
        if theirs != mine or saved.get("replicate_size") != self._rep_size \
                or saved.get("shard_size") != self.mesh.size(1):
            raise PlannerError(f"optimizer state {key} was saved for another plan/mesh: slice layout {theirs} "
                               f"(mesh {saved.get('replicate_size')}x{saved.get('shard_size')}), this executor has "
                               f"{mine} (mesh {self._rep_size}x{self.mesh.size(1)}); TwoStageExecutor cannot "
                               "reshard optimizer state")
        if "model" in state:
            from torch.distributed.checkpoint.state_dict import set_model_state_dict
            set_model_state_dict(self.model, state["model"])
        units = entry["units"]
        opt_state = {i: dict(units[u.name]["state"]) for i, (u, s) in enumerate(zip(self._units, saved["units"]))
                     if s["stepped"]}
        groups = [{**units[u.name]["group"], "params": [i]} for i, u in enumerate(self._units)]
        self.optimizer.load_state_dict({"state": opt_state, "param_groups": groups})
        for i, u in enumerate(self._units):  # load_state_dict keeps nothing for slices never stepped
            if i not in opt_state:
                self.optimizer.state.pop(u.slice_param, None)
        self.sync_from_model()

    def sync_from_model(self) -> None:
        """Copy the model's current parameter values into the slices (after loading model weights)."""
        self.wait_exchanges()
        with torch.no_grad():
            for u in self._units:
                flat = torch.cat([p.to_local().reshape(-1) for p in u.params])
                u.slice_param.copy_(flat[u.lo:u.hi])
