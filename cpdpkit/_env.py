"""The one environment variable of the emulator: ``CPDPKIT_TOPOLOGY`` (its name and its parser).

``cpdpkit launch --topology NAME|FILE`` sets it for the ranks torchrun starts;
:func:`cpdpkit.init_distributed` reads it here (and nowhere else) to decide whether to emulate.
Its value is a preset name (``lan``, ``wan``, ``wan-variable``, ``cluster``) or a path to a topology TOML file.
Unset or empty means: no emulation.

It lives outside :mod:`cpdpkit.emulator` because importing any sub-module of that package first
runs the package's ``__init__``, which imports torch; the launcher (and so the CLI) needs the
variable's name without paying for torch. :mod:`cpdpkit.emulator.env` re-exports both names.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from cpdpkit.topology import Topology, resolve_topology

__all__ = ["TOPOLOGY_ENV", "topology_from_env"]

TOPOLOGY_ENV = "CPDPKIT_TOPOLOGY"


def topology_from_env(environ: Mapping[str, str] | None = None, *, world_size: int | None = None) -> Topology | None:
    """The topology named by ``CPDPKIT_TOPOLOGY`` (placed on ``world_size`` if given), or ``None``."""
    env = os.environ if environ is None else environ
    spec = env.get(TOPOLOGY_ENV, "").strip()
    if not spec:
        return None
    return resolve_topology(spec, world_size=world_size)
