"""The one way every ``cpdpkit bench`` suite launches ranks, and the files a run folder holds.

In the parent, :func:`run_job` writes ``RUN_DIR/spec.json``, launches ``world_size`` ranks of a
suite's worker under torch's launcher (through :mod:`cpdpkit.launch`) over the placed topology,
relays each line rank 0 appends to ``RUN_DIR/progress.jsonl`` while the job runs, and reads the
``RUN_DIR/result.json`` rank 0 wrote. :func:`run_jobs` runs several jobs one after the other in one
launch (the main job, :mod:`cpdpkit.bench.periodic.runner`: every (strategy, period, seed) of a
topology); :func:`run_per_strategy` runs one launched job per strategy (the sharding and hybrid
suites). On every rank, :func:`read_spec` / :func:`read_specs` read the specs, :func:`job_store` gives
each job of a launch its own rendezvous, and :func:`finish_rank` hands the result back.
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

__all__ = ["SPEC_FILE", "RESULT_FILE", "PROGRESS_FILE", "Job", "run_job", "run_jobs", "run_per_strategy", "read_spec",
           "read_specs", "job_store", "finish_rank"]

SPEC_FILE, RESULT_FILE, PROGRESS_FILE = "spec.json", "result.json", "progress.jsonl"


@dataclass(frozen=True)
class Job:
    """One launched job, as the parent saw it."""

    result: dict[str, Any] | None  # what rank 0 wrote; None when the job failed or wrote nothing
    reason: str  # why there is no result ("" when there is one)
    restarts: int  # torch elastic's restarts of the job (only with max_restarts)
    launch_s: float  # wall clock of the job's launch (its share of one shared by several jobs), start-up included


def _prepare(run_dir: Path, spec: dict[str, Any]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in (RESULT_FILE, PROGRESS_FILE):
        (run_dir / stale).unlink(missing_ok=True)
    shutil.rmtree(run_dir / "ckpt", ignore_errors=True)  # a run never resumes from an earlier bench's checkpoints
    (run_dir / SPEC_FILE).write_text(json.dumps(spec, indent=1))


class _Watcher:
    """Polls the run folders of one launch's jobs (run one after the other by the same ranks): relays each
    progress line rank 0 appends, and notes when each job's result appears (the next job has then started)."""

    def __init__(self, run_dirs: list[Path], on_progress: Callable[[int, dict[str, Any]], None] | None,
                 on_start: Callable[[int], None]) -> None:
        self.run_dirs, self.on_progress, self.on_start = run_dirs, on_progress, on_start
        self.seen = [0] * len(run_dirs)  # progress lines relayed, per job
        self.ended: list[float] = []  # perf_counter when each finished job's result was first seen, in job order
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self.stop.wait(0.2):
            self.poll()

    def poll(self) -> None:
        index = 0
        while index < len(self.run_dirs) and index <= len(self.ended):  # the jobs finished, and the one running
            run_dir = self.run_dirs[index]
            if self.on_progress is not None:
                self._relay(index, run_dir / PROGRESS_FILE)
            if index == len(self.ended) and (run_dir / RESULT_FILE).exists():
                self.ended.append(time.perf_counter())
                if index + 1 < len(self.run_dirs):
                    self.on_start(index + 1)
            index += 1

    def _relay(self, index: int, path: Path) -> None:
        if not path.exists():
            return
        for line in path.read_text().splitlines()[self.seen[index]:]:
            try:
                entry = json.loads(line)
            except ValueError:
                break  # a line still being written; read it next time
            assert self.on_progress is not None
            self.on_progress(index, entry)
            self.seen[index] += 1


def run_job(run_dir: Path, spec: dict[str, Any], *, worker_file: str, world_size: int, topology: str | Topology,
            max_restarts: int = 0, on_progress: Callable[[dict[str, Any]], None] | None = None) -> Job:
    """Launch ``worker_file RUN_DIR`` on ``world_size`` ranks over ``topology`` with ``spec`` in ``RUN_DIR``.

    A job that fails or writes no result has ``result=None`` and the failing rank's one-line error as
    ``reason``; ``on_progress`` receives each progress line (a dict) while the job runs.
    """
    relay = None if on_progress is None else (lambda _index, entry: on_progress(entry))
    return run_jobs([(run_dir, spec)], worker_file=worker_file, world_size=world_size, topology=topology,
                    max_restarts=max_restarts, on_progress=relay)[0]


def run_jobs(jobs: list[tuple[Path, dict[str, Any]]], *, worker_file: str, world_size: int,
             topology: str | Topology, max_restarts: int = 0,
             on_progress: Callable[[int, dict[str, Any]], None] | None = None,
             on_start: Callable[[int], None] = lambda index: None) -> list[Job]:
    """Run several jobs ``(RUN_DIR, spec)`` one after the other in ONE launch: ``worker_file RUN_DIR...`` on
    ``world_size`` ranks over ``topology``, each rank running the jobs in turn (:func:`read_specs`,
    :func:`job_store`); the ranks' start-up (torch's imports, the launcher) is paid once instead of per job.

    A job whose rank fails ends that launch: it gets ``result=None`` and the failing rank's one-line error,
    and the jobs after it are launched again without it (as they would have run after a failed launch of
    their own). A job's ``launch_s`` is its share of the launch: from the end of the job before it (the
    start of the launch for the first) to its result (the end of the launch for the last), start-up
    included. While the jobs run, ``on_start(index)`` is called as job ``index`` starts (as the job before
    it wrote its result) and ``on_progress(index, line)`` with each progress line of job ``index``.
    """
    from cpdpkit.launch import LaunchConfig, launch

    for run_dir, spec in jobs:
        _prepare(run_dir, spec)
    done: list[Job] = []
    while len(done) < len(jobs):
        first = len(done)
        pending = [run_dir for run_dir, _spec in jobs[first:]]
        relay = None if on_progress is None else (lambda i, e, first=first: on_progress(first + i, e))
        watcher = _Watcher(pending, relay, lambda i, first=first: on_start(first + i))
        on_start(first)
        watcher.thread.start()
        start = time.perf_counter()
        try:
            res = launch(LaunchConfig(nproc_per_node=world_size, topology=topology, log_dir=str(pending[0] / "logs"),
                                      max_restarts=max_restarts), worker_file, [str(d) for d in pending])
        finally:
            watcher.stop.set()
            watcher.thread.join()
        end = time.perf_counter()
        watcher.poll()  # results written after the last poll
        ends = [*watcher.ended]
        ran = pending[: len(ends)]
        if len(ran) == len(pending):
            ends[-1] = end  # the last job's share includes the ranks' exit
        marks = [start, *ends]
        for i, run_dir in enumerate(ran):
            done.append(Job(json.loads((run_dir / RESULT_FILE).read_text()), "", res.restarts, marks[i + 1] - marks[i]))
        if len(ran) < len(pending):  # the next job failed (or the launch ended without its result)
            reason = (f"rank {res.failed_rank}: {res.error}" if not res.ok
                      else "launch exited with code 0 and wrote no result")
            done.append(Job(None, reason, res.restarts, end - marks[len(ran)]))
    return done


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
    return read_specs(argv[:1])[0]


def read_specs(argv: list[str]) -> list[tuple[Path, dict[str, Any]]]:
    """``argv`` is ``[RUN_DIR, ...]`` (:func:`run_jobs`): each job's run folder and spec, in the order to run them."""
    return [(Path(arg), json.loads(Path(arg, SPEC_FILE).read_text())) for arg in argv]


_BASE_STORE: list[Any] = []  # torchrun's store (env://), connected once per process


def job_store(index: int) -> Any:
    """The store job ``index`` of this launch rendezvous through: torchrun's (``env://``) under a prefix of the
    job's own (and of the restart attempt's), so no job reads an earlier one's keys (its gloo peers'
    addresses): c10d names the default group the same after each ``destroy_process_group``."""
    import os

    import torch.distributed as dist
    from torch.distributed.rendezvous import rendezvous

    if not _BASE_STORE:
        _BASE_STORE.append(next(rendezvous("env://"))[0])
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"cpdpkit/attempt{attempt}/job{index}", _BASE_STORE[0])


def finish_rank(run_dir: Path, rank: int, result: dict[str, Any]) -> None:
    """Rank 0 writes ``run_dir/result.json``; every rank then leaves the process group cleanly."""
    import torch.distributed as dist

    if rank == 0:
        (run_dir / RESULT_FILE).write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()
