"""Benchmark: what ``cpdpkit profile FOLDER --json OUT`` spends its whole process on (prints JSON).

Parts, each the median of ``--repeats`` processes (after one untimed warm-up that writes the
bytecode; ``PYTHONDONTWRITEBYTECODE`` is dropped, users have .pyc files):
  * ``interpreter``: ``python -S -c pass`` (no site);
  * ``site``: ``python -c pass`` minus the above (the venv's site, editable-install finders);
  * imports of the command as ``-X importtime`` reports them (cumulative µs): the CLI entry
    (``cpdpkit.cli._fast_profile``, which imports ``cpdpkit.cli._profile_report``) and the
    profiler (``cpdpkit.profiler``, with msgspec and orjson);
  * ``analysis and output``: the command's wall time minus all of the above.

``--instructions`` counts the same parts in instructions executed (valgrind's callgrind, one
run each: a figure that the machine's load does not move, ~1 minute): ``interpreter``,
``site``, ``import cpdpkit.cli._fast_profile``, then ``cpdpkit.profiler`` with it (each the
process that imports it minus the one before, so a module counts where it is first imported:
msgspec's and orjson's own imports included), ``analysis and output``: the whole command
minus the imports.

usage: python benchmarks/profile_startup.py [FOLDER ...] [--repeats 5] [--instructions]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_IMPORTS = ("cpdpkit.cli._fast_profile", "cpdpkit.profiler")


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def _wall(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env(), cwd=ROOT, check=False)
    return time.perf_counter() - start


def _imports(cmd: list[str]) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-X", "importtime", *cmd], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT, check=False)
    out: dict[str, float] = {}
    for line in done.stderr.splitlines():
        parts = [p.strip() for p in line.removeprefix("import time:").split("|")]
        if len(parts) == 3 and parts[2] in _IMPORTS:
            out[parts[2]] = int(parts[1]) / 1e6
    return out


def measure(folder: str, repeats: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        profile = ["-m", "cpdpkit.cli", "profile", folder, "--json", os.path.join(tmp, "out.json")]
        _wall([sys.executable, *profile])  # bytecode, file cache
        bare = statistics.median(_wall([sys.executable, "-S", "-c", "pass"]) for _ in range(repeats))
        site = statistics.median(_wall([sys.executable, "-c", "pass"]) for _ in range(repeats)) - bare
        total = statistics.median(_wall([sys.executable, *profile]) for _ in range(repeats))
        imports = [_imports(profile) for _ in range(repeats)]
    parts = {"interpreter": bare, "site": site}
    for name in _IMPORTS:
        parts[f"import {name}"] = statistics.median(i.get(name, 0.0) for i in imports)
    parts["analysis and output"] = total - sum(parts.values())
    parts["total"] = total
    return {k: round(v, 4) for k, v in parts.items()}


def _instructions(cmd: list[str]) -> int:
    """Instructions one process executes (valgrind --tool=callgrind; its children not followed)."""
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/cg.out", *cmd],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT,
                              check=False)
    m = re.search(r"Collected : (\d+)", done.stderr)
    if m is None:
        raise SystemExit(f"valgrind gave no count for {cmd}: {done.stderr.strip()[-300:]}")
    return int(m.group(1))


def measure_instructions(folder: str) -> dict[str, int]:
    with tempfile.TemporaryDirectory() as tmp:
        profile = ["-m", "cpdpkit.cli", "profile", folder, "--json", os.path.join(tmp, "out.json")]
        _wall([sys.executable, *profile])  # bytecode
        steps = {"interpreter": ["-S", "-c", "pass"], "site": ["-c", "pass"],
                 f"import {_IMPORTS[0]}": ["-c", f"import {_IMPORTS[0]}"],
                 f"import {_IMPORTS[1]}": ["-c", f"import {_IMPORTS[0]}, {_IMPORTS[1]}"],
                 "analysis and output": profile}
        parts, before = {}, 0
        for name, args in steps.items():
            count = _instructions([sys.executable, *args])
            parts[name], before = count - before, count
    parts["total"] = before
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="*", default=[str(ROOT.parent / "shared" / "traces" / n)
                                                       for n in ("nccl_2rank", "sampled_128rank")])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions (valgrind) instead of timing: load-independent")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    if args.instructions:
        if shutil.which("valgrind") is None:
            raise SystemExit("--instructions needs valgrind on the PATH (apt-get install valgrind)")
        traces = {Path(f).name: measure_instructions(f) for f in args.folders}
        print(json.dumps({"unit": "instructions", "load_average_1min": round(load, 2), "traces": traces}, indent=2))
        return
    print(json.dumps({"load_average_1min": round(load, 2),
                      "traces": {Path(f).name: measure(f, args.repeats) for f in args.folders}}, indent=2))


if __name__ == "__main__":
    main()
