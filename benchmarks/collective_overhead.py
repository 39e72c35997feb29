"""The fixed cost of one gloo collective on this machine (``collective_overhead_s`` of a tier in the
sharding suite's presets): 4 ranks as 2 nodes of 2, the median time of an 8-byte all_reduce,
reduce_scatter-sized all_gather inside a node (2 ranks) and across nodes (2 ranks), no emulated delay.

    python benchmarks/collective_overhead.py [--iters N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world: int, port: int, iters: int, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    node = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    across = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    x = torch.zeros(2)
    res = {}
    for name, group in (("intra_node", node), ("inter_node", across)):
        times = []
        for i in range(iters + 5):
            start = time.perf_counter()
            dist.all_reduce(x, group=group)
            if i >= 5:
                times.append(time.perf_counter() - start)
        res[name] = statistics.median(times)
    if rank == 0:
        out.update(res)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(4, port, args.iters, out), nprocs=4, join=True)
        print(json.dumps({"median_s": dict(out), "load": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
