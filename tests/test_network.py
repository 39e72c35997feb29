"""The one network model (cpdpkit.network): hand-computed costs, wire bytes consistent with time,
groups cached by the topology, and the planner asking the same object."""

from __future__ import annotations

import math

import pytest

from cpdpkit.errors import TopologyError
from cpdpkit.network import COLLECTIVE_OPS, NetworkGroup, Tier, alpha_beta_cost, jitter_draws, sampled_time_s
from cpdpkit.planner import plan_sharding
from cpdpkit.topology import Topology, preset

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
    # Four ranks on four sites (one tier, WAN): ring vs tree. (This used wan's 2 sites x 2 ranks,
    # which since issue 15 spans two tiers and is priced hierarchically: test_groups_spanning_tiers.)
    wan_only = Topology(name="wan4", tiers=(wan4.tier("WAN"),), intra_node_tier="WAN", ranks_per_node=4)
    small = wan_only.group(range(4)).cost("all_reduce", 64)  # 6α (ring) > 4α (tree)
    assert (small.algorithm, small.tier, small.wire_bytes) == ("tree", "WAN", 2 * 2 * 64)
    assert small.time_s == pytest.approx(4 * (A + 64 / BW))
    big = wan_only.group(range(4)).cost("all_reduce", 1 << 24)
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


# ---- network variability: sampled times ---------------------------------------------------------
MIB = 1 << 20


def test_cost_keeps_its_two_terms() -> None:
    cost = preset("wan", world_size=2).group([0, 1]).cost("all_reduce", 4 * MIB)  # ring
    assert cost.latency_term_s == pytest.approx(2 * A)
    assert cost.bandwidth_term_s == pytest.approx(cost.wire_bytes / BW)
    assert cost.latency_term_s + cost.bandwidth_term_s == cost.time_s
    # wan's 2 sites x 2 ranks span LAN and WAN (issue 15: priced hierarchically, not as a 6-step
    # ring on the WAN): per level 2(f-1)α + 2(f-1)/f·n/B, f = 2 on each
    lan_a, lan_bw = 50e-6, 1.25e9
    two_tier = preset("wan", world_size=4).group(range(4)).cost("all_reduce", 4 * MIB)
    assert two_tier.algorithm == "hierarchical"
    assert two_tier.latency_term_s == pytest.approx(2 * lan_a + 2 * A)
    assert two_tier.bandwidth_term_s == pytest.approx(4 * MIB / lan_bw + 4 * MIB / BW)
    assert two_tier.tier_bytes == (("LAN", 4 * MIB), ("WAN", 2 * MIB))  # the WAN's n per site, 2 ranks share it
    assert two_tier.latency_term_s + two_tier.bandwidth_term_s == two_tier.time_s


def test_sampled_time_for_hand_chosen_draws() -> None:
    group = preset("wan-variable", world_size=2).group([0, 1])  # WAN: ±30 % latency, ±50 % transfer
    cost = group.cost("all_reduce", MIB)  # ring on 2 ranks: 2 latency steps, MIB wire bytes
    latency_ms, transfer_ms = 2 * 8.3, MIB / BW * 1e3  # 16.6 ms and 8.388608 ms
    for u_latency, u_bandwidth, expect_ms in [
        (0.0, 0.0, latency_ms + transfer_ms),
        (0.5, -1.0, latency_ms * 1.15 + transfer_ms * 0.5),  # 19.09 + 4.194304 ms
        (-1.0, 1.0, latency_ms * 0.7 + transfer_ms * 1.5),  # 11.62 + 12.582912 ms
        (1.0, 1.0, latency_ms * 1.3 + transfer_ms * 1.5),
    ]:
        assert group.sampled_time_s(cost, u_latency, u_bandwidth) * 1e3 == pytest.approx(expect_ms, rel=1e-12)
    assert group.time_range_s("all_reduce", MIB) == pytest.approx(
        ((latency_ms * 0.7 + transfer_ms * 0.5) / 1e3, (latency_ms * 1.3 + transfer_ms * 1.5) / 1e3), rel=1e-12)
    # the same collective on a steady tier, or on one rank, never varies
    steady = preset("wan", world_size=2).group([0, 1])
    assert steady.sampled_time_s(steady.cost("all_reduce", MIB), 1.0, -1.0) == steady.cost("all_reduce", MIB).time_s
    assert sampled_time_s(cost, None, 1.0, 1.0) == cost.time_s
    assert group.time_range_s("barrier", 0) == pytest.approx((8.3e-3 * 0.7, 8.3e-3 * 1.3))


@pytest.mark.parametrize("op", COLLECTIVE_OPS)
def test_the_mean_of_the_sampled_times_is_the_planned_time(op: str) -> None:
    """Opposite draws average to ``time_s``: the planner's unjittered time is the emulator's mean."""
    group = preset("wan-variable", world_size=4).group([0, 2, 3])
    cost = group.cost(op, 0 if op == "barrier" else 3 * MIB)
    for u_latency, u_bandwidth in [(0.3, -0.9), (1.0, 1.0), (-0.25, 0.6)]:
        pair = group.sampled_time_s(cost, u_latency, u_bandwidth) + group.sampled_time_s(cost, -u_latency, -u_bandwidth)
        assert pair / 2 == pytest.approx(cost.time_s, rel=1e-12)
    low, high = group.time_range_s(op, cost.num_bytes)
    assert low < cost.time_s < high


def test_draws_are_keyed_by_seed_and_key() -> None:
    draws = [jitter_draws(7, f"pg0:{seq}") for seq in range(2000)]
    assert draws == [jitter_draws(7, f"pg0:{seq}") for seq in range(2000)]  # what another rank computes
    flat = [u for pair in draws for u in pair]
    assert all(-1.0 <= u <= 1.0 for u in flat) and min(flat) < -0.99 and max(flat) > 0.99
    assert abs(sum(flat) / len(flat)) < 0.05  # centred: the mean time stays time_s
    assert len(set(draws)) == len(draws)  # each collective draws anew
    assert jitter_draws(8, "pg0:1") != jitter_draws(7, "pg0:1") != jitter_draws(7, "pg1:1")
    u_latency, u_bandwidth = zip(*draws)
    assert u_latency != u_bandwidth  # two independent draws, not one factor twice


def test_draws_outside_the_unit_interval_are_refused() -> None:
    group = preset("wan-variable", world_size=2).group([0, 1])
    with pytest.raises(ValueError, match=r"^draws \(1\.5, 0\.0\) must lie in \[-1, 1\]; use jitter_draws\(\)$"):
        group.sampled_time_s(group.cost("barrier", 0), 1.5, 0.0)
