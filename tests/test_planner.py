"""The sharding planner's pure logic: layouts, units, mesh choice, bytes, costs, JSON, errors, scale."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from cpdpkit.errors import ConfigError
from cpdpkit.planner import (
    ModelSpec,
    ParamSpec,
    PlannerConfig,
    PlannerError,
    ShardingPlan,
    fsdp2_default_plan,
    model_preset,
    parse_bytes,
    plan_sharding,
)
from cpdpkit.planner._cost import shard_layout
from cpdpkit.planner.model_spec import BlockSpec
from cpdpkit.planner.planner import group_blocks
from cpdpkit.topology import preset

pytestmark = pytest.mark.timeout(60)

GIB = 2**30
FP32 = PlannerConfig(param_dtype="float32", grad_dtype="float32", optim_state_bytes_per_param=8)


# ---- layouts -------------------------------------------------------------------------------------
def test_5x3_weight_on_4_ranks_pads_to_2_2_1_0_rows():
    for balanced in (False, True):  # no dim divides 4: both keep padded Shard(0)
        layout = shard_layout((5, 3), 4, balanced=balanced)
        assert layout.dim == 0
        assert layout.padded_numel == 4 * 2 * 3  # chunks of ceil(5/4) = 2 rows
        assert layout.real_by_position.tolist() == [6, 6, 3, 0]  # 2/2/1/0 rows of 3


def test_shard1_is_chosen_when_it_divides_and_dim0_does_not():
    layout = shard_layout((6, 12), 4, balanced=True)
    assert (layout.dim, layout.padded_numel, layout.real_by_position.tolist()) == (1, 72, [18] * 4)
    assert shard_layout((6, 12), 4, balanced=False).dim == 0  # FSDP2's default pads instead
    assert shard_layout((6, 12), 4, balanced=False).padded_numel == 8 * 12
    assert shard_layout((8, 12), 4, balanced=True).dim == 0  # dim 0 divides: keep it
    assert shard_layout((1, 197, 384), 8, balanced=True).dim == 2  # ViT pos_embed


def test_scalar_and_empty_parameters():
    assert shard_layout((), 4, balanced=True).padded_numel == 4
    assert shard_layout((0, 3), 4, balanced=True).real_by_position.tolist() == [0, 0, 0, 0]


# ---- model specs ---------------------------------------------------------------------------------
def test_preset_parameter_counts_match_the_public_models():
    counts = {name: model_preset(name).numel for name in ("resnet50", "vit-s", "llama-7b", "llama-70b")}
    assert counts == {"resnet50": 25_557_032, "vit-s": 22_050_664, "llama-7b": 6_738_415_616,
                      "llama-70b": 68_976_648_192}
    assert len(model_preset("llama-70b").blocks) == 80


def test_model_spec_from_a_meta_module():
    import torch

    from _planner_jobs import Net

    with torch.device("meta"):
        spec = ModelSpec.from_module(Net())
    assert [b.fqn for b in spec.blocks] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert {b.container for b in spec.blocks} == {"blocks"}
    root = [p.fqn for p in spec.params if p.block == -1]
    assert root == ["embed.weight", "embed.bias", "head.weight", "head.bias", "out.weight", "out.bias"]
    assert spec.numel == sum(p.numel() for p in Net().parameters())


def test_small_neighbours_merge_but_never_across_containers():
    blocks = tuple(BlockSpec(fqn=f"{c}.{i}", container=c) for c, i in
                   [("a", 0), ("a", 1), ("a", 2), ("a", 3), ("a", 4), ("b", 0)])
    params = tuple(ParamSpec(fqn=f"p{k}", shape=(100,), block=k) for k in range(6))  # 400 B each in fp32
    spec = ModelSpec(name="m", params=params, blocks=blocks)
    assert group_blocks(spec, 800, 4) == [[0, 1], [2, 3, 4], [5]]  # trailing small a.4 joins a.2..3
    assert group_blocks(spec, 1, 4) == [[0], [1], [2], [3], [4], [5]]


# ---- plans ---------------------------------------------------------------------------------------
def _tiny_spec() -> ModelSpec:
    return ModelSpec(name="tiny", params=(ParamSpec(fqn="w", shape=(5, 3), block=0), ParamSpec(fqn="b", shape=(8,))),
                     blocks=(BlockSpec(fqn="blk", container=""),))


def test_rank_bytes_by_hand():
    plan = plan_sharding(_tiny_spec(), "lan", world_size=4, config=FP32)
    assert plan.mesh.shape == (4,) and plan.mesh.dim_names == ("shard",)
    rb = plan.rank_bytes
    # real elements per rank: w -> 6/6/3/0, b -> 2/2/2/2; fp32 params and grads, 8 B optimizer state
    assert rb.param_bytes == (32, 32, 20, 8)
    assert rb.grad_bytes == (32, 32, 20, 8)
    assert rb.optim_bytes == (64, 64, 40, 16)
    assert rb.padded_param_bytes == (6 + 2) * 4
    assert plan.padding_bytes == (24 - 15) * 4
    assert plan.summary()["max_rank_bytes"] == 128


def test_state_sharding_splits_optimizer_state_evenly_across_replicas():
    cfg = dataclasses.replace(FP32, shard_size=2)
    plan = plan_sharding(_tiny_spec(), "wan", world_size=4, config=cfg)
    assert plan.mesh.shape == (2, 2) and plan.mesh.dim_names == ("replicate", "shard")
    assert (plan.mesh.shard_tier, plan.mesh.replicate_tier) == ("LAN", "WAN")
    assert plan.state_sharding.axis == "replicate" and not plan.state_sharding.executed_by_fsdp2
    # shard position 0 owns 3 rows of w (9) + 4 of b = 13 elements -> 7 / 6 across the replicas
    # ranks 0,1 are replica 0 (positions 0,1), ranks 2,3 replica 1; 13 -> 7 + 6, 10 -> 5 + 5
    assert list(plan.rank_bytes.optim_bytes) == [7 * 8, 5 * 8, 6 * 8, 5 * 8]
    no_state = plan_sharding(_tiny_spec(), "wan", world_size=4,
                             config=dataclasses.replace(cfg, allow_state_sharding=False))
    assert no_state.state_sharding.axis is None and no_state.state_sharding.executed_by_fsdp2
    assert list(no_state.rank_bytes.optim_bytes) == [104, 80, 104, 80]


def test_llama70b_on_64_ranks_hsdp_inside_nodes_with_state_sharding():
    plan = plan_sharding("llama-70b", "cluster", world_size=64,
                         config=PlannerConfig(memory_budget_bytes=parse_bytes("80GiB")))
    assert plan.mesh.shape == (8, 8)
    assert (plan.mesh.shard_tier, plan.mesh.replicate_tier) == ("NVLINK", "IB")
    assert plan.state_sharding.num_partitions == 8
    assert len(plan.units) == 81 and plan.units[0].is_root
    assert plan.rank_bytes.peak_bytes <= 80 * GIB < plan.rank_bytes.fsdp2_peak_bytes
    base = fsdp2_default_plan("llama-70b", "cluster", world_size=64)
    assert base.rank_bytes.peak_bytes > 80 * GIB
    assert plan.all_gather_order[0] == ("<root>", "forward")
    assert plan.all_gather_order[81] == ("layers.79", "backward")
    assert plan.schedule is not None and len(plan.schedule.slots) == 81  # the two-stage schedule


def test_without_state_sharding_memory_forces_world_sharding_with_hpz():
    cfg = PlannerConfig(memory_budget_bytes=80 * GIB, allow_state_sharding=False)
    plan = plan_sharding("llama-70b", "cluster", world_size=64, config=cfg)
    assert plan.mesh.shape == (64,) and plan.strategy == "fsdp-hpz"
    assert {u.reshard_after_forward for u in plan.units if not u.is_root} == {8}
    hpz = [c for c in plan.comm if "resharded on 8" in c.name]
    assert hpz and hpz[0].tier == "NVLINK"  # backward all-gathers stay inside a node


def test_single_node_is_plain_fsdp():
    plan = plan_sharding("vit-s", "lan", world_size=8)
    assert plan.mesh.shape == (8,) and plan.mesh.replicate_size == 1 and plan.state_sharding.axis is None


def test_vit_balance_and_padding_against_fsdp2_default():
    plan = plan_sharding("vit-s", "cluster", world_size=64)
    base = fsdp2_default_plan("vit-s", "cluster", world_size=64)
    s, b = plan.summary(), base.summary()
    assert s["padding_bytes"] == 0 and s["max_rank_bytes"] / s["mean_rank_bytes"] <= 1.01
    # FSDP2 pads cls_token (1,1,384) and pos_embed (1,197,384) from 1 row to 8 on a node
    assert b["padding_bytes"] == 7 * 384 * (1 + 197) * 2
    assert b["max_rank_bytes"] / b["mean_rank_bytes"] > 1.02
    dims = {p.fqn: p.dim for p in plan.placements}
    assert dims["pos_embed"] == 2 and dims["cls_token"] == 2 and dims["head.weight"] == 0
    assert len(base.units) == 13 and len(plan.units) < 13  # small blocks merged
    assert s["predicted_comm_s_per_step"] < b["predicted_comm_s_per_step"]


def test_phase_times_are_the_topologys_collective_times():
    plan = plan_sharding("llama-7b", "cluster", world_size=16, config=PlannerConfig(memory_budget_bytes=40 * GIB))
    topo = preset("cluster", world_size=16)
    pb, gb = plan.config.param_bytes, plan.config.grad_bytes
    s = plan.mesh.shard_size
    for phase in plan.comm:
        ranks = range(0, 16, s) if phase.axis == "replicate" else range(phase.num_ranks)
        if phase.axis == "replicate":
            sizes = [u.padded_numel // s * (pb if phase.op == "all_gather" else gb) for u in plan.units]
        elif phase.name == "backward all-gather":
            sizes = [u.padded_numel * pb for u in plan.units if u.reshard_after_forward is True]
        else:
            sizes = [u.padded_numel * (pb if phase.op == "all_gather" else gb) for u in plan.units]
        expect = sum(topo.collective_time_s(phase.op, n, ranks) for n in sizes)
        assert phase.time_s == pytest.approx(expect, rel=1e-12), phase.name
    assert plan.predicted_comm_s_per_step == pytest.approx(sum(p.time_s for p in plan.comm))


def test_json_round_trip():
    for plan in (plan_sharding("resnet50", "wan", world_size=8),
                 plan_sharding("llama-70b", "cluster", world_size=64,
                               config=PlannerConfig(memory_budget_bytes=80 * GIB, allow_state_sharding=False))):
        again = ShardingPlan.from_json(plan.to_json())
        assert again == plan
        assert json.loads(again.to_json()) == json.loads(plan.to_json())
    with pytest.raises(PlannerError, match="format_version = 99 is not supported"):
        ShardingPlan.from_dict({**plan.to_dict(), "format_version": 99})


# ---- errors --------------------------------------------------------------------------------------
def test_unknown_preset():
    with pytest.raises(PlannerError) as err:
        plan_sharding("gpt-9", "cluster", world_size=8)
    assert str(err.value) == ("unknown model preset 'gpt-9'; use one of resnet50, vit-s, llama-7b, llama-70b "
                              "or 'package.module:factory'")
    assert isinstance(err.value, ConfigError)


def test_world_size_not_a_multiple_of_the_node_size():
    with pytest.raises(ConfigError) as err:
        plan_sharding("llama-7b", "cluster", world_size=60, ranks_per_node=8)
    assert str(err.value) == ("topology 'cluster' needs a world size divisible by 8 (1 site(s) x ? node(s) x "
                              "8 rank(s)); got 60; run a multiple of 8 ranks or use a TOML file")


def test_budget_nothing_fits_in_names_the_limit_and_what_fits():
    with pytest.raises(PlannerError) as err:
        plan_sharding("llama-70b", "cluster", world_size=64, config=PlannerConfig(memory_budget_bytes=10 * GIB))
    assert str(err.value) == (
        "memory budget 10.00 GiB per rank is too small for llama-70b on 64 ranks: the leanest plan (fsdp) "
        "needs 23.41 GiB per rank (model states 16.06 GiB + FSDP2 buffers 7.35 GiB); raise --memory-budget "
        "to at least 23.41 GiB or use about 392 ranks or more")
    with pytest.raises(PlannerError, match="the buffers alone exceed it on any number of ranks"):
        plan_sharding("llama-70b", "cluster", world_size=64, config=PlannerConfig(memory_budget_bytes=5 * GIB))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"param_dtype": "float7"}, "dtype 'float7' is unknown; use one of float64, float32, bfloat16"),
    ({"optim_state_bytes_per_param": -1}, "optim_state_bytes_per_param = -1 is invalid; use a whole number >= 0"),
    ({"memory_budget_bytes": 0}, "memory_budget_bytes = 0 is invalid; use a whole number of bytes > 0 or None"),
    ({"reshard_after_forward": 1}, "reshard_after_forward = 1 is invalid; use True, False, None or a number"),
])
def test_config_errors(kwargs, message):
    with pytest.raises(PlannerError, match=message.replace("(", r"\(")):
        PlannerConfig(**kwargs)


def test_shard_size_and_int_reshard_must_fit_the_topology():
    with pytest.raises(PlannerError, match="shard_size = 3 does not divide the world size 64"):
        plan_sharding("llama-7b", "cluster", world_size=64, config=PlannerConfig(shard_size=3))
    with pytest.raises(PlannerError, match="reshard_after_forward = 16 must divide the node size 8"):
        plan_sharding("llama-7b", "cluster", world_size=64, config=PlannerConfig(reshard_after_forward=16))
    with pytest.raises(PlannerError, match="size '80XB' is not understood"):
        parse_bytes("80XB")


# ---- scale ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [64, 256, 1024])
def test_llama70b_scales_to_1024_ranks(world_size):
    plan = plan_sharding("llama-70b", "cluster", world_size=world_size,
                         config=PlannerConfig(memory_budget_bytes=80 * GIB))
    s = plan.summary()
    assert len(plan.rank_bytes.param_bytes) == world_size
    assert s["max_rank_bytes"] / s["mean_rank_bytes"] <= 1.01
    assert s["padding_bytes"] <= 0.001 * s["model_bytes"]
    totals = np.asarray(plan.rank_bytes.total_bytes)
    assert totals.sum() >= plan.num_params * plan.config.state_bytes_per_param  # nothing lost
    if world_size == 1024:  # 32000 rows do not divide 1024: the embedding shards on its hidden dim
        dims = {p.fqn: p.dim for p in plan.placements}
        assert plan.mesh.shard_size == 8 and dims["tok_embeddings.weight"] == 0
        wide = plan_sharding("llama-70b", "cluster", world_size=1024, config=PlannerConfig(shard_size=1024))
        assert {p.fqn: p.dim for p in wide.placements}["tok_embeddings.weight"] == 1
        assert wide.padding_bytes == 0
        fsdp2_layout = shard_layout((32000, 8192), 1024, balanced=False)  # FSDP2's Shard(0) pads 768 rows
        assert fsdp2_layout.padded_numel - 32000 * 8192 == 768 * 8192


@pytest.mark.parametrize("name", ["resnet50", "vit-s", "llama-7b"])
def test_every_preset_plans_on_1024_ranks(name):
    plan = plan_sharding(name, "cluster", world_size=1024)
    s = plan.summary()
    assert s["max_rank_bytes"] / s["mean_rank_bytes"] <= 1.01
    assert len(plan.rank_bytes.optim_bytes) == 1024
