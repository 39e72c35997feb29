"""Network emulation for torch.distributed: the ``emu`` c10d backend and ``init_distributed``.

Set ``CPDPKIT_TOPOLOGY`` (or pass ``topology=``) and every collective of every process group
takes the time the :mod:`cpdpkit.network` model gives it on its tier (on a tier that varies, its
own seeded sample, the same on every rank of the group), while the data still moves through gloo
(CPU) or nccl (CUDA) and stays bit-identical. ``with meter() as m:`` reports what a block issued:
``m.op_counts``, ``m.bytes_by_tier`` (the model's wire bytes, the same numbers a plan prices),
``m.modeled_s_by_tier`` (the modeled seconds booked) and ``m.blocked_s``.
"""

from __future__ import annotations

from cpdpkit.emulator.backend import (
    BACKEND_NAME,
    EmulatedProcessGroup,
    EmulatorConfig,
    register_emulated_backend,
)
from cpdpkit.emulator.env import FAULTS_ENV, TOPOLOGY_ENV, faults_from_env, topology_from_env
from cpdpkit.emulator.faults import LinkDownError, PeerLostError
from cpdpkit.emulator.init import DistributedInfo, init_distributed
from cpdpkit.emulator.metering import Meter, meter

__all__ = [
    "BACKEND_NAME",
    "FAULTS_ENV",
    "TOPOLOGY_ENV",
    "DistributedInfo",
    "EmulatedProcessGroup",
    "EmulatorConfig",
    "LinkDownError",
    "Meter",
    "PeerLostError",
    "faults_from_env",
    "init_distributed",
    "meter",
    "register_emulated_backend",
    "topology_from_env",
]
