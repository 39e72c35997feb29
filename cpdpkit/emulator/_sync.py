"""What the members of an emulated group agree on: arrival times, shared uplinks, who is missing.

**Last arrival.** A collective completes for every member at (the last member's arrival + its
modeled transfer). Each group keeps a side gloo group (:class:`GroupClock`, its own connections,
on a ``cpdpkit-emu-clock/`` prefix of the group's store): with every collective, each member
all-reduces (MAX) one float64, its issue time, beside the real op. That exchange runs on the
host's real network (loopback: ~0.1 ms), concurrently with the data and under the modeled time,
so it adds no modeled round trip and leaves the data untouched. Clocks: ``time.monotonic()``
is CLOCK_MONOTONIC, one clock for every process of a Linux host; across machines it is not
shared, so the last arrival is clamped to [own arrival, the local time the exchange completed]
(a rank cannot have arrived after the exchange ended): with unsynchronised clocks the error is
bounded by the real exchange's round trip, not by the clock offset. A send/recv pair exchanges the
sender's issue time the same way (the recv completes at max(send issue, recv issue) + transfer).

**Who did not arrive.** When the exchange fails (a peer's connection closed, or the group's
timeout passed), each member that got there writes ``cpdpkit-emu/arrived/<seq>/<rank>`` in the
group's store, waits a moment for the others' keys, and names the members without one.

**Shared uplinks** (:class:`UplinkBook`). Collectives of different groups that cross one node's
(or site's) uplink share it: the group's rank 0 books them on a first-come-first-served timeline
per uplink kept in the rendezvous store (one JSON value, updated by compare-and-set), and
publishes the booked (start, end) under the group's prefix for the other members. Times are
the host's CLOCK_MONOTONIC: uplink contention is emulated for ranks on one machine.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from cpdpkit.emulator.faults import PeerLostError

__all__ = ["GroupClock", "UplinkBook"]

_CLOCK_PREFIX = "cpdpkit-emu-clock/"
_UPLINKS_KEY = "cpdpkit-emu/uplinks"
# How long a member that found the exchange broken waits for the others to say they arrived.
_ARRIVED_GRACE_S = 2.0
_FIX_DIED = "a rank died or hung: check its log"


class GroupClock:
    """The side gloo group of one emulated group: issue times, and who is missing (module doc)."""

    def __init__(self, *, store: Any, group_rank: int, global_ranks: list[int], timeout: timedelta,
                 describe: Callable[[str], str]) -> None:
        self._store = store
        self._rank = group_rank
        self._global_ranks = global_ranks
        self._timeout = timeout
        self._describe = describe  # op -> "emu <op> on group <name> (ranks ..)"
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore(_CLOCK_PREFIX, store), group_rank, len(global_ranks),
                                           timeout)
        self._lock = threading.Lock()
        self._exchanges = 0

    def agree_on_now(self) -> float:
        """Block until every member calls it; the latest of their monotonic times (a shared origin)."""
        return self.collective(time.monotonic())("start")

    def collective(self, issued_s: float) -> Callable[[str], float]:
        """Send this rank's issue time (issued before the real op, so the exchange is not queued
        behind it); the returned call, given the op's name, blocks for the last member's arrival."""
        ts = torch.tensor([issued_s], dtype=torch.float64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        with self._lock:
            self._exchanges += 1  # the same count on every member: they exchange in the same order
            seq = self._exchanges
            work = self._gloo.allreduce([ts], opts)
        return functools.partial(self._last_arrival, work, ts, issued_s, seq)

    def send(self, issued_s: float, peer: int, tag: int, op: str) -> Callable[[], float]:
        """A send's arrival exchange: tell ``peer`` (a group rank) when it was issued."""
        work = self._gloo.send([torch.tensor([issued_s], dtype=torch.float64)], peer, tag)

        def sent() -> float:
            t0 = time.monotonic()
            try:
                work.wait(self._timeout)  # a small message: buffered at once unless the peer is gone
            except RuntimeError as exc:
                raise self._lost(op, [self._global_ranks[peer]], time.monotonic() - t0, exc) from None
            return issued_s

        return sent

    def recv(self, issued_s: float, peer: int, tag: int, op: str) -> Callable[[], float]:
        """A recv's arrival exchange: the matching send's issue time from ``peer`` (a group rank)."""
        ts = torch.zeros(1, dtype=torch.float64)
        work = self._gloo.recv([ts], peer, tag)

        def received() -> float:
            t0 = time.monotonic()
            try:
                work.wait(self._timeout)
            except RuntimeError as exc:
                raise self._lost(op, [self._global_ranks[peer]], time.monotonic() - t0, exc) from None
            return min(max(float(ts[0]), issued_s), time.monotonic())

        return received

    def _last_arrival(self, work: Any, ts: torch.Tensor, issued_s: float, seq: int, op: str) -> float:
        t0 = time.monotonic()
        try:
            work.wait(self._timeout)
        except RuntimeError as exc:
            waited_s = time.monotonic() - t0
            raise self._lost(op, self._missing(seq), waited_s, exc) from None
        return min(max(float(ts[0]), issued_s), time.monotonic())

    def _missing(self, seq: int) -> list[int] | None:
        """The global ranks without an arrival key for collective ``seq`` (``None``: the store is gone)."""
        prefix = f"cpdpkit-emu/arrived/{seq}/"
        try:
            self._store.set(f"{prefix}{self._rank}", "1")
            deadline = time.monotonic() + _ARRIVED_GRACE_S
            while True:
                missing = [r for r in range(len(self._global_ranks)) if not self._store.check([f"{prefix}{r}"])]
                if not missing or time.monotonic() > deadline:
                    return [self._global_ranks[r] for r in missing]
                time.sleep(0.05)
        except RuntimeError:
            return None

    def _lost(self, op: str, missing: list[int] | None, waited_s: float, exc: BaseException) -> PeerLostError:
        timeout_s = self._timeout.total_seconds()
        who = f"ranks {missing}" if missing else "a member (the store cannot tell which)"
        if waited_s < 0.9 * timeout_s:  # not a timeout: the connection broke
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            cause = text.rsplit("] ", 1)[-1][:100]  # gloo's message without its source location
            return PeerLostError(f"{self._describe(op)}: {who} did not arrive (the connection broke after "
                                 f"{waited_s:.1f} s: {cause}); {_FIX_DIED}")
        return PeerLostError(f"{self._describe(op)}: {who} did not arrive within {timeout_s:g} s; {_FIX_DIED}, or "
                             "raise the timeout (init_distributed(timeout=timedelta(seconds=...))) if it is only slow")

    def shutdown(self) -> None:
        del self._gloo  # the side group goes with its last reference; runs once (the group forgets its clock)


def root_store(store: Any) -> Any:
    """The store under every prefix (shared by all groups of the job)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


class UplinkBook:
    """First-come-first-served timelines of the shared uplinks one group crosses (module doc)."""

    def __init__(self, *, store: Any, group_rank: int, group_size: int, uplinks: tuple[str, ...],
                 timeout: timedelta, describe: Callable[[str], str]) -> None:
        self._root = root_store(store)
        self._store = store
        self._leader = group_rank == 0
        self._size = group_size
        self._uplinks = uplinks
        self._timeout = timeout
        self._describe = describe

    def schedule(self, seq: int, op: str) -> Callable[[float, float], tuple[float, float]]:
        """The schedule step for collective ``seq``: ``(start, end) -> (start, end)`` on the uplinks."""
        return functools.partial(self._book, seq, op)

    def _book(self, seq: int, op: str, start_s: float, end_s: float) -> tuple[float, float]:
        key = f"cpdpkit-emu/uplink-booking/{seq}"
        if self._leader:
            start_s, end_s = self._reserve(start_s, end_s - start_s)
            self._store.set(key, f"{start_s!r} {end_s!r}")
            return start_s, end_s
        try:
            self._store.wait([key], self._timeout)
            start_text, end_text = self._store.get(key).decode().split()
        except RuntimeError as exc:
            raise PeerLostError(f"{self._describe(op)}: its rank 0 did not book the shared uplinks within "
                                f"{self._timeout.total_seconds():g} s ({str(exc)[:80]}); {_FIX_DIED}") from None
        if self._store.add(f"{key}/read", 1) == self._size - 1:  # the last reader removes the keys
            self._store.delete_key(key)
            self._store.delete_key(f"{key}/read")
        return float(start_text), float(end_text)

    def _reserve(self, start_s: float, duration_s: float) -> tuple[float, float]:
        current = self._root.get(_UPLINKS_KEY).decode() if self._root.check([_UPLINKS_KEY]) else ""
        while True:
            free = json.loads(current) if current else {}
            begin = max([start_s, *(free.get(u, 0.0) for u in self._uplinks)])
            end = begin + duration_s
            new = json.dumps({**free, **dict.fromkeys(self._uplinks, end)})
            got = self._root.compare_set(_UPLINKS_KEY, current, new).decode()
            if got == new:
                return begin, end
            current = got
