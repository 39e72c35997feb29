"""Every way the suite starts ranks, in one module; each with a timeout, none on a fixed port.

* :func:`run_ranks` / :func:`run_many`: a Python function on N spawned gloo ranks, rendezvous through
  a TCPStore the test process hosts on port 0 (a free port chosen by the OS); results by rank.
* :func:`share_ranks` / :func:`run_shared_calls`: the 2-rank calls of many test modules on ONE pair
  of spawned ranks (the ``sync_ranks`` fixture of tests/conftest.py).
* :func:`run_spawned`, :func:`run_phases`, :func:`share_spawn` / :func:`run_shared_spawn`: entry
  points on N ``torch.multiprocessing`` processes that start their own process groups through a
  ``file://`` rendezvous (no port at all); the jobs of many test modules in ONE group of 4 processes
  (the ``planner_spawn`` fixture), :func:`share_fn` for a function written for :func:`run_ranks`.
* :func:`run_processes` / :func:`run_script_ranks`: rank *scripts* as plain processes (their exit
  codes and stderr are what a test checks, or their traces must come from processes that imported
  nothing of the test); each one's output goes to a file, so no pipe fills up.

A hung rank is killed at its timeout and the test fails naming the ranks still running.
"""

from __future__ import annotations

import gc
import io
import multiprocessing as mp
import os
import queue
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# ---- a function on N gloo ranks (TCPStore on port 0) ----------------------------------------------


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


_SHARED_CALLS: dict[str, tuple[dict[str, tuple[Callable, dict]], float, int]] = {}
# The timeout of every test that uses the shared ranks: the first one to ask waits for all of it
# (the owners' shares add up to less).
RANKS_TIMEOUT_S = 600


def share_ranks(owner: str, calls: dict[str, tuple[Callable, dict]], timeout_s: float, *, order: int = 0) -> None:
    """Put test module ``owner``'s 2-rank calls (``name: (fn, kwargs)``, run as :func:`run_ranks` would)
    on the session's one pair of spawned gloo ranks (the ``sync_ranks`` fixture of tests/conftest.py),
    one after the other on one process group. ``timeout_s`` is the owner's share of the timeout; owners
    run by ``order``, then as registered (a call that leaves its process group unusable goes last).
    ``owner`` is the module's ``__name__``, optionally with a ``:suffix`` (a module registering twice)."""
    _SHARED_CALLS[owner] = (calls, timeout_s, order)


def run_shared_calls(modules: set[str]) -> dict[str, dict[str, list[Any]]]:
    """Every call registered by the ``modules`` pytest collected, in one 2-rank job: per owner and
    call name, the results by rank."""
    shared = sorted(((o, v) for o, v in _SHARED_CALLS.items() if o.split(":")[0] in modules), key=lambda kv: kv[1][2])
    flat = [(owner, name, call) for owner, (calls, _t, _o) in shared for name, call in calls.items()]
    results = run_many([call for _o, _n, call in flat], 2, timeout_s=sum(t for _o, (_c, t, _r) in shared))
    out: dict[str, dict[str, list[Any]]] = {owner: {} for owner, _v in shared}
    for (owner, name, _call), result in zip(flat, results):
        out[owner][name] = result
    return out


# ---- entry points on N spawned processes (file:// rendezvous) -------------------------------------
def run_phases(world_size: int, tmp_path: Path, phases: list[tuple[str, Any, int, tuple]],
               timeout_s: float) -> dict[str, list[Any]]:
    """One spawned group of ``world_size`` processes runs several jobs one after the other.

    Each phase ``(name, entry, ranks, args)`` is a whole job of its own: ranks ``0..ranks-1`` call
    ``entry(rank, ranks, out/name, *args)``, which starts a new process group (its own ``file://``
    rendezvous in ``out/name``), saves ``rank<R>.pt`` and destroys the group (:func:`finish_rank`);
    the other ranks sit the phase out. What each phase's ranks saved comes back by phase name.
    Spawning (importing torch, FSDP and dynamo in every process) is paid once instead of per job."""
    out = tmp_path / "phases"
    for name, _entry_fn, _ranks, _args in phases:
        (out / name).mkdir(parents=True)
    run_spawned(_phases_entry, (str(out), phases), world_size, None, timeout_s)
    return {name: [torch.load(out / name / f"rank{r}.pt", weights_only=False) for r in range(ranks)]
            for name, _entry_fn, ranks, _args in phases}


_SHARED_PHASES: dict[str, tuple[Any, float, int]] = {}
# The timeout of every test that uses the shared group: the first one to ask waits for all of it
# (the owners' shares below add up to less).
SPAWN_TIMEOUT_S = 1320


def share_spawn(owner: str, build: Any, timeout_s: float, *, order: int = 0) -> None:
    """Put test module ``owner``'s jobs (pass ``__name__``) into the session's one spawned group of 4
    processes (the ``planner_spawn`` fixture of tests/conftest.py): ``build()`` returns its phases (as
    for :func:`run_phases`), called when the first test asks for the group; ``timeout_s`` is its share
    of the group's timeout. Owners run by ``order``, then as registered (a job that may leave its
    process's state behind, e.g. a collective that timed out, goes last)."""
    _SHARED_PHASES[owner] = (build, timeout_s, order)


def share_fn(owner: str, name: str, fn: Callable, ranks: int, timeout_s: float, *, root_kwarg: str | None = None,
             order: int = 0, **kwargs: Any) -> None:
    """Put ``fn(rank, ranks, **kwargs)`` (a function as :func:`run_ranks` runs it) into the session's
    one spawned group as job ``name`` of test module ``owner``: its ranks get a gloo process group of
    their own, and ``root_kwarg``, if given, names the keyword that gets the job's own fresh folder.
    What each rank returns comes back by rank in ``planner_spawn[owner][name]``."""
    share_spawn(owner, lambda: [(name, _fn_phase, ranks, (fn, kwargs, root_kwarg))], timeout_s, order=order)


def _fn_phase(rank: int, ranks: int, out: str, fn: Callable, kwargs: dict, root_kwarg: str | None) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=ranks,
                            timeout=timedelta(seconds=60))
    result = fn(rank, ranks, **({**kwargs, root_kwarg: out} if root_kwarg else kwargs))
    torch.save(result, Path(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def run_shared_spawn(tmp_path: Path, owners: set[str]) -> dict[str, dict[str, list[Any]]]:
    """Run the phases of every registered owner in ``owners`` (the modules whose tests were collected:
    running one test file spawns only its own jobs) in one spawned group; results by owner, then phase."""
    shared = dict(sorted(((o, v) for o, v in _SHARED_PHASES.items() if o in owners), key=lambda kv: kv[1][2]))
    phases = [(f"{owner}.{name}", entry, ranks, args) for owner, (build, _t, _o) in shared.items()
              for name, entry, ranks, args in build()]
    done = run_phases(4, tmp_path, phases, timeout_s=sum(t for _b, t, _o in shared.values()))
    out: dict[str, dict[str, list[Any]]] = {owner: {} for owner in shared}
    for key, value in done.items():
        owner, name = key.split(".", 1)
        out[owner][name] = value
    return out


def _phases_entry(rank: int, out: str, phases: list[tuple[str, Any, int, tuple]]) -> None:
    for name, entry, ranks, args in phases:
        if rank < ranks:
            _forget_earlier_meshes()
            entry(rank, ranks, str(Path(out, name)), *args)


def _forget_earlier_meshes() -> None:
    """Start a phase with DTensor's process-wide caches empty, as in a fresh process.

    Its sharding-propagation caches (Python and C++) key on DeviceMesh equality (ranks, layout, dim
    names), so a new phase's mesh would hit entries holding an earlier phase's mesh, whose process
    groups were destroyed (or, since c10d numbers groups from 0 again, renamed)."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    import torch.distributed.tensor._random as dtensor_random
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()
    clear_redistribute_planner_cache()
    dtensor_random._rng_tracker = None
    gc.collect()


def run_spawned(entry: Any, args: tuple, world_size: int, out: Path | None, timeout_s: float) -> list[Any]:
    """Start ``entry(rank, *args)`` on ``world_size`` spawned processes, kill them all after
    ``timeout_s``, and return what each rank saved as ``out/rank<R>.pt``."""
    import torch.multiprocessing as tmp

    ctx = tmp.start_processes(entry, args=args, nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"{world_size} ranks did not finish in {timeout_s} s")
    if out is None:
        return []
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


# ---- rank scripts as plain processes -------------------------------------------------------------
@dataclass
class Ended:
    """One rank process, once it ended: exit code, output (stderr, or stdout and stderr together),
    and when it ended after the start of all of them."""

    returncode: int
    output: str
    ended_after_s: float


def run_processes(commands: list[list[str]], *, wall_s: float, env: dict[str, str] | None = None,
                  with_stdout: bool = False) -> list[Ended]:
    """Start one process per command (rank order) and wait for all of them, at most ``wall_s``: then
    every process still running is killed and the test fails naming those ranks (a hang)."""
    with tempfile.TemporaryDirectory(prefix="ranks") as logs:
        files = [open(Path(logs, f"rank{r}.log"), "w+", encoding="utf-8") for r in range(len(commands))]
        try:
            procs = [subprocess.Popen(cmd, stdout=f if with_stdout else subprocess.DEVNULL, stderr=f, text=True,
                                      env=env) for cmd, f in zip(commands, files)]
            t0 = time.monotonic()
            ended: dict[int, float] = {}
            while len(ended) < len(procs):
                for r, p in enumerate(procs):
                    if r not in ended and p.poll() is not None:
                        ended[r] = time.monotonic() - t0
                if time.monotonic() - t0 > wall_s:
                    for p in procs:
                        p.kill()
                        p.wait()
                    raise AssertionError(f"ranks {sorted(set(range(len(procs))) - set(ended))} still running "
                                         f"after {wall_s} s: a hang")
                time.sleep(0.02)
            out = []
            for r, (p, f) in enumerate(zip(procs, files)):
                f.seek(0)
                out.append(Ended(p.returncode, f.read(), ended[r]))
            return out
        finally:
            for f in files:
                f.close()


def run_script_ranks(script: Path, tmp_path: Path, *args: str, world: int = 2, timeout_s: float = 100) -> Path:
    """Run a workload script as ``world`` ranks (``script RANK WORLD STORE OUT *args``, rendezvous
    through a FileStore in ``tmp_path``); the folder they wrote to (``tmp_path/run``). Fails with
    the ranks' logs unless every rank exits 0."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "run"
    runs = run_processes([[sys.executable, str(script), str(rank), str(world), str(tmp_path / "store"), str(out),
                           *args] for rank in range(world)], wall_s=timeout_s, with_stdout=True)
    assert all(r.returncode == 0 for r in runs), "\n".join(r.output for r in runs)
    return out
