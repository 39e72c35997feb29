"""PeriodicSyncOptimizer over FSDP2 sharded inside a site (4 gloo ranks: 2 sites x 2 ranks).

References: FSDP2's own HSDP (cpdp at K=1 with SlowMo off must equal it bit for bit), and the
optimizer's plain-module path with a fast (site) and a slow (replicate) group, which computes the
same algorithm on full replicas (equal up to the order of float additions in the reductions).
"""

from __future__ import annotations

import pytest
import torch

import _sharded_sync_jobs as jobs
from _ranks import SPAWN_TIMEOUT_S, share_fn
from cpdpkit.sync._codec import Codec

pytestmark = pytest.mark.timeout(SPAWN_TIMEOUT_S)  # the first test to ask for planner_spawn waits for all of it

_FIX = ("shard the model over the site only: fully_shard(module, mesh=mesh['shard']) on a mesh "
        "init_device_mesh(device, (num_sites, ranks_per_site), mesh_dim_names=('replicate', 'shard')), "
        "and pass group=mesh['replicate'].get_group()")


# the 4-rank job runs in the session's one spawned group of 4 processes (tests/conftest.py planner_spawn)
share_fn(__name__, "numerics", jobs.job_numerics, 4, timeout_s=200.0, root_kwarg="tmp")


@pytest.fixture(scope="module")
def ranks(planner_spawn) -> list[dict]:
    return planner_spawn[__name__]["numerics"]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_k1_with_slowmo_off_equals_fsdp2_hsdp_bit_for_bit(ranks: list[dict]) -> None:
    for r in ranks:
        assert r["k1_loss"] == r["hsdp_loss"]
        assert _same(r["k1"], r["hsdp"])


@pytest.mark.parametrize("overlap", [0, 1])
def test_cpdp_over_shards_equals_the_plain_path_over_site_and_replicate_groups(ranks: list[dict], overlap: int) -> None:
    for r in ranks:
        for ours, ref in zip(r[f"k4_{overlap}"], r[f"plain_{overlap}"]):
            torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)
        assert r[f"k4_loss_{overlap}"] == pytest.approx(r[f"plain_loss_{overlap}"], abs=1e-6)
    # the two sites trained on different data: the test would pass vacuously if nothing moved
    assert not _same(ranks[0]["k4_0"], jobs.full(jobs.make_model()))


def test_clip_grad_norm_over_shards_equals_the_plain_path(ranks: list[dict]) -> None:
    for r in ranks:  # the norm of the DTensor shards (over the shard group) is the plain model's, and clipping acts
        assert max(abs(a - b) for a, b in zip(r["clip_sharded_norms"], r["clip_plain_norms"], strict=True)) < 1e-5
        assert sum(n > jobs.CLIP_NORM for n in r["clip_plain_norms"]) >= jobs.STEPS // 2
        assert max((a - b).abs().max().item() for a, b in zip(r["clip_sharded"], r["clip_plain"], strict=True)) < 1e-6


def test_only_shards_cross_the_replicate_group_and_slowmo_state_is_shard_sized(ranks: list[dict]) -> None:
    total = sum(p.numel() for p in jobs.make_model().parameters())
    for r in ranks:
        assert r["local_numel"] == total // 2
        assert r["slowmo"] == [(r["local_numel"], torch.float32)] * 2  # anchor, slow momentum
        assert r["outer"] == [(r["local_numel"], torch.float32)]  # DiLoCo's momentum buffer
        stats = r["stats"]  # 6 steps, warm-up 1, K=4: step 1 syncs gradients, step 5 reconciles
        assert (stats.gradient_syncs, stats.reconciliations, stats.local_steps) == (2, 1, 4)
        assert stats.bytes_sent == 3 * r["local_numel"] * 4  # two gradient shards, one parameter shard
        # int8 over the shards: shard-sized residuals; the reconciliations send int8 codes of the shard
        assert r["residuals"] == [(r["local_numel"], torch.float32, True)]
        comp = r["compressed_stats"]
        code = Codec("int8", r["local_numel"]).nbytes
        assert comp.reconciliations >= 2
        # the synchronous steps' gradient shards cross as int8 codes too (one residual per FSDP2 unit, shard-sized)
        units = r["grad_residuals"]
        assert len(units) >= 2 and all(pending for _, pending in units)
        assert sum(n for n, _ in units) >= r["local_numel"]  # FSDP2 may pad a unit's shard
        grad_codes = sum(Codec("int8", n).nbytes for n, _ in units)
        assert comp.bytes_sent == comp.gradient_syncs * grad_codes + comp.reconciliations * code


def test_checkpoint_mid_period_with_an_average_in_flight_resumes_bit_identically(ranks: list[dict]) -> None:
    for r in ranks:
        assert r["restored_step"] == 3
        assert r["resumed_loss"] == r["straight_loss"]
        assert _same(r["resumed"], r["straight"])
        assert r["exp_avg_is_dtensor"]


def test_models_not_sharded_the_way_the_groups_say_are_refused_before_any_collective(ranks: list[dict]) -> None:
    for rank, r in enumerate(ranks):
        replicate = [rank % 2, rank % 2 + 2]
        shard_cross = [rank % 2, rank % 2 + 2]
        assert r["errors"] == [
            "ConfigError: model is sharded with placements (Replicate(), Shard(dim=0)) over mesh dims ('replicate', "
            "'shard'): FSDP2's HSDP all-reduces gradients across its replicate dim on every step, which the periodic "
            f"sync replaces; {_FIX}",
            f"ConfigError: model is sharded over ranks [0, 1, 2, 3], which share ranks {replicate} with group "
            f"{replicate}: the shard group and the replicate group must meet only at this rank ({rank}); {_FIX}",
            "ConfigError: period='auto' with an FSDP2-sharded model: each shard's replicate group would choose its "
            "own K; pass a fixed period",
            f"ConfigError: model is sharded over ranks {shard_cross}, which span sites [0, 1] of topology "
            f"'multisite': FSDP2 would cross the WAN on every step; {_FIX}",
            "ConfigError: group [0, 1, 2, 3] (the replicate group) holds ranks 0 and 1 of site 0 of topology "
            f"'multisite': it must hold one rank per site; {_FIX}",
        ]


def test_cpdp_over_a_two_stage_executor_per_site_equals_the_plain_path(ranks: list[dict]) -> None:
    for r in ranks:
        assert r["ex_plan"] == ((2, 1), "replicate")  # optimizer state sharded over the site's two ranks
        for ours, ref in zip(r["ex"], r["ex_ref"]):
            torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)
        assert r["ex_loss"] == pytest.approx(r["ex_ref_loss"], abs=1e-6)
        stats, stage1_launched, stage1_scheduled = r["ex_stats"]
        assert (stats.gradient_syncs, stats.reconciliations) == (2, 1)
        assert stats.bytes_sent == 3 * r["ex_slice_numel"] * 4  # only this rank's slices cross sites
        # on a step that syncs gradients, the slice gradients cross sites in DDP-style buckets launched under
        # backward (one bucket of all slices by default; one per slice with a tiny cap), none left for
        # step(); a local step sends nothing across sites; the buckets change no number
        for key, per_step in (("ex_launched_in_backward", 1),
                              ("ex_launched_in_backward_per_slice", r["ex_num_slices"])):
            launched = r[key]
            assert [synced for _, synced in launched].count(1) == 2, launched
            assert launched == [(per_step * synced, synced) for _, synced in launched], key
            assert _same(r[key + "_params"], r["ex"]), key
        # local steps keep the two-stage exchange under backward; the reconciliation step defers it
        assert stage1_scheduled > 0 and 0 < stage1_launched < stage1_scheduled
        assert r["ex_errors"] == [
            "PlannerError: max_grad_norm with a mesh of 2 of the world's 4 ranks: the norm is all-reduced over the "
            "world; clip with a mesh of the whole world",
            "ConfigError: optimizer is not the TwoStageExecutor's own: pass PeriodicSyncOptimizer(executor.optimizer, "
            "model=executor, group=<the replicate group>, ...)",
            "TypeError: outer = object is not a cpdpkit.contracts.OuterSync: attach a PeriodicSyncOptimizer "
            "(PeriodicSyncOptimizer(executor.optimizer, model=executor, ...))",
        ]
        assert r["ex_contract"] == (True, True)  # the real pair satisfies the written contract, both ways
        assert r["ex_restored"] == 3  # with DiLoCo's outer step: its momentum is slice-sized and resumes
        assert r["ex_resumed_loss"] == r["ex_straight_loss"]
        assert _same(r["ex_resumed"], r["ex_straight"])
        assert r["ex_outer"] == [(r["ex_slice_numel"], torch.float32)]


def test_cpdp_over_a_partial_shard_executor_per_site_equals_the_plain_path(ranks: list[dict]) -> None:
    for r in ranks:
        assert r["partial_mesh"] == (2, 1)  # the site's 2 nodes: gradients and slices split across them
        for ours, ref in zip(r["partial"], r["ex_ref"]):
            torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)
        assert r["partial_loss"] == pytest.approx(r["ex_ref_loss"], abs=1e-6)
        stats = r["partial_stats"]
        assert (stats.gradient_syncs, stats.reconciliations) == (2, 1)
        assert stats.bytes_sent == 3 * r["partial_slice_numel"] * 4  # only this rank's slices cross sites
