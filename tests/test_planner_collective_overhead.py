"""The network model's per-collective fixed cost (``Tier.collective_overhead_s``) in the planner's prices
and unit sizes: pure Python, no process group."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from cpdpkit.bench.models.gpt import TinyGPT, gpt_preset
from cpdpkit.errors import TopologyError
from cpdpkit.network import Tier
from cpdpkit.planner import PlannerConfig, plan_sharding
from cpdpkit.planner.model_spec import ModelSpec
from cpdpkit.planner.planner import group_blocks
from cpdpkit.topology import parse_topology_toml, preset

_CFG = PlannerConfig(param_dtype="float32", grad_dtype="float32", param_sharding="sharded", shard_size=4,
                     allow_state_sharding=False)


def _gpt_tiny() -> ModelSpec:
    with torch.device("meta"):
        return ModelSpec.from_module(TinyGPT(gpt_preset("gpt-tiny")), name="gpt-tiny")


def _lan(overhead_s: float):
    spec = preset("lan")
    (tier,) = spec.tiers
    return replace(spec, tiers=(replace(tier, collective_overhead_s=overhead_s),)).place(4)


@pytest.mark.parametrize("overhead_s", [0.0, 5e-3])
def test_units_follow_the_fixed_cost_formula_and_a_large_fixed_cost_gives_fewer_larger_units(overhead_s):
    spec = _gpt_tiny()
    topo = _lan(overhead_s)
    tier = topo.tiers[0]
    p = 4  # the shard axis: the whole world on one LAN
    # the size where one all-gather's fixed cost (p-1)α + o equals its bandwidth term (p-1)/p·n/B
    min_bytes = int(p * (tier.latency_s + overhead_s / (p - 1)) * tier.bandwidth_bytes_per_s)
    plan = plan_sharding(spec, topo, config=_CFG)
    blocks = [u for u in plan.units if u.name != "<root>"]
    assert len(blocks) == len(group_blocks(spec, min_bytes, 4))
    free = plan_sharding(spec, _lan(0.0), config=_CFG)
    if overhead_s:
        assert len(blocks) < len(free.units) - 1  # fewer, so larger, units than without the fixed cost
        assert min(u.numel for u in blocks) > max(u.numel for u in free.units if u.name != "<root>")
    fixed = replace(_CFG, min_unit_bytes=1)  # the same units: only the price of each collective differs
    with_o, without = plan_sharding(spec, topo, config=fixed).comm, plan_sharding(spec, _lan(0.0), config=fixed).comm
    assert [p.name for p in with_o] == [p.name for p in without]
    for a, b in zip(with_o, without):
        assert a.time_s == pytest.approx(b.time_s + a.num_collectives * overhead_s, rel=1e-12)


def test_the_two_stage_schedule_charges_the_fixed_cost_per_exchange():
    spec = _gpt_tiny()
    base = preset("cluster-slow-ib")
    cfg = PlannerConfig(param_dtype="float32", grad_dtype="float32", param_sharding="replicated",
                        tokens_per_rank=128, flops_per_s=4.5e9, min_unit_bytes=1)
    plans = {}
    for o in (0.0, 2e-3):
        topo = replace(base, tiers=tuple(replace(t, collective_overhead_s=o) for t in base.tiers)).place(4)
        plans[o] = plan_sharding(spec, topo, config=cfg)
    for a, b in zip(plans[0.0].schedule.slots, plans[2e-3].schedule.slots):
        assert b.duration_s == pytest.approx(a.duration_s + 2e-3)


def test_the_fixed_cost_reads_from_toml_round_trips_and_refuses_a_negative_value():
    path = Path(__file__).parents[1] / "benchmarks" / "cluster-slow-ib-gloo.toml"
    spec = parse_topology_toml(path.read_text(), source=str(path))
    assert {t.name: t.collective_overhead_s for t in spec.tiers} == {"NVLINK": 0.0005, "IB": 0.0005}
    assert parse_topology_toml(spec.to_toml()) == spec
    assert all(t.collective_overhead_s == 0.0 for t in preset("cluster-slow-ib").tiers)  # no preset sets it
    with pytest.raises(TopologyError) as err:
        Tier(name="IB", latency_s=1e-3, bandwidth_bytes_per_s=1e9, collective_overhead_s=-1.0)
    assert str(err.value) == "tiers.IB.collective_overhead_s = -1.0 is invalid; set it to a finite number >= 0"
