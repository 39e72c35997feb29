"""The environment variables of the emulator: ``CPDPKIT_TOPOLOGY`` and ``CPDPKIT_FAULTS``.

``cpdpkit launch --topology NAME|FILE`` sets it for the ranks torchrun starts;
:func:`cpdpkit.init_distributed` reads it (through :func:`topology_from_env`) to decide whether
to emulate. Its value is a preset name (``lan``, ``wan``, ``wan-variable``, ``cluster``) or a path
to a topology TOML file. Unset or empty means: no emulation. ``CPDPKIT_FAULTS`` (read by
:func:`faults_from_env`) names faults to inject (docs/contracts.md).

Both names are defined in the torch-free :mod:`cpdpkit._env` (importing this module runs
:mod:`cpdpkit.emulator`'s ``__init__``, which imports torch) and re-exported here.
"""

from __future__ import annotations

from cpdpkit._env import FAULTS_ENV, TOPOLOGY_ENV, faults_from_env, topology_from_env

__all__ = ["FAULTS_ENV", "TOPOLOGY_ENV", "faults_from_env", "topology_from_env"]
