"""Counters kept by :class:`~cpdpkit.sync.PeriodicSyncOptimizer` (``opt.stats``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["SyncStats"]


@dataclass(frozen=True, kw_only=True)
class SyncStats:
    """A snapshot of what the optimizer has communicated so far.

    ``blocked_s`` is the optimizer's own measure of exposed synchronisation time: wall
    seconds the caller spent inside ``step()`` (or ``__init__``) waiting for or running
    collectives, gradient waits included; compute that overlapped an in-flight gradient
    all-reduce is not counted. ``bytes_sent`` counts collective payload bytes (the tensor
    size handed to each collective, as nccl-tests' "size"), summed over collectives.
    """

    steps: int = 0
    local_steps: int = 0
    reconciliations: int = 0
    gradient_syncs: int = 0
    collectives: int = 0
    bytes_sent: int = 0
    blocked_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SyncStats:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})
