"""Benchmark: cpdpkit.profiler vs Holistic Trace Analysis on the same traces (prints JSON).

For each trace folder, first as a user feels it: whole processes, side by side and interleaved
(startup and imports included; one untimed warm-up each, for bytecode and the OS file cache,
then the median of ``--repeats``; peak RSS of each process from ``wait4``):
  * cpdpkit: ``cpdpkit profile FOLDER --json OUT`` (the console script beside this Python);
  * HTA 0.5.0: ``python -c`` importing HTA, then ``TraceAnalysis(trace_dir=FOLDER)`` and
    ``get_comm_comp_overlap(visualize=False)``;
then in-process, each in a fresh subprocess (so memory figures are clean): cpdpkit's
``analyze([folder])`` against the same HTA calls, with wall time, the speed-up, peak memory
(tracemalloc peak of the call, and the growth of the process's peak RSS) against the
uncompressed trace size, and both overlap percentages (``null`` for a rank without
communication: cpdpkit's ``None``, HTA's NaN).
Inputs: the shared NCCL traces (``../shared/traces``), a synthesised larger trace (the 2-rank
trace's events replicated back to back, ``--scale`` copies) and the streaming case, the same
replicated to ``--huge-events`` events (~700 MB of JSON; cpdpkit only, one timed run, and its
memory with the decoding workers, which ``wait4`` does not count, from one more run).

``process_cpu_speedup`` compares the processes' CPU time (user + system, from ``wait4``), which a
loaded machine moves far less than wall time; the goal is on wall time (``process_speedup``).
``--runs N`` repeats the whole measurement and lists each case's speed-ups run by run (the goal:
>= 10x on the small traces in 5 of 5 runs, ``--only nccl_2rank,sampled_128rank --repeats 5 --runs 5``).

usage: python benchmarks/profiler_vs_hta.py [--scale 8] [--huge-events 2700000] [--no-hta]
       [--shared PATH] [--repeats 3] [--only NAME,...] [--runs 1]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
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


def _command(tool: str, folder: Path, tmp: str) -> list[str]:
    if tool == "hta":
        return [sys.executable, "-c", _HTA_PROCESS, str(folder)]
    script = Path(sys.executable).with_name("cpdpkit")  # the console script a user types
    entry = [str(script)] if script.exists() else [sys.executable, "-m", "cpdpkit.cli"]
    return [*entry, "profile", str(folder), "--json", str(Path(tmp) / "out.json")]


def _timed_process(cmd: list[str]) -> tuple[float, int, int, str, float]:
    """(wall seconds, exit code, peak RSS bytes of that process, last stderr line, its CPU seconds:
    user + system, which other processes' load moves far less than the wall time)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # users have .pyc files
    with tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        lines = err.read().decode(errors="replace").strip().splitlines()
    cpu = usage.ru_utime + usage.ru_stime
    return seconds, proc.returncode, usage.ru_maxrss * 1024, lines[-1] if lines else "", cpu


def _processes(tools: list[str], folder: Path, repeats: int) -> dict[str, dict]:
    """Whole commands as a user runs them, interleaved (one untimed warm-up each: bytecode and the
    OS file cache), then ``repeats`` alternating timed runs; the median counts. cpdpkit's exit 2
    for a run that misses ranks still counts: everything was read and analysed."""
    with tempfile.TemporaryDirectory() as tmp:
        cmds = {tool: _command(tool, folder, tmp) for tool in tools}
        runs: dict[str, list[tuple[float, int, float]]] = {tool: [] for tool in tools}
        for attempt in range(repeats + 1):
            for tool in tools:
                seconds, code, peak, last, cpu = _timed_process(cmds[tool])
                if code not in (0, 2):
                    return {**{t: {"error": last or f"exit {code}"} for t in tools if t == tool},
                            **{t: {"error": "not timed: its peer failed"} for t in tools if t != tool}}
                if attempt:
                    runs[tool].append((seconds, peak, cpu))
    return {tool: {"seconds": round(statistics.median(t for t, _, _ in got), 3),
                   "all_seconds": [round(t, 3) for t, _, _ in got],
                   "cpu_seconds": round(statistics.median(c for _, _, c in got), 3),
                   "peak_rss_bytes": max(m for _, m, _ in got)} for tool, got in runs.items()}


_MEMORY = r"""
import json, resource, sys, tempfile
from cpdpkit.cli import main
from cpdpkit.profiler._parallel import worker_count
with tempfile.TemporaryDirectory() as tmp:
    try:
        main(["profile", sys.argv[1], "--json", tmp + "/out.json"])
    except SystemExit:
        pass
own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
print(json.dumps({"main_peak_rss_bytes": own, "worker_peak_rss_bytes": child, "workers": worker_count(),
                  "peak_rss_bound_bytes": own + worker_count() * child}))
"""


def _memory_with_workers(folder: Path) -> dict:
    """The command's peak memory with its decoding workers (forked, so not in its own RSS): an upper
    bound, the main process's peak plus every worker at the largest worker's peak (shared pages
    counted in each)."""
    done = subprocess.run([sys.executable, "-c", _MEMORY, str(folder)], capture_output=True, text=True, timeout=3600,
                          cwd=ROOT)
    lines = done.stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else {"error": done.stderr.strip()[-300:]}


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
    """Replicate a trace's events ``copies`` times back to back (new correlation ids and step
    numbers), written copy by copy so that memory stays one copy even for 2.7 M events."""
    with gzip.open(src, "rb") as fh:
        doc = orjson.loads(fh.read())
    events = doc.pop("traceEvents")
    timed = [e for e in events if isinstance(e.get("ts"), (int, float))]
    span = max(e["ts"] + e.get("dur", 0) for e in timed) - min(e["ts"] for e in timed) + 1000
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "rank-0.json", "wb") as out:
        out.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2)[:-2] + b',\n  "traceEvents": [\n')
        first = True
        for k in range(copies):
            chunk = []
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
                chunk.append(orjson.dumps(e2, option=orjson.OPT_INDENT_2))
            out.write((b"" if first else b",\n") + b",\n".join(chunk))
            first = False
        out.write(b"\n  ]\n}\n")
    return out_dir


def _events_per_copy(src: Path) -> int:
    with gzip.open(src, "rb") as fh:
        return sum(1 for e in orjson.loads(fh.read())["traceEvents"] if e.get("ph") != "M")


def _row(name: str, folder: Path, args: argparse.Namespace, huge: bool) -> dict:
    size = _uncompressed_bytes(folder)
    tools = ["cpdpkit"] if args.no_hta or size > args.hta_max_bytes else ["cpdpkit", "hta"]
    row: dict = {"uncompressed_bytes": size, "process": _processes(tools, folder, 1 if huge else args.repeats)}
    mine, theirs = (row["process"].get(t, {}).get("seconds") for t in ("cpdpkit", "hta"))
    if mine and theirs:
        row["process_speedup"] = round(theirs / mine, 2)
        cpu = [row["process"][t]["cpu_seconds"] for t in ("cpdpkit", "hta")]
        row["process_cpu_speedup"] = round(cpu[1] / cpu[0], 2) if cpu[0] else None
    if huge:  # in-process timing and tracemalloc add little here and take minutes
        row["cpdpkit_memory"] = _memory_with_workers(folder)
        return row
    ours = _run("cpdpkit", folder)
    row["cpdpkit"] = ours
    if "tracemalloc_peak_bytes" in ours:
        row["cpdpkit_peak_over_trace"] = round(ours["tracemalloc_peak_bytes"] / size, 3)
        row["cpdpkit_rss_growth_over_trace"] = round(ours["rss_growth_bytes"] / size, 3)
    if "hta" in tools:
        hta = _run("hta", folder)
        row["hta"] = hta
        if "seconds" in hta and "seconds" in ours:
            row["speedup"] = round(hta["seconds"] / ours["seconds"], 1)
            row["hta_peak_over_trace"] = round(hta["tracemalloc_peak_bytes"] / size, 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=8, help="copies of the 2-rank trace in the synthetic trace")
    parser.add_argument("--huge-events", type=int, default=2_700_000,
                        help="events of the streaming case (0: skip it); HTA is not run on it")
    parser.add_argument("--hta-max-bytes", type=float, default=300e6, help="run HTA only on traces up to this size")
    parser.add_argument("--no-hta", action="store_true", help="time cpdpkit only")
    parser.add_argument("--shared", type=Path, default=ROOT.parent / "shared" / "traces")
    parser.add_argument("--only", default=None, help="comma-separated case names to run (default: all)")
    parser.add_argument("--repeats", type=int, default=3, help="whole-process runs per tool (the median counts)")
    parser.add_argument("--runs", type=int, default=1,
                        help="measure everything this many times (the goal counts runs: >= 10x in 5 of 5)")
    args = parser.parse_args()
    if args.runs > 1:
        _many_runs(args)
    else:
        main_args(args)


def main_args(args: argparse.Namespace) -> None:
    """One measurement of the cases ``args`` selects, printed as JSON."""
    src = args.shared / "nccl_2rank" / "rank-0.json.gz"
    cases: dict[str, tuple[Path | None, int]] = {p.name: (p, 0) for p in sorted(args.shared.iterdir()) if p.is_dir()}
    if src.exists() and args.scale > 0:
        cases[f"synthetic_x{args.scale}"] = (None, args.scale)
    if src.exists() and args.huge_events > 0:
        cases[f"huge_{args.huge_events}_events"] = (None, -(-args.huge_events // _events_per_copy(src)))
    only = set(args.only.split(",")) if args.only else set(cases)
    results = _results(args, src, cases, only)
    goals = {"process_speedup_min": 10.0, "speedup_min": 10.0, "peak_over_trace_max": 3.0,
             "huge_process_seconds_max": 9.0, "huge_peak_rss_bytes_max": 2.7e9}
    print(json.dumps({"benchmark": "profiler_vs_hta", "goals": goals, "load_average": os.getloadavg(),
                      "results": results}, indent=2))


def _many_runs(args: argparse.Namespace) -> None:
    """``--runs N``: the whole measurement N times, then each case's speed-ups run by run."""
    import io
    from contextlib import redirect_stdout

    runs = []
    for _ in range(args.runs):
        args.runs = 1
        with redirect_stdout(io.StringIO()) as out:
            main_args(args)
        runs.append(json.loads(out.getvalue()))
    cases = sorted({c for r in runs for c in r["results"]})
    summary = {c: {"process_speedup": [r["results"].get(c, {}).get("process_speedup") for r in runs],
                   "process_cpu_speedup": [r["results"].get(c, {}).get("process_cpu_speedup") for r in runs],
                   "cpdpkit_seconds": [r["results"].get(c, {}).get("process", {}).get("cpdpkit", {}).get("seconds")
                                       for r in runs]} for c in cases}
    for row in summary.values():
        row["runs_at_goal"] = f"{sum((x or 0) >= 10.0 for x in row['process_speedup'])}/{len(runs)}"
    print(json.dumps({"benchmark": "profiler_vs_hta", "runs": len(runs), "summary": summary,
                      "load_average_per_run": [r["load_average"] for r in runs], "each_run": runs}, indent=2))


def _results(args: argparse.Namespace, src: Path, cases: dict, only: set[str]) -> dict:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (folder, copies) in cases.items():
            if name not in only:
                continue
            if folder is None:
                folder = synthesize(src, copies, Path(tmp) / name)
            results[name] = _row(name, folder, args, huge=name.startswith("huge_"))
            if folder.is_relative_to(tmp):
                shutil.rmtree(folder)
    return results


if __name__ == "__main__":
    main()
