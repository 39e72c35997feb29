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
"""

from __future__ import annotations

import gzip
import os
import re
import zlib
from collections.abc import Callable
from typing import Any, BinaryIO

import orjson

from cpdpkit.profiler.errors import TraceFileError

__all__ = ["read_events", "read_events_whole", "read_range", "events_start", "meta_around", "StreamingNotPossible",
           "DEFAULT_CHUNK_BYTES"]

DEFAULT_CHUNK_BYTES = 64 << 10  # measured: small chunks are as fast (cache-friendly) and keep memory flat
_GZIP_MAGIC = b"\x1f\x8b"
_KEY = re.compile(rb'"traceEvents"\s*:\s*\[')
_WS = re.compile(rb"\s*")
_AFTER_CLOSE = re.compile(rb"\s*[,\]]")
_MAX_TRIES = 8

Batch = Callable[[Any, int], None]
Parse = Callable[[bytes], Any]  # raises ValueError (orjson.JSONDecodeError is one) on invalid JSON


class StreamingNotPossible(Exception):
    """The streaming path cannot handle this file; read it whole instead."""


def _open(path: str) -> BinaryIO:
    try:
        raw = open(path, "rb")  # noqa: SIM115 - closed by the caller
    except OSError as exc:
        raise TraceFileError(path, f"cannot read the file ({exc.strerror or exc})") from None
    if raw.read(2) == _GZIP_MAGIC:
        raw.seek(0)
        return gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[return-value]
    raw.seek(0)
    if path.endswith(".gz"):
        raw.close()
        raise TraceFileError(path, "not gzip data although the name ends in .gz")
    return raw


def _read(fh: BinaryIO, n: int, path: str) -> bytes:
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


def _stream_array(fh: BinaryIO, buf: bytes, path: str, chunk: int, on_batch: Batch, parse: Parse) -> bytes:
    """Feed the events of the open ``traceEvents`` array to ``on_batch``; return what follows it."""
    index = 0
    eof = False
    first = True
    while True:
        if len(buf) < chunk and not eof:
            more = _read(fh, chunk, path)
            eof = not more
            buf += more
            continue
        pos = _WS.match(buf).end()
        if not first and buf[pos : pos + 1] == b",":
            pos = _WS.match(buf, pos + 1).end()
        if buf[pos : pos + 1] == b"]":
            return buf[pos + 1 :]
        events, cut = _parse_prefix(buf, pos, parse)
        if events is None:
            if eof:
                raise StreamingNotPossible
            more = _read(fh, chunk, path)
            eof = not more
            buf += more
            continue
        on_batch(events, index)
        index += len(events)
        first = False
        buf = buf[cut:]


def _parse_prefix(buf: bytes, pos: int, parse: Parse) -> tuple[Any, int]:
    """Parse the longest run of whole events in ``buf[pos:]``; ``(None, 0)`` if none is whole."""
    end = len(buf)
    for _ in range(_MAX_TRIES):
        j = buf.rfind(b"}", pos, end)
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
    path: str, on_batch: Batch, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, parse: Parse = orjson.loads
) -> dict[str, Any]:
    """Stream ``traceEvents`` of ``path`` to ``on_batch(parse(b"[...]"), first_index)``; return the rest.

    ``parse`` turns the bytes of a JSON array of events into a batch (``len`` = number of
    events), raising ``ValueError`` when they are not valid JSON.
    The returned dict is the top-level object without the events (``traceEvents`` is []).
    Raises :class:`TraceFileError` with one line naming the file and the problem, or
    :class:`StreamingNotPossible` (after some batches may have been delivered) when the
    layout needs :func:`read_events_whole`.
    """
    path = os.fspath(path)
    with _open(path) as fh:
        head = b""
        while True:
            m = _KEY.search(head)
            if m:
                break
            more = _read(fh, chunk_bytes, path)
            if not more:
                raise StreamingNotPossible
            head += more
        rest = _stream_array(fh, head[m.end() :], path, chunk_bytes, on_batch, parse)
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
               chunk_bytes: int = DEFAULT_CHUNK_BYTES, parse: Parse = orjson.loads) -> bytes:
    """Stream the events in bytes ``[start, end)`` of an uncompressed trace, where ``start`` is
    :func:`events_start` or the ``{`` of an event; every range but the ``last`` must end exactly
    where the next event begins (before its ``{``), else :class:`StreamingNotPossible`. Returns
    what follows the array (``last``), else ``b""``."""
    with open(path, "rb") as raw:
        fh = _Window(raw, start, None if last else end, b"" if last else b"]")
        rest = _stream_array(fh, b"", path, chunk_bytes, on_batch, parse)  # type: ignore[arg-type]
        if last:
            return rest + _read(fh, -1, path)  # type: ignore[arg-type]
    if rest.strip() or fh.read():
        raise StreamingNotPossible
    return b""


def read_events_whole(path: str, on_batch: Batch) -> dict[str, Any]:
    """Non-streaming read (whole file through orjson); exact orjson messages for bad JSON."""
    path = os.fspath(path)
    with _open(path) as fh:
        data = _read(fh, -1, path)
    doc = _parse_all(data, path)
    del data
    events = doc.pop("traceEvents")
    doc["traceEvents"] = []
    on_batch(events, 0)
    return doc
