"""Modeled vs measured time of emulated collectives over message sizes and ops (prints JSON).

    .venv/bin/python benchmarks/emulator_sweep.py [--world-size 2] [--topology wan] [--repeats 5]

Each rank issues every (op, size) ``--repeats`` times after a barrier on a plain gloo group and
reports the median; the emulated time is max(modeled, gloo's own time), so small modeled times
on a fast tier show gloo's floor. Each row also shows the network model's algorithm and wire
bytes per rank beside the bytes the emulator counted for the warm-up call (``meter()``); they
agree by construction. Not a test: it prints numbers, it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "barrier")
SIZES = (4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20)


def _issue(op: str, n: int, world: int) -> Callable[[], Any]:
    """The call that runs ``op`` once on ``n`` float32 elements (``n`` a multiple of ``world``)."""
    x = torch.ones(n)
    out = torch.empty(n)
    if op == "all_reduce":
        return lambda: dist.all_reduce(x)
    if op == "all_gather":
        return lambda: dist.all_gather_into_tensor(out, x[: n // world])
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(out[: n // world], x)
    if op == "broadcast":
        return lambda: dist.broadcast(x, src=0)
    if op == "all_to_all":
        return lambda: dist.all_to_all_single(out, x)
    return lambda: dist.barrier()


def _worker(rank: int, world: int, store: str, topology: str, repeats: int, out: str) -> None:
    import cpdpkit
    from cpdpkit.emulator import meter

    torch.set_num_threads(1)
    info = cpdpkit.init_distributed(topology=topology, init_method=f"file://{store}", rank=rank, world_size=world)
    gloo = dist.new_group(backend="gloo")
    rows = []
    for op in OPS:
        for num_bytes in (0,) if op == "barrier" else SIZES:
            n = max(world, num_bytes // 4 // world * world)
            fn = _issue(op, n, world)
            real_bytes = 4 * n if op != "barrier" else 0
            with meter() as m:
                fn()  # warm-up
            times = []
            for _ in range(repeats):
                dist.barrier(gloo)
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            cost = info.topology.group(range(world)).cost(op, real_bytes)
            rows.append({"op": op, "bytes": real_bytes, "algorithm": cost.algorithm,
                         "modeled_ms": round(cost.time_s * 1e3, 3),
                         "measured_ms": round(statistics.median(times) * 1e3, 3),
                         "wire_bytes": cost.wire_bytes, "counted_wire_bytes": sum(m.bytes_by_tier.values())})
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.barrier(gloo)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--topology", default="wan")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.json")
        t0 = time.perf_counter()
        mp.start_processes(_worker, args=(args.world_size, str(Path(tmp) / "store"), args.topology, args.repeats, out),
                           nprocs=args.world_size, start_method="spawn")
        rows = json.loads(Path(out).read_text())
    for row in rows:
        row["ratio"] = round(row["measured_ms"] / row["modeled_ms"], 3) if row["modeled_ms"] else None
    ratios = [r["ratio"] for r in rows if r["ratio"] is not None and r["modeled_ms"] >= 2.0]
    result = {
        "benchmark": "emulator_sweep",
        "world_size": args.world_size,
        "topology": args.topology,
        "repeats": args.repeats,
        "wall_s": round(time.perf_counter() - t0, 1),
        "summary": {
            "rows_with_modeled_ms_ge_2": len(ratios),
            "median_ratio": round(statistics.median(ratios), 3) if ratios else None,
            "max_abs_error_pct": round(max(abs(r - 1) for r in ratios) * 100, 1) if ratios else None,
            "wire_bytes_agree": all(r["wire_bytes"] == r["counted_wire_bytes"] for r in rows),
        },
        "rows": rows,
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
