"""Running every (strategy, period, seed) of a :class:`BenchConfig` as its own launched job.

Each run is a fresh set of processes under torch's launcher (through :mod:`cpdpkit.launch`),
over the emulated network named by its spec's topology (the config's when the spec names none;
with several ``topologies`` the run folders start with the topology's name). A run that fails (a crashed rank,
a diverged loss) is recorded with its reason and the others still run. Progress reaches the
caller as events: ``("start", spec)``, ``("epoch", spec, epoch, epochs)``,
``("done", spec, result)``.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cpdpkit.bench.config import BenchConfig, RunSpec
from cpdpkit.bench.mnist1d import load_mnist1d
from cpdpkit.bench.report import BenchReport, aggregate
from cpdpkit.bench.worker import PROGRESS_FILE, RESULT_FILE, SPEC_FILE
from cpdpkit.topology import Topology, resolve_topology

__all__ = ["resolve_bench_topologies", "run_bench", "run_one"]

Event = tuple[Any, ...]


def _run_dir(work_dir: Path, spec: RunSpec, config: BenchConfig) -> Path:
    name = spec.strategy if spec.period is None else f"{spec.strategy}-k{spec.period}"
    if spec.variant is not None:  # a swept point: "β=0.2 outer lr=0.7" -> "-b0.2-olr0.7"
        name += "-" + spec.variant.replace("outer lr=", "olr").replace("β=", "b").replace(" ", "-")
    if len(config.topology_names) > 1:
        name = f"{spec.topology or config.topology}-{name}"
    return work_dir / f"{name}-seed{spec.seed}"


def _launch(run_dir: Path, config: BenchConfig, topology: str | Topology, *,
            max_restarts: int = 0) -> tuple[int, str, int]:
    """Launch the worker on ``config.world_size`` ranks over ``topology``; ``(exit code, error line, restarts)``."""
    from cpdpkit.bench import worker
    from cpdpkit.launch import LaunchConfig, launch

    result = launch(
        LaunchConfig(nproc_per_node=config.world_size, topology=topology,
                     log_dir=str(run_dir / "logs"), max_restarts=max_restarts),
        worker.__file__, [str(run_dir)],
    )
    if result.ok:
        return 0, "", result.restarts
    return result.exit_code, f"rank {result.failed_rank}: {result.error}", result.restarts


def _watch(run_dir: Path, spec: RunSpec, emit: Callable[[Event], None], stop: threading.Event) -> None:
    seen = 0
    path = run_dir / PROGRESS_FILE
    while not stop.wait(0.2):
        if not path.exists():
            continue
        lines = path.read_text().splitlines()
        for line in lines[seen:]:
            try:
                entry = json.loads(line)
            except ValueError:
                break  # a line still being written; read it next time
            emit(("epoch", spec, entry["epoch"], entry["epochs"]))
            seen += 1


def run_one(spec: RunSpec, config: BenchConfig, work_dir: Path, emit: Callable[[Event], None] = lambda e: None,
            *, topology: Topology | None = None) -> dict[str, Any]:
    """Launch one run and return its result (with status and reason on failure). ``topology``: the spec's,
    placed (``None``: the launcher resolves the spec's name)."""
    where = topology if topology is not None else spec.topology or config.topology
    run_dir = _run_dir(work_dir, spec, config)
    _prepare(run_dir, spec)
    emit(("start", spec))
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(run_dir, spec, emit, stop), daemon=True)
    watcher.start()
    start = time.perf_counter()
    try:
        code, error, restarts = _launch(run_dir, config, where, max_restarts=1 if spec.fault else 0)
    finally:
        stop.set()
        watcher.join()
    launch_s = time.perf_counter() - start
    result = _read_result(run_dir, spec, code, error)
    result["launch_s"] = launch_s
    result["harness_total_s"] = max(0.0, launch_s - float(result.get("wall_s") or 0.0))
    result["run_dir"] = str(run_dir)
    if spec.fault:
        result["restarts"] = restarts
        result["fault"] = _compare_with_uninterrupted(spec, config, run_dir, result, restarts, where)
    emit(("done", spec, result))
    return result


def _prepare(run_dir: Path, spec: RunSpec) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in (RESULT_FILE, PROGRESS_FILE):
        (run_dir / stale).unlink(missing_ok=True)
    shutil.rmtree(run_dir / "ckpt", ignore_errors=True)  # a run never resumes from an earlier bench's checkpoints
    (run_dir / SPEC_FILE).write_text(json.dumps(spec.to_dict(), indent=1))


def _read_result(run_dir: Path, spec: RunSpec, code: int, error: str) -> dict[str, Any]:
    result_path = run_dir / RESULT_FILE
    if code == 0 and result_path.exists():
        return json.loads(result_path.read_text())
    reason = error or f"launch exited with code {code} and wrote no result"
    return {"spec": spec.to_dict(), "status": "failed", "reason": reason}


def _compare_with_uninterrupted(spec: RunSpec, config: BenchConfig, run_dir: Path, result: dict[str, Any],
                                restarts: int, topology: str | Topology) -> dict[str, Any]:
    """Run ``spec`` again without the fault (same checkpoints) and compare every rank's final parameters."""
    clean = dataclasses.replace(spec, fault=None)
    ref_dir = run_dir.with_name(run_dir.name + "-uninterrupted")
    _prepare(ref_dir, clean)
    code, error, _ = _launch(ref_dir, config, topology)
    reference = _read_result(ref_dir, clean, code, error)
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
    runs = [run_one(spec, run_config, work_dir, emit, topology=placed[spec.topology or config.topology])
            for spec in run_config.runs()]
    return aggregate(config.to_dict(), runs)
