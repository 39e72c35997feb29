"""PeriodicSyncOptimizer on real gloo ranks against an independent reference and torch's peers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import _planner_jobs as pj
import sync_scenarios as sc
from _ranks import RANKS_TIMEOUT_S, SPAWN_TIMEOUT_S, share_ranks, share_spawn
from sync_reference import Workload, simulate

pytestmark = [pytest.mark.slow, pytest.mark.timeout(RANKS_TIMEOUT_S)]  # sync_ranks: all of it

TOL = 1e-6

CORE = [
    Workload(strategy=s, optimizer=o, warmup_steps=w, period=3, steps=3 * 3 + w)
    for s in ("ddp", "localsgd", "slowmo", "cpdp")
    for o in ("sgd", "adamw")
    for w in (0, 2)
]
POLICIES = [
    Workload(strategy="cpdp", batchnorm=True, buffers="average", steps=8),  # ends on an average (of step 9)
    Workload(strategy="slowmo", batchnorm=True, buffers="broadcast", steps=9),
    Workload(strategy="localsgd", batchnorm=True, buffers="local", steps=9),
    Workload(strategy="localsgd", optimizer="adamw", optimizer_state="average", steps=9),
    Workload(strategy="cpdp", optimizer="sgd", optimizer_state="average", steps=9),
    Workload(strategy="slowmo", optimizer="adamw", optimizer_state="reset", steps=9),
    Workload(strategy="cpdp", beta=0.8, alpha=0.7, period=2, steps=8),
    Workload(strategy="cpdp", period=1, warmup_steps=2, steps=6),  # K = 1: every step synchronous
    Workload(strategy="cpdp", cpdp_order="step-then-average", steps=9),
]


def _max_err(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b)
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _check_against_reference(workloads: list[Workload], results: list, world: int) -> None:
    for i, w in enumerate(workloads):
        ref = simulate(w, world)
        for rank in range(world):
            err = _max_err(results[rank][i]["params"], ref[rank])
            assert err <= TOL, f"{w} rank {rank}: max |param - reference| = {err:.3g}"


def _check_identical_after_reconciliation(workloads: list[Workload], results: list) -> None:
    for i, w in enumerate(workloads):
        snaps0 = results[0][i]["snapshots"]
        if w.strategy != "ddp":
            expected = (w.steps - w.warmup_steps) // w.period
            if w.strategy == "cpdp" and w.cpdp_order == "average-then-step" and w.period > 1:
                expected = (w.steps - w.warmup_steps + 1) // w.period  # at the end of each step before n
            assert len(snaps0) == expected, (w, len(snaps0))
        for other in results[1:]:
            for (n, mine), (n2, theirs) in zip(snaps0, other[i]["snapshots"]):
                assert n == n2
                assert all(torch.equal(a, b) for a, b in zip(mine, theirs)), (w, n)


# Every 2-rank scenario of this module runs on the session's one pair of spawned ranks (tests/conftest.py
# sync_ranks: one process group, the calls one after the other, each building its own models and seeding its
# own data); the tests read their part. Spawning (importing torch on every rank) dominated their time when
# each test spawned its own ranks.
TWO_RANK_CALLS = {
    "workloads": (sc.run_workloads, {"workloads": [dataclasses.asdict(w) for w in CORE + POLICIES]}),
    **{f"peers-{o}": (sc.against_torch_peers, {"optimizer": o, "period": 3}) for o in ("sgd", "adamw")},
    **{f"wrapped-{s}": (sc.ddp_wrapped_vs_plain, {"strategy": s, "period": 3}) for s in ("cpdp", "localsgd")},
    # stop in the middle of a period (after step 5 of periods ending at 4, 7, 10)
    **{f"resume-{s}": (sc.checkpoint_resume, {"strategy": s, "stop_at": 5, "total": 11}) for s in ("cpdp", "slowmo")},
    "scheduler": (sc.with_scheduler, {"strategy": "cpdp"}),
    "buckets": (sc.stats_and_buckets, {}),
    "labels": (sc.profiled_labels, {}),
}


share_ranks(__name__, TWO_RANK_CALLS, timeout_s=180.0)
# it registers the emu backend and leaves an emu group: after the other modules' calls
share_ranks(f"{__name__}:late", {"emulated": (sc.emulated_vs_plain, {})}, timeout_s=40.0, order=1)


@pytest.fixture(scope="module")
def two_ranks(sync_ranks):
    return {**sync_ranks[__name__], **sync_ranks[f"{__name__}:late"]}


@pytest.fixture(scope="module")
def two_rank_results(two_ranks):
    return two_ranks["workloads"]


def test_every_strategy_matches_reference_2_ranks(two_rank_results):
    _check_against_reference(CORE, two_rank_results, 2)


def test_buffer_and_state_policies_match_reference(two_rank_results):
    n = len(CORE)
    _check_against_reference(POLICIES, [r[n:] for r in two_rank_results], 2)
    for i, w in enumerate(POLICIES):
        if w.batchnorm:
            ref_model_buffers = two_rank_results[0][n + i]["buffers"]
            other = two_rank_results[1][n + i]["buffers"]
            same = all(torch.equal(a, b) for a, b in zip(ref_model_buffers, other))
            assert same == (w.buffers != "local"), w


def test_ranks_identical_right_after_every_reconciliation(two_rank_results):
    _check_identical_after_reconciliation(CORE + POLICIES, two_rank_results)


def test_stats_count_steps_and_reconciliations(two_rank_results):
    for i, w in enumerate(CORE):
        stats = two_rank_results[0][i]["stats"]
        assert stats["steps"] == w.steps
        if w.strategy == "ddp":
            assert stats["gradient_syncs"] == w.steps and stats["reconciliations"] == 0
        else:
            assert stats["reconciliations"] == (w.steps - w.warmup_steps) // w.period
            assert stats["local_steps"] == w.steps - w.warmup_steps - stats["reconciliations"]
        assert stats["bytes_sent"] > 0 and stats["blocked_s"] > 0


FOUR_RANK_FLAT = [Workload(strategy=s, optimizer="sgd", warmup_steps=1, steps=10) for s in
                  ("localsgd", "slowmo", "cpdp")]


def _four_rank_phase(rank: int, world_size: int, out: str, specs: list[dict]) -> None:
    """Flat, then hierarchical (2 nodes x 2 ranks; gradients averaged in the node every step), on one
    gloo process group of 4 ranks."""
    pj.init_rank(rank, world_size, out, emulated=False)
    flat = sc.run_workloads(rank, world_size, specs)
    hier = sc.run_workloads(rank, world_size, specs, hierarchical=True)
    pj.finish_rank(rank, out, {"flat": flat, "hier": hier})


# the 4-rank job runs in the session's one spawned group of 4 processes (tests/conftest.py planner_spawn)
share_spawn(__name__, lambda: [("four", _four_rank_phase, 4, ([dataclasses.asdict(w) for w in FOUR_RANK_FLAT],))],
               timeout_s=100.0)


@pytest.mark.timeout(SPAWN_TIMEOUT_S)  # the first test to ask for planner_spawn waits for all of it
def test_four_ranks_and_hierarchical_groups(planner_spawn):
    flat = FOUR_RANK_FLAT
    by_rank = planner_spawn[__name__]["four"]
    results, hier = [r["flat"] for r in by_rank], [r["hier"] for r in by_rank]
    _check_against_reference(flat, results, 4)
    _check_identical_after_reconciliation(flat, results)
    for i, w in enumerate(flat):
        assert all(torch.equal(a, b) for a, b in zip(hier[0][i]["params"], hier[1][i]["params"]))
        assert all(torch.equal(a, b) for a, b in zip(hier[2][i]["params"], hier[3][i]["params"]))
        ref = _simulate_hierarchical(w)
        for rank in range(4):
            assert _max_err(hier[rank][i]["params"], ref[rank // 2]) <= TOL, (w, rank)


def _simulate_hierarchical(w: Workload) -> list[list[torch.Tensor]]:
    """Two nodes of two ranks = two workers whose gradient is the mean of their ranks'."""
    import sync_reference as ref

    original = ref.batch

    def node_batch(node: int, step: int, size: int = 16):
        xs, ys = zip(*(original(2 * node + i, step, size) for i in range(2)))
        return torch.cat(xs), torch.cat(ys)

    ref.batch = node_batch  # MSE over the concatenation = mean of the two ranks' MSE
    try:
        return simulate(w, 2)
    finally:
        ref.batch = original


def test_matches_torch_ddp_and_post_local_sgd(two_ranks):
    for optimizer in ("sgd", "adamw"):
        results = two_ranks[f"peers-{optimizer}"]
        for rank, res in enumerate(results):
            ours, peer = res["ddp"]
            assert _max_err(ours, peer) <= TOL, f"ddp vs torch DDP ({optimizer}, rank {rank})"
            ours, peer = res["localsgd"]
            err = _max_err(ours, peer)
            assert err <= TOL, f"localsgd vs PostLocalSGD ({optimizer}, rank {rank}): {err}"


def test_ddp_wrapped_module_equals_plain_module(two_ranks):
    for strategy in ("cpdp", "localsgd"):
        results = two_ranks[f"wrapped-{strategy}"]
        for res in results:
            assert _max_err(res["plain"], res["ddp"]) <= TOL, strategy
            assert res["stats_ddp"]["reconciliations"] == res["stats_plain"]["reconciliations"]


def test_checkpoint_resume_is_bit_identical(two_ranks):
    for strategy in ("cpdp", "slowmo"):
        # stopped in the middle of a period (after step 5 of periods ending at 4, 7, 10)
        results = two_ranks[f"resume-{strategy}"]
        for res in results:
            assert res["saved_keys"] == ["cpdpkit", "param_groups", "state"]
            assert res["saved_step"] == 5 and res["step"] == 11
            assert res["lr"] == 0.01 * 0.5 ** 2  # StepLR(4, 0.5) on the wrapper, 11 steps
            assert all(torch.equal(a, b) for a, b in zip(res["straight"], res["resumed"]))


def test_param_groups_and_lr_scheduler(two_ranks):
    results = two_ranks["scheduler"]
    # the optimizer takes SyncConfig's default β: the measured one for 2 replicas, 0 (cpdpkit.sync.slowmo_beta_for)
    w = Workload(strategy="cpdp", optimizer="sgd2groups", period=2, steps=8, beta=0.0)
    ref = simulate(w, 2, schedulers=lambda o: torch.optim.lr_scheduler.StepLR(o, 3, 0.5))
    for rank in range(2):
        for attach in ("inner", "wrapper"):
            assert _max_err(results[rank][attach], ref[rank]) <= TOL, attach
        assert all(torch.equal(a, b) for a, b in zip(results[rank]["inner"],
                                                     results[rank]["wrapper"]))


def test_collectives_are_coalesced_into_buckets(two_ranks):
    res = two_ranks["buckets"][0]
    by_step = {n: (c, b) for n, c, b in res["counts"]}
    param_bytes = res["param_bytes"]
    # local steps communicate nothing
    for n in (1, 2, 5, 6):
        assert by_step[n] == (0, 0), (n, by_step[n])
    # a reconciliation (average-then-step): the parameters at the end of step 3, the gradients of
    # step 4, each in ~1 MB buckets (8 x 257 KB layers)
    for n in (3, 4):
        collectives, nbytes = by_step[n]
        assert nbytes == param_bytes, (n, nbytes)
        assert 1 <= collectives <= param_bytes // (1024 * 1024) + 2, (n, collectives)


def test_phases_are_labelled_and_gradient_buckets_launch_during_backward(two_ranks):
    res = two_ranks["labels"][0]
    assert {"cpdpkit::sync::grad_allreduce", "cpdpkit::sync::grad_wait",
            "cpdpkit::sync::param_average", "cpdpkit::sync::slowmo_update"} <= set(res["names"])
    # 4 layers of ~257 KB in 0.3 MB buckets: 4 launches on each of the 2 reconciliations
    assert len(res["launches"]) == 8
    inside = [any(bs <= s and e <= be for bs, be in res["backward"]) for s, e in res["launches"]]
    assert all(inside), "every bucket all-reduce must be launched from backward hooks"


def test_identical_with_and_without_network_emulation(two_ranks):
    for res in two_ranks["emulated"]:
        for ours, plain in zip(res["emu"], res["gloo"]):
            assert all(torch.equal(a, b) for a, b in zip(ours, plain))
        # the emulated runs really went through the emu backend (broadcast, all-gather, all-reduce)
        assert res["emulated_ops"].get("all_reduce", 0) >= 5 and res["emulated_ops"].get("broadcast", 0) >= 1
