"""The per-rank entry point ``cpdpkit launch`` gives torchrun: ``python -m cpdpkit._child``.

``python -m cpdpkit._child [--profile DIR --run-info JSON] [--py-spy DIR] -- script.py ARGS``
runs the script as ``__main__`` (runpy, with ``sys.argv`` set to the script's) and

* ``--profile DIR``: inside :func:`cpdpkit.tracing.trace_rank` (``DIR/rank<R>.pt.trace.json``);
  rank 0 writes ``DIR/run.json`` (topology, world size, script, ...); the script reaches the
  profiler through :func:`cpdpkit.tracing.active_profiler`;
* ``--py-spy DIR``: re-runs itself under ``py-spy record`` (``DIR/rank<R>.speedscope.json``).
  py-spy exits 0 whatever its child does, so the child reports its exit code through a file.

A script exception is written to torch elastic's error file (``@record``), which
``cpdpkit launch`` turns into one line and a traceback tail.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["main"]

_UNDER_PY_SPY = "CPDPKIT_UNDER_PY_SPY"


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m cpdpkit._child")
    parser.add_argument("--profile", default=None)
    parser.add_argument("--run-info", default="{}")
    parser.add_argument("--py-spy", dest="py_spy", default=None)
    parser.add_argument("--exit-code-file", default=None)
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    if "--" in argv:
        i = argv.index("--")
        ns = parser.parse_args([*argv[:i], argv[i + 1]])
        ns.args = argv[i + 2:]
        return ns
    return parser.parse_args(argv)


def _run_script(script: str, args: list[str]) -> None:
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")


def _run_with_profile(ns: argparse.Namespace) -> None:
    from cpdpkit._env import topology_from_env
    from cpdpkit.tracing import trace_rank

    info: dict[str, Any] = json.loads(ns.run_info)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    topology = topology_from_env(world_size=world_size)
    if topology is not None:
        info["topology_config"] = topology.to_dict()
    info.setdefault("launcher", "cpdpkit launch")
    # The script reaches the profiler through cpdpkit.tracing.active_profiler(), which trace_rank
    # sets for the block (and cpdpkit.launch.active_profiler re-exports).
    with trace_rank(ns.profile, run_info=info):
        _run_script(ns.script, ns.args)


def _rerun_under_py_spy(ns: argparse.Namespace, argv: list[str]) -> int:
    from cpdpkit.launch import py_spy_executable

    out = Path(ns.py_spy)
    out.mkdir(parents=True, exist_ok=True)
    rank = os.environ.get("RANK", "0")
    fd, code_file = tempfile.mkstemp(prefix="cpdpkit-exit-", suffix=".txt")
    os.close(fd)
    inner = [sys.executable, "-m", "cpdpkit._child", "--exit-code-file", code_file, *argv]
    cmd = [py_spy_executable(), "record", "--format", "speedscope", "--rate", "100",
           "-o", str(out / f"rank{rank}.speedscope.json"), "--", *inner]
    stderr_file = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, env={**os.environ, _UNDER_PY_SPY: "1"}, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=stderr_file, text=True, bufsize=1)

    def forward(signum: int, frame: Any) -> None:
        del frame
        os.killpg(proc.pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    _copy_without_py_spy_banner(proc.stdout)
    proc.wait()
    stderr_file.seek(0)
    stderr = stderr_file.read()
    text = Path(code_file).read_text().strip()
    os.unlink(code_file)
    if not text:
        detail = (stderr or "").strip().splitlines()
        raise RuntimeError(
            f"py-spy could not record rank {rank}: {detail[-1] if detail else 'no output'}; it needs ptrace "
            "permission (run as root, set kernel.yama.ptrace_scope=0, or add CAP_SYS_PTRACE to the container)"
        )
    for line in (stderr or "").splitlines():
        if not line.startswith("py-spy>"):
            print(line, file=sys.stderr)
    return int(text)


def _copy_without_py_spy_banner(stream: Any) -> None:
    """Pass the rank's stdout through, minus py-spy's own ``py-spy>`` lines (and their blanks)."""
    after_banner = False
    for line in stream:
        if line.startswith("py-spy>") or (after_banner and not line.strip()):
            after_banner = True
            continue
        after_banner = False
        sys.stdout.write(line)
        sys.stdout.flush()


def _record(fn: Any) -> Any:
    """torch elastic's ``@record``, but its error file appears whole: written beside it, then renamed.

    The agent reads a failed rank's error file as soon as it sees the failure; a rank that fails
    because a peer was killed may still be writing it, and an empty file crashed torch's agent
    (``JSONDecodeError``) instead of restarting the job (seen once in ``test_launch_restart``).
    """
    from torch.distributed.elastic.multiprocessing.errors import record

    final = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not final:
        return record(fn)
    partial = final + ".partial"
    os.environ["TORCHELASTIC_ERROR_FILE"] = partial
    recorded = record(fn)

    def run(*args: Any) -> Any:
        try:
            return recorded(*args)
        finally:
            if os.path.exists(partial):
                os.replace(partial, final)

    return run


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = _parse(argv)
    if ns.py_spy is not None and not os.environ.get(_UNDER_PY_SPY):
        return _record(_rerun_under_py_spy)(ns, argv)
    code = 1
    try:
        _record(_run_with_profile if ns.profile else (lambda n: _run_script(n.script, n.args)))(ns)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        if ns.exit_code_file:
            Path(ns.exit_code_file).write_text(str(code))
    return code


if __name__ == "__main__":
    sys.exit(main())
