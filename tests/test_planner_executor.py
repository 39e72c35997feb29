"""TwoStageExecutor (optimizer state sharded across the replicate axis) vs FSDP2 HSDP: the same
parameters on 4 gloo ranks (2 replicas x 2 shards) with SGD+momentum and AdamW, with and
without global-norm clipping, half the optimizer state per rank, over gloo and the emulated
backend; resuming from a torch.distributed.checkpoint; plus the refusal of non-elementwise optimizers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import _executor_jobs as jobs
import _planner_jobs as pj
from cpdpkit.planner import PlannerConfig, PlannerError, plan_sharding
from cpdpkit.planner.executor import TwoStageExecutor

CONFIG = PlannerConfig(param_dtype="float32", grad_dtype="float32", optim_state_bytes_per_param=8,
                       min_unit_bytes=1000)
CASES = [{"name": "sgd", "optimizer": "sgd"}, {"name": "adamw", "optimizer": "adamw"},
         {"name": "sgd-clip", "optimizer": "sgd", "max_grad_norm": 0.05},
         {"name": "adamw-clip", "optimizer": "adamw", "max_grad_norm": 0.05}]


def _plan(topology):
    with torch.device("meta"):
        net = pj.Net()
    plan = plan_sharding(net, topology, world_size=4, config=CONFIG)
    assert plan.mesh.shape == (2, 2) and plan.state_sharding.axis == "replicate" and plan.schedule is not None
    return plan


def _check(results, cases):
    for rank, rank_result in enumerate(results):
        for case, res in zip(cases, rank_result["cases"]):
            name = res["name"]
            for fqn, expect in res["hsdp_params"].items():
                torch.testing.assert_close(res["ex_params"][fqn], expect, rtol=1e-5, atol=1e-5, msg=f"{name} {fqn}")
            assert res["ex_losses"] == pytest.approx(res["hsdp_losses"], rel=1e-5), name
            if case.get("max_grad_norm") is not None:  # clipping active on every step
                assert res["ex_norms"] == pytest.approx(res["hsdp_norms"], rel=1e-5), name
                assert min(res["hsdp_norms"]) > case["max_grad_norm"], name
            # each replica keeps half of its shard's state (within one element per unit and state tensor)
            slack = 3 * 2 * 4  # units x state tensors x float32 bytes
            assert abs(2 * res["ex_state_bytes"] - res["hsdp_state_bytes"]) <= slack, (name, rank)
            for pending in res["pending"]:  # every case, not only the last
                assert pending == {unit: stage == 2 for unit, (stage, _) in res["stages"].items()}, name
        # the two replicas of a shard hold disjoint halves: together exactly HSDP's state
        partner = rank ^ 2  # mesh (replicate, shard): ranks r and r+2 share a shard
        for res, other in zip(rank_result["cases"], results[partner]["cases"]):
            assert res["ex_state_bytes"] + other["ex_state_bytes"] == res["hsdp_state_bytes"], res["name"]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_executor_matches_hsdp_on_4_gloo_ranks(tmp_path):
    plan = _plan("wan")
    results = jobs.spawn(4, tmp_path, plan.to_dict(), CASES, emulated=False)
    assert results[0]["backend"] == "gloo"
    _check(results, CASES)
    stages = results[0]["cases"][0]["stages"]
    assert {name: (s.stage, s.order) for name, s in ((s.unit, s) for s in plan.schedule.slots)} == stages


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_executor_matches_hsdp_over_the_emulated_backend(tmp_path):
    plan = _plan(pj.FAST_WAN)
    # a schedule with both stages: the root exchanged during "backward" (stage 1), the blocks in reverse order
    slots = tuple(dataclasses.replace(s, stage=1 if s.unit == "<root>" else 2,
                                      order={"<root>": 0, "blocks.2-3": 1, "blocks.0-1": 2}[s.unit])
                  for s in plan.schedule.slots)
    plan = dataclasses.replace(plan, schedule=dataclasses.replace(plan.schedule, slots=slots))
    cases = [CASES[1], CASES[2]]
    results = jobs.spawn(4, tmp_path, plan.to_dict(), cases, emulated=True)
    assert results[0]["backend"] == "emu"
    assert results[0]["op_counts"].get("reduce_scatter", 0) > 0 and results[0]["op_counts"].get("all_gather", 0) > 0
    _check(results, cases)
    assert results[0]["cases"][0]["stages"] == {"<root>": (1, 0), "blocks.2-3": (2, 1), "blocks.0-1": (2, 2)}


@pytest.mark.slow
@pytest.mark.timeout(30)
@pytest.mark.parametrize("make", [lambda g: torch.optim.LBFGS(g), lambda g: torch.optim.Adafactor(g)])
def test_executor_refuses_non_elementwise_optimizers(make):
    plan = _plan("wan")
    name = type(make([torch.nn.Parameter(torch.zeros(1))])).__name__
    expect = (f"TwoStageExecutor cannot run optimizer {name}: each replica updates only a 1/R slice of its shard, "
              "so the update of one element must depend only on that element's gradient and state (an "
              f"elementwise optimizer); {name} is not one of the known elementwise optimizers (SGD, Adam, AdamW, "
              "Adamax, NAdam, RAdam, Adagrad, RMSprop, Adadelta, Rprop)")
    with pytest.raises(PlannerError) as info:
        TwoStageExecutor(pj.Net(), plan, make)
    assert str(info.value) == expect


@pytest.mark.slow
@pytest.mark.timeout(30)
def test_executor_refuses_plans_without_state_sharding():
    plan = _plan("wan")
    flat = dataclasses.replace(plan, state_sharding=dataclasses.replace(plan.state_sharding, axis=None))
    with pytest.raises(PlannerError, match="does not shard optimizer state across a replicate axis"):
        TwoStageExecutor(pj.Net(), flat, lambda g: torch.optim.SGD(g, lr=0.1))


@pytest.mark.slow
@pytest.mark.timeout(30)
def test_executor_state_dict_round_trips_through_dcp(tmp_path):
    """Train k steps, dcp.save model + executor state, load into a fresh model/executor (another
    init), continue to N: bit-identical parameters to an uninterrupted run (AdamW, with and without
    clipping; plain state dict and the executor as a DCP Stateful)."""
    cases = [{"name": "adamw", "optimizer": "adamw", "k": 2},
             {"name": "adamw-clip-stateful", "optimizer": "adamw", "max_grad_norm": 0.05, "k": 2, "stateful": True},
             {"name": "sgd-k1", "optimizer": "sgd", "k": 1}]
    results = jobs.spawn_resume(4, tmp_path, _plan("wan").to_dict(), cases)
    keys = set()
    for rank, rank_result in enumerate(results):
        for res in rank_result["cases"]:
            name = res["name"]
            assert res["fresh_differs"], name
            assert res["resumed_params"].keys() == res["full_params"].keys()
            for fqn, expect in res["full_params"].items():
                torch.testing.assert_close(res["resumed_params"][fqn], expect, rtol=0, atol=0,
                                           msg=f"{name} {fqn} rank {rank}")
            assert res["resumed_losses"] == pytest.approx(res["full_losses"], rel=0, abs=1e-7), name
            assert len(res["errors"]) == 2, name
            assert "no optimizer state for this rank's mesh coordinates" in res["errors"][0]
            assert "cannot reshard optimizer state" in res["errors"][1]
            keys.add(tuple(res["optim_keys"]))  # every case, not only the last
    # every rank saves its own optimizer entry, named by its (replicate, shard) coordinates
    assert keys == {(f"rep{r}of2_shard{s}of2",) for r in range(2) for s in range(2)}
