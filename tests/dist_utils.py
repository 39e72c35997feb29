"""Run a function on N real gloo ranks (spawned processes) and collect what each returns.

Rendezvous goes through a TCPStore the test process hosts on port 0 (a free port chosen by
the OS), so tests never collide on a fixed port. Every run has a timeout: a hung rank is
killed and the test fails with the ranks' errors.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["run_ranks"]


def _child(rank: int, world: int, port: int, fn: Callable, kwargs: dict, out: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False,
                              timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        result = fn(rank, world, **kwargs)
        dist.barrier()
        dist.destroy_process_group()
        buf = io.BytesIO()
        torch.save(result, buf)  # bytes, not shared-memory handles that die with the child
        out.put((rank, "ok", buf.getvalue()))
    except BaseException:  # report everything, including assertion errors in scenarios
        out.put((rank, "error", traceback.format_exc()))


def run_ranks(fn: Callable, world: int, *, timeout_s: float = 120.0, **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world, **kwargs)`` on ``world`` gloo ranks; return results by rank."""
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True,
                          timeout=timedelta(seconds=60), wait_for_workers=False)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(r, world, store.port, fn, kwargs, out), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world):
            rank, status, payload = out.get(timeout=timeout_s)
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"rank {rank}:\n{payload}")
                break
    except queue.Empty:
        errors.append(f"timed out after {timeout_s}s waiting for ranks {sorted(set(range(world)) - set(results))}")
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("distributed run failed: " + "\n".join(errors))
    return [results[r] for r in range(world)]
