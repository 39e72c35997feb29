"""``cpdpkit profile --what-if``: the replay of :mod:`cpdpkit.profiler.whatif` on synthetic traces
whose answer follows from the network model, the unmodeled count, and the CLI around it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from _trace_builder import GLOO, annotation, cpu_op, kernel, launch, step, trace_doc, write_trace
from cpdpkit.cli import app
from cpdpkit.labels import emu_label
from cpdpkit.profiler import analyze, analyze_trace, load_trace
from cpdpkit.profiler.whatif import rank_timeline
from cpdpkit.topology import preset

pytestmark = pytest.mark.timeout(60)

NUM_BYTES = 642_564
MODELED_US = 1000.0
STEP_US = 2000.0


def _model_us(topology: str, num_bytes: int = NUM_BYTES) -> float:
    return preset(topology, world_size=2).group((0, 1)).time_s("all_reduce", num_bytes) * 1e6


def _blocking_step(k: int, *, emu: bool) -> list[dict]:
    """Step ``k`` of 2000 us: compute 0-300, all_reduce issued 300-310 (call site), waited until
    1310 (the collective completes at 1300 = issue + 1000 us), compute 1310-2000.
    Measured: exposed 10 (call site) + 1000 (wait) = 1010 us."""
    t = k * STEP_US
    events = [
        step(k, t, STEP_US),
        cpu_op("aten::mm", t, 300),
        cpu_op("c10d::allreduce_", t + 300, 10),
        cpu_op("aten::add", t + 1310, 690),
    ]
    if emu:
        label = emu_label("all_reduce", num_bytes=NUM_BYTES, tier="LAN", ranks="0-1", modeled_s=MODELED_US / 1e6)
        events.append(annotation(label, t + 300, MODELED_US, tid=GLOO + 1))
    else:
        events.append(annotation("gloo:all_reduce", t + 300, MODELED_US, tid=GLOO))
    return events


def _run(tmp_path: Path, events_of, name: str = "run") -> Path:  # type: ignore[no-untyped-def]
    folder = tmp_path / name
    for rank in (0, 1):
        write_trace(folder / f"rank{rank}.pt.trace.json", trace_doc(events_of(), rank=rank))
    (folder / "run.json").write_text(json.dumps({"strategy": "cpdp", "period": 4, "world_size": 2}))
    return folder


def _blocking_run(tmp_path: Path, *, emu: bool = True) -> Path:
    return _run(tmp_path, lambda: [e for k in range(2) for e in _blocking_step(k, emu=emu)])


@pytest.mark.parametrize("topology", ["lan", "wan"])
def test_blocking_collective_retimed_exactly(tmp_path: Path, topology: str) -> None:
    report = analyze([_blocking_run(tmp_path)], what_if=topology)
    run = report.runs[0]
    assert not report.errors
    assert run.summary.per_step["step_time_us"] == pytest.approx(STEP_US)
    measured = run.summary.per_step["exposed_us"]  # 1010: the call site and the wait
    new = _model_us(topology)
    # the wait stretches from 1000 us of link time to the model's: issue 300 + new + 10 to resume
    assert run.what_if.topology == topology
    assert run.what_if.step_time_us == pytest.approx(STEP_US - MODELED_US + new)
    assert run.what_if.exposed_us == pytest.approx(measured - MODELED_US + new)
    assert run.what_if.unmodeled_collectives == 0
    assert run.to_dict()["what_if"] == {
        "topology": topology,
        "per_step": {"step_time_us": run.what_if.step_time_us, "exposed_us": run.what_if.exposed_us},
        "unmodeled_collectives": 0,
    }


def test_hidden_collective_becomes_exposed_at_next_wait_point(tmp_path: Path) -> None:
    """Issued at 300 (call site 300-310) under compute 310-1500, a grad_wait phase 1500-1510,
    compute 1510-2000: all hidden at 1000 us of link time; on wan it completes at 300 + new and
    the training thread waits for it in the grad_wait gap."""
    label = emu_label("all_reduce", num_bytes=NUM_BYTES, tier="LAN", ranks="0-1", modeled_s=MODELED_US / 1e6)

    def events() -> list[dict]:
        out = []
        for k in range(2):
            t = k * STEP_US
            out += [step(k, t, STEP_US), cpu_op("aten::mm", t, 300), cpu_op("c10d::allreduce_", t + 300, 10),
                    annotation(label, t + 300, MODELED_US, tid=GLOO + 1), cpu_op("aten::mm", t + 310, 1190),
                    annotation("cpdpkit::sync::grad_wait", t + 1500, 10), cpu_op("aten::add", t + 1510, 490)]
        return out

    run = analyze([_run(tmp_path, events)], what_if="wan").runs[0]
    measured = run.summary.per_step["exposed_us"]  # the call site and the grad_wait phase
    new = _model_us("wan")
    late = 300 + new - 1500  # how long past the wait point it completes
    assert late > 0
    assert run.what_if.step_time_us == pytest.approx(STEP_US + late)
    assert run.what_if.exposed_us == pytest.approx(measured + late)


def test_unknown_bytes_keep_measured_time_and_are_counted(tmp_path: Path) -> None:
    run = analyze([_blocking_run(tmp_path, emu=False)], what_if="wan").runs[0]
    assert run.what_if.unmodeled_collectives == 4  # 2 steps x 2 ranks, gloo ops name no size
    assert run.what_if.step_time_us == pytest.approx(run.summary.per_step["step_time_us"])
    assert run.what_if.exposed_us == pytest.approx(run.summary.per_step["exposed_us"])


def test_without_what_if_the_json_says_null(tmp_path: Path) -> None:
    run = analyze([_blocking_run(tmp_path)]).runs[0]
    assert run.what_if is None and run.to_dict()["what_if"] is None


def test_cli_prints_the_prediction_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    result = CliRunner().invoke(app, ["profile", str(_blocking_run(tmp_path)), "--what-if", "wan",
                                      "--json", str(out)])
    assert result.exit_code == 0, result.output
    new_ms = (STEP_US - MODELED_US + _model_us("wan")) / 1e3
    measured_ms = 1.010  # the call site and the wait
    exposed_ms = (measured_ms * 1e3 - MODELED_US + _model_us("wan")) / 1e3
    line = (f"what-if cpdp K=4 on wan: step 2.0 -> {new_ms:.1f} ms, exposed {measured_ms:.1f} -> {exposed_ms:.1f} ms "
            "(per step, measured -> predicted)")
    assert line in result.output
    what_if = json.loads(out.read_text())["runs"][0]["what_if"]
    assert what_if["topology"] == "wan" and what_if["unmodeled_collectives"] == 0
    assert what_if["per_step"]["step_time_us"] == pytest.approx(new_ms * 1e3)


@pytest.mark.parametrize("topology", ["nope", "missing/file.toml"])
def test_cli_bad_topology_is_one_line_exit_2(tmp_path: Path, topology: str) -> None:
    result = CliRunner().invoke(app, ["profile", str(_blocking_run(tmp_path)), "--what-if", topology])
    assert result.exit_code == 2
    lines = [x for x in result.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in result.output


def test_topology_toml_accepted(tmp_path: Path) -> None:
    toml = tmp_path / "wan.toml"
    toml.write_text(preset("wan").to_toml())
    run = analyze([_blocking_run(tmp_path)], what_if=str(toml)).runs[0]
    assert run.what_if.topology == str(toml)
    assert run.what_if.step_time_us == pytest.approx(STEP_US - MODELED_US + _model_us("wan"))


def _gpu_events(*, sized: bool) -> list[dict]:
    """Three steps of 2000 us on a GPU: compute kernels 10-300 and 1300-1990, an NCCL all-reduce
    kernel 300-1300 (exposed 1000 us). The last step counts as partial (GPU mode)."""
    args = {"Collective name": "allreduce", "In msg nelems": NUM_BYTES // 4, "Out msg nelems": NUM_BYTES // 4,
            "dtype": "Float", "Process Group Ranks": "[0, 1]", "Group size": 2} if sized else {}
    events = []
    for k in range(3):
        t, c = k * STEP_US, 10 * k
        events += [step(k, t, STEP_US), launch(t + 1, c + 1, 1), launch(t + 2, c + 2, 1), launch(t + 3, c + 3, 1),
                   kernel("volta_sgemm", t + 10, 290, corr=c + 1),
                   kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", t + 300, MODELED_US, stream=20, corr=c + 2,
                          **args),
                   kernel("volta_sgemm", t + 1300, 690, corr=c + 3)]
    return events


def test_nccl_kernel_bytes_and_ranks_from_args(tmp_path: Path) -> None:
    run = analyze([_run(tmp_path, lambda: _gpu_events(sized=True))], what_if="wan").runs[0]
    assert run.ranks[0].mode == "gpu"
    assert run.summary.per_step["exposed_us"] == pytest.approx(MODELED_US)
    assert run.what_if.unmodeled_collectives == 0
    new = _model_us("wan")
    assert run.what_if.step_time_us == pytest.approx(STEP_US - MODELED_US + new)
    assert run.what_if.exposed_us == pytest.approx(new)


def test_nccl_kernel_without_size_args_is_unmodeled(tmp_path: Path) -> None:
    run = analyze([_run(tmp_path, lambda: _gpu_events(sized=False))], what_if="wan").runs[0]
    assert run.what_if.unmodeled_collectives == 6  # 3 kernels x 2 ranks
    assert run.what_if.step_time_us == pytest.approx(run.summary.per_step["step_time_us"])


def test_topology_that_cannot_be_placed_is_an_error_entry(tmp_path: Path) -> None:
    toml = tmp_path / "eight.toml"
    toml.write_text(preset("wan").to_toml().replace('ranks_per_node = "auto"', "ranks_per_node = 4"))
    report = analyze([_blocking_run(tmp_path)], what_if=str(toml))
    assert report.runs[0].what_if is None
    assert len(report.errors) == 1 and "places 8 ranks" in report.errors[0].error
    assert "--what-if" in report.errors[0].error


def test_ranks_wait_for_the_predicted_last_arrival(tmp_path: Path) -> None:
    """Rank 1 issues at +100, rank 0 at +300; as in the emulator, the 1000 us link starts at the
    last arrival on both (300-1300), the real data movement (gloo op) ends at +400 on both, and
    each rank resumes 10 us after the completion (1310). On a fast network rank 1 waits for rank
    0's *predicted* arrival (skew re-derived, ranks stay in step), and its measured wait past its
    own issue + 1000 us is the peer, not resuming."""
    nbytes = 1000
    label = emu_label("all_reduce", num_bytes=nbytes, tier="LAN", ranks="0-1", modeled_s=MODELED_US / 1e6)
    issue = {0: 300.0, 1: 100.0}

    def events(rank: int) -> list[dict]:
        out = []
        for k in range(2):
            t, a = k * STEP_US, issue[rank]
            out += [step(k, t, STEP_US), cpu_op("aten::mm", t, a), cpu_op("c10d::allreduce_", t + a, 10),
                    annotation(label, t + 300, MODELED_US, tid=GLOO + 1),
                    annotation("gloo:all_reduce", t + a, 400 - a, tid=GLOO),
                    cpu_op("aten::add", t + 1310, STEP_US - 1310)]
        return out

    folder = tmp_path / "skew"
    for rank in (0, 1):
        write_trace(folder / f"rank{rank}.pt.trace.json", trace_doc(events(rank), rank=rank))
    run = analyze([folder], what_if="lan").runs[0]
    d = preset("lan", world_size=2).group((0, 1)).time_s("all_reduce", nbytes) * 1e6
    # the replay by hand: per step, both ranks launch at L' = t + issue + delta; completion
    # max(the last L' + d, real end + shift of the last arrival); resume 10 us later; each
    # rank's gap (issue + 10 to 1310) changes by its new length minus the measured one
    delta, change = {0: 0.0, 1: 0.0}, {0: [], 1: []}
    for k in range(2):
        t = k * STEP_US
        launch_new = {r: t + issue[r] + delta[r] for r in (0, 1)}
        shift = max(launch_new.values()) - (t + 300)
        for r in (0, 1):
            end = max(max(launch_new.values()) + d, t + 400 + shift) + 10
            change[r].append((end - (launch_new[r] + 10)) - (1300 - issue[r]))
            delta[r] = end - (t + 1310)
    assert change[1][1] == pytest.approx(change[0][1])  # both resume together, as measured
    step_time = sum(STEP_US + sum(change[r]) / 2 for r in (0, 1)) / 2
    exposed = run.summary.per_step["exposed_us"] + sum(sum(change[r]) / 2 for r in (0, 1)) / 2
    assert run.what_if.step_time_us == pytest.approx(step_time)
    assert run.what_if.exposed_us == pytest.approx(exposed)


SLOW_BYTES = 100_000  # lan prices it under the 800 us of compute that it overlapped when measured


def _slowed_step(k: int) -> list[dict]:
    """Step ``k`` of 2000 us in which compute runs at half speed while the all-reduce is in flight:
    4 ops of 100 us alone (0-400), the call site 400-410 and 1000 us of link time (400-1400), the
    same 4 ops at 200 us each under it (410-1210), the wait 1210-1410 (completion at 1400 + 10 us
    to resume), 4 ops of 100 us alone (1410-1810), idle to 2000. Measured: exposed 10 + 200 us."""
    t = k * STEP_US
    label = emu_label("all_reduce", num_bytes=SLOW_BYTES, tier="LAN", ranks="0-1", modeled_s=MODELED_US / 1e6)
    events = [step(k, t, STEP_US), cpu_op("c10d::allreduce_", t + 400, 10),
              annotation(label, t + 400, MODELED_US, tid=GLOO + 1)]
    events += [cpu_op("aten::add", t + 100 * i, 100) for i in range(4)]
    events += [cpu_op("aten::add", t + 410 + 200 * i, 200) for i in range(4)]
    events += [cpu_op("aten::add", t + 1410 + 100 * i, 100) for i in range(4)]
    return events


def test_compute_slowed_under_communication_is_measured_and_replayed(tmp_path: Path) -> None:
    folder = _run(tmp_path, lambda: [e for k in range(2) for e in _slowed_step(k)])
    trace = load_trace(folder / "rank0.pt.trace.json")
    report = analyze([folder]).runs[0]
    assert report.summary.per_step["exposed_us"] == pytest.approx(210)
    timeline = rank_timeline(trace, analyze_trace(trace))
    assert timeline.slowdown == pytest.approx(2.0)  # 200 us under the link, 100 us alone
    d = _model_us("lan", SLOW_BYTES)
    assert 10 < d < 810  # the new link ends inside the 800 us of slowed compute
    # replay by hand: compute 410-1210 holds 400 us of work; the link now ends at 400 + d, so
    # (400 + d - 410) us of it run at half speed and the rest at full speed
    under = 400 + d - 410
    compute_change = under + (400 - under / 2) - 800
    # the wait then starts after the (earlier) completion: it shrinks to nothing
    run = analyze([folder], what_if="lan").runs[0]
    assert run.what_if.step_time_us == pytest.approx(STEP_US + compute_change - 200)
    assert run.what_if.exposed_us == pytest.approx(10)
    # on wan the link outlasts the slowed compute: compute keeps its length, the wait grows
    wan = analyze([folder], what_if="wan").runs[0].what_if
    assert wan.step_time_us == pytest.approx(400 + _model_us("wan", SLOW_BYTES) + 10 + 400 + 190)


def _exchange_step(k: int) -> list[dict]:
    """Step ``k`` of 2000 us of an emulated run as the emulator writes it since issue 15: the call
    site 300-310 issues the data op, which gloo's worker (thread GLOO) runs 320-1800 (the real
    data movement, 642 kB on 2 busy cores), after the arrival exchange (an all-reduce of issue
    times on the emulator's side group, thread GLOO + 2) ran 305-320; the modeled link 300-1300.
    The emulator completes at the later of the two, 1800; the thread resumes at 1810."""
    t = k * STEP_US
    label = emu_label("all_reduce", num_bytes=NUM_BYTES, tier="LAN", ranks="0-1", modeled_s=MODELED_US / 1e6)
    return [step(k, t, STEP_US), cpu_op("aten::mm", t, 300), cpu_op("c10d::allreduce_", t + 300, 10),
            annotation("gloo:all_reduce", t + 305, 15, tid=GLOO + 2),
            annotation("gloo:all_reduce", t + 320, 1480, tid=GLOO),
            annotation(label, t + 300, MODELED_US, tid=GLOO + 1),
            cpu_op("aten::add", t + 1810, 190)]


@pytest.mark.parametrize("topology", ["lan", "wan"])
def test_real_data_movement_found_beside_the_arrival_exchange(tmp_path: Path, topology: str) -> None:
    run = analyze([_run(tmp_path, lambda: [e for k in range(2) for e in _exchange_step(k)])],
                  what_if=topology).runs[0]
    assert run.summary.per_step["exposed_us"] == pytest.approx(10 + 1500)
    d = _model_us(topology)
    # by hand: both ranks arrive at 300; completion max(300 + d, 1800, the real data movement
    # kept), the resume 10 us later; the wait 310-resume is exposed, as is the call
    done = max(300 + d, 1800.0)
    assert run.what_if.exposed_us == pytest.approx(10 + done + 10 - 310)
    assert run.what_if.step_time_us == pytest.approx(STEP_US + (done + 10 - 310) - 1500)
    if topology == "lan":  # the lan link (614 us) ends under the real data movement: as measured
        assert d < 1500 and run.what_if.exposed_us == pytest.approx(1510)
