"""Fast decoding of a batch of trace events with msgspec, straight into columns.

orjson builds a dict holding every field of every event; most of that work is thrown away,
since the profiler reads only a handful of fields. msgspec decodes each complete event into a
small :class:`Event` struct holding just those fields (a metadata event into :class:`Meta`, any
other event into its phase alone, by the ``ph`` tag) and skips the others without building
them. :func:`decode_batch` then gathers the complete (``ph == "X"``) events' fields into
lists and typed arrays (:class:`EventBatch`), checking on the way everything the checked
per-event path of :mod:`cpdpkit.profiler.trace` checks.

When msgspec refuses a batch (an event of an unexpected type, a field of an unexpected
type, a negative duration, a required field missing, bytes that are not UTF-8), the batch
is parsed again with orjson and a plain list of dicts is returned instead: the checked path
then either loads it (odd but valid traces) or raises its exact one-line error. Invalid
JSON raises ``ValueError``, as the streaming reader expects.
"""

from __future__ import annotations

import struct
from array import array
from typing import Annotated, Any, Union

import msgspec
import orjson

__all__ = ["Event", "Meta", "EventBatch", "decode_batch", "packed"]

# Bounds that keep msgspec's integers within what orjson returns as int and the columns hold.
_Int = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]
_Int32 = Annotated[int, msgspec.Meta(ge=-(1 << 31), le=(1 << 31) - 1)]


class Args(msgspec.Struct, gc=False):
    """The ``args`` entries the profiler reads (``name`` is a thread name's label)."""

    stream: _Int32 = -1
    correlation: _Int = -1
    collective: Any = msgspec.field(default=None, name="Collective name")
    process_group: Any = msgspec.field(default=None, name="Process Group Name")
    seq: Any = msgspec.field(default=None, name="Seq")
    in_nelems: Any = msgspec.field(default=None, name="In msg nelems")
    out_nelems: Any = msgspec.field(default=None, name="Out msg nelems")
    dtype: Any = None
    pg_ranks: Any = msgspec.field(default=None, name="Process Group Ranks")
    group_size: Any = msgspec.field(default=None, name="Group size")
    name: Any = None


class Event(msgspec.Struct, gc=False, tag_field="ph", tag="X"):
    """One complete (``ph == "X"``) trace event, reduced to the fields the profiler reads; one that
    lacks a field the checked path requires fails validation (the batch takes the orjson path)."""

    name: str
    ts: float
    dur: Annotated[float, msgspec.Meta(ge=0)]
    pid: _Int | str
    tid: _Int | str
    cat: str | None = None
    args: Args | None = None


class Meta(msgspec.Struct, gc=False, tag_field="ph", tag="M"):
    """A metadata event: a ``thread_name`` one labels a thread."""

    name: str | None = None
    pid: _Int | str | None = None
    tid: _Int | str | None = None
    args: Args | None = None


# Every other phase of the Chrome trace event format: its fields are skipped unread (about a third
# of a Kineto trace's events are flow events, ``s``/``f``). A phase not listed fails validation and
# the batch takes the orjson path, which reads it as it reads these: by its ``ph`` alone.
_OTHER_PHASES = ("B", "E", "I", "i", "C", "b", "n", "e", "S", "T", "p", "F", "s", "t", "f", "P", "N", "O", "D",
                 "R", "c", "(", ")")
_Others = tuple(msgspec.defstruct(f"_Phase{i}", [], tag_field="ph", tag=ph, gc=False)
                for i, ph in enumerate(_OTHER_PHASES))


_NO_ARGS = Args()
_DECODER = msgspec.json.Decoder(list[Union[(Event, Meta, *_Others)]])  # noqa: UP007 - a runtime union of classes


def packed(code: str, values: list[Any]) -> array:
    """``values`` as an array of typecode ``code``, packed by :mod:`struct` in one call (``array``
    would parse the items one by one, several times slower). ``struct.error`` on an item that is
    no number of that type, ``None`` included."""
    out = array(code)
    out.frombytes(struct.pack(f"{len(values)}{code}", *values))
    return out


class EventBatch:
    """The complete events of one batch as columns (rows in event order), plus thread labels."""

    __slots__ = ("count", "names", "ts", "dur", "pids", "tids", "cats", "args", "stream", "corr", "labels")

    def __init__(self, count: int, xs: list[Event], labels: list[tuple[Any, Any, str]]) -> None:
        self.count = count  # all events of the batch, complete or not
        self.names: list[str] = [e.name for e in xs]
        self.ts = packed("d", [e.ts for e in xs])
        self.dur = packed("d", [e.dur for e in xs])
        self.pids: list[int | str] = [e.pid for e in xs]
        self.tids: list[int | str] = [e.tid for e in xs]
        self.cats: list[str | None] = [e.cat for e in xs]
        self.args: list[Args | None] = [e.args for e in xs]
        self.stream = packed("i", [(a or _NO_ARGS).stream for a in self.args])
        self.corr = packed("q", [(a or _NO_ARGS).correlation for a in self.args])
        self.labels = labels

    def __len__(self) -> int:
        return self.count


def decode_batch(data: bytes) -> EventBatch | list[Any]:
    """Decode the JSON array ``data`` into an :class:`EventBatch`, or a list (see module doc)."""
    if not data.isascii():  # orjson refuses what is not UTF-8; msgspec may skip it unread
        try:
            data.decode()
        except UnicodeDecodeError:
            return orjson.loads(data)
    try:
        events = _DECODER.decode(data)
    except (msgspec.ValidationError, RecursionError):  # orjson: the checked path, or its own depth error
        return orjson.loads(data)
    except msgspec.DecodeError as exc:
        raise ValueError(str(exc)) from None
    xs = [e for e in events if type(e) is Event]
    labels = [
        (e.pid, e.tid, e.args.name)
        for e in events
        if type(e) is Meta and e.name == "thread_name" and e.args is not None and isinstance(e.args.name, str)
    ]
    try:
        return EventBatch(len(events), xs, labels)
    except (TypeError, struct.error):  # a complete event lacks a field the checked path requires
        return orjson.loads(data)
