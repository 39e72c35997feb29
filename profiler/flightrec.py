"""torch's flight-recorder dumps: which rank entered which collective, and who was late.

A job run with ``TORCH_FR_BUFFER_SIZE=N`` (older name ``TORCH_NCCL_TRACE_BUFFER_SIZE``) keeps the
last ``N`` collectives of each rank in a ring buffer; ``torch._C._distributed_c10d._dump_fr_trace()``
(pickle, what NCCL's watchdog writes to ``${TORCH_FR_DUMP_TEMP_FILE}<rank>`` on a timeout) or
``_dump_fr_trace_json()`` (JSON) returns it. torch 2.13 records gloo collectives too (its gloo
backend writes no dump by itself on a timeout: the job calls the dump function, e.g. when a
collective raises). One dump per rank, named ``<prefix><rank>``; the format (version ``2.x``) is a
dict ``{"version", "pg_config", "pg_status", "entries": [...]}``, each entry with
``collective_seq_id``, ``process_group`` ``(name, desc)``, ``profiling_name`` (``nccl:all_reduce``,
``gloo:broadcast``), ``input_sizes``/``output_sizes``, ``input_dtypes``/``output_dtypes``,
``time_created_ns`` (wall clock, when the rank issued it), ``is_p2p``, ``state``, ``retired``.

**Reading is data only**: a JSON dump is parsed as JSON; a pickle dump with an unpickler whose
``find_class`` refuses every global, so only pickle's own containers and scalars (dict, list,
tuple, set, str, bytes, int, float, bool, None) can be built and no code runs; the file is read
at most ``MAX_DUMP_BYTES``. A file of another format or version, dumps of different versions, or
ranks' dumps that disagree on the world (mixed runs in one folder) raise :class:`TraceFileError`.

**Per collective** (process group, ``collective_seq_id``; point-to-point entries are left out):
``entered`` the ranks whose buffer holds it, ``never_entered`` the group's ranks (``pg_config``,
else every rank with a dump) whose last collective in that group is older (``missing_dump``:
members without a dump), ``mismatch`` when the ranks that entered disagree on the kind, sizes or
dtypes. A rank whose buffer starts after the collective (the ring wrapped) is neither. The first
collective that some member never entered is where the job hangs (``FlightRecorderReport.hang``).

**Stragglers, in the terms of** :mod:`cpdpkit.profiler.crossrank`: arrival = ``time_created_ns``;
a rank is late at a collective every member entered when it arrives last by more than
``LATE_MARGIN_US`` over the next latest; ``caused_wait_us_per_step`` is the others' wait for it,
``last arrival - own arrival`` summed over the ranks that waited (a dump has no steps and no
compute: the whole dump, every wait counted as blocking).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import field
from typing import Any

import orjson

from cpdpkit.profiler._record import record
from cpdpkit.profiler.crossrank import LATE_MARGIN_US
from cpdpkit.profiler.errors import TraceFileError

__all__ = ["MAX_DUMP_BYTES", "RankDump", "Collective", "FlightRecorderReport", "is_dump", "read_dump",
           "find_dumps", "analyze_dumps"]

MAX_DUMP_BYTES = 512 << 20
_RANK_SUFFIX = re.compile(r"^(.*?)(\d+)$")
_PICKLE_PROTO = b"\x80"


def _unpickle_data(data: bytes) -> Any:
    """``data`` unpickled with every global refused: only pickle's own containers and scalars."""
    import io
    import pickle

    class DataOnly(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            raise pickle.UnpicklingError(f"refused global {module}.{name}: a flight-recorder dump holds data only")

        def persistent_load(self, pid: Any) -> Any:
            raise pickle.UnpicklingError("refused persistent id: a flight-recorder dump holds data only")

    try:
        return DataOnly(io.BytesIO(data)).load()
    except pickle.UnpicklingError as exc:
        raise ValueError(str(exc)) from None


@record
class RankDump:
    """One rank's dump, reduced to what the analysis needs."""

    path: str
    rank: int
    version: str
    groups: Mapping[str, tuple[int, ...]]  # pg name -> ranks (from pg_config)
    entries: tuple[Mapping[str, Any], ...]


def is_dump(path: str) -> bool:
    """Whether ``path`` looks like a flight-recorder dump: named ``<prefix><rank>`` with no
    extension, starting like a pickle or a JSON object."""
    name = os.path.basename(path)
    if name.startswith(".") or "." in name or not _RANK_SUFFIX.match(name):
        return False
    try:
        with open(path, "rb") as fh:
            head = fh.read(1)
    except OSError:
        return False
    return head in (_PICKLE_PROTO, b"{")


def _ranks_of(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, str):
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError:
            return None
    if isinstance(value, (list, tuple)) and all(type(r) is int for r in value):
        return tuple(value)
    return None


def read_dump(path: str) -> RankDump:
    """One dump (pickle or JSON, see the module docstring); :class:`TraceFileError` when it is none."""
    fix = "pass dumps that torch's flight recorder wrote (_dump_fr_trace or _dump_fr_trace_json, format 2.x)"
    try:
        with open(path, "rb") as fh:
            # no more than the file holds: read(n) allocates n bytes up front
            data = fh.read(min(os.fstat(fh.fileno()).st_size, MAX_DUMP_BYTES) + 1)
    except OSError as exc:
        raise TraceFileError(path, f"cannot read the file ({exc.strerror or exc})") from None
    if len(data) > MAX_DUMP_BYTES:
        raise TraceFileError(path, f"larger than {MAX_DUMP_BYTES >> 20} MiB, the limit for a flight-recorder dump")
    try:
        doc = _unpickle_data(data) if data[:1] == _PICKLE_PROTO else orjson.loads(data)
    except (orjson.JSONDecodeError, EOFError, ValueError, TypeError, IndexError,
            KeyError, AttributeError, MemoryError) as exc:
        raise TraceFileError(path, f"not a flight-recorder dump ({type(exc).__name__}: {exc}); {fix}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("entries"), list) or "version" not in doc:
        raise TraceFileError(path, f"not a flight-recorder dump (no 'version' and 'entries'); {fix}")
    version = str(doc["version"])
    major, _, minor = version.partition(".")
    if major != "2" or not minor.isdigit() or int(minor) < 2:
        raise TraceFileError(path, f"flight-recorder format version {version!r} is not supported (cpdpkit reads "
                                   "2.2 to 2.x, torch 2.4 to 2.13); dump it with torch 2.4 or later")
    m = _RANK_SUFFIX.match(os.path.basename(path))
    assert m is not None  # is_dump checked the name
    groups = {}
    config = doc.get("pg_config")
    for key, pg in (config.items() if isinstance(config, dict) else ()):
        ranks = _ranks_of(pg.get("ranks")) if isinstance(pg, dict) else None
        if ranks is not None:
            groups[str(key)] = ranks
    entries = tuple(e for e in doc["entries"] if isinstance(e, dict))
    for e in entries:
        if type(e.get("collective_seq_id")) is not int or not isinstance(e.get("profiling_name"), str):
            raise TraceFileError(path, f"an entry without an integer 'collective_seq_id' and a 'profiling_name'; {fix}")
    return RankDump(path, int(m.group(2)), version, groups, entries)


def find_dumps(folder: str) -> list[str]:
    """The flight-recorder dumps directly inside ``folder``, sorted by name."""
    with os.scandir(folder) as it:
        return sorted(e.path for e in it if e.is_file() and is_dump(e.path))


@record
class Collective:
    """One collective of one process group across the ranks' dumps (see the module docstring)."""

    process_group: str
    seq: int
    kind: str
    entered: tuple[int, ...]
    never_entered: tuple[int, ...]
    missing_dump: tuple[int, ...]
    mismatch: tuple[str, ...] = ()
    arrival_spread_us: float | None = None
    late_rank: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"process_group": self.process_group, "seq": self.seq, "kind": self.kind,
                "entered": list(self.entered), "never_entered": list(self.never_entered),
                "missing_dump": list(self.missing_dump), "mismatch": list(self.mismatch),
                "arrival_spread_us": self.arrival_spread_us, "late_rank": self.late_rank}


@record
class FlightRecorderReport:
    """A folder of one job's dumps: its collectives, where it hangs, and its stragglers."""

    path: str
    version: str
    ranks: tuple[int, ...]
    collectives: tuple[Collective, ...]
    stragglers: tuple[Mapping[str, Any], ...]
    hang: Collective | None = None
    mismatches: tuple[Collective, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "version": self.version, "ranks": list(self.ranks),
                "hang": self.hang.to_dict() if self.hang is not None else None,
                "mismatches": [c.to_dict() for c in self.mismatches],
                "stragglers": [dict(s) for s in self.stragglers],
                "collectives": [c.to_dict() for c in self.collectives]}


def _pg(entry: Mapping[str, Any]) -> str:
    pg = entry.get("process_group")
    if isinstance(pg, (list, tuple)) and pg:
        return str(pg[0])
    return str(entry.get("pg_id", ""))


def _kind(entry: Mapping[str, Any]) -> str:
    name = entry["profiling_name"]
    return name.split(":", 1)[1] if ":" in name else name


def _members(pg: str, dumps: Sequence[RankDump], world: tuple[int, ...]) -> tuple[int, ...]:
    for d in dumps:
        if pg in d.groups:
            return d.groups[pg]
    only = {g for d in dumps for g in d.groups.values()}
    if len(only) == 1 and len({len(d.groups) for d in dumps}) == 1 and len(dumps[0].groups) == 1:
        return next(iter(only))  # one group listed (gloo lists the default group under "")
    return world


def _name_prefix(path: str) -> str:
    """The ``<prefix>`` of a dump named ``<prefix><rank>`` (:func:`is_dump` checked the name)."""
    m = _RANK_SUFFIX.match(os.path.basename(path))
    assert m is not None
    return m.group(1)


def _check_one_run(folder: str, dumps: Sequence[RankDump]) -> None:
    versions = {d.version for d in dumps}
    ranks = [d.rank for d in dumps]
    prefixes = {_name_prefix(d.path) for d in dumps}
    worlds = {max(g) + 1 for d in dumps for g in d.groups.values() if g}
    problem = None
    if len(prefixes) > 1:
        problem = f"dumps of several runs (names {sorted(prefixes)})"
    elif len(versions) > 1:
        problem = f"dumps of different flight-recorder versions {sorted(versions)}"
    elif len(set(ranks)) != len(ranks):
        problem = "two dumps of one rank"
    elif len(worlds) > 1:
        problem = f"dumps of runs of different sizes (world sizes {sorted(worlds)})"
    if problem is not None:
        raise TraceFileError(folder, f"{problem} in one folder; put each run's dumps in a folder of its own")


def _arrivals(by_rank: Mapping[int, Mapping[str, Any]]) -> dict[int, float]:
    out = {}
    for r, e in by_rank.items():
        t = e.get("time_created_ns")
        if type(t) is int and t > 0:
            out[r] = t / 1000.0
    return out


def _mismatch(by_rank: Mapping[int, Mapping[str, Any]]) -> tuple[str, ...]:
    out = []
    for key in ("profiling_name", "input_sizes", "output_sizes", "input_dtypes", "output_dtypes"):
        seen: dict[str, list[int]] = {}
        for r, e in sorted(by_rank.items()):
            if key in e:
                seen.setdefault(repr(e[key]), []).append(r)
        if len(seen) > 1:
            out.append(f"{key}: " + "; ".join(f"ranks {rs} {v}" for v, rs in seen.items()))
    return tuple(out)


def _collective(pg: str, seq: int, by_rank: dict[int, Mapping[str, Any]], members: Iterable[int],
                span: Mapping[int, tuple[int, int]]) -> Collective:
    never, missing = [], []
    for r in members:
        if r in by_rank:
            continue
        if r not in span:
            missing.append(r)
        elif span[r][1] < seq or span[r][0] <= seq:  # its last one is older (or it skipped this one)
            never.append(r)
        # else its buffer starts after this collective (the ring wrapped): no evidence
    first = by_rank[min(by_rank)]
    arrivals = _arrivals(by_rank)
    spread = late = None
    if len(arrivals) >= 2:
        order = sorted(arrivals, key=arrivals.__getitem__)
        spread = arrivals[order[-1]] - arrivals[order[0]]
        if not never and not missing and arrivals[order[-1]] - arrivals[order[-2]] > LATE_MARGIN_US:
            late = order[-1]
    return Collective(pg, seq, _kind(first), tuple(sorted(by_rank)), tuple(never), tuple(missing),
                      _mismatch(by_rank), spread, late)


def _stragglers(colls: Sequence[Collective], table: Mapping[tuple[str, int], dict[int, Mapping[str, Any]]]
                ) -> tuple[dict[str, Any], ...]:
    late_count: dict[int, int] = {}
    took_part: dict[int, int] = {}
    caused: dict[int, float] = {}
    for c in colls:
        if c.never_entered or c.missing_dump:
            continue
        arrivals = _arrivals(table[c.process_group, c.seq])
        for r in c.entered:
            took_part[r] = took_part.get(r, 0) + 1
        if c.late_rank is None:
            continue
        last = arrivals[c.late_rank]
        late_count[c.late_rank] = late_count.get(c.late_rank, 0) + 1
        caused[c.late_rank] = caused.get(c.late_rank, 0.0) + sum(last - a for r, a in arrivals.items()
                                                                  if r != c.late_rank)
    out = [{"rank": r, "late_count": n, "late_frac": n / took_part[r], "caused_wait_us_per_step": caused[r]}
           for r, n in late_count.items()]
    out.sort(key=lambda d: (-d["caused_wait_us_per_step"], -d["late_count"], d["rank"]))
    return tuple(out)


def analyze_dumps(folder: str, files: Sequence[str] | None = None) -> FlightRecorderReport:
    """Analyse one job's dumps (``files``, default: :func:`find_dumps` of ``folder``)."""
    paths = list(files) if files is not None else find_dumps(folder)
    if not paths:
        raise TraceFileError(folder, "no flight-recorder dumps (files named <prefix><rank>) in this folder")
    dumps = sorted((read_dump(p) for p in paths), key=lambda d: d.rank)
    _check_one_run(folder, dumps)
    world = tuple(d.rank for d in dumps)
    table: dict[tuple[str, int], dict[int, Mapping[str, Any]]] = {}
    span: dict[str, dict[int, tuple[int, int]]] = {}
    for d in dumps:
        for e in d.entries:
            if e.get("is_p2p"):
                continue
            pg, seq = _pg(e), e["collective_seq_id"]
            table.setdefault((pg, seq), {})[d.rank] = e
            lo, hi = span.setdefault(pg, {}).get(d.rank, (seq, seq))
            span[pg][d.rank] = (min(lo, seq), max(hi, seq))
    for ranks in span.values():  # a member with a dump but no entry in this group entered none of it
        for d in dumps:
            ranks.setdefault(d.rank, (1 << 62, 0))
    colls = []
    for (pg, seq), by_rank in sorted(table.items()):
        colls.append(_collective(pg, seq, by_rank, _members(pg, dumps, world), span[pg]))
    hang = next((c for c in colls if c.never_entered), None)
    return FlightRecorderReport(folder, dumps[0].version, world, tuple(colls), _stragglers(colls, table), hang,
                                tuple(c for c in colls if c.mismatch))


def split_inputs(paths: Iterable[str | os.PathLike[str]]) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """``(dump runs as (folder, files), the other paths)``: a dump file is a run of one, a folder
    holding dumps is one run; a folder holding both dumps and profiler traces raises
    :class:`TraceFileError`."""
    from cpdpkit.profiler.runs import find_trace_files

    runs: list[tuple[str, list[str]]] = []
    rest: list[str] = []
    for raw in paths:
        path = os.fspath(raw)
        if os.path.isfile(path) and is_dump(path):
            runs.append((path, [path]))
        elif os.path.isdir(path) and (dumps := _listed(path)):
            if find_trace_files(path):
                raise TraceFileError(path, "holds both profiler traces and flight-recorder dumps; put the dumps "
                                           "in a folder of their own")
            runs.append((path, dumps))
        else:
            rest.append(path)
    return runs, rest


def _listed(folder: str) -> list[str]:
    try:
        return find_dumps(folder)
    except OSError:
        return []  # the trace reader names the unreadable folder
