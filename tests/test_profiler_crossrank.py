"""Cross-rank analysis, who waits for whom: synthetic runs with a known straggler, then 2 real gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _ranks import run_script_ranks
from _trace_builder import GLOO, annotation, cpu_op, kernel, launch, step, trace_doc, write_trace
from cpdpkit.profiler import analyze
from cpdpkit.profiler.crossrank import LATE_MARGIN_US, MAX_CLOCK_OFFSET_US

pytestmark = pytest.mark.timeout(30)

STEP_US = 10_000.0
D_US = 3_000.0  # the late rank's delay before every collective
T_US = 400.0  # the collective's own transfer time
NUM_STEPS = 5
BASE_NS = 1_790_857_026_000_000_000  # a Kineto baseTimeNanoseconds


def _gpu_rank(rank: int, late: int, *, world: int = 2, seq: bool = False, skip_steps: int = 0,
              step_shift: int = 0, delay_us: float = D_US) -> dict:
    """NCCL-style: per step a compute kernel, then an all-reduce kernel that starts when its rank
    arrives (the late rank computes ``delay_us`` longer) and ends for all ranks ``T_US`` after the
    last arrival. Kernels are launched from the step (correlation ids), the last step is cut off."""
    delay = delay_us if rank == late else 0.0
    events = []
    for k in range(skip_steps, NUM_STEPS):
        t = k * STEP_US
        args: dict = {"Collective name": "allreduce", "Process Group Name": "0"}
        if seq:
            args["Seq"] = str(k)  # torch writes it as a string
        events += [
            step(k + step_shift, t, STEP_US),
            launch(t + 10, corr=2 * k + 1),
            launch(t + 20, corr=2 * k + 2),
            kernel("volta_sgemm_128x64_nn", t + 100, 2_000 + delay, stream=7, corr=2 * k + 1),
            kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)",
                   t + 2_100 + delay, T_US + delay_us - delay, stream=13, corr=2 * k + 2, **args),
        ]
    return trace_doc(events, rank=rank, world_size=world)


def _cpu_rank(rank: int, late: int, *, world: int = 3) -> dict:
    """gloo-style: per step compute, the all-reduce's call site, the gloo op on the worker
    thread from the rank's arrival until ``T_US`` after the last arrival, a wait on the
    training thread until then, and more compute."""
    delay = D_US if rank == late else 0.0
    events = []
    for k in range(NUM_STEPS):
        t = k * STEP_US
        arrive = t + 1_000 + delay
        done = t + 1_000 + D_US + 10 + T_US
        events += [
            step(k, t, STEP_US),
            cpu_op("aten::mm", t, 1_000 + delay),
            cpu_op("c10d::allreduce_", arrive, 10),
            annotation("gloo:all_reduce", arrive + 10, done - arrive - 10, tid=GLOO),
            cpu_op("aten::add", done + 5, t + STEP_US - done - 100),
        ]
    return trace_doc(events, rank=rank, world_size=world)


def _write_run(folder: Path, docs: list[dict]) -> Path:
    for rank, doc in enumerate(docs):
        write_trace(folder / f"rank{rank}.pt.trace.json", doc)
    return folder


def _per_step_skew(rank) -> float:  # type: ignore[no-untyped-def]
    steps = rank.full_steps
    return sum(s.skew_us for s in steps) / len(steps)


def _check_straggler(run, late: int, world: int) -> None:  # type: ignore[no-untyped-def]
    s = run.summary
    assert s.stragglers is not None and s.stragglers[0]["rank"] == late
    top = s.stragglers[0]
    assert top["late_frac"] == 1.0 and len(s.stragglers) == 1
    for r in run.ranks:
        assert r.skew_us is not None and r.transfer_us is not None
        assert r.skew_us + r.transfer_us == pytest.approx(r.exposed_us)
        for kind, split in r.skew_by_kind.items():
            assert split.skew_us + split.transfer_us == pytest.approx(r.by_kind[kind].exposed_us)
        if r.rank == late:
            assert r.skew_us == 0
        else:
            assert _per_step_skew(r) == pytest.approx(D_US, rel=0.10)
    # the others' waits, summed over the ranks that waited, per step
    assert top["caused_wait_us_per_step"] == pytest.approx((world - 1) * D_US, rel=0.10)
    assert s.per_step["skew_us"] == pytest.approx((world - 1) / world * D_US, rel=0.10)
    assert s.per_step["skew_us"] + s.per_step["transfer_us"] == pytest.approx(s.per_step["exposed_us"])


def test_gpu_nccl_straggler(tmp_path: Path) -> None:
    run_dir = _write_run(tmp_path / "run", [_gpu_rank(r, late=1) for r in range(2)])
    report = analyze([run_dir])
    assert not report.errors, report.errors
    (run,) = report.runs
    assert {r.mode for r in run.ranks} == {"gpu"}
    _check_straggler(run, late=1, world=2)
    r0 = run.ranks[0]
    # 4 complete steps (the last one is cut off): exposed D + T each, of which D waits for rank 1
    assert r0.skew_by_kind["all_reduce"].skew_us == pytest.approx(4 * D_US)
    assert r0.skew_by_kind["all_reduce"].transfer_us == pytest.approx(4 * T_US)
    assert run.summary.stragglers[0]["late_count"] == 4


def test_cpu_gloo_straggler_three_ranks(tmp_path: Path) -> None:
    run_dir = _write_run(tmp_path / "run", [_cpu_rank(r, late=1) for r in range(3)])
    report = analyze([run_dir])
    assert not report.errors, report.errors
    (run,) = report.runs
    assert {r.mode for r in run.ranks} == {"cpu"}
    _check_straggler(run, late=1, world=3)
    assert run.summary.stragglers[0]["late_count"] == NUM_STEPS
    for r in run.ranks:  # transfer = exposed - skew per step too
        for s in r.steps:
            assert s.skew_us + s.transfer_us == pytest.approx(s.exposed_us)


def test_matching_by_seq_when_a_trace_starts_later(tmp_path: Path) -> None:
    """Rank 1's trace starts a step later and numbers its steps differently: ``Seq`` still pairs
    the collectives (step numbers alone would pair none)."""
    docs = [_gpu_rank(0, late=1, seq=True), _gpu_rank(1, late=1, seq=True, skip_steps=1, step_shift=100)]
    report = analyze([_write_run(tmp_path / "run", docs)])
    assert not report.errors, report.errors
    (run,) = report.runs
    assert run.summary.stragglers[0]["rank"] == 1 and run.summary.stragglers[0]["late_count"] == 3
    assert run.ranks[0].skew_us == pytest.approx(3 * D_US)  # step 0 has no partner: not matched
    without_seq = [_gpu_rank(0, late=1), _gpu_rank(1, late=1, skip_steps=1, step_shift=100)]
    (run,) = analyze([_write_run(tmp_path / "plain", without_seq)]).runs
    assert run.summary.stragglers is None and run.ranks[0].skew_us is None


@pytest.mark.parametrize("how", ["base_time", "absolute_ts"])
def test_clock_offsets_are_corrected(tmp_path: Path, how: str) -> None:
    """Rank 1's trace is written against another base time (or in absolute Unix µs without one):
    aligned on the wall clock, the answer is the same as with one clock."""
    shift_us = 5_000_000.0
    docs = [_gpu_rank(r, late=1) for r in range(2)]
    docs[0]["baseTimeNanoseconds"] = BASE_NS
    if how == "base_time":
        docs[1]["baseTimeNanoseconds"] = BASE_NS + int(shift_us * 1000)
        offset = -shift_us
    else:
        offset = BASE_NS / 1000
    for e in docs[1]["traceEvents"]:
        if e["ph"] == "X":
            e["ts"] += offset
    report = analyze([_write_run(tmp_path / "run", docs)])
    assert not report.errors, report.errors
    _check_straggler(report.runs[0], late=1, world=2)


def test_implausible_clock_offset_is_an_error_and_the_ranks_stay(tmp_path: Path) -> None:
    docs = [_gpu_rank(r, late=1) for r in range(2)]
    docs[0]["baseTimeNanoseconds"] = BASE_NS
    docs[1]["baseTimeNanoseconds"] = BASE_NS + 3_600 * 10**9  # an hour off: not one clock
    run_dir = _write_run(tmp_path / "run", docs)
    report = analyze([run_dir])
    (run,) = report.runs
    (issue,) = report.errors
    assert issue.path == str(run_dir) and issue.error.startswith(f"{run_dir}: implausible clock offsets")
    assert "rank 1's clock is +3600.0 s off rank 0's" in issue.error
    assert f"{MAX_CLOCK_OFFSET_US / 1e6:.0f} s" in issue.error
    assert run.summary.stragglers is None and run.summary.per_step["skew_us"] is None
    good = analyze([_write_run(tmp_path / "good", [_gpu_rank(r, late=1) for r in range(2)])]).runs[0]
    for r, g in zip(run.ranks, good.ranks):  # the per-rank analysis is untouched
        assert r.skew_us is None and r.skew_by_kind == {}
        assert (r.exposed_us, r.comm_us, r.hidden_us) == (g.exposed_us, g.comm_us, g.hidden_us)
    data = report.to_dict()
    assert data["runs"][0]["summary"]["stragglers"] is None and data["runs"][0]["ranks"][0]["skew_us"] is None


def test_balanced_run_has_no_straggler_and_json_keys(tmp_path: Path) -> None:
    report = analyze([_write_run(tmp_path / "run", [_gpu_rank(r, late=-1) for r in range(2)])])
    assert not report.errors, report.errors
    (run,) = report.runs
    assert run.summary.stragglers == ()
    assert all(r.skew_us == 0 for r in run.ranks)
    data = report.to_dict()["runs"][0]
    assert data["summary"]["stragglers"] == [] and data["summary"]["per_step"]["skew_us"] == 0
    rank = data["ranks"][0]
    assert rank["skew_us"] == 0 and rank["transfer_us"] == rank["exposed_us"]
    assert set(rank["skew_by_kind"]["all_reduce"]) == {"skew_us", "transfer_us"}
    assert {"skew_us", "transfer_us"} <= set(rank["steps"][0])


def test_one_rank_has_no_split(tmp_path: Path) -> None:
    report = analyze([_write_run(tmp_path / "run", [_gpu_rank(0, late=1, world=1)])])
    assert not report.errors, report.errors
    (run,) = report.runs
    assert run.summary.stragglers is None and run.ranks[0].skew_us is None


def test_arriving_last_by_less_than_the_margin_is_a_tie(tmp_path: Path) -> None:
    docs = [_gpu_rank(r, late=1, delay_us=LATE_MARGIN_US / 2) for r in range(2)]
    (run,) = analyze([_write_run(tmp_path / "run", docs)]).runs
    assert run.summary.stragglers == ()
    assert run.ranks[0].skew_us == pytest.approx(4 * LATE_MARGIN_US / 2)


WORKER = Path(__file__).with_name("_profiler_straggler_workload.py")
DELAY_MS = 30.0
REAL_STEPS = 5


@pytest.mark.timeout(60)
def test_real_gloo_straggler(tmp_path: Path) -> None:
    """2 gloo ranks, rank 1 sleeps 30 ms before each all-reduce: rank 1 is the straggler, and
    rank 0's mean skew is what the ranks' own clocks say it was (the host's monotonic time of each
    all-reduce call, which holds the sleep's overshoot and any descheduling too) within 5 %."""
    out = run_script_ranks(WORKER, tmp_path, "1", str(DELAY_MS), str(REAL_STEPS), timeout_s=50)
    report = analyze([out])
    assert not report.errors, report.errors
    (run,) = report.runs
    r0, r1 = run.ranks
    skews = [s.skew_us for s in r0.full_steps]
    print(f"D = {DELAY_MS * 1e3:.0f} us; rank 0 skew per step {[round(x) for x in skews]}, "
          f"mean {_per_step_skew(r0):.0f} us; rank 1 mean {_per_step_skew(r1):.0f} us; "
          f"stragglers {[dict(s) for s in run.summary.stragglers]}")
    assert len(skews) == REAL_STEPS
    assert run.summary.stragglers[0]["rank"] == 1
    a0, a1 = (json.loads(Path(f"{out}.arrivals-rank{r}.json").read_text()) for r in range(2))
    truth = [(t1 - t0) * 1e6 for t0, t1 in zip(a0, a1)]
    assert min(truth) > 0.5 * DELAY_MS * 1e3  # rank 1 late on every step (rank 0 may wake late after a step)
    # the profiler's arrival is the gloo op's start, the truth a stamp just before the call: a
    # descheduling between the two (ms on 2 loaded cores) is all that may separate them
    assert _per_step_skew(r0) == pytest.approx(sum(truth) / len(truth), rel=0.05), (skews, truth)
    assert _per_step_skew(r1) < 0.1 * DELAY_MS * 1e3


def test_cli_prints_skew_transfer_and_the_straggler(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from cpdpkit.cli import app

    run_dir = _write_run(tmp_path / "gloo", [_cpu_rank(r, late=2) for r in range(3)])
    result = CliRunner().invoke(app, ["profile", str(run_dir)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "skew" in result.output and "transfer" in result.output
    (run,) = analyze([run_dir]).runs
    caused = run.summary.stragglers[0]["caused_wait_us_per_step"] / 1e3
    assert (f"gloo: straggler rank 2 arrived last at 100 % of collectives ({NUM_STEPS}); the others "
            f"waited {caused:,.2f} ms/step for it") in result.output
