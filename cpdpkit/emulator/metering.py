"""Reading the emulator's counters: ``with meter() as m: ...`` measures what a block of code did.

Every :class:`~cpdpkit.emulator.backend.EmulatedProcessGroup` counts its own collectives (by
canonical op), the wire bytes the network model charges them (by the group's tier; the bytes a
plan prices for the same collectives), the modeled seconds it booked on its links (by tier; each
collective's sampled time on a tier that varies) and the seconds each thread spent blocked in
``EmulatedWork.wait``. :func:`meter` reads all groups of one emulator session (by default the
session of the default process group) when the block starts and when it ends, and reports the
difference: collectives issued from any thread count, groups created inside the block count
from zero, and :attr:`Meter.blocked_s` is the blocked time of the thread that entered the block.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from cpdpkit.emulator._counters import Counts, GroupCounters
from cpdpkit.emulator.backend import EmulatorSession, session_of
from cpdpkit.errors import DistributedSetupError

__all__ = ["Meter", "meter", "makespan_s", "timed_runs"]


class Meter:
    """What the emulated groups of one session did during a ``with`` block (see :func:`meter`).

    Read inside the block, the properties give the counts so far; after it, the final counts.
    """

    def __init__(self, session: EmulatorSession) -> None:
        self._session = session
        self._thread_ident = -1  # the thread that enters the block (no thread's ident before)
        self._before: dict[int, tuple[GroupCounters, Counts]] | None = None
        self._result: Counts | None = None
        self._groups_result: list[tuple[str, Counts]] = []

    def __enter__(self) -> Meter:
        if self._before is not None or self._result is not None:
            raise RuntimeError("a Meter measures one block; call meter() again for another")
        self._thread_ident = threading.get_ident()
        # holding the counters (not the groups) keeps a group collected mid-block counted
        self._before = {id(c): (c, c.read()) for c in self._session.counters()}
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._groups_result = self._by_group()
        self._result = _sum(counts for _, counts in self._groups_result)
        self._before = None

    def _difference(self) -> Counts:
        return self._result if self._result is not None else _sum(counts for _, counts in self._by_group())

    def _by_group(self) -> list[tuple[str, Counts]]:
        """(tier, counts during the block) per group; after the block, as it ended."""
        if self._result is not None:
            return self._groups_result
        if self._before is None:
            raise RuntimeError("read a Meter inside or after its with-block (with meter() as m: ...)")
        groups = {id(c): c for c in self._session.counters()}
        groups.update({key: c for key, (c, _) in self._before.items()})
        out = []
        for key, counters in groups.items():
            before = self._before.get(key)
            out.append((counters.tier, counters.read() - before[1] if before is not None else counters.read()))
        return out

    @property
    def op_counts(self) -> dict[str, int]:
        """Collectives issued on the session's groups, by canonical op (``send_recv``: each send
        and each recv; ``other``: reduce, gather, scatter)."""
        return dict(self._difference().op_counts)

    @property
    def bytes_by_tier(self) -> dict[str, int]:
        """Wire bytes this rank sent, by the tier of the group that sent them: for each collective
        ``group.cost(op, num_bytes).wire_bytes`` of the network model (a p2p send: the pair's)."""
        return dict(self._difference().wire_bytes)

    @property
    def modeled_s_by_tier(self) -> dict[str, float]:
        """Modeled link seconds this rank's emulated groups booked, by tier: each collective's
        time under the network model (on a tier that varies, the time of its own draw; a send
        and a recv each book theirs)."""
        return dict(self._difference().modeled_s)

    @property
    def blocked_s(self) -> float:
        """Seconds the thread that entered the block spent blocked in ``EmulatedWork.wait``."""
        return self._difference().blocked_s.get(self._thread_ident, 0.0)

    @property
    def blocked_s_by_tier(self) -> dict[str, float]:
        """:attr:`blocked_s`, split by the tier of the group whose Work was waited on."""
        out: dict[str, float] = {}
        for tier, counts in self._by_group():
            seconds = counts.blocked_s.get(self._thread_ident, 0.0)
            if seconds:
                out[tier] = out.get(tier, 0.0) + seconds
        return out

    def __repr__(self) -> str:
        if self._before is None and self._result is None:
            return "Meter(not entered)"
        return f"Meter(op_counts={self.op_counts}, bytes_by_tier={self.bytes_by_tier}, blocked_s={self.blocked_s:.6f})"


def _sum(counts: Iterable[Counts]) -> Counts:
    total = Counts()
    for c in counts:
        total = total + c
    return total


def meter(group: Any = None) -> Meter:
    """A context manager measuring the emulated groups of ``group``'s session during a block.

    ``group`` is any emulated process group (default: the default process group); every group
    created by the same :func:`~cpdpkit.emulator.register_emulated_backend` call is measured.
    """
    if group is None:
        group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    session = session_of(group)
    if session is None:
        found = "there is no default process group" if group is None else f"{group!r} is not an 'emu' group"
        raise DistributedSetupError(
            f"cpdpkit.emulator.meter() measures emulated process groups but {found}; start them with "
            "cpdpkit.init_distributed(topology=...) (or backend='emu') or pass group= an emulated group"
        )
    return Meter(session)


def makespan_s(fn: Callable[[], Any], gloo: Any, *, group: int = 0, late_s: float = 0.0, first: bool = False) -> float:
    """Seconds from the moment the first group could start (its last rank left a barrier on the
    plain gloo group ``gloo``) to the end of the last rank's ``fn()``, the same on every rank.

    This rank sleeps ``late_s`` before ``fn`` (a late arrival); ``group`` is the index of this
    rank's group, ``-1`` when it issues nothing; ``first``: to the end of the *first* rank's
    ``fn`` instead (what an on-time rank waits for). The ranks must share one host's
    CLOCK_MONOTONIC; the barrier's own exit skew is then not counted as link time.
    """
    dist.barrier(gloo)
    left_s = time.monotonic()
    if late_s:
        time.sleep(late_s)
    fn()
    mine = torch.tensor([group, left_s, time.monotonic()], dtype=torch.float64)
    every = [torch.zeros(3, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine, group=gloo)
    rows = [(int(g), left, done) for g, left, done in (t.tolist() for t in every) if g >= 0]
    start_s = min(max(left for g, left, _ in rows if g == k) for k in {g for g, _, _ in rows})
    return (min if first else max)(done for _, _, done in rows) - start_s


def timed_runs(fn: Callable[[], Any], gloo: Any, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` runs of ``fn``, each timed from this rank's exit of a barrier
    on the plain gloo group ``gloo`` (load only adds to a run: the fastest is the floor)."""
    times = []
    for _ in range(repeats):
        dist.barrier(gloo)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times
