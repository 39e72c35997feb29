"""Worker for the profiler's CPU ground-truth test (run as a script, one process per rank).

Each step: an async gloo all-reduce of a large tensor (``ProcessGroup.allreduce``, the c10d
op itself: ``dist.all_reduce`` would add ~0.1 ms of Python argument checks that a trace shows
as the thread's own time), a chosen amount of compute, then ``wait()``, timed by the script.
The step's exposed communication (``blocked_us``, the truth) is the time the training thread
is in the call plus the time it is blocked in the wait: the wait's wall time minus the time
the thread spent in it runnable but off the CPU (``run_delay`` of
``/proc/thread-self/schedstat``; 0 where unreadable). That run-queue time comes after the
finished collective woke the waiter: contention, not communication, and a trace cannot tell
it from the Python that runs after ``wait()``.

The scheduler is kept out of the measurement, since a thread preempted inside or just after
a call looks like one that is still calling (or doing Python) and nothing in a trace tells
the two apart: the compute is an op that sleeps (``truth::compute``, a ``cpu_op`` like any
other), so on a 2-core box the ranks' training threads do not fight gloo's workers for the
cores; the training thread is pinned to one CPU and gloo's threads to the others; and where
permitted (root) the training thread runs ``SCHED_FIFO``, so other processes do not preempt it.
``unpinned`` leaves both out (an ordinary job), ``spin`` makes compute keep a core busy.

Between the call and the compute, and between the wait and the next step, the thread spends
``PYTHON_MS`` outside any torch op (a gap in the trace, like data loading): not blocked in
communication, so not exposed, although a collective is in flight during the first and has
just completed before the second.

Writes ``OUT/rank<R>.pt.trace.json`` (via ``cpdpkit.tracing``) and ``OUT.truth-rank<R>.json``
(beside the run folder) per ``ProfilerStep`` number: ``blocked_us``, and for diagnosis the
wall times ``launch_us``/``wait_us`` and their run-queue times
``launch_runnable_us``/``wait_runnable_us``.

usage: python _profiler_cpu_workload.py RANK WORLD STORE OUT NUMEL COMPUTE_MS[,...] [pinned|unpinned] [sleep|spin]
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from cpdpkit.tracing import trace_rank

# Python with no torch op after the call and after the wait (data loading, say; it sleeps, to
# leave the cores free): not communicating, though the collective is in flight during the
# first and has just completed before the second, so neither may count as exposed
PYTHON_MS = 2.0


SPIN = False  # compute that keeps a core busy (the ``spin`` argument) instead of sleeping


@torch.library.custom_op("truth::compute", mutates_args=())
def compute(x: torch.Tensor, ms: float) -> torch.Tensor:
    if SPIN:
        end = time.perf_counter() + ms / 1e3
        while time.perf_counter() < end:
            pass
    else:
        time.sleep(ms / 1e3)
    return torch.empty(0)


def _pin_threads() -> None:
    """The calling (training) thread to the first CPU it may use, every other thread of the
    process (gloo's workers) to the others: a woken gloo worker never takes the training
    thread's core. Both ranks' training threads share theirs, each running only briefly."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) < 2 or not os.path.isdir("/proc/self/task"):
        return
    me = threading.get_native_id()
    for tid in map(int, os.listdir("/proc/self/task")):
        try:
            os.sched_setaffinity(tid, cpus[:1] if tid == me else cpus[1:])
        except OSError:  # the thread is gone
            pass


def _realtime(on: bool) -> None:
    """The calling thread to ``SCHED_FIFO`` (other processes cannot preempt it; it only ever
    runs briefly, sleeping in its compute and waits) or back; a no-op where not permitted."""
    try:
        if on:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        else:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except (AttributeError, OSError):
        pass


def _run_delay_reader():  # type: ignore[no-untyped-def]
    """Seconds the calling thread has spent runnable but not running (0 where unknown)."""
    try:
        fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
    except OSError:
        return lambda: 0.0
    return lambda: int(os.pread(fd, 128, 0).split()[1]) / 1e9


def main() -> None:
    rank, world, store, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    numel = int(sys.argv[5])
    compute_ms = [float(x) for x in sys.argv[6].split(",")]
    pinned = (sys.argv[7] if len(sys.argv) > 7 else "pinned") == "pinned"
    global SPIN
    SPIN = len(sys.argv) > 8 and sys.argv[8] == "spin"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    grad = torch.randn(numel)
    x = torch.empty(0)
    compute(x, 0.0)
    dist.all_reduce(grad)  # warm up the connection outside the trace
    dist.barrier()
    truth: dict[int, dict[str, float]] = {}
    run_delay = _run_delay_reader()
    pg = dist.group.WORLD
    with trace_rank(out, run_info={"strategy": "truth", "world_size": world}) as prof:
        if pinned:
            _pin_threads()  # here, so that the profiler's threads move off the training thread's CPU too
            _realtime(True)
        for ms in compute_ms:
            q0 = run_delay()
            t0 = time.perf_counter()
            work = pg.allreduce([grad])
            t1 = time.perf_counter()
            q1 = run_delay()
            if ms > 0:  # (before a wait it would be part of the wait's gap: no trace can tell)
                time.sleep(PYTHON_MS / 1e3)
            y = compute(x, ms) if ms > 0 else None
            tc = time.perf_counter()
            q2 = run_delay()
            t2 = time.perf_counter()
            work.wait()
            t3 = time.perf_counter()
            q3 = run_delay()
            # the run-queue reads sit outside the timed spans, so they cost the truth nothing
            call, wait, call_rq, wait_rq = t1 - t0, t3 - t2, q1 - q0, q3 - q2
            truth[prof.step_num] = {
                "blocked_us": (call + max(wait - wait_rq, 0.0)) * 1e6,
                "launch_us": call * 1e6,
                "wait_us": wait * 1e6,
                "launch_runnable_us": call_rq * 1e6,
                "wait_runnable_us": wait_rq * 1e6,
                "before_wait_us": (t2 - tc) * 1e6,  # from compute's return to the wait (diagnosis)
            }
            del y
            time.sleep(PYTHON_MS / 1e3)
            prof.step()
        if pinned:
            _realtime(False)
    with open(f"{out}.truth-rank{rank}.json", "w") as fh:
        json.dump(truth, fh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
