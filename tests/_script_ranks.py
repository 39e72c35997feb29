"""Run a workload script as N rank processes (``script RANK WORLD STORE OUT *args``) and wait.

The profiler's real-trace tests start their workloads as plain scripts (the traces must come
from processes that imported nothing of the test), rendezvousing through a FileStore in
``tmp_path``, never a port. Every run has a timeout; a rank still running then is killed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def run_script_ranks(script: Path, tmp_path: Path, *args: str, world: int = 2, timeout_s: float = 100) -> Path:
    """The folder the ranks wrote their traces to (``tmp_path/run``); fails with the ranks' logs."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "run"
    procs = [
        subprocess.Popen([sys.executable, str(script), str(rank), str(world), str(tmp_path / "store"), str(out),
                          *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in range(world)
    ]
    try:
        logs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    return out
