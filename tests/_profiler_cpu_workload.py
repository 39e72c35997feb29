"""Worker for the profiler's CPU ground-truth test (run as a script, one process per rank).

Each step: an async gloo all-reduce of a large tensor, a chosen amount of compute (one
matmul sized by a calibration, so the training thread has no Python gaps to be descheduled
in), then ``wait()`` timed by the script — the time the training thread spends
in the all-reduce call plus the timed wait is the step's exposed communication. The
thread's descheduled time outside the wait (wall minus thread CPU time) is recorded too: a
thread preempted between ops looks exactly like a waiting one in a trace, so such steps
are not ground truth. Writes ``OUT/rank<R>.pt.trace.json`` (via ``cpdpkit.tracing``) and
``OUT.truth-rank<R>.json`` (beside the run folder) with the timings per ``ProfilerStep`` number.

usage: python _profiler_cpu_workload.py RANK WORLD STORE_FILE OUT_DIR NUMEL COMPUTE_MS[,COMPUTE_MS...]
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist

from cpdpkit.tracing import trace_rank


def main() -> None:
    rank, world, store, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    numel = int(sys.argv[5])
    compute_ms = [float(x) for x in sys.argv[6].split(",")]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    grad = torch.randn(numel)
    b = torch.randn(512, 512)
    t0 = time.perf_counter()
    for _ in range(5):
        torch.mm(torch.randn(512, 512), b)
    us_per_row = (time.perf_counter() - t0) * 1e6 / (5 * 512)
    dist.all_reduce(grad)  # warm up the connection outside the trace
    dist.barrier()
    truth: dict[int, dict[str, float]] = {}
    with trace_rank(out, run_info={"strategy": "truth", "world_size": world}) as prof:
        # inputs allocated up front: between the launch, the matmul and the wait the thread
        # runs only a few microseconds of Python, so there is no gap to be descheduled in
        inputs = [torch.empty(int(ms * 1e3 / us_per_row), 512) if ms > 0 else None for ms in compute_ms]
        for x in inputs:
            wall0, cpu0 = time.perf_counter(), time.thread_time()
            work = dist.all_reduce(grad, async_op=True)
            launch_us = (time.perf_counter() - wall0) * 1e6
            y = torch.mm(x, b) if x is not None else None
            t0, cpu1 = time.perf_counter(), time.thread_time()
            work.wait()
            truth[prof.step_num] = {
                "launch_us": launch_us,
                "wait_us": (time.perf_counter() - t0) * 1e6,
                # wall time the thread was off the CPU while it should have been running
                "descheduled_us": ((t0 - wall0) - (cpu1 - cpu0)) * 1e6,
            }
            del y
            prof.step()
    with open(f"{out}.truth-rank{rank}.json", "w") as fh:
        json.dump(truth, fh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
