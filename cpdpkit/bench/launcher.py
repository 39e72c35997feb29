"""The one way every ``cpdpkit bench`` suite launches ranks, and the files a run folder holds.

In the parent, :func:`run_job` writes ``RUN_DIR/spec.json``, launches ``world_size`` ranks of a
suite's worker under torch's launcher (through :mod:`cpdpkit.launch`) over the placed topology,
relays each line rank 0 appends to ``RUN_DIR/progress.jsonl`` while the job runs, and reads the
``RUN_DIR/result.json`` rank 0 wrote. :func:`run_per_strategy` runs one such job per strategy
(the sharding and hybrid suites); the main job (:mod:`cpdpkit.bench.periodic.runner`) runs one
per (topology, strategy, period, seed). On every rank, :func:`read_spec` reads the spec and
:func:`finish_rank` hands the result back.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cpdpkit.topology import Topology

__all__ = ["SPEC_FILE", "RESULT_FILE", "PROGRESS_FILE", "Job", "run_job", "run_per_strategy", "read_spec",
           "finish_rank"]

SPEC_FILE, RESULT_FILE, PROGRESS_FILE = "spec.json", "result.json", "progress.jsonl"


@dataclass(frozen=True)
class Job:
    """One launched job, as the parent saw it."""

    result: dict[str, Any] | None  # what rank 0 wrote; None when the job failed or wrote nothing
    reason: str  # why there is no result ("" when there is one)
    restarts: int  # torch elastic's restarts of the job (only with max_restarts)
    launch_s: float  # wall clock of the whole launch, start-up included


def _prepare(run_dir: Path, spec: dict[str, Any]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in (RESULT_FILE, PROGRESS_FILE):
        (run_dir / stale).unlink(missing_ok=True)
    shutil.rmtree(run_dir / "ckpt", ignore_errors=True)  # a run never resumes from an earlier bench's checkpoints
    (run_dir / SPEC_FILE).write_text(json.dumps(spec, indent=1))


def _watch(path: Path, on_progress: Callable[[dict[str, Any]], None], stop: threading.Event) -> None:
    seen = 0
    while not stop.wait(0.2):
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[seen:]:
            try:
                entry = json.loads(line)
            except ValueError:
                break  # a line still being written; read it next time
            on_progress(entry)
            seen += 1


def run_job(run_dir: Path, spec: dict[str, Any], *, worker_file: str, world_size: int, topology: str | Topology,
            max_restarts: int = 0, on_progress: Callable[[dict[str, Any]], None] | None = None) -> Job:
    """Launch ``worker_file RUN_DIR`` on ``world_size`` ranks over ``topology`` with ``spec`` in ``RUN_DIR``.

    A job that fails or writes no result has ``result=None`` and the failing rank's one-line error as
    ``reason``; ``on_progress`` receives each progress line (a dict) while the job runs.
    """
    from cpdpkit.launch import LaunchConfig, launch

    _prepare(run_dir, spec)
    stop = threading.Event()
    watcher = None
    if on_progress is not None:
        watcher = threading.Thread(target=_watch, args=(run_dir / PROGRESS_FILE, on_progress, stop), daemon=True)
        watcher.start()
    start = time.perf_counter()
    try:
        res = launch(LaunchConfig(nproc_per_node=world_size, topology=topology, log_dir=str(run_dir / "logs"),
                                  max_restarts=max_restarts), worker_file, [str(run_dir)])
    finally:
        stop.set()
        if watcher is not None:
            watcher.join()
    launch_s = time.perf_counter() - start
    path = run_dir / RESULT_FILE
    if res.ok and path.exists():
        return Job(json.loads(path.read_text()), "", res.restarts, launch_s)
    reason = f"rank {res.failed_rank}: {res.error}" if not res.ok else "launch exited with code 0 and wrote no result"
    return Job(None, reason, res.restarts, launch_s)


def run_per_strategy(strategies: Iterable[str], *, work_dir: Path, topology: Topology, world_size: int,
                     worker_file: str, spec_for: Callable[[str], dict[str, Any]],
                     emit: Callable[[tuple[Any, ...]], None],
                     unsupported: Callable[[str], str | None] = lambda s: None) -> list[dict[str, Any]]:
    """Run each strategy as its own job in ``work_dir/<strategy>``; one result dict per strategy, in order.

    ``spec_for(strategy)`` is what the job's ranks read; a strategy with an ``unsupported`` reason is
    reported ``unsupported`` without a launch; a job that fails or writes nothing is reported
    ``failed`` with the failing rank's one-line error. Events: ``("start", strategy)``,
    ``("done", strategy, result)``.
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for strategy in strategies:
        emit(("start", strategy))
        if (reason := unsupported(strategy)) is not None:
            result = {"strategy": strategy, "status": "unsupported", "reason": reason, "launch_s": 0.0}
        else:
            job = run_job(work_dir / strategy, spec_for(strategy), worker_file=worker_file, world_size=world_size,
                          topology=topology)
            result = job.result if job.result is not None else {"strategy": strategy, "status": "failed",
                                                                "reason": job.reason}
            result["launch_s"] = job.launch_s
        results.append(result)
        emit(("done", strategy, result))
    return results


# ---- every rank ---------------------------------------------------------------------------------------------
def read_spec(argv: list[str]) -> tuple[Path, dict[str, Any]]:
    """``argv`` is ``[RUN_DIR]``: the run folder and the spec the parent wrote into it."""
    run_dir = Path(argv[0])
    return run_dir, json.loads((run_dir / SPEC_FILE).read_text())


def finish_rank(run_dir: Path, rank: int, result: dict[str, Any]) -> None:
    """Rank 0 writes ``run_dir/result.json``; every rank then leaves the process group cleanly."""
    import torch.distributed as dist

    if rank == 0:
        (run_dir / RESULT_FILE).write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()
