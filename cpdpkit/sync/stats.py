"""Counters kept by :class:`~cpdpkit.sync.PeriodicSyncOptimizer` (``opt.stats``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from cpdpkit.sync.period_control import PeriodDecision

__all__ = ["SyncStats"]


@dataclass(frozen=True, kw_only=True)
class SyncStats:
    """A snapshot of what the optimizer has communicated so far.

    ``blocked_s`` is the optimizer's own measure of exposed synchronisation time: wall
    seconds the caller spent inside ``step()`` (or ``__init__``) waiting for or running
    collectives, gradient waits included; compute that overlapped an in-flight gradient
    all-reduce is not counted. ``bytes_sent`` counts collective payload bytes (the tensor
    size handed to each collective, as nccl-tests' "size"), summed over collectives.
    ``period`` is the current K (with ``period="auto"``, the one decided last) and
    ``period_decisions`` every decision of the controller, oldest first; ``in_flight`` whether
    an overlapped reconciliation's average is still to be applied.
    """

    steps: int = 0
    local_steps: int = 0
    reconciliations: int = 0
    gradient_syncs: int = 0
    collectives: int = 0
    bytes_sent: int = 0
    blocked_s: float = 0.0
    period: int | None = None
    in_flight: bool = False
    period_decisions: tuple[PeriodDecision, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["period_decisions"] = [d.to_dict() for d in self.period_decisions]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SyncStats:
        fields = {f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data}
        if "period_decisions" in fields:
            fields["period_decisions"] = tuple(PeriodDecision.from_dict(d) for d in fields["period_decisions"])
        return cls(**fields)
