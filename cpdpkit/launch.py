"""``cpdpkit launch``: torchrun with an emulated network, per-rank traces and clear failures.

:func:`launch` builds a ``torch.distributed.run`` (torchrun) command line and runs torch's own
elastic launcher in this process; there is no home-made process manager. Each rank runs
``python -m cpdpkit._child`` which wraps the user's script (``runpy``) in
:func:`cpdpkit.tracing.trace_rank` (``--profile``) and/or under py-spy (``--py-spy``) and
records a failing rank's exception with torch elastic's ``@record`` error file.

The emulated topology reaches the ranks through ``CPDPKIT_TOPOLOGY`` (see
:mod:`cpdpkit.emulator.env`); a script calls :func:`cpdpkit.init_distributed` to use it.

Importing this module does not import torch (``cpdpkit --help`` and ``cpdpkit profile`` import
it through the CLI): :func:`launch` imports torchrun when called, and ``active_profiler``, a
re-export of :func:`cpdpkit.tracing.active_profiler`, loads on first access.

Single-node runs use torchrun's ``--standalone`` rendezvous (a free port, never a fixed one);
``nnodes``/``node_rank``/``rdzv_*``/``master_*`` pass through for real multi-node runs. Rank
stdout goes to the console (and to the log folder); rank stderr goes only to the log folder, so
a failure shows as one line plus the failing rank's last traceback lines, not a wall of text.

``max_restarts`` is torchrun's: a failed rank makes torch elastic restart every rank, up to that
many times (a script resumes with :class:`cpdpkit.checkpoint.Checkpointer`); ``LaunchResult.restarts``
says how many restarts happened.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from cpdpkit._env import TOPOLOGY_ENV
from cpdpkit._values import refuse_nonfinite
from cpdpkit.errors import ConfigError, LaunchError
from cpdpkit.topology import Topology, TopologySpec, resolve_topology

__all__ = ["LaunchConfig", "LaunchResult", "launch", "torchrun_args", "py_spy_executable", "active_profiler"]

_TRACEBACK_LINES = 8


def __getattr__(name: str) -> Any:
    # ``cpdpkit.launch.active_profiler`` (kept for compatibility) is cpdpkit.tracing's function;
    # tracing imports torch, so it is looked up on first access rather than at import.
    if name == "active_profiler":
        from cpdpkit.tracing import active_profiler

        return active_profiler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _check_positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} = {value!r} is invalid; use a whole number >= 1")


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """How to launch a script (the torchrun options cpdpkit uses and passes through)."""

    nproc_per_node: int = 1
    # preset name or TOML path (the ranks resolve it at their world size), or a placed Topology (written to a
    # TOML file in the log folder for the ranks); None: no emulation
    topology: str | Topology | None = None
    profile_dir: str | None = None
    py_spy_dir: str | None = None
    nnodes: str = "1"
    node_rank: int | None = None
    rdzv_backend: str | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    master_addr: str | None = None
    master_port: int | None = None
    max_restarts: int = 0
    log_dir: str | None = None  # rank logs; a fresh temporary folder when None
    run_info: dict[str, Any] = field(default_factory=dict)  # extra keys for run.json

    def __post_init__(self) -> None:
        refuse_nonfinite(self, ConfigError)
        _check_positive("nproc_per_node", self.nproc_per_node)
        if not isinstance(self.nnodes, str) or not all(p.isdigit() and int(p) > 0 for p in self.nnodes.split(":")):
            raise ConfigError(f"nnodes = {self.nnodes!r} is invalid; use N or MIN:MAX, e.g. '2' or '1:4'")
        if self.master_port is not None and not (0 <= self.master_port <= 65535):
            raise ConfigError(f"master_port = {self.master_port!r} is invalid; use 0-65535 (0 picks a free port)")
        if not isinstance(self.max_restarts, int) or isinstance(self.max_restarts, bool) or self.max_restarts < 0:
            raise ConfigError(f"max_restarts = {self.max_restarts!r} is invalid; use a whole number >= 0 "
                              "(0: a failed rank ends the job)")

    @property
    def is_single_node(self) -> bool:
        return self.nnodes == "1" and not (self.rdzv_endpoint or self.master_addr or self.node_rank)

    @property
    def world_size(self) -> int | None:
        """nnodes × nproc_per_node when nnodes is fixed, else None (elastic)."""
        return int(self.nnodes) * self.nproc_per_node if ":" not in self.nnodes else None

    def resolve_topology(self) -> Topology | TopologySpec | None:
        """The topology, checked now: placed on the world size (the spec when the world is elastic), or None."""
        if self.topology is None:
            return None
        if isinstance(self.topology, Topology):
            return self.topology if self.world_size is None else self.topology.place(self.world_size)
        return resolve_topology(self.topology, world_size=self.world_size)

    @property
    def topology_name(self) -> str | None:
        """What run.json records: the name or path given, or the placed topology's name."""
        return self.topology.name if isinstance(self.topology, Topology) else self.topology


@dataclass(frozen=True, kw_only=True)
class LaunchResult:
    """What happened: exit code, the failing rank's error, and the files the ranks wrote."""

    exit_code: int
    world_size: int | None
    duration_s: float
    log_dir: str
    failed_rank: int | None = None
    error: str | None = None  # one line
    traceback_tail: tuple[str, ...] = ()
    trace_files: tuple[str, ...] = ()
    py_spy_files: tuple[str, ...] = ()
    restarts: int = 0  # times torch elastic restarted the ranks (``max_restarts``); counted from the log folder

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["traceback_tail"] = list(self.traceback_tail)
        out["trace_files"] = list(self.trace_files)
        out["py_spy_files"] = list(self.py_spy_files)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LaunchResult:
        data = dict(data)
        for key in ("traceback_tail", "trace_files", "py_spy_files"):
            data[key] = tuple(data.get(key, ()))
        return cls(**data)


def py_spy_executable() -> str:
    """The py-spy next to this interpreter or on PATH; a LaunchError naming the fix if absent."""
    beside = Path(sys.executable).with_name("py-spy")
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if not found:
        raise LaunchError("--py-spy needs py-spy, which is not installed; pip install py-spy (or cpdpkit[tools])")
    return found


def torchrun_args(config: LaunchConfig, script: str, args: Sequence[str], *, log_dir: str) -> list[str]:
    """The ``torch.distributed.run`` argument list for ``script args`` under ``config``."""
    out = [f"--nproc-per-node={config.nproc_per_node}", f"--max-restarts={config.max_restarts}"]
    if config.is_single_node and not (config.rdzv_backend or config.master_port is not None):
        out.append("--standalone")
    else:
        out.append(f"--nnodes={config.nnodes}")
        for flag, value in (("--node-rank", config.node_rank), ("--rdzv-backend", config.rdzv_backend),
                            ("--rdzv-endpoint", config.rdzv_endpoint), ("--rdzv-id", config.rdzv_id),
                            ("--master-addr", config.master_addr), ("--master-port", config.master_port)):
            if value is not None:
                out.append(f"{flag}={value}")
    # stdout: console and file; stderr: file only (shown on failure as a traceback tail)
    out += [f"--log-dir={log_dir}", "--redirects=2", "--tee=1", "--module", "cpdpkit._child"]
    if config.profile_dir is not None:
        out += ["--profile", str(config.profile_dir)]
        info = {"topology": config.topology_name or "none", "script": script, **config.run_info}
        out += ["--run-info", json.dumps(info, default=str)]
    if config.py_spy_dir is not None:
        out += ["--py-spy", str(config.py_spy_dir)]
    return [*out, "--", script, *args]


# torch elastic (2.13) shares its rendezvous TCPStore with the ranks and keeps it across restarts, so a
# restarted rank reads the previous attempt's keys (a dead peer's gloo address: "connectFullMesh failed
# ... Connection refused"). With sharing off each attempt's rank 0 hosts a fresh store.
_NO_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


@contextmanager
def _launch_environment(topology: str | None, max_restarts: int = 0) -> Iterator[None]:
    """Set CPDPKIT_TOPOLOGY (and, with restarts, a fresh store per attempt) for the ranks; quiet elastic's logs."""
    saved = {name: os.environ.get(name) for name in (TOPOLOGY_ENV, _NO_SHARED_STORE)}
    loggers = [logging.getLogger(n) for n in ("torch.distributed.elastic", "torch.distributed.run")]
    levels = [lg.level for lg in loggers]
    if topology is None:
        os.environ.pop(TOPOLOGY_ENV, None)
    else:
        os.environ[TOPOLOGY_ENV] = topology
    if max_restarts > 0:
        os.environ[_NO_SHARED_STORE] = "1"
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def launch(config: LaunchConfig, script: str, args: Sequence[str] = ()) -> LaunchResult:
    """Run ``script args`` on ``config.nproc_per_node`` ranks with torchrun; never raises for a rank's failure.

    Bad input (missing script, unknown topology, a world size the topology cannot place)
    raises :class:`~cpdpkit.errors.CpdpkitError` before anything starts.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    if not Path(script).is_file():
        raise LaunchError(f"script {script!r} does not exist; pass the path of a Python file")
    config.resolve_topology()
    if config.py_spy_dir is not None:
        py_spy_executable()
    log_dir = config.log_dir or tempfile.mkdtemp(prefix="cpdpkit-launch-")
    for_ranks = config.topology
    if isinstance(for_ranks, Topology):  # the ranks read it back from a file: placed once, here or above
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        path = Path(log_dir) / "topology.toml"
        path.write_text(for_ranks.to_toml(), encoding="utf-8")
        for_ranks = str(path)
    earlier_runs = _run_log_dirs(log_dir)
    argv = torchrun_args(config, script, args, log_dir=log_dir)
    t0 = time.monotonic()
    failure: tuple[int, Any] | None = None
    exit_code = 0
    with _launch_environment(for_ranks, config.max_restarts):
        try:
            run(parse_args(argv))
        except ChildFailedError as exc:
            failure = exc.get_first_failure()
            exit_code = failure[1].exitcode if failure[1].exitcode > 0 else 1
    result = LaunchResult(exit_code=exit_code, world_size=config.world_size,
                          duration_s=time.monotonic() - t0, log_dir=log_dir,
                          restarts=_restarts(log_dir, earlier_runs),
                          trace_files=_files(config.profile_dir, ".pt.trace.json"),
                          py_spy_files=_files(config.py_spy_dir, ".speedscope.json"))
    if failure is None:
        return result
    rank, proc = failure
    error, tail = _describe_failure(rank, proc, log_dir)
    return replace(result, failed_rank=rank, error=error, traceback_tail=tail)


def _run_log_dirs(log_dir: str) -> set[Path]:
    """The run folders torch elastic made in ``log_dir`` (one per launch: ``<run id>_<random>/``)."""
    root = Path(log_dir)
    return {p for p in root.iterdir() if p.is_dir()} if root.is_dir() else set()


def _restarts(log_dir: str, earlier_runs: set[Path]) -> int:
    """Restarts of this launch: torch elastic logs attempt ``n`` (``TORCHELASTIC_RESTART_COUNT = n``) in
    ``<log_dir>/<run>/attempt_<n>/``; the highest ``n`` in the run folder this launch added is the count.

    Elastic's ``run()`` returns no restart count; its log layout is the one record both a success and a
    failure leave behind (a ``--log-dir`` reused across launches keeps earlier runs, so they are set aside).
    """
    attempts = [int(a.name.removeprefix("attempt_")) for run in _run_log_dirs(log_dir) - earlier_runs
                for a in run.glob("attempt_*") if a.name.removeprefix("attempt_").isdigit()]
    return max(attempts, default=0)


def _files(folder: str | None, suffix: str) -> tuple[str, ...]:
    if folder is None or not Path(folder).is_dir():
        return ()
    return tuple(sorted(str(p) for p in Path(folder).iterdir() if p.name.endswith(suffix)))


def _describe_failure(rank: int, proc: Any, log_dir: str) -> tuple[str, tuple[str, ...]]:
    """(one line, last traceback lines) for the first failing rank."""
    data = proc.error_file_data if isinstance(proc.error_file_data, dict) else {}
    message = data.get("message")
    lines: list[str] = []
    if isinstance(message, dict):
        lines = str(message.get("extraInfo", {}).get("py_callstack", "")).rstrip().splitlines()
        summary = str(message.get("message", "")).strip()
    else:
        summary = str(message or proc.message or "").strip()
    if not lines:
        lines = _stderr_tail(log_dir, proc.local_rank)
    if not summary and lines:
        summary = lines[-1].strip()
    if proc.exitcode < 0:
        summary = summary or f"killed by signal {proc.signal_name()}"
    summary = summary.splitlines()[-1] if summary else "no error message (see the rank's log)"
    line = f"rank {rank} failed (exit code {proc.exitcode}): {summary}"
    return line, tuple(_user_frames(lines)[-_TRACEBACK_LINES:])


def _user_frames(lines: list[str]) -> list[str]:
    """The traceback from the first frame that is not the launcher's own (elastic, _child, runpy)."""
    internal = ("<frozen runpy>", "runpy.py", "cpdpkit/_child.py", "torch/distributed/elastic/")
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith("File ") and not any(part in stripped for part in internal):
            return lines[i:]
    return lines


def _stderr_tail(log_dir: str, local_rank: int) -> list[str]:
    candidates = sorted(Path(log_dir).glob(f"**/attempt_*/{local_rank}/stderr.log"), key=lambda p: p.stat().st_mtime)
    if not candidates:
        return []
    try:
        return candidates[-1].read_text(encoding="utf-8", errors="replace").rstrip().splitlines()
    except OSError:
        return []
