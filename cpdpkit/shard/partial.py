"""Partially sharded data parallelism: replicated parameters, gradients and optimizer state
sharded finely and hierarchically (:class:`PartialShardExecutor`).

The sharding paper's *partial sharding*: every rank keeps the whole model (a plain
``nn.Module``, no FSDP2: no forward or backward all-gathers), while each unit's gradient and
optimizer state are split over all ``W = R·S`` ranks of the plan's ``(replicate, shard)`` mesh
(``S`` ranks per node on the ``"shard"`` axis, ``R`` nodes on the ``"replicate"`` axis). Per
unit of ``n`` elements (``c = ceil(n/S)``, ``d = ceil(c/R)``), every step issues **two
collectives over the mesh's world group** (mesh rank ``(j, i)`` is its rank ``j·S + i``):

1. **Gradient ready.** The unit is one flat bucket: its parameters are views of ``flat_param``
   and, while a step runs, their gradients views of ``flat_grad`` (autograd accumulates into
   them; no per-parameter copies). A ``register_post_accumulate_grad_hook`` on each parameter
   counts them; the last one is the unit's gradient-ready point.
2. **One reduce-scatter over the world group** (mean over ``W``, ``async_op=True``,
   ``grad_reduce_scatter``), launched at that point. Its inputs are ``W`` views of ``flat_grad``,
   one per rank: rank ``(j, i)`` receives chunk ``j`` (``d`` elements) of node slice ``i``
   (elements ``[i·c, (i+1)·c)``), the layout :func:`cpdpkit.planner._cost.partial_owned` prices.
   The network model prices (and the emulator counts) a group spanning nodes hierarchically: a
   reduce-scatter inside each node, then across nodes on ``1/S`` of the data, all ``S`` ranks of a
   node sharing its uplink: the same bytes on each link as the two-level scheme of the paper
   (in-node reduce-scatter, then across nodes), in one collective call instead of two.
3. From there the slice pipeline shared with
   :class:`~cpdpkit.shard.executor.TwoStageExecutor` (:mod:`cpdpkit.shard._slices`): the rank
   updates its chunk in fp32 with the inner optimizer (one step of its param group, the bucket's
   slice); stage 1 during backward at the schedule-derived trigger, stage 2 in
   :meth:`~PartialShardExecutor.step`; the same exact speculative clipping, ``stats``,
   ``calibrate()`` and checkpointing. See :mod:`cpdpkit.shard.executor` for the trigger rule,
   clipping, its memory and the GPU notes.
4. **One all-gather over the world group** (async, ``param_all_gather``) of the updated chunks,
   straight into ``flat_param`` (the replicated parameters) when the chunks tile it (``R·d = c``:
   ``W`` disjoint output views), else into a buffer copied into ``flat_param`` (``R`` strided
   copies) when the exchange is waited. It is waited by the unit's next forward pre-hook (stage-1
   exchanges too: ``step()`` leaves them in flight).

Why one world-group collective and not the two levels (or the in-node pair fused): on these CPU
ranks every gloo collective costs a fixed ~0.5 ms of CPU (``benchmarks/collective_overhead.py``),
and the emulator adds an arrival exchange to each; the paper's hierarchical scheme is about the
load on each link, which the network model's hierarchical pricing of a world group keeps (a
world collective is what NCCL runs as one call, hierarchically, on a real cluster). Fusing the
in-node pair would leave three collectives a unit; the world group leaves two, as ZeRO-2's
reduce-scatter and all-gather.

Per step a rank sends on each link at most what a ring all-reduce of the model sends
(``2(S-1)/S·M`` in the node, ``2(R-1)/R·M/S`` across nodes, against ``2(W-1)/W·M``): less
memory without more communication. The constructor broadcasts mesh rank ``(0, 0)``'s
parameters over the world group, so replicas start identical; ``mp_policy`` (bf16) keeps the
replicated parameters in ``param_dtype`` and the slices as fp32 masters.

Limits: every trainable parameter must receive a gradient in every synced backward on every
rank (a unit whose parameters are only partly reached is reduced at the end of backward with
zeros for the missing ones); float32 model parameters (``mp_policy`` for bf16 compute);
elementwise optimizers only; a bucket is a plan unit (the planner's unit sizes).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.profiler import record_function
from torch.utils._pytree import tree_map

from cpdpkit.errors import DistributedSetupError
from cpdpkit.labels import SHARD
from cpdpkit.planner.config import PlannerError
from cpdpkit.planner.plan import ShardingPlan
from cpdpkit.shard._slices import (
    ALL_GATHER,
    OptimizerFactory,
    SliceExecutor,
    SliceUnit,
    build_mesh,
    check_inputs,
    chunk_of,
    mp_dtypes,
    slice_bounds,
)

__all__ = ["PartialShardExecutor"]


@dataclasses.dataclass(kw_only=True, eq=False)
class _Bucket(SliceUnit):
    """One plan unit as a flat bucket: its parameters and their gradients are views of flat buffers."""

    numels: list[int]
    total: int  # n: the unit's elements
    node_chunk: int  # c = ceil(n / S)
    offset: int  # i·c: where this rank's node slice starts in the flat unit
    flat_param: torch.Tensor  # S·c: the unit's parameters are views of its first n elements
    flat_grad: torch.Tensor  # (S-1)·c + R·d: their gradients are views of its first n elements; the tail stays zero
    grad_views: list[torch.Tensor]
    flat_reduce: torch.Tensor | None  # flat_grad in reduce_dtype when it differs from param_dtype (one cast per bucket)
    rs_inputs: list[torch.Tensor]  # the world reduce-scatter's inputs: W views (d each) of flat_reduce or flat_grad
    ag_outputs: list[torch.Tensor] | None  # the world all-gather's outputs when they tile flat_param (R·d == c)
    num_accumulated: int = 0  # parameters whose gradient this backward has accumulated


def _world_views(buf: torch.Tensor, s: int, r: int, c: int, d: int) -> list[torch.Tensor]:
    """The ``W = R·S`` chunks of ``buf`` in world-rank order: rank ``j·S + i`` gets chunk ``j`` of node slice ``i``."""
    return [buf.narrow(0, i * c + j * d, d) for j in range(r) for i in range(s)]


def _exchange_group(who: str, mesh: DeviceMesh) -> Any:
    """The process group of every rank of ``mesh`` in mesh order (``(j, i)`` is its rank ``j·S + i``)."""
    ranks = mesh.mesh.flatten().tolist()
    if ranks == list(range(dist.get_world_size())):
        group = dist.group.WORLD
    elif mesh.size(1) == 1:
        group = mesh.get_group("replicate")
    elif mesh.size(0) == 1:
        group = mesh.get_group("shard")
    else:
        group = mesh._flatten().get_group()
    expected = mesh.get_local_rank("replicate") * mesh.size(1) + mesh.get_local_rank("shard")
    if dist.get_rank(group) != expected:
        raise DistributedSetupError(f"{who}: the mesh's ranks {ranks} as one group put this rank at "
                                    f"{dist.get_rank(group)}, not {expected}; build the mesh with init_device_mesh "
                                    "(or pass mesh=None)")
    return group


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
    The constructor moves the model's parameters into the flat buckets (their values are kept,
    their storage changes) and broadcasts them from mesh rank ``(0, 0)``.
    """

    def __init__(self, model: nn.Module, plan: ShardingPlan, optimizer_factory: OptimizerFactory, *,
                 mesh: DeviceMesh | None = None, max_grad_norm: float | None = None,
                 update_in_backward: bool = True, mp_policy: Any = None) -> None:
        if not isinstance(plan, ShardingPlan):
            raise TypeError(f"plan = {type(plan).__name__} must be a ShardingPlan")
        kind = getattr(plan, "param_sharding", None)
        if kind != "replicated" or len(plan.mesh.shape) != 2:
            raise PlannerError(f"plan {plan.strategy!r} has param_sharding = {kind!r}; PartialShardExecutor runs "
                               "partial plans: plan with PlannerConfig(param_sharding='replicated'), or run this "
                               "plan with TwoStageExecutor / apply_plan")
        self._param_dtype, self._reduce_dtype = mp_dtypes("PartialShardExecutor", mp_policy, check_param=True)
        check_inputs("PartialShardExecutor", model, optimizer_factory, max_grad_norm, update_in_backward)
        if any(hasattr(p, "placements") for p in model.parameters()):
            raise PlannerError("PartialShardExecutor needs the plain (unsharded) model, but its parameters are "
                               "DTensors; pass the module before fully_shard/apply_plan")
        units = self._unit_params(model, plan)
        mesh = build_mesh("PartialShardExecutor", model, plan, mesh)
        self._setup_axes(plan, mesh, max_grad_norm, update_in_backward)
        self._gather_dtype = self._param_dtype
        self.model = model
        self._shard_size = mesh.size(1)
        self._shard_rank = mesh.get_local_rank("shard")
        self._world_group = _exchange_group("PartialShardExecutor", mesh)
        buckets = [self._make_unit(*args) for args in units]
        self._broadcast_init([b for b in buckets if b.params])
        self._setup_pipeline(buckets, optimizer_factory)
        if self._param_dtype != torch.float32:
            self._lower_params(mp_policy.cast_forward_inputs)
        self._attach_grads()

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

    def _make_unit(self, name: str, plan_index: int, modules: list[nn.Module], params: list) -> _Bucket:
        numels = [p.numel() for p in params]
        n = sum(numels)
        s, r = self._shard_size, self._rep_size
        c = chunk_of(n, s)
        d = chunk_of(c, r)
        offset = self._shard_rank * c
        m = max(0, min(c, n - offset))  # the real elements of this rank's node slice
        lo, hi = slice_bounds(m, d, self._rep_rank)
        device = params[0].device if params else torch.device("cpu")
        length = (s - 1) * c + r * d  # the last node slice's last chunk ends here
        flat_param = torch.zeros(s * c, device=device)  # float32 until _lower_params (the slices' masters)
        flat_grad = torch.zeros(length, dtype=self._param_dtype, device=device)
        flat_reduce = (torch.zeros(length, dtype=self._reduce_dtype, device=device)
                       if self._param_dtype != self._reduce_dtype else None)
        with torch.no_grad():
            for p, piece in zip(params, flat_param[:n].split(numels)):
                piece.copy_(p.detach().reshape(-1))
                p.data = piece.view_as(p)  # the model's parameter is now a view of the bucket
        grad_views = [piece.view_as(p) for p, piece in zip(params, flat_grad[:n].split(numels))]
        unit = _Bucket(name=name, plan_index=plan_index, modules=modules, params=params, numel=m, chunk=d,
                       lo=lo, hi=hi, slice_param=nn.Parameter(torch.zeros(hi - lo, device=device)), numels=numels,
                       total=n, node_chunk=c, offset=offset, flat_param=flat_param, flat_grad=flat_grad,
                       grad_views=grad_views, flat_reduce=flat_reduce,
                       rs_inputs=_world_views(flat_grad if flat_reduce is None else flat_reduce, s, r, c, d),
                       ag_outputs=_world_views(flat_param, s, r, c, d) if r * d == c else None)
        for p, view in zip(params, grad_views):
            p.register_post_accumulate_grad_hook(lambda p, u=unit, v=view: self._on_param_grad(u, p, v))
        return unit

    def _broadcast_init(self, buckets: list[_Bucket]) -> None:
        """Every rank of the mesh starts from mesh rank (0, 0)'s parameters (then fills its slices)."""
        src = dist.get_global_rank(self._world_group, 0)
        with record_function(SHARD.BROADCAST_INIT.label):
            works = [dist.broadcast(b.flat_param, src=src, group=self._world_group, async_op=True) for b in buckets]
        for work in works:
            work.wait()
        with torch.no_grad():
            for b in buckets:
                b.slice_param.copy_(b.flat_param[b.offset + b.lo:b.offset + b.hi])

    def _lower_params(self, cast_inputs: bool) -> None:
        """mp_policy: the replicated parameters in param_dtype (the float32 masters are the slices)."""
        for u in self._units:
            low = u.flat_param.to(self._param_dtype)
            with torch.no_grad():
                for p, piece in zip(u.params, low[:u.total].split(u.numels)):
                    p.data = piece.view_as(p)
            u.flat_param = low
            if u.ag_outputs is not None:
                u.ag_outputs = _world_views(low, self._shard_size, self._rep_size, u.node_chunk, u.chunk)
        if cast_inputs:
            dtype = self._param_dtype

            def cast(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
                return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point()
                                else t, (args, kwargs))

            self.model.register_forward_pre_hook(cast, with_kwargs=True)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self._full_precision_model("state_dict")
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._full_precision_model("load_state_dict")
        super().load_state_dict(*args, **kwargs)

    def _full_precision_model(self, what: str) -> None:
        if self._param_dtype != torch.float32:
            raise PlannerError(f"PartialShardExecutor.{what}() with mp_policy param_dtype = {self._param_dtype}: the "
                               "checkpoint restores the float32 slices from the model, which holds "
                               f"{self._param_dtype}; checkpoint without mp_policy (or with param_dtype=torch.float32)")

    # ---- gradients: views of the buckets -----------------------------------------------------------
    @staticmethod
    def _attach(p: nn.Parameter, view: torch.Tensor) -> None:
        """Make ``p.grad`` the bucket's view of it (holding what ``p.grad`` held; zero if None)."""
        grad = p.grad
        if grad is None:
            view.zero_()
        elif grad.data_ptr() != view.data_ptr():
            view.copy_(grad)  # a gradient autograd allocated (the views were detached): once
        else:
            return
        p.grad = view

    def _attach_grads(self) -> None:
        """Zero the buckets and make every parameter's ``.grad`` its view (autograd accumulates into it)."""
        for u in self._units:
            u.flat_grad.zero_()
            for p, view in zip(u.params, u.grad_views):
                p.grad = view

    # ---- the gradient-ready point ----------------------------------------------------------------
    def _on_param_grad(self, unit: _Bucket, p: nn.Parameter, view: torch.Tensor) -> None:
        self._attach(p, view)
        if not self._sync:
            return
        self._begin_backward()  # a unit only partly reached is reduced at the end of backward
        unit.num_accumulated += 1
        if unit.num_accumulated == len(unit.params):
            unit.num_accumulated = 0
            self._on_unit_grad(unit)

    def _on_unit_grad(self, unit: _Bucket) -> None:
        """The bucket's gradient is complete: its world reduce-scatter, then this point's exchanges."""
        self._check_first_backward(unit)
        if unit.flat_reduce is not None:
            unit.flat_reduce[:unit.total].copy_(unit.flat_grad[:unit.total])
        self._grad_ready(unit, unit.flat_grad if unit.flat_reduce is None else unit.flat_reduce)

    def _reduce_scatter(self, unit: _Bucket, recv: torch.Tensor, send: torch.Tensor) -> Any:
        """One reduce-scatter (mean) over the world group: rank ``j·S + i`` gets chunk ``j`` of node slice ``i``."""
        return dist.reduce_scatter(recv, unit.rs_inputs, op=dist.ReduceOp.AVG, group=self._world_group,
                                   async_op=True)

    def _end_of_backward(self) -> None:
        for u in reversed(self._units):  # units only partly reached by this backward
            if u.num_accumulated:
                u.num_accumulated = 0
                for p, view in zip(u.params, u.grad_views):
                    self._attach(p, view)
                self._on_unit_grad(u)
        super()._end_of_backward()

    def zero_grad(self) -> None:
        super().zero_grad()
        for u in self._units:
            u.num_accumulated = 0
        self._attach_grads()

    def step(self) -> float | None:
        norm = super().step()
        for u in self._units:  # the buckets keep their memory; .grad is None between steps (zero_grad re-attaches)
            for p in u.params:
                p.grad = None
        return norm

    # ---- the model side of an exchange ------------------------------------------------------
    def _ag_buffer(self, unit: _Bucket, send: torch.Tensor) -> torch.Tensor:
        if unit.ag_outputs is not None:
            return unit.flat_param  # the all-gather writes the parameters themselves
        return send.new_empty(unit.chunk * self._rep_size * self._shard_size)

    def _all_gather(self, unit: _Bucket, recv: torch.Tensor, send: torch.Tensor) -> Any:
        """One all-gather over the world group: into ``flat_param``'s chunks, or into ``recv`` (world-rank order)."""
        if recv is unit.flat_param:
            return dist.all_gather(unit.ag_outputs, send, group=self._world_group, async_op=True)
        return ALL_GATHER(recv, send, group=self._world_group, async_op=True)

    def _apply_gathered(self, unit: _Bucket, gathered: torch.Tensor) -> None:
        if gathered is unit.flat_param:
            return
        s, r, c, d = self._shard_size, self._rep_size, unit.node_chunk, unit.chunk
        chunks, slices = gathered.view(r, s, d), unit.flat_param.view(s, c)
        with torch.no_grad():
            for j in range(r):  # chunk j of every node slice: one strided copy
                width = min(d, c - j * d)
                if width > 0:
                    slices[:, j * d:j * d + width].copy_(chunks[j, :, :width])

    def _finish(self, unit: _Bucket, *, wait_model: bool = True) -> None:
        if wait_model:  # step() leaves the stage-1 exchanges in flight: the unit's next forward waits for them
            super()._finish(unit)

    def _model_values(self, unit: _Bucket) -> torch.Tensor:
        return unit.flat_param[unit.offset:unit.offset + unit.numel]
