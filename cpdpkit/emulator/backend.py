"""The ``emu`` c10d backend: a ProcessGroup that delays each collective by its modeled time.

:class:`EmulatedProcessGroup` is a Python subclass of ``torch.distributed.ProcessGroup`` that
wraps a real process group (gloo for CPU tensors, nccl for CUDA tensors when available). Every
collective is forwarded unchanged to the real group, so the data results are bit-identical, and
its Work completes no earlier than :meth:`cpdpkit.topology.Topology.collective_time_s` for the
group's global ranks allows (see :mod:`cpdpkit.emulator._link`).

Both the Python method names (``dist.*`` calls them) and the names c10d's C++ trampoline looks
up (DDP's reducer, functional collectives) are overridden; :attr:`EmulatedProcessGroup.op_counts`
counts what went through, so a test can prove that nothing reached the real backend directly.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from cpdpkit.emulator._link import EmulatedWork, Link
from cpdpkit.errors import DistributedSetupError
from cpdpkit.topology import Tier, Topology, alpha_beta_time_s, format_ranks

__all__ = [
    "BACKEND_NAME",
    "EmulatorConfig",
    "EmulatedProcessGroup",
    "register_emulated_backend",
    "emulated_op_counts",
    "emulated_bytes_by_tier",
    "jittered_s",
]

BACKEND_NAME = "emu"

_state_lock = threading.Lock()
_config: EmulatorConfig | None = None
_total_counts: Counter[str] = Counter()
_total_tier_bytes: dict[str, float] = {}


@dataclass(frozen=True, kw_only=True)
class EmulatorConfig:
    """What the ``emu`` backend models: a placed topology and the jitter seed."""

    topology: Topology
    jitter_seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.topology, Topology):
            raise TypeError(f"topology = {self.topology!r} must be a cpdpkit.topology.Topology")
        if not self.topology.is_placed:
            raise DistributedSetupError(
                f"topology {self.topology.name!r} is not placed; call topology.place(world_size) first"
            )
        if not isinstance(self.jitter_seed, int):
            raise TypeError(f"jitter_seed = {self.jitter_seed!r} must be an int")


def register_emulated_backend(config: EmulatorConfig) -> None:
    """Register (or re-point) the ``emu`` backend; later groups use ``config``'s topology."""
    global _config
    with _state_lock:
        _config = config
    devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    dist.Backend.register_backend(BACKEND_NAME, _create_emulated_group, extended_api=True, devices=devices)


def emulated_op_counts() -> dict[str, int]:
    """Collectives issued through emulated groups in this process, by canonical op."""
    with _state_lock:
        return dict(_total_counts)


def emulated_bytes_by_tier() -> dict[str, int]:
    """Bytes this process sent through emulated group collectives, by the group's tier, counted
    with ring-algorithm volumes whatever algorithm the time model picked: all_reduce 2(p-1)/p·n,
    all_gather / reduce_scatter / all_to_all (p-1)/p·n (n = gathered output / unreduced input),
    broadcast n, barrier 0. Point-to-point send/recv is not counted."""
    with _state_lock:
        return {k: int(v) for k, v in _total_tier_bytes.items()}


def _wire_bytes(op: str, num_bytes: int, p: int) -> float:
    if p <= 1 or op == "barrier":
        return 0.0
    if op == "all_reduce":
        return 2.0 * (p - 1) / p * num_bytes
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (p - 1) / p * num_bytes
    return float(num_bytes)


def _create_emulated_group(opts: Any, backend_options: Any) -> EmulatedProcessGroup:
    """The creator c10d calls for every group made with backend ``emu`` (world and sub-groups)."""
    with _state_lock:
        config = _config
    if config is None:
        raise DistributedSetupError(
            "backend 'emu' has no topology; call cpdpkit.init_distributed() or register_emulated_backend() first"
        )
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
    return EmulatedProcessGroup(
        inner=inner, backends=backends, config=config, global_ranks=ranks, store=opts.store,
        timeout=timeout, group_id=str(opts.group_id),
    )


def jittered_s(base_s: float, jitter_frac: float, *, seed: int, key: str) -> float:
    """``base_s`` times a factor in [1 - jitter_frac, 1 + jitter_frac] drawn from (seed, key).

    Every rank of a group uses the same key for the same collective (group name and sequence
    number), so all ranks draw the same factor and finish together.
    """
    if jitter_frac <= 0 or base_s <= 0:
        return base_s
    rng = random.Random(f"{seed}:{key}")
    return base_s * (1.0 + jitter_frac * (2.0 * rng.random() - 1.0))


def _base_s(op: str, num_bytes: int, tier: Tier | None, p: int) -> float:
    """Unjittered modeled seconds of ``op`` over ``p`` ranks whose slowest tier is ``tier``
    (what :meth:`Topology.collective_time_s` gives, without re-deriving the tier every call)."""
    if tier is None:
        return 0.0
    return alpha_beta_time_s(op, num_bytes, p, tier.latency_s, tier.bandwidth_bytes_per_s)[1]


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _flat(lists: Iterable[Iterable[torch.Tensor]]) -> list[torch.Tensor]:
    return [t for inner in lists for t in inner]


class EmulatedProcessGroup(ProcessGroup):
    """A process group whose collectives take the modeled time of their tier (see module doc)."""

    def __init__(self, *, inner: ProcessGroup, backends: dict[str, Any], config: EmulatorConfig,
                 global_ranks: Sequence[int], store: Any, timeout: timedelta, group_id: str) -> None:
        super().__init__(inner.rank(), inner.size())
        self._inner = inner
        self._config = config
        self._global_ranks = list(global_ranks)
        self._timeout_s = timeout.total_seconds()
        self._group_name = group_id
        self._link = Link(group_id)
        self._p2p_links: dict[int, tuple[Link, Tier | None, str]] = {}  # peer -> (link, tier, ranks label)
        self._seq = 0
        self.op_counts: Counter[str] = Counter()
        self._coalescing: list[tuple[str, int]] | None = None
        # The group's tier never changes: derive it once, not on every collective.
        self._tier = config.topology.tier_of(self._global_ranks)
        self.tier_name = self._tier.name if self._tier is not None else "LOCAL"
        self._jitter_frac = self._tier.jitter_frac if self._tier is not None else 0.0
        self._ranks_label = format_ranks(self._global_ranks)
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
        return self._config.topology

    # ---- the core: forward, then book the modeled link time ----------------------------------
    def _modeled_s(self, op: str, num_bytes: int, seq: int) -> float:
        base_s = _base_s(op, num_bytes, self._tier, len(self._global_ranks))
        return jittered_s(base_s, self._jitter_frac, seed=self._config.jitter_seed, key=f"{self._group_name}:{seq}")

    def _emulate(self, op: str, model_op: str, num_bytes: int, inner_work: Any,
                 outputs: list[torch.Tensor], *, count: bool = True) -> EmulatedWork:
        with _state_lock:  # one lock for the sequence number, this group's and the process's counters
            self._seq += 1
            seq = self._seq
            if count:
                self.op_counts[op] += 1
                _total_counts[op] += 1
                _total_tier_bytes[self.tier_name] = _total_tier_bytes.get(self.tier_name, 0.0) + _wire_bytes(
                    model_op, num_bytes, len(self._global_ranks))
        if self._coalescing is not None:
            self._coalescing.append((model_op, num_bytes))
            modeled_s = 0.0  # charged once, when the coalesced batch ends
        else:
            modeled_s = self._modeled_s(model_op, num_bytes, seq)
        label = (
            f"cpdpkit::emu::{op}[bytes={num_bytes},tier={self.tier_name},"
            f"ranks={self._ranks_label},modeled_us={modeled_s * 1e6:.1f}]"
        )
        return self._link.book(label=label, modeled_s=modeled_s, inner=inner_work, outputs=outputs,
                               timeout_s=self._timeout_s)

    # ---- all-reduce --------------------------------------------------------------------------
    def allreduce(self, tensors: Any, opts: Any = None) -> EmulatedWork:
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        opts = opts if opts is not None else dist.AllreduceOptions()
        work = self._inner.allreduce(tensors, opts)
        return self._emulate("all_reduce", "all_reduce", _nbytes(tensors), work, list(tensors))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> EmulatedWork:
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        work = self._inner.allreduce_coalesced(tensors, opts)
        return self._emulate("all_reduce", "all_reduce", _nbytes(tensors), work, list(tensors))

    # ---- all-gather --------------------------------------------------------------------------
    def allgather(self, output_lists: Any, input_tensors: Any, opts: Any = None) -> EmulatedWork:
        opts = opts if opts is not None else dist.AllgatherOptions()
        work = self._inner.allgather(output_lists, input_tensors, opts)
        outs = _flat(output_lists)
        return self._emulate("all_gather", "all_gather", _nbytes(outs), work, outs)

    def allgather_coalesced(self, output_lists: Any, input_tensors: Any, opts: Any = None) -> EmulatedWork:
        opts = opts if opts is not None else dist.AllgatherOptions()
        work = self._inner.allgather_coalesced(output_lists, input_tensors, opts)
        outs = _flat(output_lists)
        return self._emulate("all_gather", "all_gather", _nbytes(outs), work, outs)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> EmulatedWork:  # noqa: A002
        opts = opts if opts is not None else dist.AllgatherOptions()
        work = self._inner.all_gather_single(output, input, opts)
        return self._emulate("all_gather", "all_gather", _nbytes([output]), work, [output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> EmulatedWork:
        opts = opts if opts is not None else dist.AllgatherOptions()
        work = self._inner.all_gather_single_coalesced(outputs, inputs, opts)
        return self._emulate("all_gather", "all_gather", _nbytes(outputs), work, list(outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    # ---- reduce-scatter ----------------------------------------------------------------------
    def reduce_scatter(self, outputs: Any, input_lists: Any, opts: Any = None) -> EmulatedWork:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        work = self._inner.reduce_scatter(outputs, input_lists, opts)
        return self._emulate("reduce_scatter", "reduce_scatter", _nbytes(_flat(input_lists)), work, list(outputs))

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> EmulatedWork:  # noqa: A002
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        work = self._inner.reduce_scatter_single(output, input, opts)
        return self._emulate("reduce_scatter", "reduce_scatter", _nbytes([input]), work, [output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> EmulatedWork:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        work = self._inner.reduce_scatter_single_coalesced(outputs, inputs, opts)
        return self._emulate("reduce_scatter", "reduce_scatter", _nbytes(inputs), work, list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # ---- broadcast, barrier, all-to-all --------------------------------------------------------
    def broadcast(self, tensors: Any, opts: Any = None) -> EmulatedWork:
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        opts = opts if opts is not None else dist.BroadcastOptions()
        work = self._inner.broadcast(tensors, opts)
        return self._emulate("broadcast", "broadcast", _nbytes(tensors), work, list(tensors))

    def barrier(self, opts: Any = None) -> EmulatedWork:
        opts = opts if opts is not None else dist.BarrierOptions()
        work = self._inner.barrier(opts)
        return self._emulate("barrier", "barrier", 0, work, [])

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],  # noqa: A002
                          input_split_sizes: list[int], opts: Any = None) -> EmulatedWork:
        opts = opts if opts is not None else dist.AllToAllOptions()
        work = self._inner.all_to_all_single(output, input, output_split_sizes, input_split_sizes, opts)
        return self._emulate("all_to_all", "all_to_all", _nbytes([input]), work, [output])

    alltoall_base = all_to_all_single

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> EmulatedWork:
        opts = opts if opts is not None else dist.AllToAllOptions()
        work = self._inner.alltoall(outputs, inputs, opts)
        return self._emulate("all_to_all", "all_to_all", _nbytes(inputs), work, list(outputs))

    # ---- rooted collectives (modeled with the nearest symmetric formula, labelled "other") ----
    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> EmulatedWork:
        opts = opts if opts is not None else dist.ReduceOptions()
        work = self._inner.reduce(tensors, opts)
        return self._emulate("other", "broadcast", _nbytes(tensors), work, list(tensors))

    def gather(self, outputs: Any, inputs: list[torch.Tensor], opts: Any = None) -> EmulatedWork:
        opts = opts if opts is not None else dist.GatherOptions()
        work = self._inner.gather(outputs, inputs, opts)
        return self._emulate("other", "all_gather", _nbytes(inputs) * self.size(), work, _flat(outputs))

    def scatter(self, outputs: list[torch.Tensor], inputs: Any, opts: Any = None) -> EmulatedWork:
        opts = opts if opts is not None else dist.ScatterOptions()
        work = self._inner.scatter(outputs, inputs, opts)
        return self._emulate("other", "all_gather", _nbytes(outputs) * self.size(), work, list(outputs))

    # ---- point to point ------------------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> EmulatedWork:
        work = self._inner.send(tensors, dst, tag)
        return self._p2p(tensors, dst, work)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> EmulatedWork:
        work = self._inner.recv(tensors, src, tag)
        return self._p2p(tensors, src, work)

    def _p2p(self, tensors: list[torch.Tensor], peer: int, work: Any) -> EmulatedWork:
        route = self._p2p_links.get(peer)
        if route is None:
            # Point-to-point traffic has its own link per peer direction, not the group's timeline.
            pair = [self._global_ranks[self.rank()], self._global_ranks[peer]]
            route = self._p2p_links.setdefault(peer, (Link(f"{self._group_name}-p2p-{pair[0]}-{pair[1]}"),
                                                      self._config.topology.tier_of(pair), format_ranks(pair)))
        link, tier, ranks_label = route
        num_bytes = _nbytes(tensors)
        modeled_s = _base_s("send_recv", num_bytes, tier, 2)
        with _state_lock:
            self.op_counts["send_recv"] += 1
            _total_counts["send_recv"] += 1
        label = (
            f"cpdpkit::emu::send_recv[bytes={num_bytes},tier={tier.name if tier else 'LOCAL'},"
            f"ranks={ranks_label},modeled_us={modeled_s * 1e6:.1f}]"
        )
        return link.book(label=label, modeled_s=modeled_s, inner=work, outputs=list(tensors),
                         timeout_s=self._timeout_s)

    # ---- coalescing (dist._coalescing_manager) -------------------------------------------------
    def _start_coalescing(self, device: torch.device) -> None:
        self._inner._start_coalescing(device)
        self._coalescing = []

    start_coalescing = _start_coalescing

    def _end_coalescing(self, device: torch.device) -> EmulatedWork:
        work = self._inner._end_coalescing(device)
        batch, self._coalescing = self._coalescing or [], None
        kinds = {op for op, _ in batch}
        model_op = next(iter(kinds)) if len(kinds) == 1 else "all_reduce"
        label_op = model_op if len(kinds) == 1 else "other"
        # the batch's ops were counted one by one; this booking only charges the link time
        return self._emulate(label_op, model_op, sum(b for _, b in batch), work, [], count=False)

    end_coalescing = _end_coalescing

    # ---- lifecycle -----------------------------------------------------------------------------
    def shutdown(self) -> None:
        for link in (self._link, *(link for link, _, _ in self._p2p_links.values())):
            link.close()
        self._inner.shutdown()

    def abort(self) -> None:
        self._inner.abort()

    def __repr__(self) -> str:
        return f"EmulatedProcessGroup(ranks={self._ranks_label}, tier={self.tier_name}, name={self._group_name!r})"
