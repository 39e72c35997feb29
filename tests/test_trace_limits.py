"""Reading a trace costs bounded time and memory: limits on bytes and events, linear cost on hostile layouts.

The full-size gzip bombs (2 GiB of zeros, 2 GiB of spaces, 4 GiB of tiny events) are
benchmarks/trace_bombs.py; here the same shapes at a few MiB, the limits lowered through
``TraceLimits`` and the CLI flags, and the cost counted (bytes handed to the JSON parser), not timed.
"""

from __future__ import annotations

import gzip
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import orjson
import pytest

from _trace_builder import cpu_op, step, trace_doc, write_trace
from cpdpkit.profiler import TraceFileError, TraceLimits, _reader, load_trace
from cpdpkit.profiler._reader import WHOLE_LIMIT

pytestmark = pytest.mark.timeout(120)
EVENT = b'{"ph":"X","name":"aten::mm","cat":"cpu_op","pid":1,"tid":1,"ts":1,"dur":1}'


def _gz(path: Path, *parts: bytes) -> Path:
    with gzip.open(path, "wb", compresslevel=1) as fh:
        for part in parts:
            fh.write(part)
    return path


def test_decompressed_bytes_over_the_limit_end_in_one_line(tmp_path: Path) -> None:
    path = _gz(tmp_path / "t.json.gz", b'{"traceEvents": [', b",".join([EVENT] * 1000), b"]}")
    assert load_trace(path).num_events == 1000
    with pytest.raises(TraceFileError) as info:
        load_trace(path, limits=TraceLimits(max_bytes=10_000))
    assert str(info.value) == (f"{path}: more than 10,000 bytes decompressed, the limit: raise it with "
                               "--max-trace-bytes (TraceLimits.max_bytes) if the trace is real")


@pytest.mark.parametrize("compressed", [True, False])
def test_events_over_the_limit_end_in_one_line(tmp_path: Path, compressed: bool) -> None:
    body = (b'{"traceEvents": [', b",".join([EVENT] * 5000), b"]}")
    path = _gz(tmp_path / "t.json.gz", *body) if compressed else tmp_path / "t.json"
    if not compressed:
        path.write_bytes(b"".join(body))
    with pytest.raises(TraceFileError) as info:
        load_trace(path, limits=TraceLimits(max_events=4999), parallel=False)
    assert str(info.value) == (f"{path}: more than 4,999 events, the limit: raise it with --max-events "
                               "(TraceLimits.max_events) if the trace is real")


def test_a_file_the_stream_cannot_follow_is_read_whole_at_most_whole_limit(tmp_path: Path) -> None:
    path = _gz(tmp_path / "zeros.json.gz", b"\0" * (WHOLE_LIMIT + 1024))
    with pytest.raises(TraceFileError) as info:
        load_trace(path)
    assert str(info.value) == (f"{path}: more than {WHOLE_LIMIT:,} bytes decompressed, the most read whole (the "
                               "streaming reader could not follow this file: it is not valid JSON, or its "
                               "'traceEvents' starts after the first 64 MiB)")


@pytest.mark.parametrize("layout", ["gzip", "plain", "read whole"])
def test_memory_follows_the_file_not_the_limit(tmp_path: Path, layout: str) -> None:
    """Reading to the end asks the file for a block at a time: one ``read(limit + 1)`` made io
    allocate the limit up front (4 GiB by default; tracemalloc's peak read 4.29e9 on a 10 MB
    trace, a host without overcommit would refuse it)."""
    body = (b'{"traceEvents": [', b",".join([EVENT] * 1000), b'], "distributedInfo": {"rank": 0}}')
    path = tmp_path / "t.json"
    if layout == "gzip":
        path = _gz(tmp_path / "t.json.gz", *body)
    else:  # a comma before the first event: not streamable, read whole (WHOLE_LIMIT, 64 MiB, at once before)
        path.write_bytes(b"".join(body).replace(b"[{", b"[ ,{") if layout == "read whole" else b"".join(body))
    tracemalloc.start()
    try:
        if layout == "read whole":
            with pytest.raises(TraceFileError, match="not valid JSON"):
                load_trace(path, parallel=False)
        else:
            assert load_trace(path, parallel=False).num_events == 1000
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak


class _Counted:
    """``_WS`` with the bytes its matches cover counted."""

    def __init__(self, pattern: Any, total: list[int]) -> None:
        self.pattern, self.total = pattern, total

    def match(self, buf: bytes, pos: int = 0) -> Any:
        m = self.pattern.match(buf, pos)
        self.total[0] += m.end() - pos
        return m


@pytest.mark.parametrize("shape", ["never-ending event", "braces never a cut", "spaces"])
def test_hostile_layouts_cost_linear_work(tmp_path: Path, shape: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bytes parsed, searched for a cut and skipped as whitespace grow linearly with the file (they
    grew quadratically: each read rescanned the whole buffer from its start; 2 MiB of "{}, " made
    orjson parse 2,000 times the file)."""
    size = 2 << 20
    body = {"never-ending event": b'{"name": "' + b"a" * size,
            "braces never a cut": b'{"a": [' + b"{}, " * (size // 4),
            "spaces": b" " * size}[shape]
    path = tmp_path / "t.json"
    path.write_bytes(b'{"traceEvents": [' + body)
    parsed, searched, skipped = [0], [0], [0]

    def parse(data: bytes) -> Any:
        parsed[0] += len(data)
        return orjson.loads(data)

    cut = _reader._parse_prefix

    def counted_cut(buf: bytes, pos: int, parse: Any, lo: int) -> Any:
        searched[0] += len(buf) - lo
        return cut(buf, pos, parse, lo)

    monkeypatch.setattr(_reader, "_parse_prefix", counted_cut)
    monkeypatch.setattr(_reader, "_WS", _Counted(_reader._WS, skipped))
    with pytest.raises(_reader.StreamingNotPossible):  # never closed: load_trace then reads it whole
        _reader.read_events(str(path), lambda *_: None, chunk_bytes=4096, parse=parse)
    assert parsed[0] < 40 * size and searched[0] < 4 * size and skipped[0] < 2 * size, (parsed, searched, skipped)


def test_events_after_whitespace_and_a_final_comma_free_array_still_load(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    events = [step(0, 0, 1000), cpu_op("aten::mm", 10, 100)]
    write_trace(path, trace_doc(events))
    data = path.read_bytes().replace(b'"traceEvents": [', b'"traceEvents": [' + b" " * 300_000)
    data = data.replace(b"}, {", b"}" + b" \n" * 100_000 + b", " + b"\t" * 100_000 + b"{")
    path.write_bytes(data)
    assert load_trace(path, chunk_bytes=4096).num_events == load_trace(path).num_events >= 2


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "from cpdpkit.cli import main; main()", *args],
                          capture_output=True, text=True, timeout=60)


def test_cli_flags_raise_or_lower_the_limits(tmp_path: Path) -> None:
    path = _gz(tmp_path / "t.json.gz", b'{"traceEvents": [', b",".join([EVENT] * 1000), b"]}")
    proc = _cli("profile", str(path), "--max-trace-bytes", "10KiB")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: {path}: more than 10,240 bytes decompressed, the limit: raise it with --max-trace-bytes "
        "(TraceLimits.max_bytes) if the trace is real"]
    proc = _cli("profile", str(path), "--max-events", "0")
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "error: --max-events '0' is invalid; use a whole number >= 1, e.g. 50000000")
    proc = _cli("profile", str(path), "--max-trace-bytes", "lots")
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "error: --max-trace-bytes 'lots' is invalid; use a size >= 1 such as 8GiB, 500MiB or 1000000 (bytes)")
