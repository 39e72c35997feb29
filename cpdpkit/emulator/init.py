"""``cpdpkit.init_distributed``: one call that starts the process group a launched rank needs.

It picks the backend for the device (nccl with CUDA, else gloo) and, when a topology is given
or named by ``CPDPKIT_TOPOLOGY``, the emulated ``emu`` backend that wraps it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from cpdpkit.emulator.backend import BACKEND_NAME, EmulatorConfig, register_emulated_backend
from cpdpkit.emulator.env import FAULTS_ENV, TOPOLOGY_ENV, faults_from_env, topology_from_env
from cpdpkit.errors import DistributedSetupError
from cpdpkit.faults import FaultPlan
from cpdpkit.topology import Topology, TopologySpec, resolve_topology

__all__ = ["DistributedInfo", "init_distributed"]

DEFAULT_TIMEOUT = timedelta(minutes=5)


@dataclass(frozen=True, kw_only=True)
class DistributedInfo:
    """What :func:`init_distributed` set up."""

    rank: int
    world_size: int
    local_rank: int
    device: str
    backend: str
    topology: Topology | None

    @property
    def emulated(self) -> bool:
        return self.topology is not None

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["topology"] = self.topology.to_dict() if self.topology is not None else None
        return out


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise DistributedSetupError(
            f"{name} = {value!r} is not an integer; launch with torchrun or cpdpkit launch") from None


def init_distributed(
    *,
    backend: str | None = None,
    timeout: timedelta = DEFAULT_TIMEOUT,
    topology: Topology | TopologySpec | str | None = None,
    jitter_seed: int = 0,
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    faults: FaultPlan | None = None,
    store: dist.Store | None = None,
) -> DistributedInfo:
    """Start the default process group; emulate ``topology`` (or ``$CPDPKIT_TOPOLOGY``) if set.

    ``topology``: a preset name or TOML path, a :class:`~cpdpkit.topology.TopologySpec`, or a
    :class:`~cpdpkit.topology.Topology` (checked against the world size); resolved and placed here,
    once, and passed on placed (``DistributedInfo.topology``).

    ``backend=None`` chooses ``emu`` when a topology is known, else nccl (CUDA) or gloo.
    ``backend="gloo"``/``"nccl"`` never emulates. ``rank``/``world_size``/``init_method`` default
    to torchrun's environment (``env://``); ``store`` (instead of ``init_method``) rendezvous through a
    c10d store of the caller's (e.g. torchrun's under a prefix of its own, for several jobs one after
    the other in one launch). Calling it again returns the existing setup.
    ``faults`` (default: ``$CPDPKIT_FAULTS``, else the topology's ``[faults]`` table) are injected
    into the emulated groups (:mod:`cpdpkit.emulator.faults`).
    """
    world_size = world_size if world_size is not None else _env_int("WORLD_SIZE", 1)
    rank = rank if rank is not None else _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", rank)
    placed: Topology | None = None
    if isinstance(topology, str):
        placed = resolve_topology(topology, world_size=world_size)
    elif topology is None and backend in (None, BACKEND_NAME):
        placed = topology_from_env(world_size=world_size)
    elif topology is not None:
        placed = topology.place(world_size)
    if backend == BACKEND_NAME and placed is None:
        raise DistributedSetupError(
            f"backend 'emu' needs a topology; set {TOPOLOGY_ENV}=wan (or a TOML path) or pass topology="
        )
    real = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if backend not in (None, BACKEND_NAME, "gloo", "nccl"):
        raise DistributedSetupError(f"backend = {backend!r} is not supported; use None, 'emu', 'gloo' or 'nccl'")
    chosen = BACKEND_NAME if placed is not None and backend in (None, BACKEND_NAME) else (backend or real)
    device = "cpu"
    if real == "nccl" and chosen != "gloo":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = f"cuda:{torch.cuda.current_device()}"
    if chosen != BACKEND_NAME:
        placed = None
        if faults is not None or faults_from_env() is not None:
            raise DistributedSetupError(
                f"faults are injected by the emulated backend only, but backend = {chosen!r}; set "
                f"{TOPOLOGY_ENV} (or pass topology=) to emulate, or unset {FAULTS_ENV} / faults=")
    if not dist.is_initialized():
        if placed is not None:  # chosen is BACKEND_NAME
            faults = faults if faults is not None else faults_from_env()
            register_emulated_backend(EmulatorConfig(topology=placed, jitter_seed=jitter_seed, faults=faults))
        rendezvous: dict[str, Any] = {"store": store} if store is not None else {"init_method": init_method or "env://"}
        dist.init_process_group(backend=chosen, rank=rank, world_size=world_size, timeout=timeout, **rendezvous)
    return DistributedInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
                           device=device, backend=chosen, topology=placed)
