"""The environment variables of the emulator: ``CPDPKIT_TOPOLOGY`` and ``CPDPKIT_FAULTS`` (names, parsers).

``cpdpkit launch --topology NAME|FILE`` sets it for the ranks torchrun starts;
:func:`cpdpkit.init_distributed` reads it here (and nowhere else) to decide whether to emulate.
Its value is a preset name (``lan``, ``wan``, ``wan-variable``, ``cluster``) or a path to a topology TOML file.
Unset or empty means: no emulation.

``CPDPKIT_FAULTS`` names faults to inject (:class:`cpdpkit.faults.FaultPlan`): a TOML file
(its ``[faults]`` table, or the file's top-level keys) or the one-line form
``seed=1;latency_spikes:probability=0.1,extra_s=0.05;dead_peer:rank=1,at_collective=20``. It
overrides the topology's own ``[faults]`` table; unset or empty: the topology's (or none).

It lives outside :mod:`cpdpkit.emulator` because importing any sub-module of that package first
runs the package's ``__init__``, which imports torch; the launcher (and so the CLI) needs the
variable's name without paying for torch. :mod:`cpdpkit.emulator.env` re-exports both names.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping

from cpdpkit._text_file import read_text_file
from cpdpkit.errors import TopologyError
from cpdpkit.faults import FaultPlan
from cpdpkit.topology import Topology, resolve_topology

__all__ = ["FAULTS_ENV", "TOPOLOGY_ENV", "faults_from_env", "topology_from_env"]

TOPOLOGY_ENV = "CPDPKIT_TOPOLOGY"
FAULTS_ENV = "CPDPKIT_FAULTS"
_MAX_FAULTS_BYTES = 1 << 20  # a [faults] table is a few lines


def topology_from_env(environ: Mapping[str, str] | None = None, *, world_size: int) -> Topology | None:
    """The topology named by ``CPDPKIT_TOPOLOGY``, placed on ``world_size``, or ``None``."""
    env = os.environ if environ is None else environ
    spec = env.get(TOPOLOGY_ENV, "").strip()
    if not spec:
        return None
    return resolve_topology(spec, world_size=world_size)


def faults_from_env(environ: Mapping[str, str] | None = None) -> FaultPlan | None:
    """The faults named by ``CPDPKIT_FAULTS`` (a TOML path or the one-line form), or ``None``."""
    env = os.environ if environ is None else environ
    spec = env.get(FAULTS_ENV, "").strip()
    if not spec:
        return None
    if spec.endswith(".toml"):
        text = read_text_file(spec, what=f"{FAULTS_ENV} file", max_bytes=_MAX_FAULTS_BYTES, error=TopologyError,
                              fix="save it as UTF-8")
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise TopologyError(f"{FAULTS_ENV} = {spec!r} is not valid TOML ({exc}); fix the syntax") from None
        return FaultPlan.from_mapping(data.get("faults", data), where=f"{spec} [faults]")
    return FaultPlan.parse(spec, where=FAULTS_ENV)
