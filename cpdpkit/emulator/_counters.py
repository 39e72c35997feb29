"""What one emulated process group has done: its counters, and their immutable snapshots.

Each :class:`~cpdpkit.emulator.backend.EmulatedProcessGroup` owns one :class:`GroupCounters`
(its link's waits add their blocked time to it too); :func:`cpdpkit.emulator.meter` reads them
as :class:`Counts` and subtracts. Nothing here is shared between groups, and nothing imports torch.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from cpdpkit.network import LOCAL_TIER

__all__ = ["Counts", "GroupCounters"]


def _frozen(values: Mapping) -> Mapping:
    return MappingProxyType(dict(values))


@dataclass(frozen=True)
class Counts:
    """A reading of counters: collectives by canonical op, wire bytes by tier, seconds spent
    blocked in ``EmulatedWork.wait`` by thread ident, and modeled link seconds booked by tier (each
    collective's sampled time). Zero entries are left out."""

    op_counts: Mapping[str, int] = field(default_factory=lambda: _frozen({}))
    wire_bytes: Mapping[str, int] = field(default_factory=lambda: _frozen({}))
    blocked_s: Mapping[int, float] = field(default_factory=lambda: _frozen({}))
    modeled_s: Mapping[str, float] = field(default_factory=lambda: _frozen({}))

    def __add__(self, other: Counts) -> Counts:
        return self._merge(other, 1)

    def __sub__(self, other: Counts) -> Counts:
        return self._merge(other, -1)

    def _merge(self, other: Counts, sign: int) -> Counts:
        return Counts(_combine(self.op_counts, other.op_counts, sign),
                      _combine(self.wire_bytes, other.wire_bytes, sign),
                      _combine(self.blocked_s, other.blocked_s, sign),
                      _combine(self.modeled_s, other.modeled_s, sign))


def _combine(a: Mapping, b: Mapping, sign: int) -> Mapping:
    out = dict(a)
    for key, value in b.items():
        out[key] = out.get(key, 0) + sign * value
    return _frozen({k: v for k, v in out.items() if v})


class GroupCounters:
    """The thread-safe counters of one emulated group (the issuing threads, the link's helper
    thread and any thread that waits on one of its Works update them)."""

    def __init__(self, tier: str = LOCAL_TIER) -> None:
        self.tier = tier  # the group's slowest tier (LOCAL for one rank), for per-tier readings
        self._lock = threading.Lock()
        self._ops: Counter[str] = Counter()
        self._wire_bytes: Counter[str] = Counter()
        self._blocked_s: dict[int, float] = {}
        self._modeled_s: dict[str, float] = {}

    def add_op(self, op: str) -> None:
        with self._lock:
            self._ops[op] += 1

    def add_wire_bytes(self, tier: str, wire_bytes: int) -> None:
        if wire_bytes:
            with self._lock:
                self._wire_bytes[tier] += wire_bytes

    def add_blocked(self, thread_ident: int, seconds: float) -> None:
        with self._lock:
            self._blocked_s[thread_ident] = self._blocked_s.get(thread_ident, 0.0) + seconds

    def add_modeled(self, tier: str, seconds: float) -> None:
        if seconds:
            with self._lock:
                self._modeled_s[tier] = self._modeled_s.get(tier, 0.0) + seconds

    def read(self) -> Counts:
        with self._lock:
            return Counts(_frozen(+self._ops), _frozen(+self._wire_bytes),
                          _frozen({k: v for k, v in self._blocked_s.items() if v}),
                          _frozen({k: v for k, v in self._modeled_s.items() if v}))
