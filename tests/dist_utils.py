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

__all__ = ["SHARED_TIMEOUT_S", "run_many", "run_ranks", "run_shared", "share_ranks"]


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


def _many(rank: int, world: int, calls: list[tuple[Callable, dict]]) -> list[Any]:
    return [fn(rank, world, **kwargs) for fn, kwargs in calls]


def run_many(calls: list[tuple[Callable, dict]], world: int, *, timeout_s: float = 120.0) -> list[list[Any]]:
    """Run several ``(fn, kwargs)`` one after the other on the same ``world`` gloo ranks (one spawn,
    one process group); returns, per call, the results by rank (as :func:`run_ranks` would)."""
    by_rank = run_ranks(_many, world, timeout_s=timeout_s, calls=calls)
    return [[by_rank[r][i] for r in range(world)] for i in range(len(calls))]


_SHARED: dict[str, tuple[dict[str, tuple[Callable, dict]], float, int]] = {}
# The timeout of every test that uses the shared ranks: the first one to ask waits for all of it
# (the owners' shares add up to less).
SHARED_TIMEOUT_S = 600


def share_ranks(owner: str, calls: dict[str, tuple[Callable, dict]], timeout_s: float, *, order: int = 0) -> None:
    """Put test module ``owner``'s 2-rank calls (``name: (fn, kwargs)``, run as :func:`run_ranks` would)
    on the session's one pair of spawned gloo ranks (the ``sync_ranks`` fixture of tests/conftest.py),
    one after the other on one process group. ``timeout_s`` is the owner's share of the timeout; owners
    run by ``order``, then as registered (a call that leaves its process group unusable goes last).
    ``owner`` is the module's ``__name__``, optionally with a ``:suffix`` (a module registering twice)."""
    _SHARED[owner] = (calls, timeout_s, order)


def run_shared(modules: set[str]) -> dict[str, dict[str, list[Any]]]:
    """Every call registered by the ``modules`` pytest collected, in one 2-rank job: per owner and
    call name, the results by rank."""
    shared = sorted(((o, v) for o, v in _SHARED.items() if o.split(":")[0] in modules), key=lambda kv: kv[1][2])
    flat = [(owner, name, call) for owner, (calls, _t, _o) in shared for name, call in calls.items()]
    results = run_many([call for _o, _n, call in flat], 2, timeout_s=sum(t for _o, (_c, t, _r) in shared))
    out: dict[str, dict[str, list[Any]]] = {owner: {} for owner, _v in shared}
    for (owner, name, _call), result in zip(flat, results):
        out[owner][name] = result
    return out
