"""``cpdpkit bench --inject-fault kill:rank=R:step=S``: the fault, parsed and validated before any launch.

A run with a fault checkpoints every :data:`CHECKPOINT_EVERY` steps (``cpdpkit.checkpoint``, into
its run folder) and is launched with one elastic restart. Rank ``R`` SIGKILLs itself right after its
optimizer step ``S`` (before that step's checkpoint) on the first attempt only
(``TORCHELASTIC_RESTART_COUNT == 0``); torch elastic restarts every rank, which resume from the last
checkpoint. The same run is then launched once more without the fault, and the result records the
restart count and whether every rank's final parameters (sha256) equal that uninterrupted run's.
Torch-free (the CLI validates with it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cpdpkit.errors import ConfigError

__all__ = ["CHECKPOINT_EVERY", "Fault", "parse_fault"]

CHECKPOINT_EVERY = 8  # steps between a faulted run's checkpoints (and its reference run's)
_FORMAT = "kill:rank=R:step=S (R a rank below the world size, S >= 1 the optimizer step), e.g. kill:rank=1:step=40"
_PATTERN = re.compile(r"^kill:rank=(\d+):step=(\d+)$")


@dataclass(frozen=True, kw_only=True)
class Fault:
    """Kill ``rank`` with SIGKILL right after its optimizer step ``step``, on the first attempt."""

    rank: int
    step: int

    def __str__(self) -> str:
        return f"kill:rank={self.rank}:step={self.step}"


def parse_fault(text: str, *, world_size: int | None = None) -> Fault:
    """``kill:rank=R:step=S`` as a :class:`Fault`; a one-line ConfigError naming the value and the format."""
    match = _PATTERN.match(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise ConfigError(f"--inject-fault {text!r} is not a fault: use {_FORMAT}")
    fault = Fault(rank=int(match.group(1)), step=int(match.group(2)))
    if fault.step < 1:
        raise ConfigError(f"--inject-fault {text!r}: step must be >= 1: use {_FORMAT}")
    if world_size is not None and fault.rank >= world_size:
        raise ConfigError(f"--inject-fault {text!r}: rank {fault.rank} does not exist with --world-size {world_size}: "
                          f"use {_FORMAT}")
    return fault
