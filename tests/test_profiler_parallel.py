"""A large trace decoded in parts on several cores gives exactly what one core gives.

The parts are cut where the bytes look like an event boundary (``},{``) and the cut is proved by
parsing; a cut inside a string or a bad event sends the whole file to the one-core reader,
which names the event exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import cpdpkit.profiler.trace as trace_mod
from _trace_builder import cpu_scenario
from cpdpkit.profiler import TraceFileError, load_trace
from cpdpkit.profiler._parallel import split_events
from cpdpkit.profiler._reader import StreamingNotPossible, events_start, read_range

pytestmark = pytest.mark.timeout(120)

FIELDS = ("start_us", "end_us", "name_id", "cat_id", "thread_id", "stream", "correlation", "names", "cats", "threads",
          "thread_names", "comm_kind", "pg_name", "comm_seq", "comm_bytes", "comm_ranks", "meta", "origin_us")


def _big_trace(path: Path, copies: int = 60, middle: dict | None = None) -> Path:
    """The CPU scenario's events repeated (shifted in time), with new names in later copies so
    that each part interns names the others do not have; ``middle`` goes in the middle."""
    doc = cpu_scenario(0)
    events = doc.pop("traceEvents")
    out = []
    for k in range(copies):
        for e in events:
            e2 = dict(e)
            if isinstance(e2.get("ts"), (int, float)):
                e2["ts"] += k * 100_000
            if e2.get("ph") == "X" and e2.get("name", "").startswith("aten::") and k % 7 == 3:
                e2["name"] = f"{e2['name']}_{k}"
            out.append(e2)
        if middle is not None and k == copies // 2:
            out.append(middle)
    doc["traceEvents"] = out
    path.write_text(json.dumps(doc, indent=1))
    return path


@pytest.fixture
def eager(monkeypatch):
    """Parallel decoding for any size, in 3 parts (more parts than cores is fine), and what
    each attempt returned."""
    attempts: list[object] = []
    real = trace_mod.map_ranges

    def recorded(*args):  # type: ignore[no-untyped-def]
        got = real(*args)
        attempts.append(got is not None)
        return got

    monkeypatch.setattr(trace_mod, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(trace_mod, "worker_count", lambda: 3)
    monkeypatch.setattr(trace_mod, "map_ranges", recorded)
    return attempts


def _same(a, b) -> None:  # type: ignore[no-untyped-def]
    for name in FIELDS:
        assert getattr(a, name) == getattr(b, name), name


def test_parts_give_the_same_trace(tmp_path, eager):
    path = _big_trace(tmp_path / "rank0.json")
    start = events_start(str(path))
    assert len(split_events(str(path), start, 3)) == 3
    _same(load_trace(path, parallel=True), load_trace(path, parallel=False))
    assert eager == [True]  # decoded in parts, not by the fallback


def test_a_cut_inside_a_string_falls_back_to_one_core(tmp_path, eager):
    trap = {"ph": "X", "name": "aten::trap", "ts": 1, "dur": 1, "pid": 1, "tid": 1,
            "args": {"text": "}, {" * 400_000}}  # every boundary-looking place near the middle is inside it
    path = _big_trace(tmp_path / "rank0.json", copies=4, middle=trap)
    start = events_start(str(path))
    ranges = split_events(str(path), start, 3)
    text_at = path.read_bytes().index(b'"text"')
    assert any(text_at < a < text_at + 1_600_000 for a, _ in ranges[1:]), "the test needs a cut inside the string"
    _same(load_trace(path, parallel=True), load_trace(path, parallel=False))
    assert eager == [False]


def test_a_range_must_end_exactly_at_an_event(tmp_path):
    path = _big_trace(tmp_path / "rank0.json", copies=3)
    data = path.read_bytes()
    start = events_start(str(path))
    cut = data.index(b'"name"', len(data) // 2)  # inside an event
    with pytest.raises(StreamingNotPossible):
        read_range(str(path), start, cut, False, lambda batch, index: None)


def test_a_bad_event_in_a_later_part_is_named_with_its_index_in_the_file(tmp_path, eager):
    bad = {"ph": "X", "name": "aten::bad", "ts": "soon", "dur": 1, "pid": 1, "tid": 1}
    path = _big_trace(tmp_path / "rank0.json", middle=bad)
    with pytest.raises(TraceFileError) as parallel:
        load_trace(path, parallel=True)
    with pytest.raises(TraceFileError) as serial:
        load_trace(path, parallel=False)
    assert str(parallel.value) == str(serial.value)
    index = json.loads(path.read_text())["traceEvents"].index(bad)
    assert f"traceEvents[{index}] ('aten::bad'): field 'ts' is str, expected a number" in str(parallel.value)
    assert eager == [False]
