"""The planner's arithmetic: FSDP2 shard layouts, per-rank bytes and per-step traffic.

Everything is computed per unique parameter shape (cached) and per *shard position* (the
rank's index on the shard axis), never per rank × parameter, so 1,024 ranks cost little.
Collective times and wire bytes come from the one network model: the
:class:`~cpdpkit.network.NetworkGroup` that :meth:`cpdpkit.topology.Topology.group` gives each
group, the same object the emulator asks, so a plan's bytes equal an emulated run's counts.

**Partially sharded data parallelism** (``param_sharding = "replicated"``, strategy ``partial``;
mesh ``(R, S)`` with ``S`` the ranks of a node). Parameters stay whole on every rank; a unit of
``n`` elements (``L`` the largest unit, ``root`` the root unit, ``L_b`` the largest other unit;
``c = ceil(n/S)``, ``d = ceil(c/R) = ceil(n/W)``) is, every step, per rank, one reduce-scatter and
one all-gather over the world group, which the network model prices level by level (the executor
issues one call each; the phases below are their levels, the same bytes):

* reduce-scattered inside the node (``n`` gradient elements in, ``c`` out: the node slice),
* reduce-scattered across nodes (the node slice, ``c`` elements, ``d`` out),
* updated (the rank's ``d``-element slice), all-gathered across nodes (``c`` out) and
* all-gathered inside the node (``n`` out), back into the replicated parameters.

No forward or backward all-gathers. On each link this sends at most what a ring all-reduce of
the model sends (``2(S-1)/S·M`` inside a node, ``2(R-1)/R·M/S`` across nodes, against
``2(W-1)/W·M``): the paper's "less memory without more communication". Rank ``(replica j,
position i)`` owns chunk ``j`` of node slice ``i``: ``clip(clip(n - i·c, 0, c) - j·d, 0, d)``
elements of each unit, the layout of padded flat collectives (at most ``d``, within one element
of ``n/W``; ranks at a unit's padded end own fewer). Peak bytes per rank:

    param_bytes·M                                         replicated parameters
  + grad_bytes·Σd + optim_state_bytes_per_param·Σd        owned gradient slices, optimizer state
                                                          (its fp32 master included: Adam's 12)
  + grad_bytes·max(root + 2·L_b, 2·root)                  gradients: the executor flattens each
                                                          unit's gradient and frees it (unit + flat
                                                          copy; the root's head gradient lives
                                                          through backward)
  + (grad_bytes + param_bytes)·ceil(L/S) + param_bytes·L  communication buffers: the node slices of
                                                          the gradient and of the updated
                                                          parameters, the in-node all-gather output

``fsdp2_peak_bytes`` of such a plan is plain DDP's ``(param + grad + optim)·M`` (FSDP2 cannot run
it). Activations are not modeled, as for every plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from cpdpkit._values import is_int
from cpdpkit.network import NetworkGroup
from cpdpkit.planner.config import PlannerConfig, ceil_div
from cpdpkit.planner.plan import CommPhase, RankBytes, Reconciliation
from cpdpkit.topology import Topology

__all__ = ["Layout", "shard_layout", "UnitGeom", "CostModel", "Candidate", "Evaluation", "partial_owned",
           "partial_comm_phases", "partial_rank_bytes"]


@dataclass(frozen=True)
class Layout:
    """How one shape shards over ``S`` ranks: ``Shard(dim)``, padded numel, real numel by position."""

    dim: int
    padded_numel: int
    real_by_position: np.ndarray  # int64, length S


@lru_cache(maxsize=65536)
def shard_layout(shape: tuple[int, ...], num_shards: int, *, balanced: bool) -> Layout:
    """FSDP2's layout of ``shape`` on ``num_shards`` ranks.

    ``balanced=False`` is FSDP2's default, ``Shard(0)``. ``balanced=True`` keeps dim 0 when it
    divides evenly, else takes the first other dim that divides evenly (FSDP2 requires even
    division for dim > 0), else falls back to padded ``Shard(0)``: zero padding whenever any
    dim allows it.
    """
    dims = shape if shape else (1,)
    numel = math.prod(dims)
    dim = 0
    if balanced and dims[0] % num_shards:
        dim = next((k for k in range(1, len(dims)) if dims[k] and dims[k] % num_shards == 0), 0)
    size = dims[dim]
    chunk = ceil_div(size, num_shards)
    rest = numel // size if size else 0
    slices = np.clip(size - chunk * np.arange(num_shards, dtype=np.int64), 0, chunk)
    return Layout(dim=dim, padded_numel=chunk * num_shards * rest, real_by_position=slices * rest)


@dataclass(frozen=True)
class UnitGeom:
    """A unit's parameters laid out on the shard axis."""

    padded_numel: int
    real_by_position: np.ndarray
    reshard_after_forward: bool | int
    is_root: bool


@dataclass(frozen=True)
class Candidate:
    """One point of the search: mesh, reshard policy and whether optimizer state is sharded."""

    strategy: str
    shard_size: int
    reshard_after_forward: bool | int
    state_sharded: bool
    param_sharding: str = "sharded"

    @property
    def label(self) -> str:
        """The plan's ``strategy``: ``partial``, or the sharded kind with ``+state`` when it shards state."""
        if self.param_sharding == "replicated":
            return self.strategy
        return self.strategy + ("+state" if self.state_sharded else "")


@dataclass(frozen=True)
class Evaluation:
    candidate: Candidate
    rank_bytes: RankBytes
    comm: tuple[CommPhase, ...]
    reconciliation: Reconciliation | None = None  # set by cpdpkit.planner._reconcile_cost
    # the candidate's time at the latency-bound unit size, when its units were chosen finer for overlap
    ranking_time_s: float | None = None

    @property
    def time_s(self) -> float:
        """Modeled seconds per step: every per-step collective, plus the amortised reconciliation."""
        rec = self.reconciliation
        return sum(p.time_s for p in self.comm) + (rec.amortised_s_per_step if rec is not None else 0.0)

    @property
    def ranking_s(self) -> float:
        """What candidates are compared by: :attr:`time_s`, at the latency-bound unit size."""
        return self.time_s if self.ranking_time_s is None else self.ranking_time_s


class CostModel:
    """The network groups of a placed topology, addressed as ``(start, stop, step)`` rank ranges."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.world_size = topology.world_size

    def group(self, group: tuple[int, int, int]) -> NetworkGroup:
        """The :class:`~cpdpkit.network.NetworkGroup` of ``range(*group)`` (cached by the topology)."""
        return self.topology.group(range(*group))

    def tier_name(self, group: tuple[int, int, int]) -> str | None:
        """The tier of ``range(*group)``; ``None`` for a single rank."""
        tier = self.group(group).tier
        return tier.name if tier is not None else None


def comm_phase(model: CostModel, name: str, op: str, axis: str, group: tuple[int, int, int],
               sizes: list[int]) -> CommPhase | None:
    """One phase: ``op`` on each of ``sizes`` bytes over ``group``, priced by the network model, each
    collective also charged its tier's fixed ``collective_overhead_s`` (``None`` when there is nothing
    to send or the group has one rank)."""
    if not sizes or len(range(*group)) < 2:
        return None
    net = model.group(group)
    costs = [net.cost(op, n) for n in sizes]
    by_tier: dict[str, int] = {}
    for c in costs:
        for tier, wire in c.tier_bytes:
            by_tier[tier] = by_tier.get(tier, 0) + wire
    return CommPhase(name=name, op=op, axis=axis, tier=model.tier_name(group), num_ranks=net.num_ranks,
                     num_collectives=len(sizes), collective_bytes=sum(sizes),
                     wire_bytes_per_rank=sum(c.wire_bytes for c in costs),
                     time_s=sum(c.time_s for c in costs) + len(costs) * net.overhead_s,
                     tier_bytes=by_tier if len(by_tier) > 1 else None)


def comm_phases(model: CostModel, units: list[UnitGeom], cand: Candidate,
                config: PlannerConfig) -> tuple[CommPhase, ...]:
    """Every collective of one training step under ``cand``, grouped into phases."""
    s, w = cand.shard_size, model.world_size
    pb, gb = config.param_bytes, config.grad_bytes
    shard, replicate = (0, s, 1), (0, w, s)
    phases = [
        comm_phase(model, "forward all-gather", "all_gather", "shard", shard, [u.padded_numel * pb for u in units]),
        comm_phase(model, "backward all-gather", "all_gather", "shard", shard,
                   [u.padded_numel * pb for u in units if u.reshard_after_forward is True]),
    ]
    for k in sorted({u.reshard_after_forward for u in units if is_int(u.reshard_after_forward)}):
        phases.append(comm_phase(model, f"backward all-gather (resharded on {k})", "all_gather", "shard", (0, k, 1),
                                 [u.padded_numel * pb for u in units if u.reshard_after_forward == k]))
    phases.append(comm_phase(model, "gradient reduce-scatter", "reduce_scatter", "shard", shard,
                             [u.padded_numel * gb for u in units]))
    shard_chunks = [u.padded_numel // s for u in units]
    if cand.state_sharded:
        phases.append(comm_phase(model, "gradient reduce-scatter", "reduce_scatter", "replicate", replicate,
                                 [n * gb for n in shard_chunks]))
        phases.append(comm_phase(model, "parameter all-gather", "all_gather", "replicate", replicate,
                                 [n * pb for n in shard_chunks]))
    else:
        phases.append(comm_phase(model, "gradient all-reduce", "all_reduce", "replicate", replicate,
                                 [n * gb for n in shard_chunks]))
    return tuple(p for p in phases if p is not None)


def _even_split(total: np.ndarray, parts: int) -> np.ndarray:
    """Shape (parts, len(total)): ``total`` split into ``parts`` near-equal integers."""
    base, extra = np.divmod(total, parts)
    return base[None, :] + (np.arange(parts)[:, None] < extra[None, :])


def rank_bytes(units: list[UnitGeom], cand: Candidate, world_size: int, config: PlannerConfig) -> RankBytes:
    """Per-rank real bytes (rank r sits at shard position r % S, replica r // S) and peaks."""
    s = cand.shard_size
    replicas = world_size // s
    pb, gb, ob = config.param_bytes, config.grad_bytes, config.optim_state_bytes_per_param
    real = np.zeros(s, dtype=np.int64)
    for u in units:
        real += u.real_by_position
    padded_shard = sum(u.padded_numel for u in units) // s
    param = np.tile(real * pb, replicas)
    grad = np.tile(real * gb, replicas)
    full_optim = np.tile(real * ob, replicas)
    if cand.state_sharded and replicas > 1:
        optim = (_even_split(real, replicas) * ob).reshape(-1)  # row j = replica j: rank j*S + i
    else:
        optim = full_optim
    buffers = _buffer_bytes(units, pb, gb)
    states = (pb + gb) * padded_shard
    return RankBytes(param_bytes=tuple(param.tolist()), grad_bytes=tuple(grad.tolist()),
                     optim_bytes=tuple(optim.tolist()), padded_param_bytes=pb * padded_shard,
                     padded_grad_bytes=gb * padded_shard, buffer_bytes=buffers,
                     peak_bytes=states + int(optim.max()) + buffers,
                     fsdp2_peak_bytes=states + int(full_optim.max()) + buffers)


def _buffer_bytes(units: list[UnitGeom], pb: int, gb: int) -> int:
    """Unsharded parameters and gradients FSDP2 holds at its peak (backward of the largest unit)."""
    blocks = [u for u in units if not u.is_root]
    largest = max((u.padded_numel for u in blocks), default=0)
    root = sum(u.padded_numel for u in units if u.is_root)
    kept = 0
    for u in blocks:
        if u.reshard_after_forward is False:
            kept += u.padded_numel
        elif is_int(u.reshard_after_forward):
            kept += ceil_div(u.padded_numel, int(u.reshard_after_forward))
    # current + prefetched unit (params), the current unit's unsharded grads and the
    # reduce-scatter input, the root (kept through forward and backward), kept units
    return pb * (2 * largest + root + kept) + gb * 2 * largest


# ---- partially sharded data parallelism (param_sharding = "replicated") ------------------------
def partial_comm_phases(model: CostModel, units: list[UnitGeom], cand: Candidate,
                        config: PlannerConfig) -> tuple[CommPhase, ...]:
    """The four exchanges of a partial plan per step (module docstring), in step order."""
    s, w = cand.shard_size, model.world_size
    pb, gb = config.param_bytes, config.grad_bytes
    shard, replicate = (0, s, 1), (0, w, s)
    numels = [u.padded_numel for u in units]  # == numel: nothing is padded
    slices = [ceil_div(n, s) for n in numels]
    phases = (
        comm_phase(model, "gradient reduce-scatter", "reduce_scatter", "shard", shard, [n * gb for n in numels]),
        comm_phase(model, "gradient reduce-scatter", "reduce_scatter", "replicate", replicate,
                   [c * gb for c in slices]),
        comm_phase(model, "parameter all-gather", "all_gather", "replicate", replicate, [c * pb for c in slices]),
        comm_phase(model, "parameter all-gather", "all_gather", "shard", shard, [n * pb for n in numels]),
    )
    return tuple(p for p in phases if p is not None)


def partial_owned(numel: int, shard_size: int, replicas: int) -> np.ndarray:
    """Elements of one unit each rank owns (index = global rank ``j·S + i``).

    The layout of padded flat collectives: node slice ``i`` is elements ``[i·c, (i+1)·c)`` of
    the unit (``c = ceil(n/S)``), and replica ``j`` owns ``[j·d, (j+1)·d)`` of it (``d =
    ceil(c/R) = ceil(n/W)``), clipped to the real elements. No rank owns more than ``d``; ranks
    at the padded end of a unit own fewer.
    """
    c = ceil_div(numel, shard_size)
    d = ceil_div(c, replicas)
    node = np.clip(numel - c * np.arange(shard_size, dtype=np.int64), 0, c)
    return np.clip(node[None, :] - d * np.arange(replicas, dtype=np.int64)[:, None], 0, d).reshape(-1)


def partial_rank_bytes(units: list[UnitGeom], cand: Candidate, world_size: int, config: PlannerConfig) -> RankBytes:
    """Per-rank bytes and peak of a partial plan (the formula of the module docstring)."""
    s = cand.shard_size
    replicas = world_size // s
    pb, gb, ob = config.param_bytes, config.grad_bytes, config.optim_state_bytes_per_param
    numels = [u.padded_numel for u in units]
    total = sum(numels)
    owned = np.zeros(world_size, dtype=np.int64)
    for n in numels:
        owned += partial_owned(n, s, replicas)
    slice_numel = sum(ceil_div(ceil_div(n, s), replicas) for n in numels)  # Σd: what each rank allocates
    root = sum(u.padded_numel for u in units if u.is_root)
    largest_block = max((u.padded_numel for u in units if not u.is_root), default=0)
    largest = max(numels, default=0)
    grads = gb * max(root + 2 * largest_block, 2 * root)
    comm = (gb + pb) * ceil_div(largest, s) + pb * largest
    buffers = grads + comm
    return RankBytes(param_bytes=(pb * total,) * world_size, grad_bytes=tuple((owned * gb).tolist()),
                     optim_bytes=tuple((owned * ob).tolist()), padded_param_bytes=pb * total,
                     padded_grad_bytes=gb * slice_numel, buffer_bytes=buffers,
                     peak_bytes=pb * total + (gb + ob) * slice_numel + buffers,
                     fsdp2_peak_bytes=(pb + gb + ob) * total)


def evaluate(model: CostModel, units: list[UnitGeom], cand: Candidate, config: PlannerConfig) -> Evaluation:
    if cand.param_sharding == "replicated":
        return Evaluation(candidate=cand, rank_bytes=partial_rank_bytes(units, cand, model.world_size, config),
                          comm=partial_comm_phases(model, units, cand, config))
    return Evaluation(candidate=cand, rank_bytes=rank_bytes(units, cand, model.world_size, config),
                      comm=comm_phases(model, units, cand, config))
