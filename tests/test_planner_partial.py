"""PartialShardExecutor (replicated parameters; gradients and optimizer state sharded over all ranks, one
world-group reduce-scatter and all-gather per unit) vs plain data parallelism (gradients all-reduced with
mean, the whole optimizer) on 4 gloo ranks (2 nodes x 2): SGD+momentum and AdamW, stage 1 during backward
bit-identical to updating in step(), exact clipping, gradient accumulation, a quarter of the optimizer state
per rank, every collective labelled, a checkpoint round trip; over the emulated backend no more wire bytes per
tier than a ring all-reduce of the model, stage-1 evidence and calibration; the one-line refusals."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

import _executor_checks as checks
import _executor_jobs as ej
import _partial_jobs as jobs
import _planner_jobs as pj
from _ranks import SPAWN_TIMEOUT_S, share_spawn
from cpdpkit.planner import PlannerConfig, PlannerError, plan_sharding
from cpdpkit.shard.partial import PartialShardExecutor

CONFIG = PlannerConfig(param_dtype="float32", grad_dtype="float32", optim_state_bytes_per_param=8,
                       min_unit_bytes=1000, param_sharding="replicated")
GLOO_CASES = [
    {"name": "sgd", "optimizer": "sgd", "exact": True},
    {"name": "adamw", "optimizer": "adamw", "exact": True},
    {"name": "adamw-clip", "optimizer": "adamw", "max_grad_norm": 0.05, "exact": True},
    {"name": "sgd-clip-alternate", "optimizer": "sgd", "max_grad_norm": "alternate", "loss_scales": checks.ALTERNATE,
     "exact": True, "profile": True},
    {"name": "adamw-accum", "optimizer": "adamw", "accum": 2, "exact": True, "errors": True},
]
RESUME_CASES = [{"name": "adamw-resume", "optimizer": "adamw", "k": 2},
                {"name": "sgd-clip-resume-stateful", "optimizer": "sgd", "max_grad_norm": 0.05, "k": 2,
                 "stateful": True}]
BUCKET_CASES = [{"name": "buckets", "optimizer": "adamw", "buckets": True}]


def _plan(topology, stage1=True):
    with torch.device("meta"):
        net = pj.Net()
    plan = plan_sharding(net, topology, world_size=4, config=CONFIG)
    assert plan.param_sharding == "replicated" and plan.strategy == "partial" and plan.mesh.shape == (2, 2)
    assert plan.state_sharding.axis == "world" and plan.schedule is not None
    return ej.with_stage1_schedule(plan) if stage1 else plan


EMU_CASES = [{"name": "bytes", "optimizer": "adamw", "bytes": True},
             {"name": "slow", "optimizer": "adamw", "max_grad_norm": 1e6, "slow": True, "calibrate": True}]


def _phases():
    """The module's two 4-rank jobs (gloo cases with the resume cases, emulated cases), each its own process
    group; they run in the session's one spawned group of 4 processes (tests/conftest.py ``planner_spawn``)."""
    return [("gloo", jobs._entry, 4, (_plan("wan").to_dict(), GLOO_CASES + RESUME_CASES + BUCKET_CASES, False)),
            ("emu", jobs._entry, 4, (ej.with_stage1_schedule(_plan(pj.FAST_WAN), 0.01).to_dict(), EMU_CASES, True))]


share_spawn(__name__, _phases, timeout_s=130.0)


@pytest.fixture(scope="module")
def all_results(planner_spawn):
    return _plan("wan"), _plan(pj.FAST_WAN), planner_spawn[__name__]


@pytest.fixture(scope="module")
def gloo_results(all_results):
    plan, _emu_plan, results = all_results
    return plan, results["gloo"]


def _check_case(rank, case, res, _stages):
    name, ref, ex = case["name"], res["ref"], res["ex"]
    for fqn, expect in ref["params"].items():
        torch.testing.assert_close(ex["params"][fqn], expect, rtol=1e-5, atol=1e-6, msg=f"{name} {fqn} rank {rank}")
    assert ex["losses"] == pytest.approx(ref["losses"], rel=1e-5), name
    assert ex["grads_freed"], name  # param.grad is freed once the unit's gradient is flattened
    for fqn, expect in res["exact"]["params"].items():  # stage 1 during backward == all in step(), bit for bit
        assert torch.equal(ex["params"][fqn], expect), (name, fqn, rank)
    # a quarter of the whole model's optimizer state (within one element per unit and state tensor)
    assert abs(4 * ex["state_bytes"] - ref["state_bytes"]) <= 4 * 3 * 2 * 4, (name, rank)
    return checks.check_stats_and_clipping(name, ex, ref["norms"], res["max_grad_norm"])


@pytest.mark.slow
@pytest.mark.timeout(SPAWN_TIMEOUT_S)  # the first test to ask for planner_spawn waits for all of it
def test_partial_matches_data_parallel_on_4_gloo_ranks(gloo_results):
    plan, results = gloo_results
    clipped = checks.check_gloo_cases(plan, results, GLOO_CASES, _check_case)
    for i, case in enumerate(GLOO_CASES):  # the four ranks' slices partition the state exactly
        states = [r["cases"][i]["ex"]["state_bytes"] for r in results]
        assert sum(states) == results[0]["cases"][i]["ref"]["state_bytes"], (case["name"], states)
    assert clipped["adamw-clip"] == [True] * ej.NUM_STEPS
    assert clipped["sgd-clip-alternate"] == [False, True, False]


@pytest.mark.slow
@pytest.mark.timeout(SPAWN_TIMEOUT_S)
def test_partial_misuse_labels_and_checkpoint_on_4_gloo_ranks(gloo_results):
    _plan, results = gloo_results
    checks.check_misuse_and_labels(results, GLOO_CASES, ())
    resumed = [{"cases": r["cases"][len(GLOO_CASES):len(GLOO_CASES) + len(RESUME_CASES)]} for r in results]
    checks.check_resumed(resumed, "PartialShardExecutor")


@pytest.mark.slow
@pytest.mark.timeout(SPAWN_TIMEOUT_S)
def test_partial_bytes_stage1_and_calibration_over_the_emulated_backend(all_results):
    _gloo_plan, plan, results = all_results
    results = results["emu"]
    assert results[0]["backend"] == "emu"
    topo = plan.topology
    model_bytes = 4 * sum(p.numel() for p in pj.Net().parameters())
    ddp = ej.NUM_STEPS * topo.group(range(4)).cost("all_reduce", model_bytes).wire_bytes
    node, nodes, world = topo.group([0, 1]), topo.group([0, 2]), topo.group(range(4))
    expect = {"LAN": 0, "WAN": 0}  # the network model's bytes of one world reduce-scatter and all-gather per unit
    two_level = {"LAN": 0, "WAN": 0}  # ... and of the paper's two levels: in the node, then across nodes
    for u in plan.units:
        c = math.ceil(u.numel / 2)
        d = math.ceil(c / 2)
        for op in ("reduce_scatter", "all_gather"):
            for tier, b in world.cost(op, 4 * d * 4).tier_bytes:  # the world group priced hierarchically
                expect[tier] += b
            two_level["LAN"] += node.wire_bytes(op, 2 * c * 4)
            two_level["WAN"] += nodes.wire_bytes(op, 2 * d * 4)
    # one call per direction, the same bytes on each link as the two levels (the in-node level carries the
    # world layout's padding, R·d - c <= 1 element a unit here)
    assert expect["WAN"] == two_level["WAN"] and 0 <= expect["LAN"] - two_level["LAN"] <= 2 * 4 * len(plan.units)
    for rank, rank_result in enumerate(results):
        metered, slow = rank_result["cases"]
        tiers = metered["bytes_by_tier"]
        assert tiers == {tier: ej.NUM_STEPS * b for tier, b in expect.items()}, (rank, tiers)
        # two collectives per unit and step (the two-level scheme issued four), nothing else without clipping
        per_unit = ej.NUM_STEPS * len(plan.units)
        assert metered["op_counts"] == {"reduce_scatter": per_unit, "all_gather": per_unit}, metered["op_counts"]
        assert all(b <= 1.01 * ddp for b in tiers.values()) and sum(tiers.values()) <= 1.01 * ddp, (tiers, ddp)
        before = slow["ex"]["stats_before"]
        assert before["stage1_launched"] == 2 and before["stage1_units"] > 0, before
        sched = slow["ex"]["schedule"]
        assert sched.num_stage1 >= 1 and slow["ex"]["stats_after"]["stage1_scheduled"] == sched.num_stage1
        for fqn, expect_param in slow["ref"]["params"].items():
            torch.testing.assert_close(slow["ex"]["params"][fqn], expect_param, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(30)
def test_partial_refuses_bad_input_before_any_collective():
    plan = _plan("wan")
    sgd = lambda g: torch.optim.SGD(g, lr=0.1)  # noqa: E731
    sharded = dataclasses.replace(plan, param_sharding="sharded")

    class Bigger(pj.Net):
        def __init__(self) -> None:
            super().__init__()
            self.extra = torch.nn.Linear(2, 2)

    bad = [
        ((pj.Net(), sharded, sgd), {}, "PartialShardExecutor runs partial plans"),
        ((pj.Net().to(torch.float16), plan, sgd), {}, "needs float32 model parameters"),
        ((Bigger(), plan, sgd), {}, "parameter 'extra.weight' of the model is not in the plan"),
        ((pj.Net(), plan, lambda g: torch.optim.LBFGS(g)), {}, "cannot run optimizer LBFGS"),
        ((pj.Net(), plan, sgd), {"max_grad_norm": 0}, "max_grad_norm = 0 is invalid"),
        ((pj.Net(), plan, sgd), {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.float16)},
         "mp_policy computes in param_dtype = torch.float16; PartialShardExecutor supports float32 or bfloat16"),
        ((pj.Net(), plan, sgd), {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                   reduce_dtype=torch.float16)},
         "mp_policy reduces gradients in torch.float16; PartialShardExecutor supports float32 or bfloat16"),
        ((pj.Net(), plan, sgd), {"mp_policy": "bf16"}, "mp_policy = str must be a"),
    ]
    for args, kwargs, match in bad:
        with pytest.raises(PlannerError) as info:
            PartialShardExecutor(*args, **kwargs)
        assert match in str(info.value) and "\n" not in str(info.value), (match, str(info.value))


@pytest.mark.slow
@pytest.mark.timeout(SPAWN_TIMEOUT_S)
def test_partial_buckets_broadcast_views_and_bf16_on_4_gloo_ranks(gloo_results):
    """The flat-bucket path: replicas that start different are made identical (rank 0's values) before
    training; parameters and gradients are views of the buckets; bf16 compute (fp32 or bf16 reductions)
    follows the fp32 reference within bf16's precision, and checkpointing it is refused in one line."""
    _plan, results = gloo_results
    first = results[0]["cases"][-1]
    for rank, rank_result in enumerate(results):
        res = rank_result["cases"][-1]
        assert res["name"] == "buckets"
        for fqn, expect in first["before"].items():
            assert torch.equal(res["start"][fqn], expect), (rank, fqn)
        if rank:
            assert any(not torch.equal(res["before"][f], v) for f, v in first["before"].items()), rank
        assert res["views"] == {"params": True, "grads": True}, rank
        ref = res["ref"]
        for reduce, run in res["mixed"].items():
            assert run["dtypes"] == ["torch.bfloat16"], (reduce, run["dtypes"])
            assert run["losses"] == pytest.approx(ref["losses"], rel=3e-2), (reduce, run["losses"], ref["losses"])
            for fqn, expect in ref["params"].items():
                torch.testing.assert_close(run["params"][fqn], expect, rtol=0, atol=3e-2, msg=f"{reduce} {fqn}")
            assert len(run["errors"]) == 1 and "mp_policy param_dtype = torch.bfloat16" in run["errors"][0]
            assert "\n" not in run["errors"][0]


@pytest.mark.timeout(30)
def test_bad_bucket_size_plan_kind_and_mp_dtype_are_exact_one_line_errors():
    from cpdpkit.shard.executor import TwoStageExecutor

    plan = _plan("wan", stage1=False)
    sgd = lambda g: torch.optim.SGD(g, lr=0.1)  # noqa: E731
    cases = [
        (lambda: PlannerConfig(min_unit_bytes=0),  # the unit (a partial bucket) size
         "min_unit_bytes = 0 is invalid; use a whole number of bytes > 0 or None"),
        (lambda: PartialShardExecutor(pj.Net(), dataclasses.replace(plan, param_sharding="sharded"), sgd),
         "plan 'partial' has param_sharding = 'sharded'; PartialShardExecutor runs partial plans: plan with "
         "PlannerConfig(param_sharding='replicated'), or run this plan with TwoStageExecutor / apply_plan"),
        (lambda: TwoStageExecutor(pj.Net(), plan, sgd),
         "plan 'partial' keeps parameters replicated (partial sharding); use PartialShardExecutor for it"),
        (lambda: PartialShardExecutor(pj.Net(), plan, sgd, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16)),
         "mp_policy computes in param_dtype = torch.float16; PartialShardExecutor supports float32 or bfloat16 "
         "parameters: set param_dtype=torch.bfloat16 (or torch.float32)"),
    ]
    for make, message in cases:
        with pytest.raises(PlannerError) as info:
            make()
        assert str(info.value) == message
