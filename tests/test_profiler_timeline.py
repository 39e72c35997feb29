"""``cpdpkit profile --timeline``: one Chrome trace, every rank on one clock, read back with a strict
JSON parser; the alignment checked on synthetic ranks with shifted clocks and on 2 real gloo ranks
against their own monotonic stamps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from _ranks import run_script_ranks
from _trace_builder import cpu_op, kernel, launch, step, trace_doc, write_trace
from cpdpkit.profiler import analyze
from cpdpkit.profiler.timeline import TRACKS, timeline_doc

pytestmark = pytest.mark.timeout(60)

BASE_NS = 1_790_857_026_000_000_000
STEP_US, DELAY_US, T_US, EARLY_US = 10_000.0, 3_000.0, 400.0, 2_000.0


def _strict(text: str) -> dict:
    def refuse(name: str) -> None:
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def _gpu_rank(rank: int, shift_us: float) -> dict:
    """Per step a compute kernel (the late rank's ``DELAY_US`` longer), then an all-reduce that starts at
    the rank's arrival and ends ``T_US`` after the last one. The trace's own clock starts ``shift_us``
    later (``baseTimeNanoseconds``), so its ``ts`` are ``shift_us`` smaller for the same moment; rank
    1's trace starts ``EARLY_US`` earlier (its trace clock, from its first event, is offset)."""
    delay = DELAY_US if rank == 1 else 0.0
    events = [cpu_op("aten::empty", -EARLY_US - shift_us, 5.0)] if rank == 1 else []
    for k in range(4):
        t = k * STEP_US - shift_us
        events += [
            step(k, t, STEP_US), launch(t + 10, corr=2 * k + 1), launch(t + 20, corr=2 * k + 2),
            kernel("volta_sgemm_128x64_nn", t + 100, 2_000 + delay, stream=7, corr=2 * k + 1),
            kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", t + 2_100 + delay, T_US + DELAY_US - delay,
                   stream=13, corr=2 * k + 2, **{"Collective name": "allreduce", "Process Group Name": "0",
                                                 "Seq": str(k)}),
        ]
    doc = trace_doc(events, rank=rank)
    doc["baseTimeNanoseconds"] = BASE_NS + int(shift_us * 1000)
    return doc


def _by_track(doc: dict) -> dict[tuple[int, str], list[dict]]:
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    out: dict[tuple[int, str], list[dict]] = {}
    for e in doc["traceEvents"]:
        if e["ph"] in ("X", "i"):
            out.setdefault((e["pid"], names[e["pid"], e["tid"]]), []).append(e)
    return out


def test_synthetic_ranks_with_shifted_clocks_line_up(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for rank, shift in ((0, 0.0), (1, 5_000.0)):
        write_trace(run / f"rank{rank}.json", _gpu_rank(rank, shift))
    report = analyze([run], timeline=True)
    doc = _strict(json.dumps(timeline_doc(report), allow_nan=False))
    (info,) = doc["otherData"]["cpdpkit_timeline"]["runs"]
    assert info["aligned"] and info["matched_collectives"] == 3  # the last step's launch is cut off
    assert [r["offset_us"] for r in info["ranks"]] == [EARLY_US, 0.0]
    assert len({r["wall_origin_us"] for r in info["ranks"]}) == 1
    tracks = _by_track(doc)
    assert {t for _, t in tracks} == set(TRACKS) - {"hidden"}  # the all-reduces run after compute
    assert report.runs[0].ranks[0].hidden_us == 0
    # on one clock, every step starts at the same time on both ranks, and rank 1's all-reduce
    # starts DELAY_US after rank 0's
    for pid in (1, 2):
        assert [e["ts"] for e in tracks[pid, "steps"]] == [EARLY_US + k * STEP_US for k in range(4)]
    c0 = [e for e in tracks[1, "collectives"] if e["ph"] == "X" and e["args"]["match"] is not None]
    c1 = [e for e in tracks[2, "collectives"] if e["ph"] == "X" and e["args"]["match"] is not None]
    assert [b["ts"] - a["ts"] for a, b in zip(c0, c1)] == [DELAY_US] * 3
    assert all(e["args"]["straggler"] == 1 for e in c0 + c1)
    assert [e["args"]["late"] for e in c1] == [True] * 3 and not any(e["args"]["late"] for e in c0)
    assert len([e for e in tracks[2, "collectives"] if e["ph"] == "i" and e["name"] == "straggler"]) == 3
    # rank 0 waits DELAY_US at every matched all-reduce, exposed; rank 1 waits for nobody
    skew0 = sum(e["dur"] for e in tracks[1, "skew"])
    assert skew0 == pytest.approx(report.runs[0].ranks[0].skew_us) == pytest.approx(3 * DELAY_US)
    assert not tracks.get((2, "skew"))
    exposed0 = sum(e["dur"] for e in tracks[1, "exposed"])
    assert exposed0 == pytest.approx(report.runs[0].ranks[0].exposed_us)


WORKER = Path(__file__).with_name("_profiler_straggler_workload.py")
DELAY_MS, STEPS = 30.0, 5


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cpdpkit.cli", *args], capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(90)
def test_real_gloo_ranks_line_up_with_their_monotonic_stamps(tmp_path: Path) -> None:
    """2 gloo ranks, rank 1 sleeps 30 ms before each all-reduce. In the timeline, each matched
    all-reduce starts later on rank 1 than on rank 0 by what the ranks' monotonic stamps of the
    calls say (one clock for all processes of the host), and rank 1 is its straggler."""
    out = run_script_ranks(WORKER, tmp_path, "1", str(DELAY_MS), str(STEPS), timeout_s=60)
    path = tmp_path / "timeline.json"
    result = _cli("profile", str(out), "--timeline", str(path))
    assert result.returncode == 0, result.stderr
    doc = _strict(path.read_text())
    (info,) = doc["otherData"]["cpdpkit_timeline"]["runs"]
    assert info["aligned"], info
    tracks = _by_track(doc)
    colls = [[e for e in tracks[pid, "collectives"] if e["ph"] == "X" and e["args"]["match"] is not None]
             for pid in (1, 2)]
    by_match = [{e["args"]["match"]: e for e in c} for c in colls]
    steps = [{e["args"]["step"]: e for e in c} for c in colls]
    a0, a1 = (json.loads(Path(f"{out}.arrivals-rank{r}.json").read_text()) for r in range(2))
    truth = [(t1 - t0) * 1e6 for t0, t1 in zip(a0, a1)]
    # one all-reduce per recorded step: the k-th recorded step's on both ranks is the k-th stamp
    nums = sorted(set(steps[0]) & set(steps[1]))
    assert len(nums) == STEPS and set(by_match[0]) == set(by_match[1])
    seen = [steps[1][n]["ts"] - steps[0][n]["ts"] for n in nums]
    print(f"rank 1 - rank 0 arrival, timeline {[round(x) for x in seen]} us, stamps {[round(x) for x in truth]} us")
    # the stamp is taken just before the call, the arrival is the gloo op's start: only a
    # descheduling between the two separates them (ms on 2 loaded cores), so the mean holds to 5 %
    assert sum(seen) / len(seen) == pytest.approx(sum(truth) / len(truth), rel=0.05)
    assert min(seen) > 0.5 * DELAY_MS * 1e3
    assert all(steps[r][n]["args"]["straggler"] == 1 for r in (0, 1) for n in nums)
    w0, w1 = (r["wall_origin_us"] for r in info["ranks"])
    assert w1 == pytest.approx(w0, abs=1.0)  # the timeline's 0 is one moment for both (to float rounding)


def test_timeline_path_that_is_an_input_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for rank in (0, 1):
        write_trace(run / f"rank{rank}.json", _gpu_rank(rank, 0.0))
    trace = run / "rank0.json"
    before = trace.read_bytes()
    result = _cli("profile", str(run), "--timeline", str(trace))
    assert result.returncode == 2
    assert result.stderr == (f"error: --timeline {str(trace)!r}: it is a trace file of the run {str(run)!r}; "
                             "write the timeline outside the run folders (e.g. --timeline timeline.json)\n")
    assert trace.read_bytes() == before and result.stdout == ""
    inside = run / "timeline.json"
    result = _cli("profile", str(run), "--timeline", str(inside))
    assert result.returncode == 2 and "would be read as a rank's trace" in result.stderr
    assert not inside.exists()


def test_timeline_path_that_is_a_baseline_input_is_refused(tmp_path: Path) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    for run in (old, new):
        for rank in (0, 1):
            write_trace(run / f"rank{rank}.json", _gpu_rank(rank, 0.0))
    trace = old / "rank0.json"
    before = trace.read_bytes()
    result = _cli("profile", str(new), "--baseline", str(old), "--timeline", str(trace))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (f"error: --timeline {str(trace)!r}: it is a trace file of the run {str(old)!r}; "
                             "write the timeline outside the run folders (e.g. --timeline timeline.json)\n")
    assert trace.read_bytes() == before
    result = _cli("profile", str(new), "--baseline", str(old), "--timeline", str(old / "timeline.json"))
    assert result.returncode == 2 and "would be read as a rank's trace" in result.stderr
    assert not (old / "timeline.json").exists()


def test_timeline_of_flight_recorder_dumps_is_refused_before_any_work(tmp_path: Path) -> None:
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    for rank in (0, 1):
        (dumps / f"fr_{rank}").write_text(json.dumps({"version": "2.10", "entries": []}))
    out = tmp_path / "timeline.json"
    result = _cli("profile", str(dumps), "--timeline", str(out))
    assert result.returncode == 2 and result.stdout == "" and not out.exists()
    assert result.stderr == (f"error: --timeline {str(out)!r}: {str(dumps)!r} holds flight-recorder dumps, which "
                             "record collectives only, not the ranks' compute, so no timeline is drawn from them; "
                             "drop --timeline for dumps, or pass the run's profiler trace folders\n")
