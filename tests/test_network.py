"""The one network model (cpdpkit.network): hand-computed costs, wire bytes consistent with time,
groups cached by the topology, and the planner asking the same object."""

from __future__ import annotations

import math

import pytest

from cpdpkit.errors import TopologyError
from cpdpkit.network import COLLECTIVE_OPS, NetworkGroup, Tier, alpha_beta_cost
from cpdpkit.planner import plan_sharding
from cpdpkit.topology import preset

A, BW = 8.3e-3, 125e6  # the wan preset's WAN tier


@pytest.mark.parametrize("p", [2, 3, 4, 8, 128])
@pytest.mark.parametrize("n", [0, 64, 1 << 20, 1 << 30])
@pytest.mark.parametrize("op", COLLECTIVE_OPS)
def test_time_is_steps_alpha_plus_wire_beta(op: str, n: int, p: int) -> None:
    algorithm, time_s, wire = alpha_beta_cost(op, n, p, A, BW)
    steps = (time_s - wire / BW) / A
    assert steps == pytest.approx(round(steps), abs=1e-6)  # a whole number of latency steps
    frac, log_p = (p - 1) / p, math.ceil(math.log2(p))
    expect = {("all_reduce", "ring"): 2 * frac * n, ("all_reduce", "tree"): 2 * log_p * n,
              ("all_gather", "ring"): frac * n, ("reduce_scatter", "ring"): frac * n,
              ("all_to_all", "pairwise"): frac * n, ("broadcast", "tree"): log_p * n,
              ("broadcast", "scatter_allgather"): 2 * frac * n, ("send_recv", "p2p"): n,
              ("barrier", "dissemination"): 0.0}[(op, algorithm)]
    assert wire == pytest.approx(expect)


def test_hand_computed_group_costs() -> None:
    wan4 = preset("wan", world_size=4)
    small = wan4.group(range(4)).cost("all_reduce", 64)  # 6α (ring) > 4α (tree)
    assert (small.algorithm, small.tier, small.wire_bytes) == ("tree", "WAN", 2 * 2 * 64)
    assert small.time_s == pytest.approx(4 * (A + 64 / BW))
    big = wan4.group(range(4)).cost("all_reduce", 1 << 24)
    assert (big.algorithm, big.wire_bytes) == ("ring", int(2 * 3 / 4 * (1 << 24)))
    assert big.time_s == pytest.approx(6 * A + 2 * 3 / 4 * (1 << 24) / BW)
    lan = wan4.group([0, 1])  # one site: the LAN tier
    assert (lan.tier_name, lan.wire_bytes("all_gather", 1000)) == ("LAN", 500)
    single = wan4.group([3])
    assert (single.tier, single.tier_name, single.cost("all_reduce", 1 << 20).time_s) == (None, "LOCAL", 0.0)


def test_groups_are_cached_per_topology_and_order_free() -> None:
    topo = preset("cluster", world_size=16)
    g = topo.group([8, 0])
    assert g is topo.group((0, 8)) and isinstance(g, NetworkGroup) and g.ranks == (0, 8)
    assert g.tier_name == "IB" and topo.group(range(8)).tier_name == "NVLINK"
    assert topo.collective_cost("all_gather", 4096, [0, 8]) is g.cost("all_gather", 4096)


def test_bad_input_is_one_line() -> None:
    topo = preset("wan", world_size=2)
    with pytest.raises(TopologyError, match=r"^op = 'gossip' is not a modeled collective; use one of all_reduce"):
        topo.group([0, 1]).cost("gossip", 1)
    with pytest.raises(TopologyError, match=r"^num_bytes = -1 is invalid; pass a whole number of bytes >= 0$"):
        topo.group([0, 1]).cost("all_reduce", -1)
    with pytest.raises(TopologyError, match=r"^a group needs at least one rank"):
        topo.group([])
    with pytest.raises(TopologyError, match=r"^tier name 'LOCAL' is reserved"):
        Tier(name="LOCAL", latency_s=0.0, bandwidth_bytes_per_s=1.0)


def test_plan_bytes_are_the_network_models() -> None:
    """A plan's phase is the sum of its group's modeled costs (no second formula)."""
    plan = plan_sharding("llama-7b", "cluster", world_size=16)
    topo, s = plan.topology, plan.mesh.shard_size
    (fwd,) = [p for p in plan.comm if p.name == "forward all-gather"]
    group = topo.group(range(s))
    sizes = [u.padded_numel * plan.config.param_bytes for u in plan.units]
    assert fwd.tier == group.tier_name and fwd.num_collectives == len(sizes)
    assert fwd.wire_bytes_per_rank == sum(group.wire_bytes("all_gather", n) for n in sizes)
    assert fwd.time_s == pytest.approx(sum(group.time_s("all_gather", n) for n in sizes))
