"""Trace capture: record one rank's torch.profiler trace where ``cpdpkit profile`` reads it.

A run folder holds one Chrome-trace file per rank, named ``<worker>.pt.trace.json[.gz]``
(torch-tb-profiler's layout, so the same folder opens in TensorBoard), and a small
``run.json`` describing the run (strategy, period, topology, world size, ...) that the
analysis in :mod:`cpdpkit.profiler` uses to label and group results.

Usage on every rank::

    with trace_rank("runs/cpdp", schedule=default_schedule(active=6),
                    run_info={"strategy": "cpdp", "period": 4}) as prof:
        for batch in loader:
            train_step(batch)
            prof.step()          # marks ProfilerStep#N, the analysis' unit of a step

``schedule=None`` records the whole block, still marking a ``ProfilerStep#N`` at every
``prof.step()``. Files are written to a temporary name first and renamed, so a reader never
sees a half-written trace.

Code that did not open the block (a script run by ``cpdpkit launch --profile``) reaches the
profiler through :func:`active_profiler`.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerAction, ProfilerActivity, profile
from torch.profiler import schedule as _torch_schedule

__all__ = [
    "trace_rank",
    "active_profiler",
    "write_run_json",
    "default_schedule",
    "record_all_schedule",
    "trace_file_name",
    "RUN_JSON",
    "TRACE_SUFFIX",
]

RUN_JSON = "run.json"
TRACE_SUFFIX = ".pt.trace.json"

# The profiler of the open ``trace_rank`` block. A ContextVar, not a module global that other
# modules assign: ``trace_rank`` sets it on enter and resets it with the token on exit (an exception
# included), so the value lives exactly as long as the block and only this module writes it. Like
# ``prof.step()`` it belongs to the thread that runs the block: a thread started inside the block
# starts from an empty context and sees None.
_ACTIVE_PROFILER: ContextVar[profile | None] = ContextVar("cpdpkit_active_profiler", default=None)


def active_profiler() -> profile | None:
    """The ``torch.profiler.profile`` of the enclosing :func:`trace_rank` block, or None outside one.

    Under ``cpdpkit launch --profile`` the launcher wraps each rank's script in ``trace_rank``, so
    a script may call ``active_profiler().step()`` once per training step to mark steps (check
    for None to run unprofiled too).
    """
    return _ACTIVE_PROFILER.get()


def default_schedule(
    *, skip_first: int = 0, wait: int = 1, warmup: int = 1, active: int = 5, repeat: int = 1
) -> Callable[[int], ProfilerAction]:
    """A ``torch.profiler.schedule`` that skips start-up noise and records ``active`` steps once.

    One wait step and one warm-up step keep first-iteration allocation and autotuning out
    of the trace; ``repeat=1`` yields exactly one trace file per rank.
    """
    return _torch_schedule(
        skip_first=skip_first, wait=wait, warmup=warmup, active=active, repeat=repeat
    )


def record_all_schedule(step: int) -> ProfilerAction:
    """Schedule that records every step (so ``ProfilerStep#N`` markers appear) until exit."""
    del step
    return ProfilerAction.RECORD


def _current_rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def _world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def trace_file_name(worker_name: str, *, cycle: int = 0, gzip: bool = False) -> str:
    """File name of one exported trace: ``<worker>.pt.trace.json[.gz]``.

    A schedule that repeats exports one file per cycle; cycles after the first get a
    numeric span suffix (``<worker>.<cycle>.pt.trace.json``), which TensorBoard's plugin
    reads as a span of the same worker.
    """
    span = f".{cycle}" if cycle else ""
    return f"{worker_name}{span}{TRACE_SUFFIX}" + (".gz" if gzip else "")


def _default_file_mode() -> int:
    # mkstemp creates 0600 files; give the trace the mode a plain open() would have.
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _atomic_export(prof: profile, path: Path, gzip: bool) -> None:
    """Export to a hidden temporary file in the same folder, then rename over ``path``."""
    suffix = ".json.gz" if gzip else ".json"
    with _atomic_target(path, f".{path.name}.", suffix) as tmp:
        prof.export_chrome_trace(tmp)


@contextmanager
def _atomic_target(path: Path, prefix: str, suffix: str) -> Iterator[str]:
    """A hidden temporary file beside ``path``, renamed over it when the block succeeds."""
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=path.parent)
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, _default_file_mode())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _default_activities() -> list[ProfilerActivity]:
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    return activities


@contextmanager
def trace_rank(
    out_dir: str | os.PathLike[str],
    *,
    worker_name: str | None = None,
    schedule: Callable[[int], ProfilerAction] | None = None,
    run_info: dict[str, Any] | None = None,
    gzip: bool = False,
    activities: Iterable[ProfilerActivity] | None = None,
    record_shapes: bool = False,
    with_stack: bool = False,
    profile_memory: bool = False,
    write_run_info_on_all_ranks: bool = False,
) -> Iterator[profile]:
    """Profile the block and write ``out_dir/<worker_name>.pt.trace.json[.gz]``.

    Yields the ``torch.profiler.profile``; call ``prof.step()`` once per training step.
    ``worker_name`` defaults to ``rank<R>`` (the global rank when a process group is up,
    else ``$RANK``, else 0). ``schedule=None`` records the whole block. ``run_info``, when
    given, is merged into ``out_dir/run.json`` (with ``world_size`` filled in) by rank 0
    only, so ranks do not race on the file; set ``write_run_info_on_all_ranks`` for
    ranks that are not in one process group.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rank = _current_rank()
    name = worker_name or f"rank{rank}"
    if "/" in name or os.sep in name or not name.strip():
        raise ValueError(f"worker_name {name!r} must be a plain file-name stem (no '/')")
    if run_info is not None and (rank == 0 or write_run_info_on_all_ranks):
        write_run_json(out, **{"world_size": _world_size(), **run_info})
    cycles = [0]

    def on_ready(prof: profile) -> None:
        _atomic_export(prof, out / trace_file_name(name, cycle=cycles[0], gzip=gzip), gzip)
        cycles[0] += 1

    with profile(
        activities=list(activities) if activities is not None else _default_activities(),
        schedule=schedule if schedule is not None else record_all_schedule,
        on_trace_ready=on_ready,
        record_shapes=record_shapes,
        with_stack=with_stack,
        profile_memory=profile_memory,
        experimental_config=_all_threads_config(),
    ) as prof:
        token = _ACTIVE_PROFILER.set(prof)
        try:
            yield prof
        finally:
            _ACTIVE_PROFILER.reset(token)


def _all_threads_config() -> Any:
    """Record every thread, the emulator's link threads included.

    The emulated backend then emits each collective's link-time event on its own thread (see
    docs/contracts.md). In the default, thread-local mode the event would be entered on the
    training thread and ended by the link thread, which appends to the training thread's event
    buffer while that thread records its own events: a data race that crashed ranks (SIGSEGV)
    when collectives completed during backward.
    """
    from torch._C._profiler import _ExperimentalConfig

    return _ExperimentalConfig(profile_all_threads=True)


def write_run_json(out_dir: str | os.PathLike[str], **info: Any) -> Path:
    """Write ``out_dir/run.json``, merged over an existing file; returns its path.

    Keys the analysis reads: ``strategy`` (str), ``period`` (int), ``topology`` (preset
    name or a description), ``world_size`` (int); any other JSON-serialisable key is kept.
    The file is replaced atomically.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / RUN_JSON
    merged: dict[str, Any] = {}
    if path.exists():
        try:
            loaded = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            loaded = None
        if isinstance(loaded, dict):
            merged.update(loaded)
    merged.update(info)
    text = json.dumps(merged, indent=2, sort_keys=True, default=str) + "\n"
    with _atomic_target(path, ".run.", ".json") as tmp:
        Path(tmp).write_text(text, encoding="utf-8")
    return path
