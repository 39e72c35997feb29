"""``cpdpkit profile`` on torch flight-recorder dumps: real gloo jobs (a straggler, a hang), dumps in
torch's JSON format with mismatched sizes and kinds, and dumps that are not of one run or format."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from _ranks import run_script_ranks
from cpdpkit.profiler.errors import TraceFileError
from cpdpkit.profiler.flightrec import analyze_dumps, read_dump

pytestmark = pytest.mark.timeout(60)

WORKER = Path(__file__).with_name("_profiler_fr_workload.py")
DELAY_MS, STEPS = 30.0, 5


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cpdpkit.cli", *args], capture_output=True, text=True, timeout=60)


def test_real_gloo_straggler_from_its_dumps(tmp_path: Path) -> None:
    """rank 1 sleeps 30 ms before each all-reduce: every collective entered by both, rank 1 late at
    all of them, and rank 0's wait is what the ranks' own stamps of the calls say."""
    out = run_script_ranks(WORKER, tmp_path, "1", str(DELAY_MS), str(STEPS), "0", timeout_s=50)
    assert sorted(p.name for p in out.iterdir()) == ["nccl_trace_rank_0", "nccl_trace_rank_1"]
    report = analyze_dumps(str(out))
    assert report.hang is None and not report.mismatches
    assert [(c.kind, c.entered, c.never_entered) for c in report.collectives] == [("all_reduce", (0, 1), ())] * STEPS
    (s,) = report.stragglers
    assert s["rank"] == 1 and s["late_count"] == STEPS and s["late_frac"] == 1.0
    a0, a1 = (json.loads(Path(f"{out}.stamps-rank{r}.json").read_text()) for r in range(2))
    truth_us = sum(t1 - t0 for t0, t1 in zip(a0, a1)) / 1e3
    # the recorder stamps the collective when it is issued, just after the rank's own stamp
    assert s["caused_wait_us_per_step"] == pytest.approx(truth_us, rel=0.05)
    result = _cli("profile", str(out))
    assert result.returncode == 0, result.stderr
    assert (f"{out}: straggler rank 1 arrived last at 100 % of collectives ({STEPS}); the others waited "
            f"{s['caused_wait_us_per_step'] / 1e3:,.2f} ms in all for it") in result.stdout


def test_real_gloo_hang_names_the_rank_that_never_entered(tmp_path: Path) -> None:
    out = run_script_ranks(WORKER, tmp_path, "1", "0", "3", "1", timeout_s=50)
    result = _cli("profile", str(out), "--json", str(tmp_path / "fr.json"))
    assert result.returncode == 0, result.stderr
    assert f"{out}: hang at process group '0' seq 4 (all_reduce): rank 0 entered, rank 1 never did" in result.stdout
    (fr,) = json.loads((tmp_path / "fr.json").read_text())["flight_recorder"]
    assert fr["hang"]["never_entered"] == [1] and fr["hang"]["entered"] == [0]
    assert [c["seq"] for c in fr["collectives"]] == [1, 2, 3, 4]
    # without rank 1's dump, the hang cannot be told; the missing dump is named
    (out / "nccl_trace_rank_1").unlink()
    report = analyze_dumps(str(out))
    assert report.hang is None and report.collectives[-1].missing_dump == (1,)
    result = _cli("profile", str(out))
    assert (f"{out}: no dump from rank 1, a member of process group '0': whether it entered seq 1 (all_reduce) "
            "and later ones cannot be told") in result.stdout


def _entry(seq: int, name: str = "nccl:all_reduce", sizes: list | None = None, t_ns: int = 0) -> dict:
    """An entry as torch's _dump_fr_trace_json writes it (format 2.10)."""
    sizes = sizes if sizes is not None else [[1024]]
    return {"collective_seq_id": seq, "input_dtypes": ["Float"], "input_sizes": sizes, "is_p2p": False,
            "op_id": seq, "output_dtypes": ["Float"], "output_sizes": sizes, "p2p_seq_id": 0, "pg_id": 0,
            "process_group": ["0", "default_pg"], "profiling_name": name, "record_id": seq - 1,
            "retired": True, "state": "completed", "time_created_ns": 1_796_222_415_000_000_000 + t_ns,
            "time_discovered_completed_ns": 0, "time_discovered_started_ns": 0, "timeout_ms": 600000}


def _dump(entries: list[dict], version: str = "2.10", world: int = 2) -> dict:
    return {"version": version, "comm_lib_version": "2.21.5", "entries": entries, "nccl_comm_state": {},
            "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": json.dumps(list(range(world)))}},
            "pg_status": {"0": {"last_enqueued_collective": len(entries), "last_started_collective": len(entries),
                                "last_completed_collective": len(entries)}}}


def test_json_dumps_with_mismatched_sizes_and_kinds(tmp_path: Path) -> None:
    (tmp_path / "fr_0").write_text(json.dumps(_dump([_entry(1), _entry(2), _entry(3)])))
    (tmp_path / "fr_1").write_text(json.dumps(_dump([_entry(1), _entry(2, sizes=[[512]]),
                                                      _entry(3, name="nccl:broadcast")])))
    report = analyze_dumps(str(tmp_path))
    assert [c.seq for c in report.mismatches] == [2, 3]
    assert report.mismatches[0].mismatch == ("input_sizes: ranks [0] [[1024]]; ranks [1] [[512]]",
                                             "output_sizes: ranks [0] [[1024]]; ranks [1] [[512]]")
    assert report.mismatches[1].mismatch == ("profiling_name: ranks [0] 'nccl:all_reduce'; ranks [1] 'nccl:broadcast'",)
    result = _cli("profile", str(tmp_path))
    assert result.returncode == 0
    assert (f"{tmp_path}: mismatch at process group '0' seq 3 (all_reduce): profiling_name: ranks [0] "
            "'nccl:all_reduce'; ranks [1] 'nccl:broadcast'") in result.stdout


def test_a_wrapped_ring_buffer_is_no_evidence_of_a_hang(tmp_path: Path) -> None:
    (tmp_path / "fr_0").write_text(json.dumps(_dump([_entry(s) for s in range(5, 9)])))
    (tmp_path / "fr_1").write_text(json.dumps(_dump([_entry(s) for s in range(1, 8)])))
    report = analyze_dumps(str(tmp_path))
    assert report.hang is not None and (report.hang.seq, report.hang.never_entered) == (8, (1,))
    assert all(c.never_entered == () for c in report.collectives if c.seq < 8)


def test_pickle_dumps_execute_nothing(tmp_path: Path) -> None:
    class Boom:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (print, ("executed",))

    path = tmp_path / "fr_0"
    path.write_bytes(pickle.dumps({"version": "2.10", "entries": [Boom()]}))
    with pytest.raises(TraceFileError, match=r"refused global builtins\.print"):
        read_dump(str(path))
    path.write_bytes(pickle.dumps(_dump([_entry(1)])))
    assert read_dump(str(path)).entries[0]["collective_seq_id"] == 1


@pytest.mark.parametrize(("files", "message"), [
    ({"fr_0": _dump([_entry(1)], version="1.0")},
     "fr_0: flight-recorder format version '1.0' is not supported (cpdpkit reads 2.2 to 2.x, torch 2.4 to "
     "2.13); dump it with torch 2.4 or later"),
    ({"fr_0": {"entries": []}},
     "fr_0: not a flight-recorder dump (no 'version' and 'entries'); pass dumps that torch's flight recorder "
     "wrote (_dump_fr_trace or _dump_fr_trace_json, format 2.x)"),
    ({"fr_0": _dump([_entry(1)]), "dump_1": _dump([_entry(1)])},
     ": dumps of several runs (names ['dump_', 'fr_']) in one folder; put each run's dumps in a folder of its own"),
    ({"fr_0": _dump([_entry(1)]), "fr_1": _dump([_entry(1)], version="2.9")},
     ": dumps of different flight-recorder versions ['2.10', '2.9'] in one folder; put each run's dumps in a "
     "folder of its own"),
    ({"fr_0": _dump([_entry(1)]), "fr_1": _dump([_entry(1)], world=4)},
     ": dumps of runs of different sizes (world sizes [2, 4]) in one folder; put each run's dumps in a folder "
     "of its own"),
    ({"fr_0": _dump([_entry(1)]), "rank0.json": {"traceEvents": []}},
     ": holds both profiler traces and flight-recorder dumps; put the dumps in a folder of their own"),
])
def test_bad_dumps_are_one_line_and_exit_2(tmp_path: Path, files: dict, message: str) -> None:
    for name, doc in files.items():
        (tmp_path / name).write_text(json.dumps(doc))
    result = _cli("profile", str(tmp_path))
    assert result.returncode == 2 and result.stdout == ""
    line = result.stderr.removesuffix("\n")
    assert "\n" not in line and line.startswith(f"error: {tmp_path}") and line.endswith(message), line
