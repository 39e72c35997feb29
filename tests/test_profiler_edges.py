"""Profiler edges: an empty trace, no step, absurd timestamps, and --debug (a traceback, still exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)
MM = {"ph": "X", "name": "aten::mm", "cat": "cpu_op", "pid": 1, "tid": 1, "ts": 1, "dur": 1}


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "from cpdpkit.cli import main; main()", *args],
                          capture_output=True, text=True, timeout=100)


def _trace(path: Path, events: list[dict]) -> Path:
    path.write_text(json.dumps({"traceEvents": events}))
    return path


@pytest.mark.parametrize(("events", "code", "line"), [
    ([], 2, "error: {p}: no events in 'traceEvents': the profiler recorded nothing (check its schedule's active "
            "steps, and that prof.step() is called)"),
    ([{**MM, "ts": 1e300}], 2, "error: {p}: a timestamp or duration of 1e+300 µs is not a time (they must stay below "
                               "1e+17 µs, about 3,000 years): the trace is corrupt"),
    ([{**MM, "dur": 1e20}], 2, "error: {p}: a timestamp or duration of 1e+20 µs is not a time (they must stay "
                               "below 1e+17 µs, about 3,000 years): the trace is corrupt"),
    ([MM], 0, "warning: {p}: no complete ProfilerStep#N event, so no step was found: the per-step figures are "
              "empty (call prof.step() once per step)"),
])
def test_edges_say_so_in_one_line(tmp_path: Path, events: list[dict], code: int, line: str) -> None:
    path = _trace(tmp_path / "t.json", events)
    proc = _cli("profile", str(path))
    assert proc.returncode == code and proc.stderr.strip() == line.format(p=path), proc.stderr


@pytest.mark.parametrize("args", [["profile", "/nonexistent", "--max-events", "0"],
                                  ["plan", "--model", "nope", "--world-size", "2"]])
def test_debug_shows_the_traceback_and_still_exits_2(args: list[str]) -> None:
    plain, debug = _cli(*args), _cli("--debug", *args)
    assert plain.returncode == debug.returncode == 2
    assert "Traceback" not in plain.stderr and len(plain.stderr.strip().splitlines()) == 1
    assert debug.stderr.startswith("Traceback (most recent call last):")
    assert debug.stderr.strip().splitlines()[-1] == plain.stderr.strip()


def test_debug_shows_the_traceback_of_an_error_collected_per_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad" / "rank0.json"
    bad.parent.mkdir()
    bad.write_text("not json")
    good = _trace(tmp_path / "good.json", [MM])
    plain, debug = _cli("profile", str(bad.parent), str(good)), _cli("--debug", "profile", str(bad.parent), str(good))
    assert plain.returncode == debug.returncode == 2 and plain.stdout == debug.stdout != ""  # the good run is shown
    assert "Traceback" not in plain.stderr
    error = next(line for line in plain.stderr.splitlines() if str(bad) in line)
    before, _, after = debug.stderr.partition(error)
    assert before.startswith("Traceback (most recent call last):") and "TraceFileError" in before
    assert after.strip() == plain.stderr.partition(error)[2].strip()  # the other lines as without --debug
