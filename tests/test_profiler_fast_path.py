"""The msgspec batch path loads exactly what the orjson + checked path loads."""

from __future__ import annotations

from array import array
from pathlib import Path

import orjson
import pytest

from _trace_builder import GLOO, annotation, cpu_scenario, kernel, launch, step, thread_name, trace_doc, write_trace
from cpdpkit.profiler import analyze_trace, load_trace
from cpdpkit.profiler import trace as trace_mod
from cpdpkit.profiler._events import EventBatch, decode_batch

pytestmark = pytest.mark.timeout(60)

HTA_TRACES = Path(__file__).resolve().parent / "data" / "hta"  # tools/build_fixtures.py
COLUMNS = ("start_us", "end_us", "name_id", "cat_id", "thread_id", "stream", "correlation")
FIELDS = ("path", "rank", "meta", "origin_us", "names", "name_classes", "cats", "threads", "thread_names",
          "comm_kind", "pg_name", "comm_seq")


def _load_both(path: Path, monkeypatch: pytest.MonkeyPatch, **kw):  # type: ignore[no-untyped-def]
    kinds: list[str] = []

    def counting(data: bytes):  # type: ignore[no-untyped-def]
        batch = decode_batch(data)
        kinds.append("fast" if type(batch) is EventBatch else "checked")
        return batch

    with monkeypatch.context() as m:
        m.setattr(trace_mod, "decode_batch", counting)
        fast = load_trace(path, **kw)
    with monkeypatch.context() as m:
        m.setattr(trace_mod, "decode_batch", orjson.loads)  # every batch through the checked path
        checked = load_trace(path, **kw)
    return fast, checked, kinds


def _assert_same(a, b) -> None:  # type: ignore[no-untyped-def]
    for col in COLUMNS:
        x, y = getattr(a, col), getattr(b, col)
        assert type(x) is array and x.typecode == y.typecode and x == y, col
    for name in FIELDS:
        assert getattr(a, name) == getattr(b, name), name
    assert analyze_trace(a).to_dict() == analyze_trace(b).to_dict()


REAL_TRACES = sorted(HTA_TRACES.glob("*/*.json.gz"))


def test_real_traces_are_in_the_repo() -> None:
    assert len(REAL_TRACES) == 3, REAL_TRACES  # a parametrized test over nothing would pass silently


@pytest.mark.parametrize("path", REAL_TRACES, ids=lambda p: f"{p.parent.name}/{p.name}")
@pytest.mark.parametrize("chunk", [64 << 10, 4096])
def test_real_traces_identical(path: Path, chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    fast, checked, kinds = _load_both(path, monkeypatch, chunk_bytes=chunk)
    assert kinds and set(kinds) == {"fast"}  # real traces never need the fallback
    _assert_same(fast, checked)


def _gpu_doc() -> dict:
    return trace_doc([
        step(1, 0, 100), step(2, 100, 100), step(3, 200, 100),
        launch(10, corr=1), launch(20, corr=2), launch(110, corr=4),
        kernel("gemm_kernel", 100, 50, corr=1),
        kernel("ncclDevKernel_Generic", 120, 60, stream=20, corr=2,
               **{"Collective name": "allgather", "Process Group Name": 3}),
        kernel("gemm_kernel", 190, 10, corr=4),
        thread_name(GLOO, "pt_gloo_runloop"),
        annotation("gloo:all_reduce", 10, 40, tid=GLOO),
    ])


@pytest.mark.parametrize("doc", [cpu_scenario(0), cpu_scenario(1), _gpu_doc()], ids=["cpu0", "cpu1", "gpu"])
@pytest.mark.parametrize("gz", [False, True])
def test_generated_traces_identical(tmp_path: Path, doc: dict, gz: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_trace(tmp_path / ("rank0.json.gz" if gz else "rank0.json"), doc)
    fast, checked, kinds = _load_both(path, monkeypatch)
    assert set(kinds) == {"fast"}
    _assert_same(fast, checked)


ODD_BUT_VALID = [
    {"ph": "f", "name": "flow", "pid": 1, "tid": 1, "ts": "3"},  # a string ts outside a complete event
    {"ph": "M", "name": "thread_name", "pid": 1.5, "tid": 2, "args": {"name": "odd"}},
    {"ph": "X", "cat": 5, "name": "aten::mm", "pid": 100, "tid": 100, "ts": 7, "dur": 1},  # a number as cat
    {"ph": "X", "name": "k", "pid": "p", "tid": 3, "ts": 1, "dur": 2, "args": {"stream": "7", "correlation": 2.0}},
    {"ph": "X", "name": "k", "pid": 1, "tid": 3, "ts": 1, "dur": 2, "args": None},
    {"ph": "X", "name": "k", "pid": 1, "tid": 3, "ts": 1, "dur": 2, "args": {"stream": 1 << 40}},
]


@pytest.mark.parametrize("event", ODD_BUT_VALID[:-1])
def test_odd_but_valid_batches_fall_back(tmp_path: Path, event: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = cpu_scenario()
    doc["traceEvents"].insert(3, event)
    fast, checked, kinds = _load_both(write_trace(tmp_path / "r.json", doc), monkeypatch)
    _assert_same(fast, checked)


def test_out_of_range_ids_load_as_unknown_alike(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream past 32 bits (a correlation past 64) is no stream (-1) on both paths, as msgspec's bounds say."""
    doc = cpu_scenario()
    doc["traceEvents"].append(ODD_BUT_VALID[-1])
    doc["traceEvents"].append({**ODD_BUT_VALID[-1], "args": {"correlation": 1 << 70}})
    path = write_trace(tmp_path / "r.json", doc)
    fast = load_trace(path)
    with monkeypatch.context() as m:
        m.setattr(trace_mod, "decode_batch", orjson.loads)
        checked = load_trace(path)
    _assert_same(fast, checked)
    assert list(fast.stream[-2:]) == [-1, -1] and list(fast.correlation[-2:]) == [-1, -1]


def test_decode_batch_falls_back_to_dicts() -> None:
    assert type(decode_batch(b'[{"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 1, "dur": 1}]')) is EventBatch
    for bad in (b'[{"ph": "X", "name": "a", "pid": 1, "tid": 1, "dur": 1}]',  # ts missing
                b'[{"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 1, "dur": -1}]',
                b'[{"name": "a"}]', b"[[1, 2]]"):
        assert type(decode_batch(bad)) is list
    # not valid JSON for orjson either: not UTF-8, or cut short
    for bad in ('[{"ph": "i", "s": "\udcff"}]'.encode("utf-8", "surrogatepass"), b'[{"ph": "X",'):
        with pytest.raises(ValueError):
            decode_batch(bad)
