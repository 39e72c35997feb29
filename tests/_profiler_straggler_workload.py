"""Worker for the cross-rank (straggler) test: run as a script, one process per rank.

Every step: a small matmul, then, on the late rank only, a sleep of ``DELAY_MS``,
then a blocking gloo all-reduce. So every other rank reaches each all-reduce about
``DELAY_MS`` before the late one and waits for it inside the collective. Writes
``OUT_DIR/rank<R>.pt.trace.json`` (via ``cpdpkit.tracing``) recording ``STEPS`` steps after one
wait and one warm-up step, so the profiler's start-up (which differs between processes) is
not in the recorded arrivals; and the truth, ``OUT_DIR.arrivals-rank<R>.json``: the monotonic
time (one clock for all processes of the host) of every step's all-reduce call, recorded steps only.

usage: python _profiler_straggler_workload.py RANK WORLD STORE_FILE OUT_DIR LATE_RANK DELAY_MS STEPS
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from cpdpkit.tracing import default_schedule, trace_rank

NUMEL = 1 << 18  # 1 MB: the all-reduce itself takes about a millisecond on loopback


def main() -> None:
    rank, world, store, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    late, delay_s, steps = int(sys.argv[5]), float(sys.argv[6]) / 1e3, int(sys.argv[7])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    grad = torch.randn(NUMEL)
    a = torch.randn(128, 128)
    dist.all_reduce(grad)  # warm up the connection outside the trace
    dist.barrier()
    schedule = default_schedule(wait=1, warmup=1, active=steps)
    with trace_rank(out, schedule=schedule, run_info={"strategy": "straggler", "world_size": world}) as prof:
        arrivals = []
        for _ in range(steps + 2):
            torch.mm(a, a)
            if rank == late:
                time.sleep(delay_s)
            arrivals.append(time.monotonic())
            dist.all_reduce(grad)
            prof.step()
    Path(f"{out}.arrivals-rank{rank}.json").write_text(json.dumps(arrivals[2:]))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
