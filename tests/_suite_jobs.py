"""The bench suites' CLI runs (``cpdpkit bench sharding`` / ``cpdpkit bench hybrid``) with their jobs on the
session's one spawned group of 4 processes (the ``planner_spawn`` fixture of tests/conftest.py) instead of
one torchrun launch per strategy.

A quick suite's job trains for about 1 s and spends about 12 s (quiet machine; 30-60 s loaded) starting its
4 ranks under torchrun, each importing torch and FSDP; the shared group has paid that once.
:func:`share_suite` registers, at import, a CLI run whose jobs go into the shared group: when the group
starts, the real CLI runs in-process with :func:`cpdpkit.bench.launcher.run_job` recording each job (its
spec, worker, world size and placed topology) instead of launching it, and each recorded job becomes a
phase: the suite's own worker ``main(RUN_DIR)`` on the job's ranks, in an emulated process group placed on
the job's topology, as torchrun's ranks have it (``$CPDPKIT_TOPOLOGY``, ``RANK``, ``WORLD_SIZE``: the
worker's ``init_distributed()`` finds the group started and returns it). :func:`run_suite` then runs the
same CLI again with ``run_job`` handing back what each job's rank 0 wrote, after checking that the CLI asks
for exactly the job that ran. Not exercised here: torchrun and ``cpdpkit._child`` around the worker
(tests/test_bench_e2e.py and tests/test_launch.py launch through them).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from typer.testing import CliRunner, Result

import _ranks

# A suite's share of the shared group's timeout (its 4-5 jobs: ~2 s each quiet, up to ~15 s loaded).
SUITE_TIMEOUT_S = 90.0
_RECORDED: dict[str, list[dict[str, Any]]] = {}  # owner -> the jobs its CLI run asked for, in order


def _cli(args: list[str], run_job: Any) -> Result:
    from cpdpkit.bench import launcher
    from cpdpkit.cli import app

    with mock.patch.object(launcher, "run_job", run_job):  # run_per_strategy's one launch call
        return CliRunner().invoke(app, ["bench", *args])


def _job(spec: dict[str, Any], worker_file: str, world_size: int, topology: Any) -> dict[str, Any]:
    """One job as the CLI asks for it: its spec, its worker (a module name the spawned ranks import), its ranks
    and its placed topology (as the TOML the launcher hands the ranks)."""
    worker = next(name for name, module in sys.modules.items() if getattr(module, "__file__", None) == worker_file)
    return {"spec": spec, "worker": worker, "world_size": world_size, "topology": topology.to_toml()}


def share_suite(owner: str, args: list[str]) -> None:
    """Run ``cpdpkit bench ARGS``'s jobs in the shared group as test module ``owner``'s phases (one per
    strategy that launches; ``ARGS`` without output options, which :func:`run_suite` adds)."""

    def build() -> list[tuple[str, Any, int, tuple]]:
        from cpdpkit.bench.launcher import Job

        jobs: list[dict[str, Any]] = []

        def record(run_dir: Path, spec: dict[str, Any], *, worker_file: str, world_size: int, topology: Any,
                   **_: Any) -> Job:
            jobs.append(_job(spec, worker_file, world_size, topology))
            return Job(None, "recorded, not launched", 0, 0.0)

        result = _cli(args, record)
        assert jobs, result.output  # a refusal: nothing to run
        _RECORDED[owner] = jobs
        return [(job["spec"]["strategy"], _job_phase, job["world_size"], (job["worker"], job["spec"], job["topology"]))
                for job in jobs]

    _ranks.share_spawn(owner, build, SUITE_TIMEOUT_S, order=1)


def run_suite(owner: str, args: list[str], planner_spawn: dict[str, dict[str, list[Any]]]) -> Result:
    """``cpdpkit bench ARGS`` (``share_suite``'s arguments and output options) in-process, each job's result
    the one its phase produced in the shared group; fails if the CLI asks for a job other than the one that ran."""
    from cpdpkit.bench.launcher import Job

    jobs = iter(_RECORDED[owner])
    done = planner_spawn[owner]

    def replay(run_dir: Path, spec: dict[str, Any], *, worker_file: str, world_size: int, topology: Any,
               **_: Any) -> Job:
        ran = next(jobs)
        assert _job(spec, worker_file, world_size, topology) == ran, (spec, ran["spec"])
        result, launch_s = done[spec["strategy"]][0]
        return Job(result, "", 0, launch_s)

    return _cli(args, replay)


def _job_phase(rank: int, ranks: int, out: str, worker: str, spec: dict[str, Any], topology_toml: str) -> None:
    """One job's rank: the suite's worker on its own run folder (rank 0's gets the result, as under torchrun)."""
    from cpdpkit._env import TOPOLOGY_ENV
    from cpdpkit.bench.launcher import RESULT_FILE, SPEC_FILE
    from cpdpkit.emulator import init_distributed

    start = time.perf_counter()
    run_dir = Path(out, f"rank{rank}")
    run_dir.mkdir()
    (run_dir / SPEC_FILE).write_text(json.dumps(spec))
    (run_dir / "topology.toml").write_text(topology_toml, encoding="utf-8")
    env = {TOPOLOGY_ENV: str(run_dir / "topology.toml"), "RANK": str(rank), "LOCAL_RANK": str(rank),
           "WORLD_SIZE": str(ranks)}
    with mock.patch.dict(os.environ, env):  # restored afterwards, as the process had them
        init_distributed(init_method=f"file://{out}/store", rank=rank, world_size=ranks)
        importlib.import_module(worker).main([str(run_dir)])  # its finish_rank destroys the group
    result = json.loads((run_dir / RESULT_FILE).read_text()) if rank == 0 else None
    torch.save((result, time.perf_counter() - start), Path(out, f"rank{rank}.pt"))
