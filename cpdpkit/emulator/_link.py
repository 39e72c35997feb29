"""One emulated link per process group: a timeline of modeled collectives and their Works.

Each collective issued on an emulated group starts its real data movement at once (on the
wrapped gloo/nccl group) and is booked on the group's :class:`Link`. The link's helper thread
*resolves* bookings in order: it learns the last member's arrival (``arrival()``, the backend's
exchange of issue times; a booking without one starts at its own issue time), starts the
collective at ``max(last arrival, end of the previous booking)``, lets ``schedule`` move or
stretch it (shared uplinks, injected faults) and so fixes its end; collectives on one group run
one after another as on one wire, and every member of a group gets the same start and end. The
helper thread then completes each :class:`EmulatedWork` when both the real op and the modeled
time are done; the caller keeps computing meanwhile and ``wait()`` blocks only for what is left.
A fault found while resolving (a member that never arrives, a link down past the timeout) is
raised by every ``wait()`` of that booking.

Each link belongs to one group and adds the time threads spend blocked in
:meth:`EmulatedWork.wait` to that group's :class:`~cpdpkit.emulator._counters.GroupCounters`.
A ``weakref.finalize`` per link (which does not reference the link) joins its helper thread when
the link is collected and, at the latest, at interpreter exit.

Each booking also becomes the profiler event ``cpdpkit::emu::<op>[...]`` (docs/contracts.md).
torch.profiler records a Python thread it did not start only when it runs with
``experimental_config=_ExperimentalConfig(profile_all_threads=True)`` (its callbacks are then
process-global). Then the helper thread emits the event on its own thread
``cpdpkit-emu-<group>``, from the moment it takes the booking up (this rank's issue, or the end of
the previous booking: the profiler reads the start as this rank's arrival) to the modeled end
(the last member's arrival + the modeled time). With a default, thread-local profiler the event is
entered on the issuing thread at issue time and ended by the helper thread at the modeled
completion (RecordFunction may end on another thread); it then starts at the issue time, which
for queued collectives is before their link time starts.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from cpdpkit.emulator._counters import GroupCounters

__all__ = ["Link", "Booking", "EmulatedWork"]

# How long past the process group's timeout a caller waits before declaring the emulator stuck
# (the wrapped backend normally raises its own timeout error first).
_WAIT_SLACK_S = 5.0
# How long past the group's timeout a waiter waits for the helper to resolve a booking (the
# arrival exchange itself times out at the group's timeout, then names the missing ranks).
_RESOLVE_SLACK_S = 15.0
# How long a link's finalizer (collection or interpreter exit) waits for its helper thread.
_FINAL_JOIN_S = 5.0


class EmulatedWork(dist.Work):
    """A Work that completes when the real op and the modeled link time have both finished."""

    def __init__(self, booking: Booking, counters: GroupCounters) -> None:
        super().__init__()
        self._booking = booking
        self._counters = counters

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the modeled time has passed and the real op is done (or time out)."""
        start_s = time.monotonic()
        try:
            return self._wait(timeout)
        finally:
            self._counters.add_blocked(threading.get_ident(), time.monotonic() - start_s)

    def _wait(self, timeout: timedelta | None) -> bool:
        b = self._booking
        limit_s = b.timeout_s + b.modeled_s + _WAIT_SLACK_S
        if timeout is not None and timeout.total_seconds() > 0:
            limit_s = timeout.total_seconds()
        # the helper resolves the start (the last member's arrival) within the group's timeout
        if b.resolved.wait(b.timeout_s + _RESOLVE_SLACK_S if timeout is None else limit_s) and b.fault is None:
            limit_s += max(0.0, b.end_s - time.monotonic())
            if b.end_s - time.monotonic() < limit_s:
                # Finish on this thread when the helper has not yet: a synchronous collective then
                # ends within sleep precision of its modeled time, not after a thread wake-up.
                _sleep_until(b.end_s)
                b.finish_here()
        if not b.done.wait(limit_s):
            raise RuntimeError(
                f"emulated {b.label} did not complete within {limit_s:.1f} s "
                "(a peer rank is missing or slow; raise the process group timeout if that is expected)"
            )
        if b.error is not None:
            raise b.error
        return True

    def get_future(self) -> torch.futures.Future:
        return self._booking.future

    def is_completed(self) -> bool:
        return self._booking.done.is_set()

    def is_success(self) -> bool:
        return self._booking.done.is_set() and self._booking.error is None

    def exception(self) -> BaseException | None:
        return self._booking.error

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._booking.outputs

    def synchronize(self) -> None:
        self.wait()

    def source_rank(self) -> int:
        return self._booking.inner.source_rank()


@dataclass(eq=False)
class Booking:
    """One collective's slot on a link (monotonic seconds) and its completion state."""

    label: str
    inner: Any  # the wrapped backend's Work
    outputs: list[torch.Tensor]
    issued_s: float  # this rank's arrival (monotonic seconds)
    modeled_s: float
    timeout_s: float
    # blocks until the last member's arrival is known and returns it; raises the fault if one never comes
    arrival: Callable[[], float] | None = None
    # (start, modeled seconds) -> (start, end): moves or stretches the booking (uplinks, faults) or raises
    schedule: Callable[[float, float], tuple[float, float]] | None = None
    start_s: float = 0.0  # set when resolved
    end_s: float = 0.0
    resolved: threading.Event = field(default_factory=threading.Event)
    fault: BaseException | None = None  # what resolving found (every waiter raises it)
    done: threading.Event = field(default_factory=threading.Event)
    future: torch.futures.Future = field(default_factory=torch.futures.Future)
    error: BaseException | None = None
    profiling: bool = False  # a profiler was running when the collective was issued
    issuer_handle: Any = None  # RecordFunction entered on the issuing thread (thread-local mode)
    _claim: threading.Lock = field(default_factory=threading.Lock)

    def finish_here(self) -> None:
        """Wait for the real op and complete this booking, unless another thread already does.

        Exactly one thread may wait on the real Work: gloo's send/recv Works count completions,
        so a second ``wait()`` on the same Work blocks forever.
        """
        if not self._claim.acquire(blocking=False):
            return
        try:
            self.inner.wait(timedelta(seconds=self.timeout_s))
        except BaseException as exc:  # noqa: BLE001 - handed to every waiter
            self.error = exc
        if self.fault is not None:  # the one-line diagnosis replaces the backend's own error
            self.error = self.fault
        self.done.set()
        if self.error is not None:
            self.future.set_exception(self.error)
        else:
            self.future.set_result(self.outputs)

    def resolve(self, free_at_s: float) -> float:
        """Fix this booking's start and end after the previous one's end ``free_at_s``; the end
        (the link's next free time). A fault is kept for the waiters and ends the booking now."""
        try:
            last_s = self.arrival() if self.arrival is not None else self.issued_s
            start_s = max(last_s, free_at_s)
            start_s, end_s = (self.schedule(start_s, self.modeled_s) if self.schedule is not None
                              else (start_s, start_s + self.modeled_s))
        except BaseException as exc:  # noqa: BLE001 - handed to every waiter
            self.fault = exc
            start_s = end_s = max(free_at_s, time.monotonic())
        self.start_s, self.end_s = start_s, end_s
        self.arrival = self.schedule = None  # they hold the side exchange's gloo Work: let it go
        self.resolved.set()
        return end_s


class Link:
    """The serialized timeline of one emulated process group; a helper thread completes its Works."""

    def __init__(self, name: str, counters: GroupCounters) -> None:
        self.name = name
        self._counters = counters
        self._lock = threading.Lock()
        self._worker = _Worker(f"cpdpkit-emu-{name}")
        # Joins the helper thread when this link is collected, or at exit (finalize's atexit=True):
        # a thread still holding gloo Works at interpreter exit aborts the process.
        weakref.finalize(self, self._worker.stop, _FINAL_JOIN_S)

    def book(self, *, label: str, modeled_s: float, inner: Any, outputs: list[torch.Tensor],
             timeout_s: float, issued_s: float | None = None, arrival: Callable[[], float] | None = None,
             schedule: Callable[[float, float], tuple[float, float]] | None = None) -> EmulatedWork:
        """Queue a booking of ``modeled_s`` issued at ``issued_s`` (default: now; monotonic) and
        return its Work; the helper thread resolves it (module docstring)."""
        with self._lock:
            booking = Booking(label=label, inner=inner, outputs=outputs, modeled_s=modeled_s, timeout_s=timeout_s,
                              issued_s=time.monotonic() if issued_s is None else issued_s, arrival=arrival,
                              schedule=schedule)
            _start_profiler_event(booking)
            self._worker.submit(booking)
        return EmulatedWork(booking, self._counters)

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the helper thread after the bookings already queued (process-group shutdown).

        Joining it here, while the interpreter is fully alive, keeps torch objects from being
        torn down on a frozen daemon thread at exit (seen as SIGABRT, "terminate called without
        an active exception"). A later booking starts a new helper thread.
        """
        self._worker.stop(timeout_s)


class _Worker:
    """A link's helper thread and its queue (started on the first booking). It holds no
    reference to its :class:`Link`, so the link's finalizer can stop it."""

    def __init__(self, thread_name: str) -> None:
        self._thread_name = thread_name
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[Booking | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._timeline = [0.0]  # the end of the last resolved booking (shared with later helper threads)

    def submit(self, booking: Booking) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=_complete_bookings, args=(self._queue, self._timeline),
                                                name=self._thread_name, daemon=True)
                self._thread.start()
            self._queue.put(booking)

    def stop(self, timeout_s: float) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is not None:
                self._queue.put(None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)


def _complete_bookings(bookings: queue.SimpleQueue[Booking | None], timeline: list[float]) -> None:
    """The helper thread: resolve each booking in order, then complete it at its modeled end,
    until told to stop (``None``)."""
    while True:
        booking = bookings.get()
        if booking is None:
            return
        try:
            if booking.profiling and booking.issuer_handle is None:
                # the event opens when this rank is in the collective (its issue, or the end of the
                # previous one on this link): the profiler reads its start as this rank's arrival
                with torch.profiler.record_function(booking.label):
                    timeline[0] = booking.resolve(timeline[0])
                    _sleep_until(booking.end_s)
            else:
                timeline[0] = booking.resolve(timeline[0])
                _sleep_until(booking.end_s)
                if booking.issuer_handle is not None:
                    torch.ops.profiler._record_function_exit._RecordFunction(booking.issuer_handle)
        finally:
            booking.finish_here()
        # Hold no Work, Future or tensor while idle: a daemon thread's frame that still
        # references them at interpreter exit makes their C++ destructors run mid-teardown
        # (seen as "terminate called without an active exception", SIGABRT).
        del booking


def _start_profiler_event(booking: Booking) -> None:
    """Decide where the booking's profiler event lives (see the module docstring)."""
    booking.profiling = bool(torch.autograd.profiler._is_profiler_enabled)
    # True only for a thread-local profiler active on this (the issuing) thread; with
    # profile_all_threads=True it reads False while the process-wide flag above reads True.
    if booking.profiling and torch._C._autograd._profiler_enabled():
        booking.issuer_handle = torch.ops.profiler._record_function_enter_new(booking.label, None)


def _sleep_until(deadline_s: float) -> None:
    while True:
        left_s = deadline_s - time.monotonic()
        if left_s <= 0:
            return
        time.sleep(left_s)
