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
    format_bytes,
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


# ---- partially sharded data parallelism (param_sharding = "replicated") ------------------------------
def _partial_spec() -> ModelSpec:
    """Root ``b`` (8), block 0 ``w`` (5x3 = 15), block 1 ``v`` (4x4 = 16): 39 elements."""
    return ModelSpec(name="small", params=(ParamSpec(fqn="b", shape=(8,)), ParamSpec(fqn="w", shape=(5, 3), block=0),
                                           ParamSpec(fqn="v", shape=(4, 4), block=1)),
                     blocks=(BlockSpec(fqn="blk0", container="blocks"), BlockSpec(fqn="blk1", container="blocks")))


PARTIAL = dataclasses.replace(FP32, param_sharding="replicated", min_unit_bytes=1)


def test_partial_plan_bytes_and_memory_by_hand():
    plan = plan_sharding(_partial_spec(), "wan", world_size=4, config=PARTIAL)  # 2 sites x 1 node x 2 ranks
    assert (plan.strategy, plan.param_sharding) == ("partial", "replicated")
    assert plan.mesh.shape == (2, 2) and plan.mesh.dim_names == ("replicate", "shard")
    assert (plan.mesh.shard_tier, plan.mesh.replicate_tier) == ("LAN", "WAN")
    assert plan.state_sharding.to_dict() == {"axis": "world", "num_partitions": 4, "executed_by_fsdp2": False}
    assert [(u.name, u.numel, u.padded_numel, u.reshard_after_forward) for u in plan.units] == [
        ("<root>", 8, 8, False), ("blk0", 15, 15, False), ("blk1", 16, 16, False)]
    assert plan.placements == () and plan.all_gather_order == ()
    rb = plan.rank_bytes
    # rank j*2+i owns chunk j of node slice i; node slices ceil(n/2), chunks ceil(n/4):
    # root 8 -> 2/2/2/2; blk0 15 -> slices 8, 7 -> 4/4 | 4/3 (rank 3 short); blk1 16 -> 4 each
    assert rb.param_bytes == (39 * 4,) * 4  # replicated
    assert rb.grad_bytes == (40, 40, 40, 36) and rb.optim_bytes == (80, 80, 80, 72)
    assert (rb.padded_param_bytes, rb.padded_grad_bytes) == (156, 40)  # Σ ceil(n/4) = 2 + 4 + 4
    # gradients 4·max(root 8 + 2·16, 2·8) = 160; node slices (4 + 4)·ceil(16/2) = 64; in-node all-gather 4·16
    assert rb.buffer_bytes == 160 + 64 + 64
    assert rb.peak_bytes == 156 + (4 + 8) * 10 + 288
    assert rb.fsdp2_peak_bytes == (4 + 4 + 8) * 39  # plain DDP
    phases = [(c.name, c.op, c.axis, c.tier, c.collective_bytes, c.wire_bytes_per_rank) for c in plan.comm]
    assert phases == [  # in-node: n·4 bytes (32, 60, 64); across nodes: ceil(n/2)·4 bytes (16, 32, 32); p = 2
        ("gradient reduce-scatter", "reduce_scatter", "shard", "LAN", 156, 78),
        ("gradient reduce-scatter", "reduce_scatter", "replicate", "WAN", 80, 40),
        ("parameter all-gather", "all_gather", "replicate", "WAN", 80, 40),
        ("parameter all-gather", "all_gather", "shard", "LAN", 156, 78)]
    topo = plan.topology
    lan, wan = topo.group(range(2)), topo.group(range(0, 4, 2))
    expect = sum(lan.time_s(op, n) + wan.time_s(op, m)
                 for op in ("reduce_scatter", "all_gather") for n, m in ((32, 16), (60, 32), (64, 32)))
    assert plan.predicted_comm_s_per_step == pytest.approx(expect, rel=1e-12)
    assert plan.tier_bytes_per_step == {"LAN": 156, "WAN": 80}
    sched = plan.schedule  # the across-node exchange of each unit's node slice
    assert sched is not None and [s.num_bytes for s in sched.slots] == [16, 32, 32] and sched.tier == "WAN"


@pytest.mark.parametrize(("topology", "world_size", "rpn"), [
    ("cluster", 4, 2), ("cluster", 16, None), ("cluster", 64, None), ("wan", 4, None), ("wan", 16, None),
    ("wan", 64, None)])
@pytest.mark.parametrize("model", ["vit-s", "llama-7b"])
def test_partial_sends_no_more_than_a_ring_all_reduce_on_any_tier(topology, world_size, rpn, model):
    plan = plan_sharding(model, topology, world_size=world_size, ranks_per_node=rpn,
                         config=PlannerConfig(param_sharding="replicated"))
    ddp = plan.topology.group(range(world_size)).cost("all_reduce", plan.num_params * plan.config.grad_bytes)
    assert not any(c.op == "all_gather" and c.axis == "shard" and "forward" in c.name for c in plan.comm)
    for tier, sent in plan.tier_bytes_per_step.items():
        assert sent <= 1.01 * ddp.wire_bytes, (tier, sent, ddp.wire_bytes)
    assert sum(plan.tier_bytes_per_step.values()) > 0


def _as_fast_sharded(plan):
    """The partial candidate and the sharded candidate as fast as it (hsdp-node+state, no reshard)."""
    (partial,) = [c for c in plan.candidates if c.param_sharding == "replicated"]
    (twin,) = [c for c in plan.candidates if c.strategy == "hsdp-node+state" and c.reshard_after_forward is False]
    return partial, twin


def test_partial_is_chosen_when_it_is_fastest_and_fits_and_not_when_it_does_not_fit():
    free = plan_sharding("llama-7b", "cluster", world_size=16)
    partial, twin = _as_fast_sharded(free)
    assert partial.time_s == pytest.approx(twin.time_s, rel=1e-3) and partial.peak_bytes < twin.peak_bytes
    # a tie keeps parameters sharded (and says so)
    assert free.strategy == "hsdp-node+state" and free.param_sharding == "sharded"
    assert "partial is as fast and needs" in free.choice_reason and "param_sharding='replicated'" in free.choice_reason
    # a budget between the two: every sharded plan as fast no longer fits, partial does and wins
    between = plan_sharding("llama-7b", "cluster", world_size=16,
                            config=PlannerConfig(memory_budget_bytes=(partial.peak_bytes + twin.peak_bytes) // 2))
    assert (between.strategy, between.mesh.shape, between.state_sharding.axis) == ("partial", (2, 8), "world")
    assert between.choice_reason.startswith("fastest of the ")
    assert (f"hsdp-node+state raf=False would be as fast but needs {format_bytes(twin.peak_bytes)}, over the budget"
            in between.choice_reason)
    assert [c.chosen for c in between.candidates].count(True) == 1
    # a budget just below partial's peak: it does not fit and is not chosen
    below = plan_sharding("llama-7b", "cluster", world_size=16,
                          config=PlannerConfig(memory_budget_bytes=partial.peak_bytes - 1))
    assert below.param_sharding == "sharded"
    assert not [c for c in below.candidates if c.param_sharding == "replicated"][0].fits_budget
    big = plan_sharding("llama-70b", "cluster", world_size=64, config=PlannerConfig(memory_budget_bytes=80 * GIB))
    assert big.strategy == "hsdp-node+state"
    assert "; partial would be 16.6 % faster but needs 148.69 GiB, over the budget" in big.choice_reason


def test_candidates_are_every_evaluated_point():
    plan = plan_sharding("llama-70b", "cluster", world_size=64, config=PlannerConfig(memory_budget_bytes=80 * GIB))
    names = sorted((c.strategy, str(c.reshard_after_forward)) for c in plan.candidates)
    assert names == sorted([("hsdp-node", "True"), ("hsdp-node", "False"), ("hsdp-node+state", "True"),
                            ("hsdp-node+state", "False"), ("fsdp", "True"), ("fsdp", "False"), ("fsdp-hpz", "8"),
                            ("partial", "False")])
    (chosen,) = [c for c in plan.candidates if c.chosen]
    assert (chosen.strategy, chosen.peak_bytes, chosen.time_s) == (
        plan.strategy, plan.rank_bytes.peak_bytes, pytest.approx(plan.predicted_comm_s_per_step))
    assert all(c.fits_budget == (c.peak_bytes <= 80 * GIB) for c in plan.candidates)
    assert plan.choice_reason.startswith("fastest of the 3 candidates that fit 80.00 GiB (")
    only = plan_sharding("llama-7b", "cluster", world_size=16, config=PlannerConfig(param_sharding="sharded"))
    assert {c.param_sharding for c in only.candidates} == {"sharded"} and len(only.candidates) == 7


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"param_sharding": "both"},
     "param_sharding = 'both' is invalid; use 'sharded', 'replicated' or None (consider both)"),
    ({"param_sharding": "replicated", "allow_state_sharding": False},
     "param_sharding = 'replicated' shards optimizer state across the world, which allow_state_sharding = False "
     "forbids; allow state sharding or use 'sharded'"),
    ({"param_sharding": "replicated", "reshard_after_forward": True},
     "param_sharding = 'replicated' keeps parameters unsharded, so reshard_after_forward = True cannot hold; "
     "leave it None or use 'sharded'"),
])
def test_param_sharding_config_errors(kwargs, message):
    with pytest.raises(PlannerError) as err:
        PlannerConfig(**kwargs)
    assert str(err.value) == message


def test_param_sharding_errors_that_need_the_topology():
    with pytest.raises(PlannerError) as err:
        plan_sharding("vit-s", "lan", world_size=4, config=PlannerConfig(param_sharding="replicated"))
    assert str(err.value) == (
        "param_sharding = 'replicated' needs at least 2 nodes (gradients and optimizer state shard inside a node, "
        "then across nodes), but 'lan' places all 4 ranks on one node; use more ranks, --ranks-per-node, or "
        "param_sharding 'sharded'")
    with pytest.raises(PlannerError) as err:
        plan_sharding("vit-s", "cluster", world_size=16, config=PlannerConfig(param_sharding="replicated",
                                                                             shard_size=16))
    assert str(err.value) == ("param_sharding = 'replicated' shards inside a node (8 ranks), which shard_size = 16 "
                              "contradicts; leave shard_size None or set it to 8")
    # with param_sharding None the partial candidate is simply left out
    assert all(c.param_sharding == "sharded" for c in plan_sharding("vit-s", "lan", world_size=4).candidates)


def test_partial_budget_error_names_what_would_fit():
    with pytest.raises(PlannerError) as err:
        plan_sharding("llama-70b", "cluster", world_size=64,
                      config=PlannerConfig(param_sharding="replicated", memory_budget_bytes=80 * GIB))
    assert str(err.value).startswith("memory budget 80.00 GiB per rank is too small for llama-70b on 64 ranks: the "
                                     "leanest plan (partial) needs ")
    assert "its replicated parameters and buffers alone exceed it on any number of ranks" in str(err.value)


def test_partial_plan_json_round_trip_and_version_1_loads():
    plan = plan_sharding("llama-7b", "cluster", world_size=16, config=PlannerConfig(param_sharding="replicated"))
    again = ShardingPlan.from_json(plan.to_json())
    assert again == plan and again.candidates == plan.candidates and again.param_sharding == "replicated"
    sharded = plan_sharding("vit-s", "cluster", world_size=16)
    data = json.loads(sharded.to_json())
    assert data["format_version"] == 2 and len(data["candidates"]) == 8 and data["choice_reason"]
    # what cpdpkit wrote before format 2: no param_sharding, candidates, choice_reason, nor schedule clip
    v1 = {k: v for k, v in data.items() if k not in ("param_sharding", "candidates", "choice_reason")}
    v1["format_version"] = 1
    v1["schedule"] = {k: v for k, v in v1["schedule"].items() if k not in ("clip", "norm_s")}
    old = ShardingPlan.from_dict(v1)
    assert old == dataclasses.replace(sharded, candidates=(), choice_reason="")
    assert old.param_sharding == "sharded"


def test_partial_plans_on_1024_ranks_fast_enough_for_the_scale_tests():
    plan = plan_sharding("llama-70b", "cluster", world_size=1024, config=PlannerConfig(param_sharding="replicated"))
    assert plan.mesh.shape == (128, 8) and len(plan.rank_bytes.optim_bytes) == 1024
    optim = np.asarray(plan.rank_bytes.optim_bytes)
    assert optim.sum() == plan.num_params * plan.config.optim_state_bytes_per_param  # every element once
    ceil_total = sum(-(-u.numel // 1024) for u in plan.units) * plan.config.optim_state_bytes_per_param
    assert optim.max() == ceil_total == plan.rank_bytes.padded_grad_bytes // 2 * 12  # bf16 grads, 12 B state


def test_partial_slices_are_the_padded_flat_layout():
    from cpdpkit.planner._cost import partial_owned

    # n = 9, S = 2, R = 2: node slices [0,5) and [5,9); chunks of 3: rank (j, i) = j*2 + i
    assert partial_owned(9, 2, 2).tolist() == [3, 3, 2, 1]  # (0,0) [0,3) (0,1) [5,8) (1,0) [3,5) (1,1) [8,9)
    for numel, s, r in [(9, 2, 2), (15, 2, 2), (1, 4, 2), (1000003, 8, 16), (7, 8, 3)]:
        owned = partial_owned(numel, s, r)
        assert owned.sum() == numel and owned.max() == -(-numel // (s * r))  # none above ceil(n/W)
