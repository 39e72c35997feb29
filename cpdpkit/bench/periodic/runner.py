"""Running every (strategy, period, seed) of a :class:`BenchConfig` as a launched job.

The runs of one topology are launched together (:func:`cpdpkit.bench.launcher.run_jobs`): one torchrun
launch whose ranks run them one after the other, each in a fresh process group over the emulated network
named by its spec's topology (the config's when the spec names none; with several ``topologies`` the run
folders start with the topology's name); a run with an injected fault has a launch of its own (its restart
must not rerun the others). A run that fails (a crashed rank, a diverged loss) is recorded with its
reason and the others still run. Progress reaches the caller as events: ``("start", spec)``,
``("epoch", spec, epoch, epochs)``, ``("done", spec, result)`` (the runs of a shared launch: done when
it ends).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cpdpkit.bench.data.mnist1d import load_mnist1d
from cpdpkit.bench.launcher import Job, run_job, run_jobs
from cpdpkit.bench.periodic.config import BenchConfig, RunSpec
from cpdpkit.bench.periodic.report import BenchReport, aggregate
from cpdpkit.topology import Topology, resolve_topology

__all__ = ["resolve_bench_topologies", "run_bench", "run_one", "run_together"]

Event = tuple[Any, ...]


def _run_dir(work_dir: Path, spec: RunSpec, config: BenchConfig) -> Path:
    name = spec.strategy if spec.period is None else f"{spec.strategy}-k{spec.period}"
    if spec.variant is not None:  # a swept point: "β=0.2 outer lr=0.7" -> "-b0.2-olr0.7"
        name += "-" + spec.variant.replace("outer lr=", "olr").replace("β=", "b").replace(" ", "-")
    if len(config.topology_names) > 1:
        name = f"{spec.topology or config.topology}-{name}"
    return work_dir / f"{name}-seed{spec.seed}"


def _job(run_dir: Path, spec: RunSpec, config: BenchConfig, topology: str | Topology,
         emit: Callable[[Event], None] | None = None) -> tuple[dict[str, Any], Job]:
    """Launch the worker for ``spec`` on ``config.world_size`` ranks; its result (failed: status and reason)."""
    from cpdpkit.bench.periodic import worker

    on_progress = None if emit is None else (lambda entry: emit(("epoch", spec, entry["epoch"], entry["epochs"])))
    job = run_job(run_dir, spec.to_dict(), worker_file=worker.__file__, world_size=config.world_size,
                  topology=topology, max_restarts=1 if spec.fault else 0, on_progress=on_progress)
    result = job.result if job.result is not None else {"spec": spec.to_dict(), "status": "failed",
                                                        "reason": job.reason}
    return result, job


def run_one(spec: RunSpec, config: BenchConfig, work_dir: Path, emit: Callable[[Event], None] = lambda e: None,
            *, topology: Topology | None = None) -> dict[str, Any]:
    """Launch one run and return its result (with status and reason on failure). ``topology``: the spec's,
    placed (``None``: the launcher resolves the spec's name)."""
    where = topology if topology is not None else spec.topology or config.topology
    run_dir = _run_dir(work_dir, spec, config)
    emit(("start", spec))
    result, job = _job(run_dir, spec, config, where, emit)
    _add_launch(result, job, run_dir)
    if spec.fault:
        result["restarts"] = job.restarts
        result["fault"] = _compare_with_uninterrupted(spec, config, run_dir, result, job.restarts, where)
    emit(("done", spec, result))
    return result


def _add_launch(result: dict[str, Any], job: Job, run_dir: Path) -> None:
    result["launch_s"] = job.launch_s
    result["harness_total_s"] = max(0.0, job.launch_s - float(result.get("wall_s") or 0.0))
    result["run_dir"] = str(run_dir)


def run_together(specs: list[RunSpec], config: BenchConfig, work_dir: Path,
                 emit: Callable[[Event], None] = lambda e: None, *, topology: str | Topology) -> list[dict[str, Any]]:
    """Launch ``specs`` (one topology, no fault) in ONE launch whose ranks run them one after the other; their
    results, in order, each as :func:`run_one` would return it (``launch_s``: the run's share of the launch)."""
    from cpdpkit.bench.periodic import worker

    if any(spec.fault for spec in specs):
        raise ValueError("a run with an injected fault needs a launch of its own: use run_one")
    run_dirs = [_run_dir(work_dir, spec, config) for spec in specs]
    if len(set(run_dirs)) < len(run_dirs):
        raise ValueError(f"runs sharing a run folder: {[d.name for d in run_dirs]}")
    jobs = run_jobs([(d, spec.to_dict()) for d, spec in zip(run_dirs, specs)], worker_file=worker.__file__,
                    world_size=config.world_size, topology=topology,
                    on_progress=lambda i, entry: emit(("epoch", specs[i], entry["epoch"], entry["epochs"])),
                    on_start=lambda i: emit(("start", specs[i])))
    results = []
    for spec, run_dir, job in zip(specs, run_dirs, jobs):
        result = job.result if job.result is not None else {"spec": spec.to_dict(), "status": "failed",
                                                            "reason": job.reason}
        _add_launch(result, job, run_dir)
        emit(("done", spec, result))
        results.append(result)
    return results


def _compare_with_uninterrupted(spec: RunSpec, config: BenchConfig, run_dir: Path, result: dict[str, Any],
                                restarts: int, topology: str | Topology) -> dict[str, Any]:
    """Run ``spec`` again without the fault (same checkpoints) and compare every rank's final parameters."""
    clean = dataclasses.replace(spec, fault=None)
    ref_dir = run_dir.with_name(run_dir.name + "-uninterrupted")
    reference, _ = _job(ref_dir, clean, config, topology)
    mine, theirs = result.get("final_params_sha256"), reference.get("final_params_sha256")
    return {"injected": spec.fault, "restarts": restarts, "resumed_from_step": result.get("resumed_from_step"),
            "final_params_sha256": mine, "uninterrupted_params_sha256": theirs,
            "final_params_equal_uninterrupted": bool(mine) and mine == theirs,
            "uninterrupted_status": reference.get("status"), "uninterrupted_run_dir": str(ref_dir)}


def resolve_bench_topologies(config: BenchConfig) -> dict[str, Topology]:
    """Each of ``config.topology_names`` placed on its world size (a bad one fails here, before any launch)."""
    return {name: resolve_topology(name, world_size=config.world_size) for name in config.topology_names}


def run_bench(config: BenchConfig, work_dir: Path, emit: Callable[[Event], None] = lambda e: None, *,
              topologies: dict[str, Topology] | None = None) -> BenchReport:
    """Run every (topology, strategy, period, seed) of ``config``; aggregate over seeds. ``topologies``: the
    placed topologies (:func:`resolve_bench_topologies`; resolved here when not given)."""
    placed = topologies if topologies is not None else resolve_bench_topologies(config)
    work_dir.mkdir(parents=True, exist_ok=True)
    run_config = config
    if config.dataset == "mnist1d" and config.data_dir is None:
        # generated once here (seconds), read by every rank of every run from the work folder
        load_mnist1d(work_dir, quick=config.quick)
        run_config = dataclasses.replace(config, data_dir=str(work_dir))
    runs: list[dict[str, Any]] = []
    for (name, faulty), group in itertools.groupby(run_config.runs(), lambda s: (s.topology or config.topology,
                                                                                 bool(s.fault))):
        specs = list(group)
        if faulty:
            runs += [run_one(spec, run_config, work_dir, emit, topology=placed[name]) for spec in specs]
        else:
            runs += run_together(specs, run_config, work_dir, emit, topology=placed[name])
    return aggregate(config.to_dict(), runs)
