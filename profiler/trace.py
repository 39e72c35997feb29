"""One rank's trace as a few typed columns (:class:`array.array`): what the overlap analysis needs, and nothing more.

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
import struct
import sys
from array import array
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import field
from functools import cached_property
from itertools import accumulate, compress, repeat
from operator import add, itemgetter, sub
from typing import Any

from cpdpkit.profiler._events import EventBatch, decode_batch, packed
from cpdpkit.profiler._parallel import PARALLEL_MIN_BYTES, map_ranges, split_events, worker_count
from cpdpkit.profiler._reader import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_LIMITS,
    StreamingNotPossible,
    TraceLimits,
    events_start,
    meta_around,
    read_events,
    read_events_whole,
    read_range,
)
from cpdpkit.profiler._record import record
from cpdpkit.profiler.classify import STEP_NAME, NameClass, canonical_kind, classify_name
from cpdpkit.profiler.errors import TraceFileError

__all__ = ["RankTrace", "load_trace", "rank_from_file_name", "rank_in_meta", "world_size_in_meta"]

_NUMBER = (int, float)
_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1
_MAX_TIME_US = 1e17  # Kineto's epoch microseconds are ~1.8e15; a bigger value makes 300-digit step times
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


@record(eq=False)
class RankTrace:
    """Columns of one rank's complete events plus the trace metadata.

    The per-event columns are :class:`array.array` (row ``i`` is the ``i``-th complete event of
    the file): ``start_us``/``end_us`` (``"d"``, microseconds relative to ``origin_us``, the
    earliest event start), ``name_id`` (``"i"``, index into ``names`` and ``name_classes``),
    ``cat_id`` (``"h"``, into ``cats``), ``thread_id`` (``"i"``, into ``threads``: ``(pid, tid)``),
    ``stream`` (``"i"``, the GPU stream, -1 on the CPU) and ``correlation`` (``"q"``, the CUDA
    correlation id, -1 when none).
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
    start_us: array
    end_us: array
    name_id: array
    cat_id: array
    thread_id: array
    stream: array
    correlation: array
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
        return len(self.start_us)

    def rows_of(self, *, gpu_roles: Collection[str] = (), cpu_roles: Collection[str] = (),
                steps: bool = False) -> list[int]:
        """Rows, in row order, of the GPU events whose name's ``gpu_role`` is one of ``gpu_roles``
        and of the CPU events whose name's ``cpu_role`` is one of ``cpu_roles`` or, with
        ``steps``, that are ``ProfilerStep#N`` markers (names: :mod:`cpdpkit.profiler.classify`)."""
        codes, kinds = self._row_codes
        table = bytearray(256)
        for k, (gpu_role, cpu_role, is_step) in enumerate(kinds):
            table[2 * k + 1] = gpu_role in gpu_roles
            table[2 * k] = cpu_role in cpu_roles or (steps and is_step)
        return _positions(codes.translate(table)) if any(table) else []

    def launch_rows(self) -> list[int]:
        """Rows, in row order, of the CPU events with a correlation id (``>= 0``): the launches
        of the GPU work that carries the same id."""
        has_id = _bytes_where(self.correlation, lambda top: top < 0x80)  # the sign byte says >= 0
        return _positions(_both(has_id, self._row_codes[0].translate(_CPU_BIT)))

    @cached_property
    def _row_codes(self) -> tuple[bytes, list[tuple[str, str, bool]]]:
        """Per row one byte, ``2 * k + (on a GPU stream)``, where ``k`` indexes the returned list of
        the distinct ``(gpu_role, cpu_role, is ProfilerStep)`` of the names (at most 4 × 5 × 2):
        :meth:`rows_of` then selects rows with one ``bytes.translate``."""
        kinds: dict[tuple[str, str, bool], int] = {}
        of_name = [2 * kinds.setdefault((c.gpu_role, c.cpu_role, bool(STEP_NAME.match(n))), len(kinds))
                   for n, c in zip(self.names, self.name_classes)]
        assert len(kinds) <= 128, kinds
        on_gpu = _bytes_where(self.stream, None).translate(_NOT_ALL_ONES)  # stream != -1
        return _either(_lookup(self.name_id, of_name), on_gpu), list(kinds)


# byte tables: 1 for each odd code (GPU rows), 1 for each even one (CPU rows), 1 for all but 0xff
_CPU_BIT = bytes(1 - k % 2 for k in range(256))
_NOT_ALL_ONES = bytes([1] * 255 + [0])


def _bytes_where(column: array, top: Callable[[int], bool] | None) -> bytes:
    """Per element of an integer ``column`` one byte: with ``top``, 1 where ``top(its most
    significant byte)``; without, the AND of all its bytes (0xff only for -1). All in C: strided
    slices of the raw bytes, combined as big integers."""
    raw, width = column.tobytes(), column.itemsize
    if top is not None:
        sign = raw[width - 1 :: width] if sys.byteorder == "little" else raw[::width]
        return sign.translate(bytes(int(top(k)) for k in range(256)))
    acc = int.from_bytes(raw[::width], "little")
    for k in range(1, width):
        acc &= int.from_bytes(raw[k::width], "little")
    return acc.to_bytes(len(column), "little")


def _lookup(ids: array, table: list[int]) -> bytes:
    """``bytes(table[i] for i in ids)`` (``table`` of bytes values): with up to 2,048 distinct ids,
    by ``bytes.translate`` of the ids' low bytes, one 256-id page at a time, each page's rows
    picked by their second byte (ids are unsigned and below 65,536 there)."""
    if len(table) > 8 * 256 or ids.itemsize < 2:
        return bytes(itemgetter(*ids)(table)) if len(ids) > 1 else bytes(table[i] for i in ids)
    raw, width = ids.tobytes(), ids.itemsize
    little = sys.byteorder == "little"
    low = raw[::width] if little else raw[width - 1 :: width]
    if len(table) <= 256:
        return low.translate(bytes(table).ljust(256, b"\0"))
    page = raw[1::width] if little else raw[width - 2 :: width]
    out = 0
    for p in range((len(table) + 255) // 256):
        codes = low.translate(bytes(table[256 * p : 256 * p + 256]).ljust(256, b"\0"))
        mine = page.translate(bytes(255 * (k == p) for k in range(256)))  # 0xff on the page's rows
        out |= int.from_bytes(codes, "little") & int.from_bytes(mine, "little")
    return out.to_bytes(len(ids), "little")


def _both(a: bytes, b: bytes) -> bytes:
    """Bytewise AND of two equally long masks."""
    return (int.from_bytes(a, "little") & int.from_bytes(b, "little")).to_bytes(len(a), "little")


def _either(a: bytes, b: bytes) -> bytes:
    """Bytewise OR of two equally long masks."""
    return (int.from_bytes(a, "little") | int.from_bytes(b, "little")).to_bytes(len(a), "little")


def _positions(mask: bytes) -> list[int]:
    """Indexes of the 1 bytes of ``mask`` (a mask of 0 and 1 bytes)."""
    if mask.count(1) * 4 > len(mask):
        return list(compress(range(len(mask)), mask))
    gaps = mask.split(b"\x01")  # the k-th 1 follows k gaps and k earlier 1s
    gaps.pop()
    return list(map(sub, accumulate(map(add, map(len, gaps), repeat(1))), repeat(1)))


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
            pid, tid = event.get("pid"), event.get("tid")
            if isinstance(label, str) and type(pid) in (int, str) and type(tid) in (int, str):
                self.thread_labels[(pid, tid)] = label

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
        nids = self._intern(self.name_id, self.name_ids, lambda: b.names, self._new_name)
        if self.comm_nids and not self.comm_nids.isdisjoint(nids):
            self._comm_rows(row0, b, nids)
        self._intern(self.cat_id, self.cat_ids, lambda: b.cats, self._new_cat)
        self._intern(self.thread_id, self.thread_ids, lambda: zip(b.pids, b.tids), self._new_key)
        self.ts.extend(b.ts)
        self.dur.extend(b.dur)
        self.stream.extend(b.stream)
        self.corr.extend(b.corr)

    @staticmethod
    def _intern(column: array, ids: dict, values: Callable[[], Iterable[Any]], new: Callable[[Any], None]) -> list[int]:
        """Append the ids of ``values()`` (through ``ids``) to ``column`` and return them;
        ``new(value)`` interns the unseen values in order of appearance."""
        got = list(map(ids.get, values()))
        try:  # an unseen value is a None: an error, and the column is left as it was
            _extend(column, got)
        except (TypeError, struct.error):
            for value in dict.fromkeys(values()):
                if value not in ids:
                    new(value)
            got = list(map(ids.__getitem__, values()))
            _extend(column, got)
        return got

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

    def _comm_rows(self, row0: int, b: EventBatch, nids: list[int]) -> None:
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
            if type(cat) is not str:  # a number, list, ...: no category, as when it is missing
                cat = None
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
                if type(s) is int and _INT32_MIN <= s <= _INT32_MAX:  # msgspec's bounds (_events): else unknown
                    stream = s
                c = args.get("correlation")
                if type(c) is int and _INT64_MIN <= c <= _INT64_MAX:
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

    def absorb(self, other: _Columns) -> None:
        """Append the rows another reader decoded from the next part of the same file."""
        row0 = len(self.ts)
        for column, own, ids, values, new in (
            (self.name_id, other.name_id, self.name_ids, other.names, self._new_name),
            (self.cat_id, other.cat_id, self.cat_ids, list(other.cat_ids), self._new_cat),
            (self.thread_id, other.thread_id, self.thread_ids, other.threads, self._new_key),
        ):
            for value in values:
                if value not in ids:
                    new(value)
            trans = [ids[v] for v in values]
            if trans == list(range(len(trans))):
                column += own
            else:
                column += array(own.typecode, map(trans.__getitem__, own))
        for mine, theirs in ((self.ts, other.ts), (self.dur, other.dur), (self.stream, other.stream),
                             (self.corr, other.corr)):
            mine += theirs
        for mine, theirs in ((self.comm_kind, other.comm_kind), (self.pg_name, other.pg_name),
                             (self.comm_seq, other.comm_seq), (self.comm_sizes, other.comm_sizes)):
            mine.update({row0 + row: value for row, value in theirs.items()})
        self.thread_labels.update(other.thread_labels)

    def finish(self, meta: dict[str, Any], rank: int | None) -> RankTrace:
        if self.ts and not (-_MAX_TIME_US < min(self.ts) and max(self.ts) < _MAX_TIME_US
                            and max(self.dur) < _MAX_TIME_US):
            worst = max((*self.ts, *self.dur), key=abs)
            raise TraceFileError(self.path, f"a timestamp or duration of {worst:g} µs is not a time (they must stay "
                                            f"below {_MAX_TIME_US:g} µs, about 3,000 years): the trace is corrupt")
        origin = min(self.ts) if self.ts else 0.0
        start, end = _relative(self.ts, self.dur, origin)
        thread_names = {
            i: self.thread_labels[key] for i, key in enumerate(self.threads) if key in self.thread_labels
        }
        return RankTrace(
            path=self.path,
            rank=rank,
            meta=meta,
            origin_us=origin,
            start_us=start,
            end_us=end,
            name_id=self.name_id,
            cat_id=self.cat_id,
            thread_id=self.thread_id,
            stream=self.stream,
            correlation=self.corr,
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


def _relative(ts: array, dur: array, origin: float) -> tuple[array, array]:
    """Per event ``start = ts - origin`` and ``end = start + dur``; a block of events at a time, so
    few Python floats exist at once."""
    start, end = array("d"), array("d")
    for i in range(0, len(ts), _BLOCK):
        s = [t - origin for t in ts[i : i + _BLOCK]]
        start += packed("d", s)
        end += packed("d", list(map(add, s, dur[i : i + _BLOCK])))
    return start, end


_BLOCK = 1 << 16


def _extend(column: array, ids: list[int]) -> None:
    """Append ``ids`` to an id column: packed by :mod:`struct`, except the 16-bit category ids
    (``array`` raises ``OverflowError`` past 32,767 categories)."""
    if column.typecode == "h":
        column.fromlist(ids)
    else:
        column.frombytes(struct.pack(f"{len(ids)}{column.typecode}", *ids))


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
        count_in = n_in if n_in is not None else n_out  # one count stands for both when the other is missing
        count_out = n_out if n_out is not None else n_in
        if width is not None and count_in is not None and count_out is not None:
            comm_bytes[row] = (count_in * width, count_out * width)
        group = _ranks_arg(ranks)
        if group is None and world_size is not None and _int_arg(size) == world_size:
            group = tuple(range(world_size))
        if group is not None:
            comm_ranks[row] = group
    return {"comm_bytes": comm_bytes, "comm_ranks": comm_ranks}


def world_size_in_meta(meta: Mapping[str, Any]) -> int | None:
    """The trace's ``distributedInfo.world_size`` (absent in old-style ``{"rank": N}``), else ``None``."""
    return _distributed_int(meta, "world_size", 1)


def _rank_of(meta: dict[str, Any], path: str) -> int | None:
    rank = rank_in_meta(meta)
    return rank if rank is not None else rank_from_file_name(path)


def load_trace(path: str | os.PathLike[str], *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
               parallel: bool = True, limits: TraceLimits = DEFAULT_LIMITS) -> RankTrace:
    """Load one rank's trace file (``.json`` or ``.json.gz``) into a :class:`RankTrace`.

    ``parallel``: decode a large uncompressed file (>= 48 MiB) on every core this process may
    use (forked workers, :mod:`cpdpkit.profiler._parallel`); the result is the same.
    ``limits``: the most decompressed bytes and events one file may hold (:class:`TraceLimits`).

    Raises :class:`~cpdpkit.profiler.errors.TraceFileError` (one line: path and problem).
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise TraceFileError(path, "is a folder, expected a trace file")
    if not os.path.exists(path):
        raise TraceFileError(path, "no such file")
    loaded = _load_parallel(path, chunk_bytes, limits) if parallel else None
    if loaded is not None:
        cols, meta = loaded
    else:
        cols = _Columns(path)
        try:
            meta = read_events(path, cols.add, chunk_bytes=chunk_bytes, parse=decode_batch, limits=limits)
        except StreamingNotPossible:
            cols = _Columns(path)
            meta = read_events_whole(path, cols.add, limits=limits)
    if len(cols.ts) > limits.max_events:
        raise limits.too_many_events(path)
    meta.pop("traceEvents", None)
    return cols.finish(meta, _rank_of(meta, path))


def _decode_range(path: str, start: int, end: int, last: bool, chunk_bytes: int,
                  limits: TraceLimits) -> tuple[_Columns, bytes]:
    cols = _Columns(path)
    return cols, read_range(path, start, end, last, cols.add, chunk_bytes=chunk_bytes, parse=decode_batch,
                            limits=limits)


def _load_parallel(path: str, chunk_bytes: int, limits: TraceLimits) -> tuple[_Columns, dict[str, Any]] | None:
    """A large uncompressed file decoded in parts on several cores (:mod:`._parallel`); ``None``
    when it is not worth it or any part failed (the caller reads it on one core, which names
    a bad event exactly)."""
    workers = worker_count()
    if workers < 2 or os.path.getsize(path) < PARALLEL_MIN_BYTES:
        return None
    start = events_start(path, chunk_bytes)
    if start is None:
        return None
    ranges = split_events(path, start, workers)
    work = lambda *where: _decode_range(*where, chunk_bytes, limits)  # noqa: E731
    parts = map_ranges(work, path, ranges) if len(ranges) > 1 else None
    if parts is None:
        return None
    with open(path, "rb") as fh:
        head = fh.read(start)
    try:
        meta = meta_around(head, parts[-1][1])
    except StreamingNotPossible:
        return None
    cols = parts[0][0]
    for more, _ in parts[1:]:
        cols.absorb(more)
    return cols, meta
