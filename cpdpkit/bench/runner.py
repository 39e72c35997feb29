"""Running every (strategy, period, seed) of a :class:`BenchConfig` as its own launched job.

Each run is a fresh set of processes under torch's launcher (through :mod:`cpdpkit.launch`),
over the emulated network named by its spec's topology (the config's when the spec names none;
with several ``topologies`` the run folders start with the topology's name). A run that fails (a crashed rank,
a diverged loss) is recorded with its reason and the others still run. Progress reaches the
caller as events: ``("start", spec)``, ``("epoch", spec, epoch, epochs)``,
``("done", spec, result)``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cpdpkit.bench.config import BenchConfig, RunSpec
from cpdpkit.bench.report import BenchReport, aggregate
from cpdpkit.bench.worker import PROGRESS_FILE, RESULT_FILE, SPEC_FILE

__all__ = ["run_bench", "run_one"]

Event = tuple[Any, ...]


def _run_dir(work_dir: Path, spec: RunSpec, config: BenchConfig) -> Path:
    name = spec.strategy if spec.period is None else f"{spec.strategy}-k{spec.period}"
    if len(config.topology_names) > 1:
        name = f"{spec.topology or config.topology}-{name}"
    return work_dir / f"{name}-seed{spec.seed}"


def _launch(run_dir: Path, config: BenchConfig, topology: str) -> tuple[int, str]:
    """Launch the worker on ``config.world_size`` ranks over ``topology``; ``(exit code, error line)``."""
    from cpdpkit.bench import worker
    from cpdpkit.launch import LaunchConfig, launch

    result = launch(
        LaunchConfig(nproc_per_node=config.world_size, topology=topology,
                     log_dir=str(run_dir / "logs")),
        worker.__file__, [str(run_dir)],
    )
    if result.ok:
        return 0, ""
    return result.exit_code, f"rank {result.failed_rank}: {result.error}"


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


def run_one(spec: RunSpec, config: BenchConfig, work_dir: Path,
            emit: Callable[[Event], None] = lambda e: None) -> dict[str, Any]:
    """Launch one run and return its result (with status and reason on failure)."""
    run_dir = _run_dir(work_dir, spec, config)
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in (RESULT_FILE, PROGRESS_FILE):
        (run_dir / stale).unlink(missing_ok=True)
    (run_dir / SPEC_FILE).write_text(json.dumps(spec.to_dict(), indent=1))
    emit(("start", spec))
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(run_dir, spec, emit, stop), daemon=True)
    watcher.start()
    start = time.perf_counter()
    try:
        code, error = _launch(run_dir, config, spec.topology or config.topology)
    finally:
        stop.set()
        watcher.join()
    launch_s = time.perf_counter() - start
    result_path = run_dir / RESULT_FILE
    if code == 0 and result_path.exists():
        result = json.loads(result_path.read_text())
    else:
        reason = error or f"launch exited with code {code} and wrote no result"
        result = {"spec": spec.to_dict(), "status": "failed", "reason": reason}
    result["launch_s"] = launch_s
    result["harness_total_s"] = max(0.0, launch_s - float(result.get("wall_s") or 0.0))
    result["run_dir"] = str(run_dir)
    emit(("done", spec, result))
    return result


def run_bench(config: BenchConfig, work_dir: Path,
              emit: Callable[[Event], None] = lambda e: None) -> BenchReport:
    """Run every (topology, strategy, period, seed) of ``config``; aggregate over seeds."""
    work_dir.mkdir(parents=True, exist_ok=True)
    runs = [run_one(spec, config, work_dir, emit) for spec in config.runs()]
    return aggregate(config.to_dict(), runs)
