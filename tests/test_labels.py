"""The trace-label contract (cpdpkit.labels): names, the profiler's reading of them, and that every
collective cpdpkit issues (PeriodicSyncOptimizer and TwoStageExecutor) runs inside a label."""

from __future__ import annotations

import pytest
import torch

import _label_jobs as jobs
import _planner_jobs as pj
from _executor_checks import check_collectives_labelled
from _ranks import SPAWN_TIMEOUT_S, share_spawn
from cpdpkit import labels
from cpdpkit.planner import PlannerConfig, plan_sharding
from cpdpkit.profiler.classify import classify_name


def test_phase_labels_are_unique_and_read_back() -> None:
    names = [p.label for p in labels.PHASES]
    assert len(names) == len(set(names)) == len(labels.PHASES)
    for phase in labels.PHASES:
        assert phase.label == f"cpdpkit::{phase.component}::{phase.name}"
        assert labels.phase_by_label(phase.label) is phase
        assert labels.phase_by_label(phase.label + "#3") is phase  # what some torch versions append
        assert phase.kind is None or phase.kind in labels.KINDS
    assert labels.phase_by_label("cpdpkit::sync::no_such_phase") is None
    assert labels.phase_by_label("aten::add") is None


def test_profiler_counts_only_communication_phases() -> None:
    for phase in labels.PHASES:
        cls = classify_name(phase.label)
        if phase.is_communication:
            assert (cls.cpu_role, cls.cpu_kind) == ("phase", phase.kind), phase
        else:
            assert (cls.cpu_role, cls.cpu_kind) == ("cpu", None), phase
    # the local SlowMo arithmetic and the executor's update are local work
    assert not labels.SYNC.SLOWMO_UPDATE.is_communication and not labels.SHARD.UPDATE.is_communication


def test_emu_label_round_trip() -> None:
    name = labels.emu_label("reduce_scatter", num_bytes=4096, tier="IB", ranks=labels.format_ranks([0, 1, 2, 3, 8, 9]),
                            modeled_s=12.25e-6)
    assert name == "cpdpkit::emu::reduce_scatter[bytes=4096,tier=IB,ranks=0-3,8-9,modeled_us=12.2]"
    parsed = labels.parse_emu_label(name)
    assert parsed == labels.EmuLabel("reduce_scatter", 4096, "IB", (0, 1, 2, 3, 8, 9), 12.2)
    assert classify_name(name).cpu_role == "emu"
    assert labels.parse_emu_label("cpdpkit::emu::all_reduce[bytes=1") is None
    assert labels.parse_emu_label("cpdpkit::sync::grad_wait") is None


def _plan():
    config = PlannerConfig(param_dtype="float32", grad_dtype="float32", optim_state_bytes_per_param=8,
                           min_unit_bytes=1000)
    with torch.device("meta"):
        return plan_sharding(pj.Net(), "wan", world_size=4, config=config)


# the 4-rank job runs in the session's one spawned group of 4 processes (tests/conftest.py planner_spawn)
share_spawn(__name__, lambda: [("labels", jobs._entry, 4, (_plan().to_dict(),))], timeout_s=80.0)


@pytest.mark.slow
@pytest.mark.timeout(SPAWN_TIMEOUT_S)  # the first test to ask for planner_spawn waits for all of it
def test_every_collective_cpdpkit_issues_is_labelled(planner_spawn) -> None:
    plan = _plan()
    assert plan.mesh.shape == (2, 2) and plan.state_sharding.axis == "replicate"
    results = planner_spawn[__name__]["labels"]
    assert len(results) == 4
    for rank, saved in enumerate(results):
        seen = check_collectives_labelled(saved["sync"], ())
        s = labels.SYNC
        assert {s.CONFIG_CHECK, s.BROADCAST_INIT, s.GRAD_ALLREDUCE, s.GRAD_WAIT, s.PARAM_AVERAGE,
                s.BUFFER_SYNC, s.STATE_SYNC, s.SLOWMO_UPDATE} <= seen, (rank, seen)
        seen = check_collectives_labelled(saved["executor"], ("FSDP::",))
        h = labels.SHARD
        assert {h.GRAD_REDUCE_SCATTER, h.GRAD_WAIT, h.GRAD_NORM, h.PARAM_ALL_GATHER, h.PARAM_WAIT,
                h.UPDATE} <= seen, (rank, seen)
