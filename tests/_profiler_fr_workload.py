"""Worker for the flight-recorder tests: run as a script, one process per rank (gloo).

Sets ``TORCH_FR_BUFFER_SIZE`` (the flight recorder is on for the process groups created after it)
and ``TORCH_FR_DUMP_TEMP_FILE=OUT/nccl_trace_rank_``, the names torch's NCCL watchdog writes its
dumps to. Every step: on the late rank only, a sleep of ``DELAY_MS``; a stamp of the wall clock
(``time.time_ns()``, the flight recorder's clock) just before the all-reduce; the all-reduce.
With ``HANG=1``, the late rank then never enters the next all-reduce: the other ranks time out in
it (3 s) and dump the recorder, as a job's timeout handler would; the late rank dumps on its own.
Writes ``OUT/<prefix><rank>`` (``_dump_fr_trace()``, pickle) and ``OUT.stamps-rank<R>.json``.

usage: python _profiler_fr_workload.py RANK WORLD STORE_FILE OUT_DIR LATE_RANK DELAY_MS STEPS HANG
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path


def main() -> None:
    rank, world, store, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    late, delay_s, steps, hang = int(sys.argv[5]), float(sys.argv[6]) / 1e3, int(sys.argv[7]), sys.argv[8] == "1"
    out.mkdir(parents=True, exist_ok=True)
    os.environ["TORCH_FR_BUFFER_SIZE"] = "64"
    os.environ["TORCH_FR_DUMP_TEMP_FILE"] = f"{out}/nccl_trace_rank_"
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import _dump_fr_trace

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=3))
    grad = torch.randn(1 << 14)
    stamps = []
    for _ in range(steps):
        if rank == late:
            time.sleep(delay_s)
        stamps.append(time.time_ns())
        dist.all_reduce(grad)
    if hang and rank != late:
        try:
            dist.all_reduce(grad)  # the late rank never enters it
        except RuntimeError:
            pass
    Path(os.environ["TORCH_FR_DUMP_TEMP_FILE"] + str(rank)).write_bytes(_dump_fr_trace())
    Path(f"{out}.stamps-rank{rank}.json").write_text(json.dumps(stamps))
    if hang:
        os._exit(0)  # a process group with a timed-out collective cannot be torn down cleanly
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
