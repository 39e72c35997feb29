"""One rank's trace as a few numpy columns: what the overlap analysis needs, and nothing more.

:func:`load_trace` streams a Chrome-trace file (``.json`` or ``.json.gz``) batch by batch
and keeps, for every complete event (``ph == "X"``), its start and end (microseconds,
relative to the file's first event), an interned name and category, its thread, its GPU
stream (-1 on the CPU), its CUDA correlation id and, for communication events only, the
collective and process group from its arguments. Batches are dropped as they are added,
so memory is a few columns per event instead of the whole JSON tree.

Each batch is decoded by msgspec into just the fields above (:mod:`cpdpkit.profiler._events`),
already type-checked and gathered into columns, and appended as a whole. A batch msgspec
refuses is parsed by orjson into dicts and goes through the checked per-event path, which
validates events as they go by: a non-object event, or a complete event whose
``name``/``ts``/``dur``/``pid``/``tid``/``args`` is missing or of the wrong type, makes the
whole file fail with one line naming the file, the event index and the field. Both paths
give identical columns.
"""

from __future__ import annotations

import os
import re
from array import array
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cpdpkit.profiler._events import EventBatch, decode_batch
from cpdpkit.profiler._reader import (
    DEFAULT_CHUNK_BYTES,
    StreamingNotPossible,
    read_events,
    read_events_whole,
)
from cpdpkit.profiler.classify import NameClass, canonical_kind, classify_name
from cpdpkit.profiler.errors import TraceFileError

__all__ = ["RankTrace", "load_trace", "rank_from_file_name", "rank_in_meta", "world_size_in_meta"]

_NUMBER = (int, float)


@dataclass(frozen=True, eq=False)
class RankTrace:
    """Columns of one rank's complete events plus the trace metadata.

    ``start_us``/``end_us`` are relative to ``origin_us`` (the earliest event start).
    ``comm_kind`` holds a canonical kind from the event's ``Collective name`` argument
    (``""`` when absent) and ``pg_name`` its ``Process Group Name`` (``comm_seq`` its ``Seq``;
    ``comm_bytes`` its input and output bytes, ``In msg nelems``/``Out msg nelems`` × the size of its
    ``dtype``; ``comm_ranks`` its group's ranks, ``Process Group Ranks``, or ``Group size`` ranks
    from 0 when that is the world size), all only for
    communication events.
    """

    path: str
    rank: int | None
    meta: dict[str, Any]
    origin_us: float
    start_us: np.ndarray
    end_us: np.ndarray
    name_id: np.ndarray
    cat_id: np.ndarray
    thread_id: np.ndarray
    stream: np.ndarray
    correlation: np.ndarray
    names: list[str]
    name_classes: list[NameClass]
    cats: list[str]
    threads: list[tuple[Any, Any]]
    thread_names: dict[int, str]
    comm_kind: dict[int, str] = field(default_factory=dict)
    pg_name: dict[int, str] = field(default_factory=dict)
    comm_seq: dict[int, int] = field(default_factory=dict)
    comm_bytes: dict[int, tuple[int, int]] = field(default_factory=dict)
    comm_ranks: dict[int, tuple[int, ...]] = field(default_factory=dict)

    @property
    def num_events(self) -> int:
        return int(self.start_us.shape[0])


class _Columns:
    """Accumulates validated events into compact typed arrays."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.ts = array("d")
        self.dur = array("d")
        self.name_id = array("i")
        self.cat_id = array("h")
        self.thread_id = array("i")
        self.stream = array("i")
        self.corr = array("q")
        self.names: list[str] = []
        self.name_ids: dict[str, int] = {}
        self.classes: list[NameClass] = []
        self.cats: list[str] = []
        self.cat_ids: dict[Any, int] = {}
        self.threads: list[tuple[Any, Any]] = []
        self.thread_ids: dict[tuple[Any, Any], int] = {}
        self.thread_labels: dict[tuple[Any, Any], str] = {}
        self.comm_kind: dict[int, str] = {}
        self.pg_name: dict[int, str] = {}
        self.comm_seq: dict[int, int] = {}
        self.comm_sizes: dict[int, tuple[Any, ...]] = {}  # raw size arguments, read in finish()
        self.comm_nids: set[int] = set()  # names whose events' comm arguments are read

    def _bad(self, index: int, event: Any, problem: str) -> TraceFileError:
        name = event.get("name") if isinstance(event, dict) else None
        label = f" ({name!r})" if isinstance(name, str) else ""
        return TraceFileError(self.path, f"traceEvents[{index}]{label}: {problem}")

    def _field_error(self, index: int, event: dict, key: str, expected: str) -> TraceFileError:
        if key not in event:
            return self._bad(index, event, f"field {key!r} is missing")
        got = type(event[key]).__name__
        return self._bad(index, event, f"field {key!r} is {got}, expected {expected}")

    def _metadata(self, event: dict) -> None:
        if event.get("name") == "thread_name":
            args = event.get("args")
            label = args.get("name") if isinstance(args, dict) else None
            if isinstance(label, str):
                self.thread_labels[(event.get("pid"), event.get("tid"))] = label

    def add(self, events: EventBatch | list[Any], first_index: int) -> None:
        """Append one batch: columns msgspec already decoded and checked, or plain events."""
        if type(events) is EventBatch:
            self._add_batch(events)
        else:
            self._add_checked(events, first_index)

    def _add_batch(self, b: EventBatch) -> None:
        for pid, tid, label in b.labels:
            self.thread_labels[(pid, tid)] = label
        row0 = len(self.ts)
        nids = self._ids(self.name_ids, b.names, self._new_name)
        if self.comm_nids and not self.comm_nids.isdisjoint(nids):
            self._comm_rows(row0, b, nids)
        self.name_id.extend(nids)
        self.cat_id.extend(self._ids(self.cat_ids, b.cats, self._new_cat, "h"))
        self.thread_id.extend(self._ids(self.thread_ids, list(zip(b.pids, b.tids)), self._new_key))
        self.ts.extend(b.ts)
        self.dur.extend(b.dur)
        self.stream.extend(b.stream)
        self.corr.extend(b.corr)

    @staticmethod
    def _ids(ids: dict, values: list, new: Callable[[Any], None], code: str = "i") -> array:
        """``values`` interned through ``ids``; ``new(value)`` interns the unseen ones in order."""
        try:
            return array(code, map(ids.get, values))
        except TypeError:  # some value not seen before
            for value in dict.fromkeys(values):
                if value not in ids:
                    new(value)
            return array(code, map(ids.__getitem__, values))

    def _new_name(self, name: str) -> None:
        nid = self.name_ids[name] = len(self.names)
        self.names.append(name)
        self.classes.append(classify_name(name))
        if self.classes[nid].reads_comm_args:
            self.comm_nids.add(nid)

    def _new_cat(self, cat: Any) -> None:
        self.cat_ids[cat] = len(self.cats)
        self.cats.append(cat if isinstance(cat, str) else "")

    def _new_key(self, key: tuple[Any, Any]) -> None:
        self.thread_ids[key] = len(self.threads)
        self.threads.append(key)

    def _comm_rows(self, row0: int, b: EventBatch, nids: array) -> None:
        comm_nids = self.comm_nids
        for i, nid in enumerate(nids):
            if nid in comm_nids:
                args = b.args[i]
                if args is not None:
                    self._comm_args(row0 + i, args.collective, args.process_group, args.seq)
                    sizes = (args.in_nelems, args.out_nelems, args.dtype, args.pg_ranks, args.group_size)
                    if sizes != (None,) * 5:
                        self.comm_sizes[row0 + i] = sizes

    def _add_checked(self, events: list[Any], first_index: int) -> None:  # noqa: C901 - hot loop
        name_ids, classes, cat_ids, thread_ids = self.name_ids, self.classes, self.cat_ids, self.thread_ids
        ts_a, dur_a, nid_a, cat_a = self.ts, self.dur, self.name_id, self.cat_id
        tid_a, stream_a, corr_a = self.thread_id, self.stream, self.corr
        for offset, e in enumerate(events):
            if type(e) is not dict:
                raise self._bad(first_index + offset, e, f"is a {type(e).__name__}, expected an object")
            ph = e.get("ph")
            if ph != "X":
                if ph == "M":
                    self._metadata(e)
                elif not isinstance(ph, str):
                    raise self._field_error(first_index + offset, e, "ph", "a string")
                continue
            name, ts, dur = e.get("name"), e.get("ts"), e.get("dur")
            if type(name) is not str:
                raise self._field_error(first_index + offset, e, "name", "a string")
            if type(ts) not in _NUMBER:
                raise self._field_error(first_index + offset, e, "ts", "a number")
            if type(dur) not in _NUMBER:
                raise self._field_error(first_index + offset, e, "dur", "a number")
            if dur < 0:
                raise self._bad(first_index + offset, e, f"field 'dur' is negative ({dur})")
            key = (e.get("pid"), e.get("tid"))
            try:
                tid = thread_ids.get(key)
            except TypeError:  # an unhashable pid/tid (list, dict)
                tid = None
            if tid is None:
                tid = self._new_thread(first_index + offset, e, key)
            nid = name_ids.get(name)
            if nid is None:
                nid = len(self.names)
                self._new_name(name)
            cat = e.get("cat")
            cid = cat_ids.get(cat)
            if cid is None:
                cid = len(self.cats)
                self._new_cat(cat)
            args = e.get("args")
            stream, corr = -1, -1
            if args is not None:
                if type(args) is not dict:
                    raise self._field_error(first_index + offset, e, "args", "an object")
                s = args.get("stream")
                if type(s) is int:
                    stream = s
                c = args.get("correlation")
                if type(c) is int:
                    corr = c
                if classes[nid].reads_comm_args:
                    self._comm_args(len(ts_a), args.get("Collective name"), args.get("Process Group Name"),
                                    args.get("Seq"))
                    sizes = tuple(args.get(k) for k in _SIZE_ARGS)
                    if sizes != (None,) * 5:
                        self.comm_sizes[len(ts_a)] = sizes
            ts_a.append(ts)
            dur_a.append(dur)
            nid_a.append(nid)
            cat_a.append(cid)
            tid_a.append(tid)
            stream_a.append(stream)
            corr_a.append(corr)

    def _new_thread(self, index: int, event: dict, key: tuple[Any, Any]) -> int:
        for part, value in zip(("pid", "tid"), key):
            if type(value) not in (int, str):
                raise self._field_error(index, event, part, "an integer or a string")
        tid = len(self.threads)
        self._new_key(key)
        return tid

    def _comm_args(self, row: int, coll: Any, pg: Any, seq: Any = None) -> None:
        """Record a comm event's ``Collective name``, ``Process Group Name`` and ``Seq`` arguments."""
        if type(seq) is str and seq.isascii() and seq.isdigit():
            seq = int(seq)
        if type(seq) is int and seq >= 0:
            self.comm_seq[row] = seq
        if isinstance(coll, str) and coll:
            self.comm_kind[row] = canonical_kind(coll)
        if isinstance(pg, (str, int)) and pg != "":
            self.pg_name[row] = str(pg)

    def finish(self, meta: dict[str, Any], rank: int | None) -> RankTrace:
        ts = np.frombuffer(self.ts, dtype=np.float64)
        dur = np.frombuffer(self.dur, dtype=np.float64)
        origin = float(ts.min()) if ts.size else 0.0
        start = ts - origin
        thread_names = {
            i: self.thread_labels[key] for i, key in enumerate(self.threads) if key in self.thread_labels
        }
        return RankTrace(
            path=self.path,
            rank=rank,
            meta=meta,
            origin_us=origin,
            start_us=start,
            end_us=start + dur,
            name_id=np.frombuffer(self.name_id, dtype=np.int32).copy(),
            cat_id=np.frombuffer(self.cat_id, dtype=np.int16).copy(),
            thread_id=np.frombuffer(self.thread_id, dtype=np.int32).copy(),
            stream=np.frombuffer(self.stream, dtype=np.int32).copy(),
            correlation=np.frombuffer(self.corr, dtype=np.int64).copy(),
            names=self.names,
            name_classes=self.classes,
            cats=self.cats,
            threads=self.threads,
            thread_names=thread_names,
            comm_kind=self.comm_kind,
            pg_name=self.pg_name,
            comm_seq=self.comm_seq,
            **_comm_sizes(self.comm_sizes, world_size_in_meta(meta)),
        )


# the first that matches names the rank: ``rank3``, ``rank-3``, ``x_rank_3_y``; else ``worker3``
_RANK_IN_NAME = (re.compile(r"rank[-_]?(\d+)", re.IGNORECASE), re.compile(r"worker[-_]?(\d+)", re.IGNORECASE))


def rank_from_file_name(path: str) -> int | None:
    """``rank3.pt.trace.json`` / ``rank-3.json.gz`` / ``host_rank_3_1.pt.trace.json`` /
    ``worker3.pt.trace.json`` -> 3; ``None`` when the file name has no rank."""
    name = os.path.basename(path)
    for pattern in _RANK_IN_NAME:
        m = pattern.search(name)
        if m:
            return int(m.group(1))
    return None


def _distributed_int(meta: Mapping[str, Any], key: str, low: int) -> int | None:
    info = meta.get("distributedInfo")
    value = info.get(key) if isinstance(info, dict) else None
    return value if type(value) is int and value >= low else None


def rank_in_meta(meta: Mapping[str, Any]) -> int | None:
    """The trace's own rank (``distributedInfo.rank``; any torch version that writes it), else ``None``."""
    return _distributed_int(meta, "rank", 0)


_SIZE_ARGS = ("In msg nelems", "Out msg nelems", "dtype", "Process Group Ranks", "Group size")
# bytes per element of the dtypes torch writes in NCCL kernel arguments
_DTYPE_BYTES = {"Double": 8, "Long": 8, "ComplexFloat": 8, "Float": 4, "Int": 4, "Half": 2, "BFloat16": 2,
                "Short": 2, "Byte": 1, "Char": 1, "Bool": 1, "Float8_e4m3fn": 1, "Float8_e5m2": 1}


def _int_arg(value: Any) -> int | None:
    if type(value) is str and value.isascii() and value.isdigit():
        value = int(value)
    return value if type(value) is int and value >= 0 else None


def _ranks_arg(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, str):
        parts = value.strip().strip("[]").replace(" ", "").split(",")
        value = [int(p) for p in parts] if all(p.isascii() and p.isdigit() for p in parts) else None
    if isinstance(value, list) and value and all(type(r) is int and r >= 0 for r in value):
        return tuple(value)
    return None


def _comm_sizes(raw: Mapping[int, tuple[Any, ...]], world_size: int | None) -> dict[str, dict]:
    """``comm_bytes`` and ``comm_ranks`` from the raw ``_SIZE_ARGS`` of each comm row."""
    comm_bytes: dict[int, tuple[int, int]] = {}
    comm_ranks: dict[int, tuple[int, ...]] = {}
    for row, (n_in, n_out, dtype, ranks, size) in raw.items():
        n_in, n_out = _int_arg(n_in), _int_arg(n_out)
        width = _DTYPE_BYTES.get(dtype) if isinstance(dtype, str) else None
        if width is not None and (n_in is not None or n_out is not None):
            n_in = n_in if n_in is not None else n_out
            comm_bytes[row] = (n_in * width, (n_out if n_out is not None else n_in) * width)  # type: ignore[operator]
        group = _ranks_arg(ranks)
        if group is None and _int_arg(size) is not None and _int_arg(size) == world_size:
            group = tuple(range(world_size))  # type: ignore[arg-type]
        if group is not None:
            comm_ranks[row] = group
    return {"comm_bytes": comm_bytes, "comm_ranks": comm_ranks}


def world_size_in_meta(meta: Mapping[str, Any]) -> int | None:
    """The trace's ``distributedInfo.world_size`` (absent in old-style ``{"rank": N}``), else ``None``."""
    return _distributed_int(meta, "world_size", 1)


def _rank_of(meta: dict[str, Any], path: str) -> int | None:
    rank = rank_in_meta(meta)
    return rank if rank is not None else rank_from_file_name(path)


def load_trace(path: str | os.PathLike[str], *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> RankTrace:
    """Load one rank's trace file (``.json`` or ``.json.gz``) into a :class:`RankTrace`.

    Raises :class:`~cpdpkit.profiler.errors.TraceFileError` (one line: path and problem).
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise TraceFileError(path, "is a folder, expected a trace file")
    if not os.path.exists(path):
        raise TraceFileError(path, "no such file")
    cols = _Columns(path)
    try:
        meta = read_events(path, cols.add, chunk_bytes=chunk_bytes, parse=decode_batch)
    except StreamingNotPossible:
        cols = _Columns(path)
        meta = read_events_whole(path, cols.add)
    meta.pop("traceEvents", None)
    return cols.finish(meta, _rank_of(meta, path))
