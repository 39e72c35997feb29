"""PeriodicSyncOptimizer over a model FSDP2 shards inside each replica (CPDP across sites, FSDP inside).

The layout: FSDP2 shards the model over the *shard group* (a site: ``fully_shard(module,
mesh=mesh["shard"])``) and does its all-gathers and reduce-scatters there on every step; the
optimizer's ``group`` is the *replicate group* (one rank per site, the ranks holding the same shard
index). Everything the optimizer sends crosses only that group, and only this rank's shard of it:

* **Gradients** (:class:`ShardGradientSync`): on a step that synchronises gradients (warm-up, and
  CPDP's reconciliation), FSDP2's official ``set_all_reduce_hook`` hands each unit's reduce-scatter
  output (the site-averaged gradient shard) to an all-reduce ``AVG`` over the replicate group, what
  FSDP2's own HSDP does after its reduce-scatter, so the numbers equal HSDP's bit for bit. FSDP2
  makes the gradient a view of that output; once a step has proved it (the storage is checked), the
  all-reduce is launched asynchronously and waited in ``step()``, so it overlaps the rest of
  backward. On other steps nothing crosses the replicate group. With a ``compression`` codec, ``cpdp``'s
  synchronous step sends codes instead (one codec per tier: FSDP2's reduce-scatter inside the site stays
  as it is, only the cross-site exchange is encoded): the unit's gradient shard plus its residual (shard-
  sized, one per unit) is encoded in the hook, every rank's code all-gathered over the replicate group and,
  under the same proof, waited for and decoded in rank order into the reduce-scatter output in ``step()``
  (before the proof, inside the hook), so the codes cross the WAN under the rest of backward too. From 3
  replicas the codes are reduce-scattered instead (:mod:`cpdpkit.sync._code_exchange`: an all-to-all of chunk
  codes, then an all-gather of the re-encoded chunk means), two rounds of exchanges in ``step()``.
* **Parameters and SlowMo** (:class:`ShardedParameters`): a reconciliation packs this rank's local
  shards into one buffer per dtype, averages it over the replicate group, runs SlowMo on it and
  unpacks it. SlowMo's anchor and slow momentum are shard-sized: +2 × this rank's parameter shard
  (in ``anchor_dtype``), not +2 × the model.

FSDP2's own HSDP (a 2-D mesh) cannot be wrapped: it all-reduces across the replicate axis on every
step, and in torch 2.13 its ``set_requires_all_reduce(False)`` assigns no gradient at all (only a
partial reduce-scatter output accumulates). So a parameter with a ``Replicate`` placement is refused
with the fix, as is a shard group that meets the replicate group at another rank than this one and,
when a topology is given, a shard group that spans sites or a replicate group holding two ranks of
one site. All of it is checked before the first collective.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from cpdpkit.errors import ConfigError
from cpdpkit.labels import SYNC
from cpdpkit.sync._code_exchange import CHUNKED_FROM, ChunkedFeedback
from cpdpkit.sync._codec import ErrorFeedback
from cpdpkit.sync._comm import Communicator, group_ranks
from cpdpkit.sync._flat import SegmentedParameters, build_segments

__all__ = ["ShardedParameters", "ShardGradientSync", "is_sharded", "check_sharded_model", "check_replica_layout",
           "as_param_layout"]

_AVG_DTYPES = (torch.float32, torch.bfloat16)  # what FSDP2 all-reduces with ReduceOp.AVG
_FIX = ("shard the model over the site only: fully_shard(module, mesh=mesh['shard']) on a mesh "
        "init_device_mesh(device, (num_sites, ranks_per_site), mesh_dim_names=('replicate', 'shard')), "
        "and pass group=mesh['replicate'].get_group()")


def _dtensor_type() -> type:
    from torch.distributed.tensor import DTensor

    return DTensor


def is_sharded(params: Sequence[torch.Tensor]) -> bool:
    """Whether any parameter is a DTensor (FSDP2 shards it); mixing is refused by :func:`check_sharded_model`."""
    dtensor = _dtensor_type()
    return any(isinstance(p, dtensor) for p in params)


def _local(p: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard itself (under no_grad ``to_local`` returns the very tensor)."""
    with torch.no_grad():
        return p.to_local()


def check_sharded_model(model: nn.Module, params: Sequence[torch.Tensor], group: Any,
                        topology: Any = None) -> list[int]:
    """Refuse a model not sharded the way the groups say (module docstring); the shard group's ranks."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import Shard

    dtensor = _dtensor_type()
    plain = [i for i, p in enumerate(params) if not isinstance(p, dtensor)]
    if plain:
        raise ConfigError(f"parameter {plain[0]} of the optimizer is a plain tensor while others are FSDP2 DTensors: "
                          "fully_shard the root module too, so that every parameter is sharded")
    if not isinstance(model, FSDPModule):
        raise ConfigError(f"model ({type(model).__name__}) holds DTensor parameters but is not an FSDP2 module: "
                          "pass the root module you called fully_shard on")
    for p in params:
        if p.device_mesh.ndim != 1 or not all(isinstance(pl, Shard) for pl in p.placements):
            names = p.device_mesh.mesh_dim_names
            raise ConfigError(f"model is sharded with placements {tuple(p.placements)} over mesh dims {names}: FSDP2's "
                              "HSDP all-reduces gradients across its replicate dim on every step, which the periodic "
                              f"sync replaces; {_FIX}")
    meshes = {tuple(group_ranks(p.device_mesh.get_group(0))) for p in params}  # each 1-D (checked above)
    if len(meshes) != 1:
        raise ConfigError(f"model's parameters are sharded over {len(meshes)} different groups: {_FIX}")
    shard_ranks = list(next(iter(meshes)))
    check_replica_layout(shard_ranks, group, topology, what="model is sharded", fix=_FIX)
    return shard_ranks


def check_replica_layout(inner_ranks: list[int], group: Any, topology: Any, *, what: str, fix: str) -> None:
    """``inner_ranks`` (one replica: a shard group, an executor's mesh) and ``group`` (the replicate group)
    must meet only at this rank; with a topology of several sites the replica lies in one site and the
    replicate group holds one rank per site."""
    replicate_ranks = group_ranks(group)
    me = dist.get_rank()
    shared = sorted(set(inner_ranks) & set(replicate_ranks))
    if shared != [me]:
        raise ConfigError(f"{what} over ranks {inner_ranks}, which share ranks {shared} with group "
                          f"{replicate_ranks}: the shard group and the replicate group must meet only at this rank "
                          f"({me}); {fix}")
    if topology is not None and topology.num_sites and topology.num_sites > 1:
        _check_sites(topology, inner_ranks, replicate_ranks, what, fix)


def _check_sites(topology: Any, inner_ranks: list[int], replicate_ranks: list[int], what: str, fix: str) -> None:
    sites = sorted({topology.site_of(r) for r in inner_ranks})
    if len(sites) > 1:
        raise ConfigError(f"{what} over ranks {inner_ranks}, which span sites {sites} of topology "
                          f"{topology.name!r}: FSDP2 would cross the WAN on every step; {fix}")
    seen: dict[int, int] = {}
    for r in replicate_ranks:
        site = topology.site_of(r)
        if site in seen:
            raise ConfigError(f"group {replicate_ranks} (the replicate group) holds ranks {seen[site]} and {r} of site "
                              f"{site} of topology {topology.name!r}: it must hold one rank per site; {fix}")
        seen[site] = r


class ShardedParameters(SegmentedParameters):
    """This rank's local shards as segments (module docstring); packing copies, FSDP2 owns the storage."""

    def __init__(self, param_groups: Sequence[dict], *, anchor_dtype: torch.dtype | None,
                 stats_slots: int = 0) -> None:
        super().__init__(build_segments(param_groups, lambda p: _local(p).shape), anchor_dtype=anchor_dtype,
                         stats_slots=stats_slots)

    def _locals(self, seg: Any) -> list[torch.Tensor]:
        # fetched anew: FSDP2 may re-create a local tensor (load_state_dict(assign=True), lazy init)
        return [_local(p) for p in seg.params]

    @torch.no_grad()
    def pack(self, *, slots: bool = False) -> list[torch.Tensor]:
        out = []
        for i, seg in enumerate(self.segments):
            buffer = torch.empty(seg.numel + self._extra(i, slots), dtype=seg.dtype, device=seg.device)
            for local, off in zip(self._locals(seg), seg.offsets):
                buffer[off : off + local.numel()].copy_(local.reshape(-1))
            out.append(buffer)
        return out

    def snapshot(self, *, slots: bool = False) -> list[torch.Tensor]:
        return self.pack(slots=slots)  # already a copy the caller owns

    @torch.no_grad()
    def unpack(self, values: Sequence[torch.Tensor]) -> None:
        for seg, v in zip(self.segments, values):
            for local, off in zip(self._locals(seg), seg.offsets):
                local.copy_(v[off : off + local.numel()].view_as(local))


def as_param_layout(inner_state: dict[str, Any], params: Sequence[torch.Tensor]) -> dict[str, Any]:
    """``inner_state`` with plain tensors shaped like a DTensor parameter's local shard wrapped back as DTensors.

    cpdpkit's Checkpointer saves a DTensor as its local shard; torch's optimizers need state laid out
    like the parameter (0-d entries such as Adam's ``step`` stay plain, as torch keeps them)."""
    from torch.distributed.tensor import DTensor

    state = dict(inner_state.get("state", {}))
    for index, entry in list(state.items()):
        p = params[int(index)] if int(index) < len(params) else None
        if not isinstance(p, DTensor):
            continue
        local_shape = _local(p).shape
        wrapped = {}
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.dim() > 0 \
                    and value.shape == local_shape:
                value = DTensor.from_local(value, p.device_mesh, p.placements, run_check=False,
                                           shape=p.shape, stride=p.stride())
            wrapped[key] = value
        state[index] = wrapped
    return {**inner_state, "state": state}


class ShardGradientSync:
    """All-reduce FSDP2's reduce-scatter outputs across the replicate group on gradient-sync steps.

    ``target()`` returns the communicator of the coming step's gradient sync, or ``None`` on a step
    that does not synchronise gradients; ``compressed()`` (with a ``compression``) whether it sends codes.
    :meth:`finish` (from ``step()``) waits for what was launched and decodes the codes. :meth:`state` and
    :meth:`load` are the compressed exchange's residuals, one per FSDP2 unit (None for a unit that has not sent yet).
    """

    def __init__(self, model: nn.Module, *, target: Callable[[], Communicator | None], compression: str = "none",
                 compressed: Callable[[], bool] | None = None, replicas: int = 1) -> None:
        from torch.distributed.fsdp import FSDPModule

        self._target, self._compression, self._compressed = target, compression, compressed
        self._replicas = replicas  # from CHUNKED_FROM replicas on, the codes are reduce-scattered (_code_exchange)
        self._feedback: dict[int, ErrorFeedback | ChunkedFeedback] = {}  # per unit, made at its first exchange
        self._pending: list[_Exchange] = []
        self.defer = True  # False: every exchange waits inside the hook, as before the proof (a test's reference)
        self._checks: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        self._async_ok = False  # set once a step proved FSDP2's gradients are views of the hook's tensor
        claimed: set[int] = set()
        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        self._num_units = 0
        for module in reversed(units):  # nested units first: a unit owns what no nested unit claimed
            own = [p for p in module.parameters() if id(p) not in claimed]
            claimed.update(id(p) for p in own)
            if not own:
                continue
            self._num_units += 1
            try:
                module.set_all_reduce_hook(functools.partial(self._on_reduced, own, self._num_units - 1))
            except ValueError as exc:
                raise ConfigError(f"FSDP2 refused the gradient hook on {type(module).__name__} ({exc}): shard each "
                                  "module over one mesh (no shard_placement_fn with per-parameter meshes)") from exc

    @torch.no_grad()
    def _on_reduced(self, own: list[torch.Tensor], unit: int, reduce_output: torch.Tensor) -> None:
        comm = self._target()
        if comm is None:
            return
        if self._compression != "none" and self._compressed is not None and self._compressed():
            exchange = self._launch_codes(comm, unit, reduce_output)
        else:
            exchange = _Exchange(comm, self._launch_mean(comm, reduce_output))
        if self.defer and self._async_ok and reduce_output.dtype == own[0].dtype and all(p.grad is None for p in own):
            self._pending.append(exchange)  # waited (and decoded) in step(): it overlaps the rest of backward
            return
        while exchange is not None:
            with comm.blocking(SYNC.GRAD_WAIT):
                comm.wait(exchange.work)
            exchange = exchange.complete()
        if not self._async_ok:
            self._checks.append((reduce_output, own))

    @staticmethod
    def _launch_mean(comm: Communicator, reduce_output: torch.Tensor) -> Any:
        """The replicate group's mean of ``reduce_output``, in place, launched."""
        with record_function(SYNC.GRAD_ALLREDUCE.label):
            if reduce_output.dtype in _AVG_DTYPES:
                return comm.all_reduce_avg_async(reduce_output)
            # FSDP2 pre/post-divides such dtypes itself; the replicate mean by dividing first
            reduce_output.div_(comm.size)
            return comm.all_reduce_sum_async(reduce_output)

    def _launch_codes(self, comm: Communicator, unit: int, reduce_output: torch.Tensor) -> _Exchange:
        """Launch the exchange of every replica's code of (``reduce_output`` + this unit's residual); completing
        it writes the mean of the decoded codes (rank order) into ``reduce_output``."""
        numel = reduce_output.numel()
        feedback = self._feedback.get(unit)
        if feedback is None:
            feedback = self._feedback[unit] = self._new_feedback(numel)
        elif _numel(feedback) != numel:
            raise ConfigError(f"FSDP2 unit {unit}'s gradient shard has {numel} elements, its residual "
                              f"{_numel(feedback)}: load a checkpoint saved with the same sharding")
        if isinstance(feedback, ChunkedFeedback):
            return self._launch_chunks(comm, feedback, reduce_output)
        code = feedback.encode_one(0, reduce_output)  # the residual keeps what the code lost, now
        gathered = torch.empty(comm.size * code.numel(), dtype=torch.uint8)
        with record_function(SYNC.GRAD_ALLREDUCE.label):
            work = comm.all_gather_async(gathered, code)

        def decode() -> None:
            reduce_output.copy_(feedback.mean_one(0, gathered, comm.size).view_as(reduce_output))
        return _Exchange(comm, work, decode)

    def _new_feedback(self, numel: int) -> ErrorFeedback | ChunkedFeedback:
        if self._replicas >= CHUNKED_FROM:
            return ChunkedFeedback(self._compression, numel, self._replicas)
        return ErrorFeedback(self._compression, [numel])

    @staticmethod
    def _launch_chunks(comm: Communicator, feedback: ChunkedFeedback, reduce_output: torch.Tensor) -> _Exchange:
        """The reduce-scatter of codes: the all-to-all of chunk codes now, then (once waited) the chunk mean's
        re-encoding and the all-gather of every rank's chunk-mean code (:mod:`cpdpkit.sync._code_exchange`)."""
        send = feedback.encode(reduce_output)
        received = torch.empty_like(send)
        with record_function(SYNC.GRAD_ALLREDUCE.label):
            first = comm.all_to_all_async(received, send)

        def gather() -> _Exchange:
            code = feedback.reencode(received)
            gathered = torch.empty(comm.size * code.numel(), dtype=torch.uint8)
            with record_function(SYNC.GRAD_ALLREDUCE.label):
                work = comm.all_gather_async(gathered, code)

            def decode() -> None:
                reduce_output.copy_(feedback.mean(gathered).view_as(reduce_output))
            return _Exchange(comm, work, decode)
        return _Exchange(comm, first, gather)

    def state(self) -> list[torch.Tensor | None]:
        return [_state(self._feedback[u]) if u in self._feedback else None for u in range(self._num_units)]

    def load(self, residuals: list[torch.Tensor | None] | None) -> None:
        self._feedback.clear()
        for unit, residual in enumerate(residuals or ()):
            if residual is None:
                continue
            if self._replicas < CHUNKED_FROM:
                feedback = self._feedback[unit] = ErrorFeedback(self._compression, [residual.numel()])
                feedback.load([residual])
                continue
            numel = ChunkedFeedback.numel_of_state(residual.numel(), self._replicas)
            if numel is None:
                raise ConfigError(f"checkpoint's gradient residual of FSDP2 unit {unit} has {residual.numel()} "
                                  f"elements, which fits no shard over {self._replicas} replicas: load a checkpoint "
                                  "saved with the same model, sharding, number of replicas and compression")
            self._feedback[unit] = ChunkedFeedback(self._compression, numel, self._replicas)
            self._feedback[unit].load(residual)

    @torch.no_grad()
    def finish(self) -> None:
        """Wait for the launched exchanges and decode the compressed ones into their reduce-scatter outputs; after
        the first synced step, check that the gradients alias those outputs (the proof that deferring is exact)."""
        pending, self._pending = self._pending, []
        while pending:  # one round of exchanges at a time (the reduce-scatter of codes has two)
            for exchange in pending:
                with exchange.comm.blocking(SYNC.GRAD_WAIT):
                    exchange.comm.wait(exchange.work)
            # local work after every wait: decodes, or a second exchange's encode and launch
            pending = [then for then in (exchange.complete() for exchange in pending) if then is not None]
        if self._checks:
            checks, self._checks = self._checks, []
            self._async_ok = all(
                p.grad is not None and _local(p.grad).untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
                for out, own in checks for p in own)


@dataclass
class _Exchange:
    """One unit's launched cross-replica exchange: its Work, and what completes it once waited (a decode, or the
    launch of the next exchange, which :meth:`complete` returns)."""

    comm: Communicator
    work: Any
    then: Callable[[], _Exchange | None] | None = None

    def complete(self) -> _Exchange | None:
        return None if self.then is None else self.then()


def _numel(feedback: ErrorFeedback | ChunkedFeedback) -> int:
    return feedback.numel if isinstance(feedback, ChunkedFeedback) else feedback.codecs[0].numel


def _state(feedback: ErrorFeedback | ChunkedFeedback) -> torch.Tensor:
    return feedback.state() if isinstance(feedback, ChunkedFeedback) else feedback.residuals[0].clone()
