"""Emulator fidelity (issue 15): a collective completes for every member at the last arrival plus
its transfer, concurrent groups share a node's uplink, groups spanning tiers are priced
hierarchically, all through the one network model (cpdpkit.network).

The model's formulas are checked by hand with no process group; the emulator on 2 and 4 real
gloo ranks (each rank its own process: tests/_fault_jobs.py). No wall time is below the model
(lower bounds from the model); above it, the load of the moment may add anything to a wall time on a
shared 2-core machine, so the upper bound is on what the issuing threads' own calls stamped: the
emulator's scheduled end less the last member's issue, within HIGH of the model (tests/_fault_jobs.py
``_timed``); benchmarks/emulator_sweep.py reports the accuracy itself.
"""

from __future__ import annotations

import pytest

from _fault_jobs import CONTEND_BYTES, LATE_S, NUM_BYTES, P2P_LATE_S, TOPOLOGY, RankRun, run_ranks
from cpdpkit.errors import TopologyError
from cpdpkit.network import concurrent_time_s
from cpdpkit.topology import Tier, Topology, preset

LOW, HIGH = 0.97, 1.25  # wall time / modeled, at least; the emulator's own schedule / modeled, at most
SLACK_S = 0.005  # 4 processes on 2 shared cores: a barrier's exit skew of a few ms


# ---- the network model -------------------------------------------------------------------------
def test_a_group_spanning_tiers_is_priced_level_by_level() -> None:
    topo = preset("cluster", world_size=16)  # 2 nodes x 8 ranks: NVLINK (3 us, 300 GB/s), IB (5 us, 25 GB/s)
    world = topo.group(range(16))
    assert [(t.name, f) for t, f in world.levels] == [("NVLINK", 8), ("IB", 2)]
    n = 1 << 26
    cost = world.cost("all_reduce", n)
    # per level 2(f-1)α + 2(f-1)/f·n/B: the IB uplink carries n per node, shared by its 8 ranks
    expect = (2 * 7 * 3e-6 + 2 * 7 / 8 * n / 300e9) + (2 * 1 * 5e-6 + n / 25e9)
    assert (cost.algorithm, cost.tier) == ("hierarchical", "IB")
    assert cost.time_s == pytest.approx(expect)
    assert cost.tier_bytes == (("NVLINK", 2 * 7 * n // 8), ("IB", n // 8))
    flat = 2 * 15 * 5e-6 + 2 * 15 / 16 * n / 25e9  # the old price: a 16-rank ring on IB
    assert cost.time_s < 0.65 * flat
    gather = world.cost("all_gather", n)
    assert gather.time_s == pytest.approx(7 * 3e-6 + 7 / 8 * n / 300e9 + 5e-6 + n / 2 / 25e9)
    # all_to_all: the 8 ranks of a node each send half their bytes across the shared IB uplink
    a2a = world.cost("all_to_all", n)
    assert a2a.time_s == pytest.approx(7 * 3e-6 + 7 / 16 * n / 300e9 + 8 * 5e-6 + 8 * (8 / 16 * n) / 25e9)
    # one tier, or ranks spread unevenly over nodes: priced flat, as before
    assert topo.group(range(8)).levels == () and topo.group([0, 1, 8]).levels == ()
    assert topo.group([0, 1, 8]).cost("all_reduce", n).algorithm == "ring"


def test_uplinks_are_named_where_groups_can_share_them() -> None:
    topo = preset("cluster", world_size=16)
    assert topo.group([0, 8]).uplinks == ("node0", "node1")  # HSDP's replicate groups share them
    assert topo.group(range(8)).uplinks == ()  # inside a node
    assert preset("wan", world_size=2).group([0, 1]).uplinks == ()  # one rank per node: nothing to share


def test_concurrent_groups_share_the_uplink() -> None:
    pair = TOPOLOGY.place(4).group([0, 2])
    one = pair.cost("all_reduce", CONTEND_BYTES)
    assert concurrent_time_s([one, one]) == pytest.approx(2 * one.time_s)
    assert pair.cost("all_reduce", CONTEND_BYTES, concurrent=2).time_s == pytest.approx(2 * one.time_s)
    with pytest.raises(TopologyError, match=r"^concurrent = 0 is invalid; pass a whole number of groups >= 1$"):
        pair.cost("all_reduce", 1, concurrent=0)


def test_three_tiers() -> None:
    topo = Topology(name="3", tiers=(Tier(name="A", latency_s=1e-6, bandwidth_bytes_per_s=1e11),
                                     Tier(name="B", latency_s=1e-5, bandwidth_bytes_per_s=1e10),
                                     Tier(name="C", latency_s=1e-2, bandwidth_bytes_per_s=1e8)),
                    intra_node_tier="A", inter_node_tier="B", inter_site_tier="C",
                    ranks_per_node=2, nodes_per_site=2, num_sites=2)
    world = topo.group(range(8))
    assert [(t.name, f) for t, f in world.levels] == [("A", 2), ("B", 2), ("C", 2)]
    assert world.uplinks == ("node0", "node1", "node2", "node3", "site0", "site1")
    n = 1 << 20
    assert world.cost("all_reduce", n).time_s == pytest.approx(
        sum(2 * a + n / b for a, b in ((1e-6, 1e11), (1e-5, 1e10), (1e-2, 1e8))))


# ---- the emulator --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> list[RankRun]:
    """One 4-rank job (2 sites x 2 ranks) for the skew and the contention checks."""
    runs = run_ranks("fidelity", tmp_path_factory.mktemp("fidelity"), timeout_s=30.0, world=4, wall_s=120.0)
    assert [r.returncode for r in runs] == [0] * 4, [r.stderr for r in runs]
    return runs


def _within(timed: dict[str, float], modeled_s: float, *, late_s: float = 0.0) -> bool:
    """The wall time no shorter than a rank's lateness ``late_s`` plus the model (less SLACK_S with a late
    rank: its sleep starts at its own barrier exit); the schedule the emulator stamped, from the last
    member's issue to its end, no longer than HIGH x the model."""
    floor_s = LOW * (late_s + modeled_s) - (SLACK_S if late_s else 0.0)
    return floor_s <= timed["wall_s"] and timed["schedule_s"] <= HIGH * modeled_s + SLACK_S


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_late_rank_delays_everyone_by_its_lateness(four: list[RankRun]) -> None:
    topo = TOPOLOGY.place(4)
    modeled = topo.collective_time_s("all_reduce", NUM_BYTES, range(4))
    times = four[0].result  # makespans from the moment every rank left a barrier: the same on every rank
    assert _within(times["on_time"], modeled), times
    # every rank completes at rank 1's arrival + the transfer (before: at its own issue + modeled): the
    # on-time ranks' wall time holds rank 1's lateness, the schedule runs from rank 1's issue. The late
    # rank's sleep starts when *it* leaves the barrier, which may be up to the barrier's exit skew (a few
    # ms on 2 busy cores) before the last rank leaves: hence SLACK_S below.
    assert _within(times["late"], modeled, late_s=LATE_S), times
    # a recv completes at max(send issue, recv issue) + transfer
    p2p = topo.collective_time_s("send_recv", NUM_BYTES, [0, 1])
    assert _within(times["p2p"], p2p, late_s=P2P_LATE_S), times


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_two_groups_on_one_uplink_take_twice_as_long(four: list[RankRun]) -> None:
    topo = TOPOLOGY.place(4)
    one = topo.group([0, 2]).cost("all_reduce", CONTEND_BYTES)
    times = four[0].result
    assert _within(times["alone"], one.time_s), times
    # first come, first served on the two node uplinks: one group ends at 1x, the other at 2x, the
    # model's makespan for two collectives sharing an uplink
    makespan = concurrent_time_s([one, one])
    assert _within(times["together"], makespan), times
    world = topo.group(range(4)).cost("all_reduce", CONTEND_BYTES)
    assert world.algorithm == "hierarchical"
    assert _within(times["world"], world.time_s), times
