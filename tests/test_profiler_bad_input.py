"""Bad input gives one clear line naming the file and the problem, never a traceback."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from _trace_builder import cpu_op, cpu_scenario, step, trace_doc, write_trace
from cpdpkit.errors import CpdpkitError, TraceError
from cpdpkit.profiler import TraceFileError, analyze, load_trace

pytestmark = pytest.mark.timeout(30)


def _error_of(path: Path) -> str:
    with pytest.raises(TraceFileError) as info:
        load_trace(path)
    assert isinstance(info.value, TraceError) and isinstance(info.value, CpdpkitError)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}: ")
    return message[len(f"{path}: "):]


def test_truncated_gzip(tmp_path: Path) -> None:
    data = gzip.compress(json.dumps(cpu_scenario()).encode())
    p = write_trace(tmp_path / "r.json.gz", data[: len(data) // 2], gz=False)
    assert _error_of(p) == "truncated gzip file (compressed data ends before the end-of-stream marker)"


def test_corrupt_gzip(tmp_path: Path) -> None:
    data = bytearray(gzip.compress(json.dumps(cpu_scenario()).encode()))
    data[-8:-4] = b"\0\0\0\0"  # CRC
    p = write_trace(tmp_path / "r.json.gz", bytes(data), gz=False)
    assert _error_of(p).startswith("corrupt gzip data (CRC check failed")


def test_gz_name_without_gzip_data(tmp_path: Path) -> None:
    p = write_trace(tmp_path / "r.json.gz", "{}", gz=False)
    assert _error_of(p) == "not gzip data although the name ends in .gz"


def test_not_json(tmp_path: Path) -> None:
    assert _error_of(write_trace(tmp_path / "r.json", "hello")).startswith("not valid JSON (unexpected character")
    assert _error_of(write_trace(tmp_path / "e.json", "")) == "empty file"


def test_truncated_json(tmp_path: Path) -> None:
    text = json.dumps(cpu_scenario(), indent=1)
    p = write_trace(tmp_path / "r.json", text[: len(text) // 2])
    assert _error_of(p).startswith("not valid JSON (")


def test_json_without_trace_events(tmp_path: Path) -> None:
    assert _error_of(write_trace(tmp_path / "a.json", {"a": 1})) == (
        "JSON has no 'traceEvents' (not a Chrome/Kineto trace)")
    assert _error_of(write_trace(tmp_path / "b.json", [1, 2])) == (
        "JSON top level is a list, expected an object with 'traceEvents'")
    assert _error_of(write_trace(tmp_path / "c.json", {"traceEvents": 3})) == (
        "'traceEvents' is a number, expected a list")


@pytest.mark.parametrize(
    "event,problem",
    [
        ({"ph": "X", "name": "aten::mm", "pid": 1, "tid": 1, "dur": 5},
         "traceEvents[1] ('aten::mm'): field 'ts' is missing"),
        ({"ph": "X", "name": "aten::mm", "pid": 1, "tid": 1, "ts": "3", "dur": 5},
         "traceEvents[1] ('aten::mm'): field 'ts' is str, expected a number"),
        ({"ph": "X", "name": 7, "pid": 1, "tid": 1, "ts": 3, "dur": 5},
         "traceEvents[1]: field 'name' is int, expected a string"),
        ({"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 3, "dur": -5},
         "traceEvents[1] ('a'): field 'dur' is negative (-5)"),
        ({"ph": "X", "name": "a", "pid": 1, "tid": [1], "ts": 3, "dur": 5},
         "traceEvents[1] ('a'): field 'tid' is list, expected an integer or a string"),
        ({"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 3, "dur": 5, "args": []},
         "traceEvents[1] ('a'): field 'args' is list, expected an object"),
        ([1, 2], "traceEvents[1]: is a list, expected an object"),
        ({"name": "a"}, "traceEvents[1] ('a'): field 'ph' is missing"),
    ],
)
def test_bad_events(tmp_path: Path, event: object, problem: str) -> None:
    doc = {"traceEvents": [cpu_op("aten::add", 0, 1), event]}
    assert _error_of(write_trace(tmp_path / "r.json", doc)) == problem


def _doc(rank: int, world_size: int | None) -> dict:
    doc = cpu_scenario(rank)
    if world_size is None:
        del doc["distributedInfo"]
    else:
        doc["distributedInfo"]["world_size"] = world_size
    return doc


def test_bad_rank_does_not_lose_the_others(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_trace(run / "rank0.pt.trace.json", _doc(0, 3))
    write_trace(run / "rank1.pt.trace.json", "{not json")
    write_trace(run / "rank2.pt.trace.json.gz", _doc(2, 3))
    (tmp_path / "empty").mkdir()
    report = analyze([run, tmp_path / "missing", tmp_path / "empty"])
    (r,) = report.runs
    assert [k.rank for k in r.ranks] == [0, 2]
    errors = {e.path: e.error for e in report.errors}
    assert errors[str(run / "rank1.pt.trace.json")].startswith(f"{run / 'rank1.pt.trace.json'}: not valid JSON (")
    assert errors[str(tmp_path / "missing")] == f"{tmp_path / 'missing'}: no such file or folder"
    assert errors[str(tmp_path / "empty")] == f"{tmp_path / 'empty'}: no trace files (*.json, *.json.gz) in this folder"


def test_bad_run_json_is_reported_but_ranks_load(tmp_path: Path) -> None:
    write_trace(tmp_path / "rank0.json", trace_doc([step(0, 0, 10), cpu_op("aten::mm", 0, 10)], world_size=1))
    (tmp_path / "run.json").write_text("[1,")
    report = analyze([tmp_path])
    assert len(report.runs) == 1 and report.runs[0].strategy is None
    (error,) = report.errors
    assert error.error.startswith(f"{tmp_path / 'run.json'}: not valid JSON (")


def _errors(report) -> dict[str, str]:  # type: ignore[no-untyped-def]
    out: dict[str, str] = {}
    for e in report.errors:
        assert e.path not in out and e.error.startswith(f"{e.path}: ") and "\n" not in e.error
        out[e.path] = e.error[len(e.path) + 2:]
    return out


def test_traces_of_other_runs_in_one_folder(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for rank in range(4):
        write_trace(run / f"rank{rank}.pt.trace.json", _doc(rank, 4))
    write_trace(run / "rank1_old.pt.trace.json", _doc(1, 4))   # a second rank 1
    write_trace(run / "rank7.json", _doc(0, None))              # no distributedInfo: the name says 7
    write_trace(run / "zz.json", _doc(0, 8))                    # another world size
    report = analyze([run])
    (r,) = report.runs
    assert [(k.rank, Path(k.path).name) for k in r.ranks] == [(i, f"rank{i}.pt.trace.json") for i in range(4)]
    assert r.summary.num_ranks == 4
    assert _errors(report) == {
        str(run / "rank1_old.pt.trace.json"): f"rank 1 (distributedInfo) is also the rank of "
                                              f"{run / 'rank1.pt.trace.json'}: traces of different runs in one "
                                              "folder? skipped",
        str(run / "rank7.json"): "rank 7 (file name) is not below the run's world size 4: a trace of another run "
                                 "in this folder? skipped",
        str(run / "zz.json"): "world size 8 (distributedInfo), but the run's is 4: a trace of another run in this "
                              "folder? skipped",
    }


def test_missing_ranks_are_named(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for rank in (0, 2):
        write_trace(run / f"rank{rank}.json", _doc(rank, 8))
    report = analyze([run])
    assert [k.rank for k in report.runs[0].ranks] == [0, 2]
    assert _errors(report) == {str(run): "world size 8, but no trace of ranks 1, 3-7 (found 2 of 8); the present "
                                            "ranks are analysed"}
    # one trace file given on its own is one rank by choice
    alone = analyze([run / "rank2.json"])
    assert alone.errors == () and [k.rank for k in alone.runs[0].ranks] == [2]


def test_run_json_world_size_and_ranks_checked(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for rank in (0, 1):
        write_trace(run / f"rank{rank}.json", _doc(rank, 2))
    (run / "run.json").write_text('{"world_size": 4, "ranks": {"rank0.json": 0, "gone.json": 1}}')
    report = analyze([run])
    assert [k.rank for k in report.runs[0].ranks] == [0, 1]
    assert [e.error for e in report.errors] == [
        f"{run / 'run.json'}: \"ranks\" names gone.json, not a trace file of this run",
        f"{run / 'run.json'}: world_size 4, but the traces say 2; using 2",
    ]
    (run / "run.json").write_text('{"ranks": [0, 1]}')
    assert _errors(analyze([run])) == {
        str(run / "run.json"): '"ranks" must map trace file names to ranks >= 0, such as {"rank0.json": 0}; ignored'}
