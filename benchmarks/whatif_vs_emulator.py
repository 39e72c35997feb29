"""Benchmark: ``cpdpkit profile --what-if`` against the same job run on the emulator (prints JSON).

Runs the bench workload once per topology with traces (``cpdpkit bench --quick --strategies
ddp,cpdp --periods 4 --topologies lan,wan --profile DIR``), then, for every run and every pair
of topologies (lan -> wan, wan -> lan), predicts the run on the other topology from its own
traces (``analyze([run], what_if=other)``) and compares the prediction with what the run
measured there: step time and exposed communication per step. Goal (issue 14): within 15 %.

usage: python benchmarks/whatif_vs_emulator.py [--strategies ddp,cpdp] [--topologies lan,wan] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from cpdpkit.profiler import analyze

ROOT = Path(__file__).resolve().parents[1]
GOAL = 0.15


def _run_bench(profile: Path, strategies: str, topologies: str) -> None:
    cmd = [sys.executable, "-m", "cpdpkit.cli", "bench", "--quick", "--strategies", strategies, "--periods", "4",
           "--topologies", topologies, "--profile", str(profile), "--json", str(profile / "bench.json")]
    subprocess.run(cmd, check=True, cwd=ROOT, timeout=3600, stdout=subprocess.DEVNULL)


def _per_step(report) -> dict[str, float]:  # type: ignore[no-untyped-def]
    (run,) = report.runs
    return {"step_time_us": run.summary.per_step["step_time_us"], "exposed_us": run.summary.per_step["exposed_us"]}


def compare(profile: Path, topologies: list[str]) -> list[dict]:
    rows = []
    names = sorted(p.name for p in (profile / topologies[0]).iterdir() if p.is_dir())
    for name in names:
        measured = {t: _per_step(analyze([profile / t / name])) for t in topologies}
        for src in topologies:
            for dst in topologies:
                if src == dst:
                    continue
                (run,) = analyze([profile / src / name], what_if=dst).runs
                w = run.what_if
                pred = {"step_time_us": w.step_time_us, "exposed_us": w.exposed_us}
                err = {k: pred[k] / measured[dst][k] - 1 for k in pred}
                rows.append({"run": name, "from": src, "to": dst, "measured_on_from": measured[src],
                             "measured": measured[dst], "predicted": pred,
                             "error": {k: round(v, 4) for k, v in err.items()},
                             "within_goal": all(abs(v) <= GOAL for v in err.values())})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default="ddp,cpdp")
    parser.add_argument("--topologies", default="lan,wan")
    parser.add_argument("--keep", type=Path, default=None, help="keep the traces here (default: a temp dir)")
    args = parser.parse_args()
    topologies = args.topologies.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        profile = args.keep or Path(tmp)
        profile.mkdir(parents=True, exist_ok=True)
        _run_bench(profile, args.strategies, args.topologies)
        rows = compare(profile, topologies)
    met = sum(r["within_goal"] for r in rows)
    print(json.dumps({"benchmark": "whatif_vs_emulator", "goal_abs_error_max": GOAL,
                      "within_goal": f"{met}/{len(rows)}", "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
