"""The ``emu`` c10d backend: a ProcessGroup that delays each collective by its modeled time.

:class:`EmulatedProcessGroup` is a Python subclass of ``torch.distributed.ProcessGroup`` that
wraps a real process group (gloo for CPU tensors, nccl for CUDA tensors when available). Every
collective is forwarded unchanged to the real group, so the data results are bit-identical, and
its Work completes no earlier than the network model allows (see :mod:`cpdpkit.emulator._link`).

The emulator asks only the network model: each group holds the
:class:`~cpdpkit.network.NetworkGroup` of its global ranks (``topology.group(ranks)``; per
point-to-point peer, the pair's group) and takes both a collective's modeled time and the wire
bytes it counts from ``group.cost(op, num_bytes)``, so an emulated run counts exactly the bytes
a plan prices for the same collectives, whichever algorithm the model picked.

On a tier that varies (``latency_jitter_frac``, ``bandwidth_jitter_frac``) each collective takes
its *sampled* time, :func:`cpdpkit.network.sampled_time_s` for the draws
:func:`cpdpkit.network.jitter_draws` gives the key ``(jitter_seed, "<group name>:<sequence
number>")`` (:func:`jittered_s`): every rank of a group issues its collectives in the same order,
so all of them draw the same factors and finish together. A send and its recv draw from
``"<group name>:p2p:<src>-><dst>:<n>"``, ``n`` counting the messages from ``src`` to ``dst``
(sends and receives between two ranks match in order).

Both the Python method names (``dist.*`` calls them) and the names c10d's C++ trampoline looks
up (DDP's reducer, functional collectives) are overridden, and each group counts what went
through (:func:`cpdpkit.emulator.meter` reads the counts), so a test can prove that nothing
reached the real backend directly.

Every member of a group completes a collective at (the last member's arrival + its modeled
time), the members exchanging issue times on a side gloo group; collectives of different groups
that cross one shared uplink queue on it; injected faults (``EmulatorConfig.faults``) apply. See
:mod:`cpdpkit.emulator._sync` and :mod:`cpdpkit.emulator.faults`.

There is no module-level state: :func:`register_emulated_backend` binds its configuration into
the creator it registers, and the groups that creator makes share one :class:`EmulatorSession`.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from cpdpkit._values import refuse_nonfinite
from cpdpkit.emulator._counters import GroupCounters
from cpdpkit.emulator._link import EmulatedWork, Link
from cpdpkit.emulator._sync import GroupClock, UplinkBook
from cpdpkit.emulator.faults import FaultInjector
from cpdpkit.errors import DistributedSetupError
from cpdpkit.faults import FaultPlan
from cpdpkit.labels import emu_label, format_ranks
from cpdpkit.network import LOCAL_TIER, CollectiveCost, NetworkGroup, jitter_draws
from cpdpkit.topology import Topology, TopologySpec

__all__ = [
    "BACKEND_NAME",
    "EmulatorConfig",
    "EmulatorSession",
    "EmulatedProcessGroup",
    "register_emulated_backend",
    "jittered_s",
]

BACKEND_NAME = "emu"
# Collectives whose transfer (the model's bandwidth term) is shorter do not book shared uplinks.
_MIN_UPLINK_BOOKING_S = 1e-3


@dataclass(frozen=True, kw_only=True)
class EmulatorConfig:
    """What the ``emu`` backend models: a placed topology, the jitter seed and injected faults
    (``None``: the topology's own ``[faults]`` table, if any)."""

    topology: Topology
    jitter_seed: int = 0
    faults: FaultPlan | None = None

    def __post_init__(self) -> None:
        refuse_nonfinite(self, DistributedSetupError)
        if isinstance(self.topology, TopologySpec):
            raise DistributedSetupError(
                f"topology {self.topology.name!r} is not placed; call topology.place(world_size) first"
            )
        if not isinstance(self.topology, Topology):
            raise TypeError(f"topology = {self.topology!r} must be a cpdpkit.topology.Topology")
        if not isinstance(self.jitter_seed, int):
            raise TypeError(f"jitter_seed = {self.jitter_seed!r} must be an int")
        if self.faults is not None and not isinstance(self.faults, FaultPlan):
            raise TypeError(f"faults = {self.faults!r} must be a cpdpkit.faults.FaultPlan or None")

    @property
    def fault_plan(self) -> FaultPlan | None:
        """The faults to inject: ``faults``, else the topology's ``[faults]`` table (``None``: none)."""
        plan = self.faults if self.faults is not None else self.topology.faults
        return None if plan is None or plan.is_empty else plan


class EmulatorSession:
    """The groups made by one :func:`register_emulated_backend` call: its config, and a weak
    reference to each group with that group's counters (what :func:`cpdpkit.emulator.meter`
    reads). The registered creator and every group hold the session; it holds no group alive."""

    def __init__(self, config: EmulatorConfig) -> None:
        self.config = config
        self.faults: FaultInjector | None = None  # made with the first group (it knows this rank)
        self.started = False  # the members agreed on the start time (faults' origin)
        self._lock = threading.Lock()
        self._groups: weakref.WeakKeyDictionary[EmulatedProcessGroup, GroupCounters] = weakref.WeakKeyDictionary()

    def add(self, group: EmulatedProcessGroup, counters: GroupCounters) -> None:
        with self._lock:
            self._groups[group] = counters

    def counters(self) -> list[GroupCounters]:
        """The counters of every group of this session that is still alive."""
        with self._lock:
            return list(self._groups.values())


def register_emulated_backend(config: EmulatorConfig) -> None:
    """Register (or re-point) the ``emu`` backend; groups created from now on use ``config``.

    Each call starts a new :class:`EmulatorSession` (c10d replaces the previous creator).
    """
    if not isinstance(config, EmulatorConfig):
        raise TypeError(f"config = {config!r} must be a cpdpkit.emulator.EmulatorConfig")
    devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    creator = functools.partial(_create_emulated_group, EmulatorSession(config))
    dist.Backend.register_backend(BACKEND_NAME, creator, extended_api=True, devices=devices)


def session_of(group: Any) -> EmulatorSession | None:
    """The session of ``group`` if it is an emulated process group, else ``None``."""
    return group._session if isinstance(group, EmulatedProcessGroup) else None


def _create_emulated_group(session: EmulatorSession, opts: Any, backend_options: Any) -> EmulatedProcessGroup:
    """The creator c10d calls for every group made with backend ``emu`` (world and sub-groups)."""
    timeout = opts.timeout if isinstance(opts.timeout, timedelta) else timedelta(seconds=float(opts.timeout))
    ranks = list(opts.global_ranks_in_group) or list(range(opts.group_size))
    inner = ProcessGroup(opts.store, opts.group_rank, opts.group_size)
    gloo = dist.ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size, timeout)
    inner._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, gloo)
    backends = {"cpu": gloo}
    if torch.cuda.is_available() and dist.is_nccl_available():
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts._timeout = timeout
        nccl = dist.ProcessGroupNCCL(opts.store, opts.group_rank, opts.group_size, nccl_opts)
        inner._register_backend(torch.device("cuda"), ProcessGroup.BackendType.NCCL, nccl)
        inner._set_default_backend(ProcessGroup.BackendType.NCCL)
        backends["cuda"] = nccl
    else:
        inner._set_default_backend(ProcessGroup.BackendType.GLOO)
    plan = session.config.fault_plan
    if plan is not None and session.faults is None:
        session.faults = FaultInjector(plan, rank=ranks[opts.group_rank], topology=session.config.topology)
    return EmulatedProcessGroup(inner=inner, backends=backends, session=session, global_ranks=ranks,
                                timeout=timeout, group_id=str(opts.group_id), store=opts.store)


def jittered_s(network: NetworkGroup, costs: Sequence[CollectiveCost], *, seed: int, key: str) -> float:
    """The emulated seconds of ``costs`` (one collective, or a coalesced batch) on ``network``.

    Their summed :meth:`~cpdpkit.network.NetworkGroup.sampled_time_s` for the draws of
    ``(seed, key)``; every rank passes the same key for the same collective (module docstring),
    so all ranks get the same time. On a tier without jitter: the summed ``time_s``.
    """
    if network.tier is None or not network.tier.is_variable:
        return sum(c.time_s for c in costs)
    u_latency, u_bandwidth = jitter_draws(seed, key)
    return sum(network.sampled_time_s(c, u_latency, u_bandwidth) for c in costs)


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _flat(lists: Iterable[Iterable[torch.Tensor]]) -> list[torch.Tensor]:
    return [t for inner in lists for t in inner]


class EmulatedProcessGroup(ProcessGroup):
    """A process group whose collectives take the modeled time of their tier (see module doc)."""

    def __init__(self, *, inner: ProcessGroup, backends: dict[str, Any], session: EmulatorSession,
                 global_ranks: Sequence[int], timeout: timedelta, group_id: str, store: Any = None) -> None:
        super().__init__(inner.rank(), inner.size())
        self._inner = inner
        self._session = session
        self._global_ranks = list(global_ranks)
        self._timeout_s = timeout.total_seconds()
        self._group_name = group_id
        self._network = session.config.topology.group(self._global_ranks)
        self.tier_name = self._network.tier_name
        self._ranks_label = format_ranks(self._global_ranks)
        self._counters = GroupCounters(self.tier_name or LOCAL_TIER)
        self._link = Link(group_id, self._counters)
        self._p2p_links: dict[int, tuple[Link, NetworkGroup]] = {}  # peer (group rank) -> (link, pair's group)
        self._p2p_seq: dict[tuple[int, int], int] = {}  # (src, dst) global ranks -> messages so far
        self._seq_lock = threading.Lock()
        self._seq = 0
        self._coalescing: list[tuple[str, int]] | None = None
        self._faults = session.faults
        self._clock: GroupClock | None = None
        self._pending = threading.local()  # the arrival exchange _arrive started for this thread's op
        self._uplinks: UplinkBook | None = None
        if store is not None and len(self._global_ranks) > 1:
            self._clock = GroupClock(store=store, group_rank=inner.rank(), global_ranks=self._global_ranks,
                                     timeout=timeout, describe=self._describe)
            if self._network.uplinks:
                self._uplinks = UplinkBook(store=store, group_rank=inner.rank(), group_size=inner.size(),
                                           uplinks=self._network.uplinks, timeout=timeout, describe=self._describe)
            if self._faults is not None and not session.started:
                # the first group (the world) agrees on the origin of the faults' times
                self._faults.start_s = self._clock.agree_on_now()
                session.started = True
        session.add(self, self._counters)
        for device, backend in backends.items():
            btype = ProcessGroup.BackendType.NCCL if device == "cuda" else ProcessGroup.BackendType.GLOO
            self._register_backend(torch.device(device), btype, backend)
        self._set_default_backend(
            ProcessGroup.BackendType.NCCL if "cuda" in backends else ProcessGroup.BackendType.GLOO
        )

    # ---- identity ----------------------------------------------------------------------------
    @property
    def group_name(self) -> str:
        return self._group_name

    def _set_group_name(self, name: str) -> None:
        self._group_name = name
        super()._set_group_name(name)

    def getBackendName(self) -> str:  # noqa: N802 - the C++ trampoline's name
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    @property
    def global_ranks(self) -> list[int]:
        return list(self._global_ranks)

    @property
    def topology(self) -> Topology:
        return self._session.config.topology

    @property
    def network(self) -> NetworkGroup:
        """The network model of this group's ranks (what every collective here costs)."""
        return self._network

    def _describe(self, op: str) -> str:
        """How one-line errors name a collective: ``emu all_reduce on group world (ranks 0-1)``."""
        world = self.topology.world_size
        name = "world" if self._global_ranks == list(range(world or 0)) else repr(self._group_name)
        return f"emu {op} on group {name} (ranks {self._ranks_label})"

    # ---- the core: forward, then book the modeled link time ----------------------------------
    def _arrive(self, exchange: bool | None = None) -> float:
        """This rank's arrival at a collective (monotonic), after what injected faults do first;
        starts the arrival exchange (``exchange``; default: unless inside a coalesced batch, whose
        end exchanges once) before the real op, and leaves it for :meth:`_book` on this thread."""
        if self._faults is not None:
            self._faults.before_issue(self._timeout_s)
        issued_s = time.monotonic()
        if self._clock is not None and (self._coalescing is None if exchange is None else exchange):
            self._pending.arrival = self._clock.collective(issued_s)
        return issued_s

    def _schedule(self, network: NetworkGroup, seq: int, op: str,
                  uplinks: UplinkBook | None) -> Any:
        """The booking's schedule step (a link that is down, then the shared uplinks), or ``None``."""
        hold = self._faults.link_down(network, self._timeout_s, lambda: self._describe(op)) if self._faults else None
        if hold is None and uplinks is None:
            return None

        def schedule(start_s: float, modeled_s: float) -> tuple[float, float]:
            start_s, end_s = hold(start_s, modeled_s) if hold is not None else (start_s, start_s + modeled_s)
            return uplinks.schedule(seq, op)(start_s, end_s) if uplinks is not None else (start_s, end_s)

        return schedule

    def _next_seq(self) -> int:
        with self._seq_lock:
            self._seq += 1
            return self._seq

    def _emulate(self, op: str, model_op: str, num_bytes: int, inner_work: Any,
                 outputs: list[torch.Tensor], issued_s: float) -> EmulatedWork:
        """Count ``op`` and book ``model_op``'s modeled cost (``op`` is the label's kind) from
        ``issued_s``, the monotonic time the collective was handed to the real backend (gloo may
        run part of an "async" collective, e.g. its reduce_scatter, before returning the Work;
        that time overlaps the modeled link time instead of adding to it)."""
        seq = self._next_seq()
        self._counters.add_op(op)
        if self._coalescing is not None:
            self._coalescing.append((model_op, num_bytes))
            # time and bytes are charged once, when the coalesced batch ends
            return self._book(op, num_bytes, [], seq, inner_work, outputs, issued_s)
        costs = [self._network.cost(model_op, num_bytes)]
        return self._book(op, num_bytes, costs, seq, inner_work, outputs, issued_s)

    def _book(self, op: str, num_bytes: int, costs: list[CollectiveCost], seq: int, inner_work: Any,
              outputs: list[torch.Tensor], issued_s: float) -> EmulatedWork:
        """Count ``costs``' wire bytes and book their sampled time (one draw for the whole batch)."""
        for cost in costs:  # per tier as the model decomposes it (a hierarchical collective: each level's own)
            for tier, wire in (cost.tier_bytes or ((self.tier_name, cost.wire_bytes),)):
                self._counters.add_wire_bytes(tier, wire)
        key = f"{self._group_name}:{seq}"
        modeled_s = jittered_s(self._network, costs, seed=self._session.config.jitter_seed, key=key)
        if self._faults is not None and costs:
            modeled_s = self._faults.modeled_s(self._network, key, modeled_s)
        self._counters.add_modeled(self.tier_name, modeled_s)
        label = emu_label(op, num_bytes=num_bytes, tier=self.tier_name, ranks=self._ranks_label, modeled_s=modeled_s)
        # a coalesced batch's members (no costs) complete with the batch, which exchanges arrivals
        pending, self._pending.arrival = getattr(self._pending, "arrival", None), None
        arrival = functools.partial(pending, op) if pending is not None and costs else None
        # booking a shared uplink costs a few store round trips (~0.1 ms each): only transfers that
        # occupy it for longer are booked (the same decision on every member: it depends on the model only)
        uplinks = self._uplinks if sum(c.bandwidth_term_s for c in costs) >= _MIN_UPLINK_BOOKING_S else None
        schedule = self._schedule(self._network, seq, op, uplinks) if costs else None
        return self._link.book(label=label, modeled_s=modeled_s, inner=inner_work, outputs=outputs,
                               timeout_s=self._timeout_s, issued_s=issued_s, arrival=arrival, schedule=schedule)

    # ---- all-reduce --------------------------------------------------------------------------
    def allreduce(self, tensors: Any, opts: Any = None) -> EmulatedWork:
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        opts = opts if opts is not None else dist.AllreduceOptions()
        issued_s, work = self._arrive(), self._inner.allreduce(tensors, opts)
        return self._emulate("all_reduce", "all_reduce", _nbytes(tensors), work, list(tensors), issued_s)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> EmulatedWork:
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        issued_s, work = self._arrive(), self._inner.allreduce_coalesced(tensors, opts)
        return self._emulate("all_reduce", "all_reduce", _nbytes(tensors), work, list(tensors), issued_s)

    # ---- all-gather --------------------------------------------------------------------------
    def allgather(self, output_lists: Any, input_tensors: Any, opts: Any = None) -> EmulatedWork:
        opts = opts if opts is not None else dist.AllgatherOptions()
        issued_s, work = self._arrive(), self._inner.allgather(output_lists, input_tensors, opts)
        outs = _flat(output_lists)
        return self._emulate("all_gather", "all_gather", _nbytes(outs), work, outs, issued_s)

    def allgather_coalesced(self, output_lists: Any, input_tensors: Any, opts: Any = None) -> EmulatedWork:
        opts = opts if opts is not None else dist.AllgatherOptions()
        issued_s, work = self._arrive(), self._inner.allgather_coalesced(output_lists, input_tensors, opts)
        outs = _flat(output_lists)
        return self._emulate("all_gather", "all_gather", _nbytes(outs), work, outs, issued_s)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> EmulatedWork:  # noqa: A002
        opts = opts if opts is not None else dist.AllgatherOptions()
        issued_s, work = self._arrive(), self._inner.all_gather_single(output, input, opts)
        return self._emulate("all_gather", "all_gather", _nbytes([output]), work, [output], issued_s)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> EmulatedWork:
        opts = opts if opts is not None else dist.AllgatherOptions()
        issued_s, work = self._arrive(), self._inner.all_gather_single_coalesced(outputs, inputs, opts)
        return self._emulate("all_gather", "all_gather", _nbytes(outputs), work, list(outputs), issued_s)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    # ---- reduce-scatter ----------------------------------------------------------------------
    def reduce_scatter(self, outputs: Any, input_lists: Any, opts: Any = None) -> EmulatedWork:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        issued_s, work = self._arrive(), self._inner.reduce_scatter(outputs, input_lists, opts)
        return self._emulate("reduce_scatter", "reduce_scatter", _nbytes(_flat(input_lists)), work, list(outputs),
                             issued_s)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> EmulatedWork:  # noqa: A002
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        issued_s, work = self._arrive(), self._inner.reduce_scatter_single(output, input, opts)
        return self._emulate("reduce_scatter", "reduce_scatter", _nbytes([input]), work, [output], issued_s)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> EmulatedWork:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        issued_s, work = self._arrive(), self._inner.reduce_scatter_single_coalesced(outputs, inputs, opts)
        return self._emulate("reduce_scatter", "reduce_scatter", _nbytes(inputs), work, list(outputs), issued_s)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # ---- broadcast, barrier, all-to-all --------------------------------------------------------
    def broadcast(self, tensors: Any, opts: Any = None) -> EmulatedWork:
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        opts = opts if opts is not None else dist.BroadcastOptions()
        issued_s, work = self._arrive(), self._inner.broadcast(tensors, opts)
        return self._emulate("broadcast", "broadcast", _nbytes(tensors), work, list(tensors), issued_s)

    def barrier(self, opts: Any = None) -> EmulatedWork:
        opts = opts if opts is not None else dist.BarrierOptions()
        issued_s, work = self._arrive(), self._inner.barrier(opts)
        return self._emulate("barrier", "barrier", 0, work, [], issued_s)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],  # noqa: A002
                          input_split_sizes: list[int], opts: Any = None) -> EmulatedWork:
        opts = opts if opts is not None else dist.AllToAllOptions()
        issued_s = self._arrive()
        work = self._inner.all_to_all_single(output, input, output_split_sizes, input_split_sizes, opts)
        return self._emulate("all_to_all", "all_to_all", _nbytes([input]), work, [output], issued_s)

    alltoall_base = all_to_all_single

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> EmulatedWork:
        opts = opts if opts is not None else dist.AllToAllOptions()
        issued_s, work = self._arrive(), self._inner.alltoall(outputs, inputs, opts)
        return self._emulate("all_to_all", "all_to_all", _nbytes(inputs), work, list(outputs), issued_s)

    # ---- rooted collectives (modeled with the nearest symmetric formula, labelled "other") ----
    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> EmulatedWork:
        opts = opts if opts is not None else dist.ReduceOptions()
        issued_s, work = self._arrive(), self._inner.reduce(tensors, opts)
        return self._emulate("other", "broadcast", _nbytes(tensors), work, list(tensors), issued_s)

    def gather(self, outputs: Any, inputs: list[torch.Tensor], opts: Any = None) -> EmulatedWork:
        opts = opts if opts is not None else dist.GatherOptions()
        issued_s, work = self._arrive(), self._inner.gather(outputs, inputs, opts)
        return self._emulate("other", "all_gather", _nbytes(inputs) * self.size(), work, _flat(outputs), issued_s)

    def scatter(self, outputs: list[torch.Tensor], inputs: Any, opts: Any = None) -> EmulatedWork:
        opts = opts if opts is not None else dist.ScatterOptions()
        issued_s, work = self._arrive(), self._inner.scatter(outputs, inputs, opts)
        return self._emulate("other", "all_gather", _nbytes(outputs) * self.size(), work, list(outputs), issued_s)

    # ---- point to point ------------------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> EmulatedWork:
        issued_s, work = self._arrive(exchange=False), self._inner.send(tensors, dst, tag)
        return self._p2p(tensors, dst, work, issued_s, sending=True, tag=tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> EmulatedWork:
        issued_s, work = self._arrive(exchange=False), self._inner.recv(tensors, src, tag)
        return self._p2p(tensors, src, work, issued_s, sending=False, tag=tag)

    def _p2p(self, tensors: list[torch.Tensor], peer: int, work: Any, issued_s: float, *,
             sending: bool, tag: int = 0) -> EmulatedWork:
        """Book a send or recv on the link to ``peer``, priced by the pair's network group.

        The sender counts the wire bytes (a recv sends nothing). Both sides draw the jitter of
        the ``n``-th message from ``src`` to ``dst`` (module docstring), so they sample one time.
        """
        me, other = self._global_ranks[self.rank()], self._global_ranks[peer]
        route = self._p2p_links.get(peer)
        if route is None:
            # Point-to-point traffic has its own link per peer direction, not the group's timeline.
            route = self._p2p_links.setdefault(
                peer, (Link(f"{self._group_name}-p2p-{me}-{other}", self._counters), self.topology.group((me, other))))
        link, network = route
        num_bytes = _nbytes(tensors)
        cost = network.cost("send_recv", num_bytes)
        direction = (me, other) if sending else (other, me)
        with self._seq_lock:
            n = self._p2p_seq[direction] = self._p2p_seq.get(direction, 0) + 1
        key = f"{self._group_name}:p2p:{direction[0]}->{direction[1]}:{n}"
        modeled_s = jittered_s(network, [cost], seed=self._session.config.jitter_seed, key=key)
        if self._faults is not None:
            modeled_s = self._faults.modeled_s(network, key, modeled_s)
        self._counters.add_op("send_recv")
        self._counters.add_modeled(network.tier_name, modeled_s)
        if sending:
            self._counters.add_wire_bytes(network.tier_name, cost.wire_bytes)
        label = emu_label("send_recv", num_bytes=num_bytes, tier=network.tier_name, ranks=format_ranks(network.ranks),
                          modeled_s=modeled_s)
        arrival = None
        if self._clock is not None:  # a recv completes at max(send issue, recv issue) + transfer
            arrival = (self._clock.send(issued_s, peer, tag, "send_recv") if sending
                       else self._clock.recv(issued_s, peer, tag, "send_recv"))
        return link.book(label=label, modeled_s=modeled_s, inner=work, outputs=list(tensors),
                         timeout_s=self._timeout_s, issued_s=issued_s, arrival=arrival,
                         schedule=self._schedule(network, n, "send_recv", None))

    # ---- coalescing (dist._coalescing_manager) -------------------------------------------------
    def _start_coalescing(self, device: torch.device) -> None:
        self._inner._start_coalescing(device)
        self._coalescing = []

    start_coalescing = _start_coalescing

    def _end_coalescing(self, device: torch.device) -> EmulatedWork:
        """Charge the batch once: one collective of the summed bytes when every op is of one
        kind (as a fused launch), else the sum of each op's own cost (labelled ``other``)."""
        issued_s, work = self._arrive(exchange=True), self._inner._end_coalescing(device)
        batch, self._coalescing = self._coalescing or [], None
        seq = self._next_seq()
        total = sum(n for _, n in batch)
        kinds = {op for op, _ in batch}
        if len(kinds) == 1:
            cost = self._network.cost(next(iter(kinds)), total)
            return self._book(cost.op, total, [cost], seq, work, [], issued_s)
        return self._book("other", total, [self._network.cost(op, n) for op, n in batch], seq, work, [], issued_s)

    end_coalescing = _end_coalescing

    # ---- lifecycle -----------------------------------------------------------------------------
    def shutdown(self) -> None:
        for link in (self._link, *(link for link, _ in self._p2p_links.values())):
            link.close()
        if self._clock is not None:
            self._clock.shutdown()
            self._clock = None
        self._inner.shutdown()

    def abort(self) -> None:
        self._inner.abort()

    def __repr__(self) -> str:
        return f"EmulatedProcessGroup(ranks={self._ranks_label}, tier={self.tier_name}, name={self._group_name!r})"
