"""Decode one large, uncompressed trace on several cores: byte ranges cut between events.

A 2.7 M-event trace (~700 MB of JSON) takes seconds to decode on one core, and nearly all of
it is the ``traceEvents`` array. :func:`split_events` cuts that array into ``parts`` byte
ranges at places that look like event boundaries (``}``, a comma, ``{``); :func:`map_ranges`
decodes each range in a forked process with the same streaming reader as a whole file
(:func:`cpdpkit.profiler._reader.read_range`) and returns the results in order.

A guessed cut can lie inside a string or a nested object. It is checked rather than trusted:
every range but the last must end *exactly* at the next cut, closing its array there. The
first range starts at the array's true beginning, and any proper prefix of a JSON object is
invalid JSON, so a range that starts at a true boundary and parses cleanly up to the cut
proves that cut a true boundary too, and by induction all of them. If any range fails (a bad
cut, invalid JSON, an event of the wrong type), the caller decodes the file on one core,
which also gives the exact one-line error with the event's index.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["PARALLEL_MIN_BYTES", "worker_count", "split_events", "map_ranges"]

T = TypeVar("T")

PARALLEL_MIN_BYTES = 48 << 20  # below this, forking costs more than it saves (measured on 2 cores)
_BOUNDARY = re.compile(rb"\}\s*,\s*\{")
_PROBE_BYTES = 1 << 20


def worker_count() -> int:
    """Cores this process may use (its affinity mask), at most 8."""
    try:
        return min(8, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return min(8, os.cpu_count() or 1)


def split_events(path: str, array_start: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` byte ranges ``[start, end)`` covering the file from ``array_start`` (just after
    ``"traceEvents": [``); every range after the first starts at a ``{`` that follows ``},``
    (a guess, checked by the decoding). Fewer ranges when no boundary is found near a cut."""
    size = os.path.getsize(path)
    cuts = [array_start]
    with open(path, "rb") as fh:
        for k in range(1, parts):
            target = array_start + (size - array_start) * k // parts
            if target <= cuts[-1]:
                continue
            fh.seek(target)
            m = _BOUNDARY.search(fh.read(_PROBE_BYTES))
            if m is None:
                continue
            cuts.append(target + m.end() - 1)  # the "{" of the next event
    return [(a, b) for a, b in zip(cuts, [*cuts[1:], size])]


def _child(work: Callable[..., T], path: str, start: int, end: int, last: bool, write_fd: int) -> None:
    import pickle

    try:
        payload = pickle.dumps((True, work(path, start, end, last)), protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which falls back to one core
        payload = pickle.dumps((False, f"{type(exc).__name__}: {exc}"))
    with os.fdopen(write_fd, "wb") as out:
        out.write(payload)


def map_ranges(work: Callable[[str, int, int, bool], T], path: str,
               ranges: list[tuple[int, int]]) -> list[T] | None:
    """``work(path, start, end, is_last)`` for every range, each in a forked process; the results
    in order, or ``None`` when any range failed (the caller then decodes on one core)."""
    import pickle

    children: list[tuple[int, int]] = []
    for i, (start, end) in enumerate(ranges):
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: decode, send, and leave without running the parent's cleanup
            os.close(read_fd)
            code = 0
            try:
                _child(work, path, start, end, i == len(ranges) - 1, write_fd)
            except BaseException:  # noqa: BLE001
                code = 1
            finally:
                os._exit(code)
        os.close(write_fd)
        children.append((pid, read_fd))
    results: list[Any] = []
    ok = True
    for pid, read_fd in children:
        with os.fdopen(read_fd, "rb") as src:
            data = src.read()
        os.waitpid(pid, 0)
        try:
            good, value = pickle.loads(data)
        except Exception:  # noqa: BLE001 - a child that died without a result
            good, value = False, None
        ok = ok and good
        results.append(value)
    return results if ok else None
