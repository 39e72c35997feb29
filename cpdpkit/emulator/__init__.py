"""Network emulation for torch.distributed: the ``emu`` c10d backend and ``init_distributed``.

Set ``CPDPKIT_TOPOLOGY`` (or pass ``topology=``) and every collective of every process group
takes the time the :mod:`cpdpkit.topology` model gives its tier, while the data still moves
through gloo (CPU) or nccl (CUDA) and stays bit-identical.
"""

from __future__ import annotations

from cpdpkit.emulator._link import blocked_s_by_thread
from cpdpkit.emulator.backend import (
    BACKEND_NAME,
    EmulatedProcessGroup,
    EmulatorConfig,
    emulated_bytes_by_tier,
    emulated_op_counts,
    register_emulated_backend,
)
from cpdpkit.emulator.env import TOPOLOGY_ENV, topology_from_env
from cpdpkit.emulator.init import DistributedInfo, init_distributed

__all__ = [
    "BACKEND_NAME",
    "TOPOLOGY_ENV",
    "DistributedInfo",
    "EmulatedProcessGroup",
    "EmulatorConfig",
    "blocked_s_by_thread",
    "emulated_bytes_by_tier",
    "emulated_op_counts",
    "init_distributed",
    "register_emulated_backend",
    "topology_from_env",
]
