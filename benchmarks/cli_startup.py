"""Whole-process time of the commands that do not train, as a user runs them.

Each command runs ``--repeat`` times as a fresh process (the console script, bytecode cached:
one untimed warm-up run first) and the benchmark prints one JSON object with the min and median
wall seconds per command and whether each met the goal (<= 0.5 s: `cpdpkit --help` and
`cpdpkit profile` on one ~2 MB trace). The 2 MB trace is a CPU/gloo-style trace built with the
tests' trace builder (2,500 steps); the real NCCL trace is the HTA fixture in tests/data/hta.

    python benchmarks/cli_startup.py [--repeat N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOAL_S = 0.5


def _cpdpkit() -> str:
    exe = Path(sys.executable).with_name("cpdpkit")
    return str(exe) if exe.exists() else (shutil.which("cpdpkit") or "cpdpkit")


def _two_mb_trace(folder: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from _trace_builder import GLOO, annotation, cpu_op, step, trace_doc, write_trace  # the tests' builder

    events: list[dict] = []
    for n in range(2500):  # ~2.1 MB: steps of 1 ms with an all-reduce partly hidden behind compute
        t = n * 1000.0
        events += [step(n, t, 1000), cpu_op("c10d::allreduce_", t, 10),
                   annotation("gloo:all_reduce", t + 10, 390, tid=GLOO), cpu_op("aten::mm", t + 10, 290),
                   cpu_op("aten::add", t + 400, 600)]
    run = folder / "run2mb"
    write_trace(run / "rank0.pt.trace.json", trace_doc(events))
    (run / "run.json").write_text(json.dumps({"strategy": "ddp"}))
    return run


def _time(cmd: list[str], repeat: int) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # as a user has it
    subprocess.run(cmd, capture_output=True, env=env, check=True)  # warm-up: bytecode written
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run(cmd, capture_output=True, env=env, check=True)
        times.append(time.perf_counter() - start)
    return {"min_s": round(min(times), 3), "median_s": round(statistics.median(times), 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    exe = _cpdpkit()
    with tempfile.TemporaryDirectory() as tmp:
        trace = _two_mb_trace(Path(tmp))
        commands = {
            "--help": [exe, "--help"],
            "profile (2 MB CPU trace)": [exe, "profile", str(trace)],
            "profile (HTA NCCL trace, 750 KB gz)": [exe, "profile",
                                                    str(ROOT / "tests/data/hta/nccl_2rank/rank-0.json.gz")],
            "plan llama-7b 64 ranks": [exe, "plan", "--model", "llama-7b", "--world-size", "64"],
            "topology show wan": [exe, "topology", "show", "wan", "--world-size", "4"],
            "bench --help": [exe, "bench", "--help"],
        }
        results = {name: _time(cmd, args.repeat) for name, cmd in commands.items()}
        size = sum(p.stat().st_size for p in trace.iterdir())
    goals = {name: results[name]["median_s"] <= GOAL_S for name in ("--help", "profile (2 MB CPU trace)")}
    print(json.dumps({"trace_bytes": size, "goal_s": GOAL_S, "results": results, "goals_met": goals}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
