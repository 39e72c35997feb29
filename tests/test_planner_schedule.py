"""The two-stage exchange schedule: hand-checked timelines, invariants, JSON, the plan and the CLI."""

from __future__ import annotations

import json
import random

import pytest
from typer.testing import CliRunner

from cpdpkit.cli import app
from cpdpkit.planner import (
    PlannerConfig,
    PlannerError,
    ShardingPlan,
    TwoStageSchedule,
    UnitTiming,
    estimate_unit_timings,
    plan_sharding,
    plan_two_stage,
    schedule_two_stage,
)
from cpdpkit.topology import preset

EPS = 1e-9


def _timings(*spec: tuple[str, float, float]) -> list[UnitTiming]:
    return [UnitTiming(name=n, forward_s=f, backward_s=b) for n, f, b in spec]


def _three(ag_c: float) -> TwoStageSchedule:
    """A, B, C: forward 1 s, backward 2 s, reduce-scatters 1 s; all-gathers A 1 s, B 0.5 s, C ``ag_c``.

    Backward C [0,2] B [2,4] A [4,6]; reduce-scatters C [2,3] B [4,5] A [6,7] (releases 3, 5, 7);
    deadlines A 6, B 7, C 8.
    """
    return schedule_two_stage(_timings(("A", 1, 2), ("B", 1, 2), ("C", 1, 2)), reduce_scatter_s=[1, 1, 1],
                              all_gather_s=[1, 0.5, ag_c], num_bytes=[10, 20, 30], tier="IB")


def _by_unit(sched: TwoStageSchedule) -> dict:
    return {s.unit: s for s in sched.slots}


def _check_invariants(sched: TwoStageSchedule) -> None:
    for s in sched.slots:
        assert s.start_s >= s.release_s - EPS
        assert s.end_s == pytest.approx(s.start_s + s.duration_s)
        assert s.stage == (1 if s.end_s <= sched.backward_s + EPS else 2)
    link = sorted(sched.link_intervals, key=lambda x: (x.start_s, x.end_s))
    for a, b in zip(link, link[1:]):
        assert b.start_s >= a.end_s - EPS, (a, b)
    assert sorted(s.order for s in sched.slots) == list(range(len(sched.slots)))
    assert sched.exposed_s <= sched.naive_exposed_s + EPS
    assert sched.exposed_s >= sched.lower_bound_exposed_s - EPS
    assert sched.exposed_s == pytest.approx(sum(s.wait_s for s in sched.slots), abs=EPS)


# ---- hand-checked timelines ------------------------------------------------------------------------
@pytest.mark.timeout(10)
def test_three_units_by_hand():
    sched = _three(ag_c=1.0)
    s = _by_unit(sched)
    # t=3: C fits the gap [3,4] before B's reduce-scatter; t=5: B fits [5,6]; A after its own at 7
    assert [(s[u].start_s, s[u].end_s, s[u].stage, s[u].order) for u in "ABC"] == [
        (7, 8, 2, 2), (5, 5.5, 1, 1), (3, 4, 1, 0)]
    assert [(s[u].release_s, s[u].deadline_s) for u in "ABC"] == [(7, 6), (5, 7), (3, 8)]
    assert (sched.num_stage1, sched.num_stage2) == (2, 1)
    assert [m.unit for m in sched.deadline_misses] == ["A"] and s["A"].late_s == 2
    assert (s["A"].wait_s, sched.exposed_s, sched.makespan_s) == (2, 2, 11)  # forward A waits 6 -> 8
    assert sched.naive_exposed_s == 3.5 and sched.naive_makespan_s == 12.5  # A [7,8] B [8,8.5] C [8.5,9.5]
    assert sched.lower_bound_exposed_s == 2  # A: release 7 + 1 - deadline 6
    _check_invariants(sched)


@pytest.mark.timeout(10)
def test_reduce_scatters_have_priority_over_a_ready_exchange():
    sched = _three(ag_c=1.5)  # C is ready at 3 but 1.5 s does not fit before B's reduce-scatter at 4
    s = _by_unit(sched)
    rs = {i.unit: (i.start_s, i.end_s) for i in sched.link_intervals if i.kind == "reduce_scatter"}
    assert rs == {"C": (2, 3), "B": (4, 5), "A": (6, 7)}  # never delayed by an exchange
    assert [(s[u].start_s, s[u].stage) for u in "ABC"] == [(7, 2), (5, 1), (8, 2)]  # EDF at 7: A before C
    assert [m.unit for m in sched.deadline_misses] == ["A", "C"]  # C ends 9.5 > 8 ...
    assert s["C"].wait_s == 0 and sched.exposed_s == 2  # ... but A's wait already pushed C's forward to 10
    _check_invariants(sched)


@pytest.mark.timeout(10)
def test_backfill_runs_a_later_deadline_that_fits_the_gap():
    # backward C [0,2] B [2,3.2] A [3.2,5.2]; reduce-scatters C [2,3] B [3.2,4.2] A [5.2,6.2]
    sched = schedule_two_stage(_timings(("A", 1, 2), ("B", 1, 1.2), ("C", 1, 2)), reduce_scatter_s=[1, 1, 1],
                               all_gather_s=[1, 1.5, 0.8], num_bytes=[1, 1, 1])
    s = _by_unit(sched)
    # gap [4.2,5.2]: B (deadline 6.2) does not fit, C (deadline 7.2) does and runs; then A, B after 6.2
    assert [(s[u].start_s, s[u].stage) for u in "ABC"] == [
        pytest.approx((6.2, 2)), pytest.approx((7.2, 2)), pytest.approx((4.2, 1))]
    assert sched.exposed_s == pytest.approx(2.5)  # A waits 2.0, B 0.5
    assert sched.naive_exposed_s == pytest.approx(4.3) and sched.lower_bound_exposed_s == pytest.approx(2.0)
    _check_invariants(sched)


@pytest.mark.timeout(10)
def test_at_points_an_exchange_waits_for_the_next_gradient_ready_point():
    # _three's timeline; the executor acts only in hooks at 2 (C), 4 (B), 6 (A, the end of backward): C's release 3
    # moves to B's point 4, B's 5 to A's point 6, A's 7 is after backward and stays. C runs after B's reduce-scatter
    # [4,5] in [5,6] (stage 1, launched at B's hook); B and A only after A's reduce-scatter [6,7], in deadline order.
    from cpdpkit.shard._slice_schedule import stage1_triggers

    args = dict(reduce_scatter_s=[1, 1, 1], all_gather_s=[1, 0.5, 1], num_bytes=[10, 20, 30])
    sched = schedule_two_stage(_timings(("A", 1, 2), ("B", 1, 2), ("C", 1, 2)), at_points=True, **args)
    s = _by_unit(sched)
    assert [(s[u].release_s, s[u].start_s, s[u].stage) for u in "ABC"] == [(7, 7, 2), (6, 8, 2), (4, 5, 1)]
    assert sched.num_stage1 == 1 and _three(ag_c=1.0).num_stage1 == 2  # without the points, B too
    units = [type("U", (), {"name": n, "plan_index": i, "stage": s[n].stage, "order": s[n].order})()
             for i, n in enumerate("ABC")]
    assert {k: [u.name for u in v] for k, v in stage1_triggers(units, sched).items()} == {"B": ["C"]}
    _check_invariants(sched)
    with pytest.raises(ValueError, match="at_points = 1 must be True or False"):
        schedule_two_stage(_timings(("A", 1, 1)), reduce_scatter_s=[1], all_gather_s=[1], num_bytes=[1], at_points=1)


@pytest.mark.timeout(10)
def test_update_time_delays_the_release():
    sched = schedule_two_stage(_timings(("A", 1, 2)), reduce_scatter_s=[1], all_gather_s=[1], num_bytes=[1],
                               update_s=0.25)
    (slot,) = sched.slots
    assert (slot.grad_ready_s, slot.release_s, slot.start_s, slot.deadline_s) == (2, 3.25, 3.25, 2)
    assert sched.exposed_s == sched.naive_exposed_s == 2.25


@pytest.mark.timeout(10)
def test_clipped_step_waits_for_the_last_reduce_scatter_and_the_norm():
    # A, B, C as in _three; reduce-scatters end at 3 (C), 5 (B), 7 (A); the norm's all-reduce takes 0.5 s:
    # every release is 7 + 0.5 = 7.5, after backward (6): stage 1 is lost. EDF from 7.5: A [7.5,8.5] (deadline 6),
    # B [8.5,9] (7), C [9,10] (8). Forward from 6: A waits to 8.5 and runs to 9.5; B (9) and C (10) are ready in time.
    sched = schedule_two_stage(_timings(("A", 1, 2), ("B", 1, 2), ("C", 1, 2)), reduce_scatter_s=[1, 1, 1],
                               all_gather_s=[1, 0.5, 1], num_bytes=[10, 20, 30], tier="IB", clip=True, norm_s=0.5)
    s = _by_unit(sched)
    assert [(s[u].release_s, s[u].start_s, s[u].end_s, s[u].stage, s[u].order) for u in "ABC"] == [
        (7.5, 7.5, 8.5, 2, 0), (7.5, 8.5, 9, 2, 1), (7.5, 9, 10, 2, 2)]
    assert [s[u].wait_s for u in "ABC"] == [2.5, 0, 0]
    assert (sched.exposed_s, sched.makespan_s, sched.num_stage1) == (2.5, 11.5, 0)
    assert (sched.naive_exposed_s, sched.naive_makespan_s, sched.lower_bound_exposed_s) == (4, 13, 2.5)
    assert (sched.clip, sched.norm_s) == (True, 0.5)
    unclipped = _three(ag_c=1.0)  # the step where clipping does not scale: two exchanges in stage 1
    assert (unclipped.clip, unclipped.num_stage1, unclipped.exposed_s) == (False, 2, 2)
    _check_invariants(sched)
    with pytest.raises(ValueError, match="norm_s = -1 is invalid"):
        schedule_two_stage(_timings(("A", 1, 1)), reduce_scatter_s=[1], all_gather_s=[1], num_bytes=[1], clip=True,
                           norm_s=-1)


# ---- invariants on random timelines ----------------------------------------------------------------
@pytest.mark.timeout(10)
def test_random_timelines_keep_every_invariant():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 12)
        timings = [UnitTiming(name=f"u{i}", forward_s=rng.uniform(0, 2), backward_s=rng.uniform(0, 4))
                   for i in range(n)]
        sched = schedule_two_stage(timings, reduce_scatter_s=[rng.uniform(0, 2) for _ in range(n)],
                                   all_gather_s=[rng.uniform(0, 3) for _ in range(n)], num_bytes=[1] * n,
                                   update_s=rng.choice([0.0, 0.1]), clip=rng.random() < 0.3,
                                   norm_s=rng.choice([0.0, 0.05]), at_points=rng.random() < 0.5)
        _check_invariants(sched)


@pytest.mark.timeout(10)
def test_bad_inputs_name_the_value():
    with pytest.raises(ValueError, match="forward_s = -1"):
        UnitTiming(name="x", forward_s=-1, backward_s=0)
    with pytest.raises(ValueError, match="one timing"):
        schedule_two_stage(_timings(("A", 1, 1)), reduce_scatter_s=[], all_gather_s=[1], num_bytes=[1])


# ---- on a plan ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama7b() -> ShardingPlan:
    return plan_sharding("llama-7b", "cluster", world_size=16)


@pytest.mark.timeout(10)
def test_plan_carries_a_schedule_that_matches_its_comm_phase(llama7b):
    sched = llama7b.schedule
    assert sched is not None and sched.tier == "IB" and len(sched.slots) == len(llama7b.units)
    (phase,) = [c for c in llama7b.comm if c.name == "parameter all-gather"]
    assert sum(s.duration_s for s in sched.slots) == pytest.approx(phase.time_s)
    assert sum(s.num_bytes for s in sched.slots) == phase.collective_bytes
    assert sched.slots[0].unit == "<root>" and sched.slots[0].stage == 2  # needed first, ready last
    assert sched.num_stage1 > 0 and sched.exposed_s < sched.naive_exposed_s
    _check_invariants(sched)


@pytest.mark.timeout(10)
def test_plan_two_stage_inputs(llama7b):
    slow = [UnitTiming(name=t.name, forward_s=t.forward_s * 2, backward_s=t.backward_s * 2)
            for t in reversed(estimate_unit_timings(llama7b))]  # any order, matched by name
    assert plan_two_stage(llama7b, timings=slow).backward_s == pytest.approx(2 * llama7b.schedule.backward_s)
    with pytest.raises(ValueError, match="missing"):
        plan_two_stage(llama7b, timings=slow[1:])
    with pytest.raises(PlannerError, match="places 8 ranks"):
        plan_two_stage(llama7b, preset("cluster", world_size=8))


@pytest.mark.timeout(10)
def test_plan_two_stage_clip_prices_the_norm_over_the_world(llama7b):
    sched = plan_two_stage(llama7b, clip=True)
    norm_s = preset("cluster", world_size=16).group(range(16)).time_s("all_reduce", 8)
    last_rs = max(i.end_s for i in sched.link_intervals if i.kind == "reduce_scatter")
    assert sched.clip and sched.norm_s == norm_s > 0
    assert all(s.release_s == pytest.approx(last_rs + norm_s) and s.stage == 2 for s in sched.slots)
    assert sched.exposed_s >= llama7b.schedule.exposed_s
    _check_invariants(sched)


@pytest.mark.timeout(10)
def test_partial_plan_schedules_its_node_slices_across_nodes():
    plan = plan_sharding("llama-7b", "cluster", world_size=16, config=PlannerConfig(param_sharding="replicated"))
    sched = plan.schedule
    assert sched is not None and sched.tier == "IB" and len(sched.slots) == len(plan.units)
    (ag,) = [c for c in plan.comm if c.name == "parameter all-gather" and c.axis == "replicate"]
    (rs,) = [c for c in plan.comm if c.name == "gradient reduce-scatter" and c.axis == "replicate"]
    assert [s.num_bytes for s in sched.slots] == [-(-u.numel // 8) * 2 for u in plan.units]
    assert sum(s.duration_s for s in sched.slots) == pytest.approx(ag.time_s)
    reduce = [i for i in sched.link_intervals if i.kind == "reduce_scatter"]
    assert sum(i.end_s - i.start_s for i in reduce) == pytest.approx(rs.time_s)
    assert plan_two_stage(plan, update_s=0.001).update_s == 0.001  # the executor's call
    _check_invariants(sched)


@pytest.mark.timeout(10)
def test_no_schedule_without_replicate_axis_or_state_sharding():
    assert plan_sharding("llama-7b", "cluster", world_size=16,
                         config=PlannerConfig(allow_state_sharding=False)).schedule is None
    fsdp = plan_sharding("llama-7b", "cluster", world_size=16, config=PlannerConfig(shard_size=16))
    assert fsdp.mesh.replicate_size == 1 and fsdp.schedule is None and plan_two_stage(fsdp) is None


@pytest.mark.timeout(10)
def test_json_round_trip(llama7b):
    sched = llama7b.schedule
    assert TwoStageSchedule.from_dict(json.loads(json.dumps(sched.to_dict()))) == sched
    again = ShardingPlan.from_json(llama7b.to_json())
    assert again == llama7b and again.schedule == sched
    old = {k: v for k, v in sched.to_dict().items() if k not in ("clip", "norm_s")}  # before clip was modeled
    assert TwoStageSchedule.from_dict(old) == sched


# ---- CLI ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_cli_prints_the_schedule_and_writes_it(tmp_path):
    out = tmp_path / "plan.json"
    args = ["plan", "--model", "llama-7b", "--topology", "cluster", "--world-size", "16"]
    result = CliRunner().invoke(app, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    for text in ("two-stage exchange schedule on the IB link", "deadline", "stage", "<root>", "layers.31",
                 "... 25 more", "31 unit(s) in stage 1", "2 in stage 2", "exposed tail naive"):
        assert text in result.output, text
    data = json.loads(out.read_text())
    assert len(data["plan"]["schedule"]["slots"]) == 33
    quiet = CliRunner().invoke(app, [*args, "--no-schedule", "--tflops", "50"])
    assert quiet.exit_code == 0 and "two-stage exchange schedule" not in quiet.output
