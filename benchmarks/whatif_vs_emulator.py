"""Benchmark: ``cpdpkit profile --what-if`` against the same job run on the emulator (prints JSON).

Runs the bench workload once per topology with traces (``cpdpkit bench --quick --strategies
ddp,cpdp --periods 4 --topologies lan,wan --profile DIR``), then, for every run and every pair
of topologies (lan -> wan, wan -> lan), predicts the run on the other topology from its own
traces (``analyze([run], what_if=other)``) and compares the prediction with what the run
measured there: step time and exposed communication per step. Goal (issue 14): within 15 %.
It is a timing benchmark (the emulator sleeps real time, compute runs on this host's cores):
``--runs N`` repeats the whole thing N times (a fresh bench run each, the load average beside
each), and ``--traces DIR`` re-predicts runs kept by ``--keep DIR`` without running the bench
again (``DIR`` or its numbered sub-folders ``1``, ``2``, ... from ``--runs``).

usage: python benchmarks/whatif_vs_emulator.py [--strategies ddp,cpdp] [--topologies lan,wan] [--keep DIR]
       [--runs N] [--traces DIR]
"""

from __future__ import annotations

import argparse
import json
import os
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


def _summary(rows: list[dict], load: dict | None) -> dict:
    met = sum(r["within_goal"] for r in rows)
    within = sum(abs(v) <= GOAL for r in rows for v in r["error"].values())
    return {"within_goal": f"{within}/{2 * len(rows)}", "rows_within_goal": f"{met}/{len(rows)}",
            "load_average": load, "errors": {f'{r["run"]} {r["from"]}->{r["to"]}': r["error"] for r in rows},
            "rows": rows}


def _trace_sets(folder: Path) -> list[Path]:
    numbered = sorted((p for p in folder.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    return numbered or [folder]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default="ddp,cpdp")
    parser.add_argument("--topologies", default="lan,wan")
    parser.add_argument("--keep", type=Path, default=None, help="keep the traces here (default: a temp dir)")
    parser.add_argument("--runs", type=int, default=1, help="bench runs, each predicted on its own")
    parser.add_argument("--traces", type=Path, default=None,
                        help="predict the runs kept by an earlier --keep DIR instead of running the bench")
    args = parser.parse_args()
    topologies = args.topologies.split(",")
    results = []
    if args.traces is not None:
        for folder in _trace_sets(args.traces):
            results.append({"traces": str(folder), **_summary(compare(folder, topologies), None)})
    else:
        with tempfile.TemporaryDirectory() as tmp:
            root = args.keep or Path(tmp)
            for k in range(1, args.runs + 1):
                profile = root / str(k) if args.runs > 1 else root
                profile.mkdir(parents=True, exist_ok=True)
                before = os.getloadavg()
                _run_bench(profile, args.strategies, args.topologies)
                load = {"before": [round(x, 2) for x in before], "after": [round(x, 2) for x in os.getloadavg()]}
                results.append(_summary(compare(profile, topologies), load))
    out = {"benchmark": "whatif_vs_emulator", "goal_abs_error_max": GOAL,
           "predictions_within_goal_per_run": [r["within_goal"] for r in results], "runs": results}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
