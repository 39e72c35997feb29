"""Run every benchmark in this folder (``make bench``) and print one JSON object.

Each benchmark is a script that prints one JSON object on stdout; they run one after
another (never in parallel: they measure time), each in its own process. A benchmark that
fails is reported with its exit code and last stderr lines; the others still run.

    python benchmarks/run_all.py [NAME ...]       # e.g. sync_overhead emulator_sweep
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _last_json_object(text: str) -> object:
    """The JSON object a benchmark printed (it may print other lines before it)."""
    start = text.find("{")
    while start != -1:
        try:
            return json.loads(text[start:])
        except ValueError:
            start = text.find("{", start + 1)
    raise ValueError("no JSON object in the output")


def main(names: list[str]) -> int:
    scripts = sorted(p for p in HERE.glob("*.py") if p.name != Path(__file__).name)
    if names:
        scripts = [p for p in scripts if p.stem in names]
    results: dict[str, object] = {}
    failures = 0
    for script in scripts:
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
        elapsed = time.perf_counter() - start
        try:
            if proc.returncode != 0:
                raise ValueError(f"exit code {proc.returncode}")
            results[script.stem] = {"seconds": elapsed, "result": _last_json_object(proc.stdout)}
        except ValueError as exc:
            failures += 1
            results[script.stem] = {"seconds": elapsed, "error": str(exc),
                                    "stderr_tail": proc.stderr.strip().splitlines()[-5:]}
        print(f"# {script.stem}: {elapsed:.1f} s", file=sys.stderr, flush=True)
    print(json.dumps(results, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
