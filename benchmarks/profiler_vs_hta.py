"""Benchmark: cpdpkit.profiler vs Holistic Trace Analysis on the same traces (prints JSON).

For each trace folder, first as a user feels it, whole processes side by side (startup and
imports included; the median of ``--repeats``):
  * cpdpkit: ``cpdpkit profile FOLDER --json OUT`` (``python -m cpdpkit.cli``);
  * HTA 0.5.0: ``python -c`` importing HTA, then ``TraceAnalysis(trace_dir=FOLDER)`` and
    ``get_comm_comp_overlap(visualize=False)``;
then in-process, each in a fresh subprocess (so memory figures are clean): cpdpkit's
``analyze([folder])`` against the same HTA calls, with wall time, the speed-up, peak memory
(tracemalloc peak of the call, and the growth of the process's peak RSS) against the
uncompressed trace size, and both overlap percentages (``null`` for a rank without
communication: cpdpkit's ``None``, HTA's NaN).
Inputs: the shared NCCL traces (``../shared/traces``) and a synthesised larger trace (the
2-rank trace's events replicated back to back, ``--scale`` copies).

usage: python benchmarks/profiler_vs_hta.py [--scale 8] [--no-hta] [--shared PATH] [--repeats 3]
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

from cpdpkit.profiler import find_trace_files

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, math, resource, sys, time, tracemalloc, gc
tool, folder, mode = sys.argv[1], sys.argv[2], sys.argv[3]
if tool == "cpdpkit":
    from cpdpkit.profiler import analyze
else:
    import logging
    logging.disable(logging.CRITICAL)
    from hta.trace_analysis import TraceAnalysis
gc.collect()
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
if mode == "mem":
    tracemalloc.start()
t0 = time.perf_counter()
if tool == "cpdpkit":
    report = analyze([folder])
    overlap = {r.rank: r.overlap_pct for run in report.runs for r in run.ranks}
else:
    ta = TraceAnalysis(trace_dir=folder)
    df = ta.get_comm_comp_overlap(visualize=False)
    overlap = dict(zip(df["rank"].tolist(), df["comp_comm_overlap_pctg"].tolist()))
seconds = time.perf_counter() - t0
peak = tracemalloc.get_traced_memory()[1] if mode == "mem" else None
rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
# a rank without communication: cpdpkit says None, HTA NaN; both print as null, so they compare equal
print(json.dumps({"seconds": seconds, "tracemalloc_peak_bytes": peak, "rss_growth_bytes": rss1 - rss0,
                  "overlap_pct": {str(k): None if v is None or math.isnan(v) else round(float(v), 2)
                                  for k, v in overlap.items()}}))
"""


_HTA_PROCESS = r"""
import logging, sys
logging.disable(logging.CRITICAL)
from hta.trace_analysis import TraceAnalysis
print(TraceAnalysis(trace_dir=sys.argv[1]).get_comm_comp_overlap(visualize=False))
"""


def _process_seconds(tool: str, folder: Path, repeats: int) -> float | dict:
    """Median wall seconds of the whole command, as a user runs it (cpdpkit's exit 2 for a run
    that misses ranks still counts: everything was read and analysed)."""
    with tempfile.TemporaryDirectory() as tmp:
        if tool == "cpdpkit":
            cmd = [sys.executable, "-m", "cpdpkit.cli", "profile", str(folder), "--json", str(Path(tmp) / "out.json")]
        else:
            cmd = [sys.executable, "-c", _HTA_PROCESS, str(folder)]
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=ROOT)
            times.append(time.perf_counter() - start)
            if done.returncode not in (0, 2):
                return {"error": (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]}
    return statistics.median(times)


def _uncompressed_bytes(folder: Path) -> int:
    """Uncompressed size of the trace files ``analyze`` reads in ``folder``."""
    total = 0
    for f in map(Path, find_trace_files(folder)):
        if f.name.endswith(".gz"):
            with gzip.open(f, "rb") as fh:
                while chunk := fh.read(1 << 24):
                    total += len(chunk)
        else:
            total += f.stat().st_size
    return total


def _child(tool: str, folder: Path, mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _CHILD, tool, str(folder), mode], capture_output=True, text=True,
                          timeout=3600, cwd=ROOT)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _run(tool: str, folder: Path) -> dict:
    """Time (and peak RSS growth) in one fresh process; tracemalloc peak in another, since
    tracemalloc slows allocation-heavy code down several times."""
    timed = _child(tool, folder, "time")
    if "error" in timed:
        return timed
    mem = _child(tool, folder, "mem")
    timed["tracemalloc_peak_bytes"] = mem.get("tracemalloc_peak_bytes")
    return timed


def synthesize(src: Path, copies: int, out_dir: Path) -> Path:
    """Replicate a trace's events ``copies`` times back to back (new correlation ids)."""
    with gzip.open(src, "rb") as fh:
        doc = orjson.loads(fh.read())
    events = doc["traceEvents"]
    timed = [e for e in events if isinstance(e.get("ts"), (int, float))]
    span = max(e["ts"] + e.get("dur", 0) for e in timed) - min(e["ts"] for e in timed) + 1000
    out: list[dict] = []
    for k in range(copies):
        for e in events:
            if k and e.get("ph") == "M":
                continue
            e2 = dict(e)
            if "ts" in e2 and isinstance(e2["ts"], (int, float)):
                e2["ts"] = e2["ts"] + k * span
            args = e2.get("args")
            if isinstance(args, dict) and "correlation" in args:
                e2["args"] = {**args, "correlation": args["correlation"] + k * 10_000_000}
            if isinstance(e2.get("name"), str) and e2["name"].startswith("ProfilerStep#"):
                e2["name"] = f"ProfilerStep#{int(e2['name'].split('#')[1]) + 100 * k}"
            out.append(e2)
    doc["traceEvents"] = out
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "rank-0.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=8, help="copies of the 2-rank trace in the synthetic trace")
    parser.add_argument("--no-hta", action="store_true", help="time cpdpkit only")
    parser.add_argument("--shared", type=Path, default=ROOT.parent / "shared" / "traces")
    parser.add_argument("--repeats", type=int, default=3, help="whole-process runs per tool (the median counts)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folders = {p.name: p for p in sorted(args.shared.iterdir()) if p.is_dir()}
        if args.scale > 0 and (args.shared / "nccl_2rank" / "rank-0.json.gz").exists():
            folders[f"synthetic_x{args.scale}"] = synthesize(args.shared / "nccl_2rank" / "rank-0.json.gz",
                                                             args.scale, Path(tmp) / "synthetic")
        results = {}
        for name, folder in folders.items():
            size = _uncompressed_bytes(folder)
            whole = {"cpdpkit": _process_seconds("cpdpkit", folder, args.repeats)}
            row = {"uncompressed_bytes": size, "process_s": whole}
            if not args.no_hta:
                row["process_s"]["hta"] = _process_seconds("hta", folder, args.repeats)
                mine, theirs = row["process_s"]["cpdpkit"], row["process_s"]["hta"]
                if isinstance(mine, float) and isinstance(theirs, float):
                    row["process_speedup"] = round(theirs / mine, 2)
            ours = _run("cpdpkit", folder)
            row["cpdpkit"] = ours
            if "tracemalloc_peak_bytes" in ours:
                row["cpdpkit_peak_over_trace"] = round(ours["tracemalloc_peak_bytes"] / size, 3)
                row["cpdpkit_rss_growth_over_trace"] = round(ours["rss_growth_bytes"] / size, 3)
            if not args.no_hta:
                hta = _run("hta", folder)
                row["hta"] = hta
                if "seconds" in hta and "seconds" in ours:
                    row["speedup"] = round(hta["seconds"] / ours["seconds"], 1)
                    row["hta_peak_over_trace"] = round(hta["tracemalloc_peak_bytes"] / size, 3)
            results[name] = row
    goals = {"process_speedup_min": 10.0, "speedup_min": 10.0, "peak_over_trace_max": 3.0}
    print(json.dumps({"benchmark": "profiler_vs_hta", "goals": goals, "results": results}, indent=2))


if __name__ == "__main__":
    main()
