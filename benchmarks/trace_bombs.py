"""Hostile trace files against ``cpdpkit profile``: every one must end in one line, within 30 s and 3 GiB.

Each case is a ``.json.gz`` written to a temporary folder (a few MB at most on disk) that expands to
up to 4 GiB: zeros, ``{"traceEvents": [`` then spaces (8/16/32 MiB: the quadratic case of issue 25,
and 2 GiB), one event that never ends, ``}``s that are never a cut, and millions of tiny valid
events. Each runs as ``cpdpkit profile FILE`` in its own process; the JSON has its wall time, the
child's peak RSS, exit code and stderr's last line::

    python benchmarks/trace_bombs.py [--only NAME ...]

Prints ``{"cases": {name: {"expands_to_bytes", "seconds", "max_rss_bytes", "exit", "line"}}, "ok": bool}``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

CLI = [sys.executable, "-c", "from cpdpkit.cli import main; main()"]
MiB, GiB = 1 << 20, 1 << 30
EVENT = b'{"ph":"X","name":"aten::mm","cat":"cpu_op","pid":1,"tid":1,"ts":1,"dur":1},'


def _repeat(head: bytes, unit: bytes, total: int, tail: bytes = b"") -> Iterator[bytes]:
    yield head
    block = unit * max(1, (4 * MiB) // len(unit))
    left = total
    while left > 0:
        yield block[:left]
        left -= len(block)
    yield tail


CASES = {
    "zeros 2 GiB": lambda: _repeat(b"", b"\0", 2 * GiB),
    "spaces 8 MiB": lambda: _repeat(b'{"traceEvents": [', b" ", 8 * MiB),
    "spaces 16 MiB": lambda: _repeat(b'{"traceEvents": [', b" ", 16 * MiB),
    "spaces 32 MiB": lambda: _repeat(b'{"traceEvents": [', b" ", 32 * MiB),
    "spaces 2 GiB": lambda: _repeat(b'{"traceEvents": [', b" ", 2 * GiB),
    "one event that never ends, 1 GiB": lambda: _repeat(b'{"traceEvents": [{"name": "', b"a", GiB),
    "braces that are never a cut, 1 GiB": lambda: _repeat(b'{"traceEvents": [{"a": [', b"{}, ", GiB),
    "tiny valid events past the limit, 4 GiB": lambda: _repeat(b'{"traceEvents": [', EVENT, 4 * GiB, b"{}]}"),
}


def _write(name: str, folder: Path) -> tuple[Path, int]:
    path = folder / (name.replace(" ", "_").replace(",", "") + ".json.gz")
    size = 0
    with gzip.open(path, "wb", compresslevel=6) as fh:
        for part in CASES[name]():
            fh.write(part)
            size += len(part)
    return path, size


def _run(path: Path) -> dict:
    """Wall time, peak RSS (this child's own, from wait4), exit code and stderr of one profile run."""
    with tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen([*CLI, "profile", str(path)], stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        lines = [ln for ln in err.read().splitlines() if ln.strip()]
    return {"seconds": round(seconds, 2), "max_rss_bytes": usage.ru_maxrss * 1024,  # KiB on Linux
            "exit": proc.returncode, "stderr_lines": len(lines), "line": lines[-1] if lines else ""}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=list(CASES), choices=list(CASES))
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only:
            path, size = _write(name, Path(tmp))
            results[name] = {"expands_to_bytes": size, "gz_bytes": os.path.getsize(path), **_run(path)}
            path.unlink()
    ok = all(r["exit"] == 2 and r["stderr_lines"] == 1 and r["seconds"] < 30 and r["max_rss_bytes"] < 3 * GiB
             for r in results.values())
    print(json.dumps({"cases": results, "ok": ok}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
