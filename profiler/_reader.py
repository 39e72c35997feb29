"""Streaming reader for Chrome-trace JSON (plain or gzip): events in batches, metadata aside.

A Kineto trace is one JSON object whose ``traceEvents`` list holds nearly all the bytes.
Parsing it whole would build millions of Python objects at once (about ten times the file
size), so the reader walks the ``traceEvents`` array in chunks of 64 KiB: it cuts each
chunk at the last ``}`` that is followed by ``,`` or ``]`` and hands ``[chunk]`` to a
``parse`` function (orjson by default; :func:`cpdpkit.profiler.trace.load_trace` passes
the msgspec decoder of :mod:`cpdpkit.profiler._events`, which falls back to orjson). A cut
inside a string or a nested object cannot produce valid JSON (its brackets would not
balance), so a successful parse proves the cut was between events; otherwise (``parse``
raised ``ValueError``) an earlier ``}`` is tried, then more data is read. Everything
outside the array (``distributedInfo``, ``deviceProperties``, ...) is parsed with orjson at
the end as the object with an empty ``traceEvents``. Unusual but valid layouts fall back to
parsing the whole file with orjson, which also produces orjson's exact message for invalid
JSON. Nothing is ever eval'ed or unpickled.

Cost is bounded on any file, including a gzip bomb (:class:`TraceLimits`): time is linear in the
decompressed size (whitespace between events is dropped as it is read; a cut that fails is not
searched again, and the next read doubles the buffer, so a huge or never-ending event costs a
constant number of passes over its bytes); at most ``max_bytes`` decompressed bytes are read and
``max_events`` events kept, the key ``"traceEvents"`` must start within the first
``HEAD_LIMIT`` bytes and an event must end within ``MAX_EVENT_BYTES``. A file the streaming path
cannot follow is read whole, at most ``WHOLE_LIMIT`` bytes (a whole parse builds up to ~25 bytes
of objects per byte). Each limit ends in one line naming it and how to raise it.
"""

from __future__ import annotations

import gzip
import os
import re
import zlib
from collections.abc import Callable
from typing import Any, BinaryIO, Protocol

import orjson

from cpdpkit.profiler._record import record
from cpdpkit.profiler.errors import TraceFileError

__all__ = ["read_events", "read_events_whole", "read_range", "events_start", "meta_around", "StreamingNotPossible",
           "DEFAULT_CHUNK_BYTES", "TraceLimits", "DEFAULT_LIMITS"]

DEFAULT_CHUNK_BYTES = 64 << 10  # measured: small chunks are as fast (cache-friendly) and keep memory flat
_GZIP_MAGIC = b"\x1f\x8b"
_KEY = re.compile(rb'"traceEvents"\s*:\s*\[')
_WS = re.compile(rb"\s*")
_AFTER_CLOSE = re.compile(rb"\s*[,\]]")
_MAX_TRIES = 8
_READ_BLOCK = 1 << 20  # what a read to the end asks the file for at a time
HEAD_LIMIT = 64 << 20  # Kineto writes a few KiB of metadata before the events
MAX_EVENT_BYTES = 16 << 20  # no cut within this many bytes: not a Kineto event (they are < 1 MiB); read whole
WHOLE_LIMIT = 64 << 20  # a whole parse builds up to ~25 bytes of objects per byte (`[{},{}...]`)

Batch = Callable[[Any, int], None]
Parse = Callable[[bytes], Any]  # raises ValueError (orjson.JSONDecodeError is one) on invalid JSON


class _Reads(Protocol):
    """What the readers read from: a file, a gzip stream, a window of a file, or a bounded one of these."""

    def read(self, n: int = -1, /) -> bytes: ...


class StreamingNotPossible(Exception):
    """The streaming path cannot handle this file; read it whole instead."""


@record(kw_only=True)
class TraceLimits:
    """The most one trace file may cost: decompressed bytes read and events kept.

    The defaults take a Kineto trace of 4 GiB, or of 10 million events (about 2.5 GiB at ~250 bytes
    each; ~15 s to analyse); the CLI's ``--max-trace-bytes`` and ``--max-events`` raise them.
    """

    max_bytes: int = 4 << 30
    max_events: int = 10_000_000

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_events"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} = {value!r} is invalid; use a whole number >= 1")

    def too_many_events(self, path: str) -> TraceFileError:
        return TraceFileError(path, f"more than {self.max_events:,} events, the limit: raise it with --max-events "
                                    "(TraceLimits.max_events) if the trace is real")


DEFAULT_LIMITS = TraceLimits()


class _Bounded:
    """A file object that raises a one-line :class:`TraceFileError` once ``limit`` bytes have been read."""

    def __init__(self, fh: BinaryIO | gzip.GzipFile, path: str, limit: int, flag: str) -> None:
        self.fh, self.path, self.left, self.limit, self.flag = fh, path, limit, limit, flag

    def read(self, n: int = -1) -> bytes:
        if 0 <= n <= self.left:
            data = self.fh.read(n)
            self.left -= len(data)
            return data
        # to the end (or one byte past the limit), a block at a time: ``read(left + 1)`` at once
        # makes io allocate that many bytes up front, 4 GiB under the default limit (untouched
        # pages, so no RSS, but tracemalloc counts them and a host without overcommit refuses)
        parts = []
        while more := self.fh.read(min(_READ_BLOCK, self.left + 1)):
            parts.append(more)
            self.left -= len(more)
            if self.left < 0:
                raise TraceFileError(self.path, f"more than {self.limit:,} bytes {self.flag}")
        return b"".join(parts)

    def __enter__(self) -> _Bounded:
        return self

    def __exit__(self, *exc: object) -> None:
        self.fh.close()


def _open_bounded(path: str, limits: TraceLimits, limit: int | None = None, flag: str | None = None) -> _Bounded:
    return _Bounded(_open(path), path, limits.max_bytes if limit is None else limit, flag or
                    "decompressed, the limit: raise it with --max-trace-bytes (TraceLimits.max_bytes) if the trace "
                    "is real")


def _open(path: str) -> BinaryIO | gzip.GzipFile:
    try:
        raw = open(path, "rb")  # noqa: SIM115 - closed by the caller
    except OSError as exc:
        raise TraceFileError(path, f"cannot read the file ({exc.strerror or exc})") from None
    if raw.read(2) == _GZIP_MAGIC:
        raw.seek(0)
        return gzip.GzipFile(fileobj=raw, mode="rb")
    raw.seek(0)
    if path.endswith(".gz"):
        raw.close()
        raise TraceFileError(path, "not gzip data although the name ends in .gz")
    return raw


def _read(fh: _Reads, n: int, path: str) -> bytes:
    try:
        return fh.read(n)
    except EOFError:
        raise TraceFileError(
            path, "truncated gzip file (compressed data ends before the end-of-stream marker)"
        ) from None
    except (gzip.BadGzipFile, zlib.error) as exc:
        raise TraceFileError(path, f"corrupt gzip data ({exc})") from None
    except OSError as exc:
        raise TraceFileError(path, f"cannot read the file ({exc.strerror or exc})") from None


def _meta_from(doc: Any, path: str) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise TraceFileError(path, f"JSON top level is a {_json_type(doc)}, expected an object with 'traceEvents'")
    if "traceEvents" not in doc:
        raise TraceFileError(path, "JSON has no 'traceEvents' (not a Chrome/Kineto trace)")
    if not isinstance(doc["traceEvents"], list):
        raise TraceFileError(path, f"'traceEvents' is a {_json_type(doc['traceEvents'])}, expected a list")
    return doc


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number" if isinstance(value, (int, float)) else type(value).__name__)


def _parse_all(data: bytes, path: str) -> dict[str, Any]:
    if not data.strip():
        raise TraceFileError(path, "empty file")
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise TraceFileError(path, f"not valid JSON ({exc})") from None
    return _meta_from(doc, path)


def _stream_array(fh: _Reads, buf: bytes, path: str, chunk: int, on_batch: Batch, parse: Parse,
                  limits: TraceLimits) -> bytes:
    """Feed the events of the open ``traceEvents`` array to ``on_batch``; return what follows it.

    Linear in the bytes read: leading whitespace is dropped before reading on, ``lo`` marks where
    the last failed search for a cut ended (those ``}`` are not tried again), and after a failed
    round the next read is as large as the buffer (a long event takes O(log n) rounds)."""
    index = 0
    eof = False
    need_comma = False  # after an event: a ``,`` (or the ``]``) comes next
    lo = 0
    grow = chunk
    while True:
        if len(buf) < chunk and not eof:
            more = _read(fh, chunk, path)
            eof = not more
            buf += more
            continue
        pos = _WS.match(buf).end()
        if need_comma and buf[pos : pos + 1] == b",":
            need_comma = False
            pos = _WS.match(buf, pos + 1).end()
        if pos == len(buf) and not eof:  # only whitespace (and perhaps the comma): drop it, read on
            buf = _read(fh, chunk, path)
            eof, lo = not buf, 0
            continue
        if buf[pos : pos + 1] == b"]":
            return buf[pos + 1 :]
        if need_comma:
            raise StreamingNotPossible  # two events without a comma: invalid, let orjson say where
        events, cut = _parse_prefix(buf, pos, parse, max(lo, pos))
        if events is None:
            if eof or len(buf) - pos > MAX_EVENT_BYTES:
                raise StreamingNotPossible
            buf = buf[pos:]
            lo = max(0, len(buf) - 1)  # a ``}`` at the very end may become a cut once its follower arrives
            grow = max(grow, len(buf))
            more = _read(fh, grow, path)
            eof = not more
            buf += more
            continue
        on_batch(events, index)
        index += len(events)
        if index > limits.max_events:
            raise limits.too_many_events(path)
        need_comma, lo, grow = True, 0, chunk
        buf = buf[cut:]


def _parse_prefix(buf: bytes, pos: int, parse: Parse, lo: int) -> tuple[Any, int]:
    """Parse the longest run of whole events in ``buf[pos:]``, cut at a ``}`` at or after ``lo``;
    ``(None, 0)`` if none is whole."""
    end = len(buf)
    for _ in range(_MAX_TRIES):
        j = buf.rfind(b"}", lo, end)
        if j < 0:
            return None, 0
        end = j
        if not _AFTER_CLOSE.match(buf, j + 1):
            continue
        try:
            with memoryview(buf) as view:  # one copy into the array's bytes, not three
                data = b"".join((b"[", view[pos : j + 1], b"]"))
            events = parse(data)
        except ValueError:
            continue
        return events, j + 1
    return None, 0


def read_events(
    path: str, on_batch: Batch, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, parse: Parse = orjson.loads,
    limits: TraceLimits = DEFAULT_LIMITS,
) -> dict[str, Any]:
    """Stream ``traceEvents`` of ``path`` to ``on_batch(parse(b"[...]"), first_index)``; return the rest.

    ``parse`` turns the bytes of a JSON array of events into a batch (``len`` = number of
    events), raising ``ValueError`` when they are not valid JSON.
    The returned dict is the top-level object without the events (``traceEvents`` is []).
    Raises :class:`TraceFileError` with one line naming the file and the problem (a limit of
    ``limits`` included), or :class:`StreamingNotPossible` (after some batches may have been
    delivered) when the layout needs :func:`read_events_whole`.
    """
    path = os.fspath(path)
    with _open_bounded(path, limits) as fh:
        buf = bytearray()
        while True:
            m = _KEY.search(buf)
            if m:
                break
            if len(buf) > HEAD_LIMIT:
                raise StreamingNotPossible
            more = _read(fh, max(chunk_bytes, len(buf)), path)  # doubling: linear
            if not more:
                raise StreamingNotPossible
            buf += more
        head = bytes(buf)
        rest = _stream_array(fh, head[m.end() :], path, chunk_bytes, on_batch, parse, limits)
        tail = rest + _read(fh, -1, path)
    return meta_around(head[: m.end()], tail)


def meta_around(head: bytes, tail: bytes) -> dict[str, Any]:
    """The top-level object from the bytes before the events (ending in ``"traceEvents": [``) and
    those after the array's ``]``, with an empty ``traceEvents``; :class:`StreamingNotPossible` if
    they do not make one."""
    try:
        meta = orjson.loads(head + b"]" + tail)
    except orjson.JSONDecodeError:
        raise StreamingNotPossible from None
    if not isinstance(meta, dict) or meta.get("traceEvents") != []:
        raise StreamingNotPossible
    return meta


def events_start(path: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int | None:
    """Byte offset just after ``"traceEvents": [`` in an uncompressed trace; ``None`` for a gzip
    file or when it is not within the first few chunks."""
    with open(path, "rb") as fh:
        head = fh.read(4 * chunk_bytes)
    if head[:2] == _GZIP_MAGIC:
        return None
    m = _KEY.search(head)
    return m.end() if m else None


class _Window:
    """Reads bytes ``[start, end)`` of an open file, then ``closing`` (``end=None``: to the end)."""

    def __init__(self, raw: BinaryIO, start: int, end: int | None, closing: bytes) -> None:
        raw.seek(start)
        self.raw, self.left, self.closing = raw, end - start if end is not None else None, closing

    def read(self, n: int = -1) -> bytes:
        if self.left is None:
            return self.raw.read(n)
        if n < 0 or n > self.left:
            n = self.left
        data = self.raw.read(n) if n else b""
        self.left -= len(data)
        if not data:
            data, self.closing = self.closing, b""
        return data


def read_range(path: str, start: int, end: int, last: bool, on_batch: Batch, *,
               chunk_bytes: int = DEFAULT_CHUNK_BYTES, parse: Parse = orjson.loads,
               limits: TraceLimits = DEFAULT_LIMITS) -> bytes:
    """Stream the events in bytes ``[start, end)`` of an uncompressed trace, where ``start`` is
    :func:`events_start` or the ``{`` of an event; every range but the ``last`` must end exactly
    where the next event begins (before its ``{``), else :class:`StreamingNotPossible`. Returns
    what follows the array (``last``), else ``b""``."""
    with open(path, "rb") as raw:
        fh = _Window(raw, start, None if last else end, b"" if last else b"]")
        rest = _stream_array(fh, b"", path, chunk_bytes, on_batch, parse, limits)
        if last:
            return rest + _read(fh, -1, path)
    if rest.strip() or fh.read():
        raise StreamingNotPossible
    return b""


def read_events_whole(path: str, on_batch: Batch, *, limits: TraceLimits = DEFAULT_LIMITS) -> dict[str, Any]:
    """Non-streaming read (whole file through orjson, at most ``WHOLE_LIMIT`` bytes); exact orjson
    messages for bad JSON."""
    path = os.fspath(path)
    limit = min(WHOLE_LIMIT, limits.max_bytes)
    flag = ("decompressed, the most read whole (the streaming reader could not follow this file: it is not "
            "valid JSON, or its 'traceEvents' starts after the first 64 MiB)") if limit == WHOLE_LIMIT else None
    with _open_bounded(path, limits, limit, flag) as fh:
        data = _read(fh, -1, path)
    doc = _parse_all(data, path)
    del data
    events = doc.pop("traceEvents")
    doc["traceEvents"] = []
    on_batch(events, 0)
    return doc
