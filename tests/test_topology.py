"""Pure topology logic: placement, tiers, α-β costs against hand-computed numbers, TOML, errors."""

from __future__ import annotations

import math

import pytest
from typer.testing import CliRunner

from cpdpkit.cli import app
from cpdpkit.errors import TopologyError
from cpdpkit.topology import (
    PRESETS,
    Tier,
    Topology,
    TopologySpec,
    format_ranks,
    load_topology,
    parse_topology_toml,
    preset,
    resolve_topology,
)

pytestmark = pytest.mark.timeout(30)

A, BW = 8.3e-3, 125e6  # the wan preset's WAN tier
MIB = 1 << 20


def test_wan_preset_is_the_cpdp_link() -> None:
    wan = preset("wan", world_size=2)
    assert (wan.num_sites, wan.nodes_per_site, wan.ranks_per_node) == (2, 1, 1)
    tier = wan.tier("WAN")
    assert 2 * tier.latency_s == pytest.approx(16.6e-3)  # RTT
    assert tier.bandwidth_bytes_per_s * 8 == pytest.approx(1e9)
    assert wan.tier_between(0, 1).name == "WAN"
    assert wan.tier_between(0, 0) is None


def test_wan_with_four_ranks_has_lan_inside_a_site() -> None:
    wan = preset("wan", world_size=4)
    assert wan.tier_of([0, 1]).name == "LAN"
    assert wan.tier_of([2, 3]).name == "LAN"
    assert wan.tier_of([0, 2]).name == "WAN"
    assert wan.tier_of(range(4)).name == "WAN"
    assert wan.tier_of([3]) is None


@pytest.mark.parametrize(("world", "ranks_per_node", "num_nodes"),
                         [(2, 2, 1), (3, 3, 1), (4, 2, 2), (8, 4, 2), (16, 8, 2), (1024, 8, 128), (6, 2, 3)])
def test_cluster_placement_rule(world: int, ranks_per_node: int, num_nodes: int) -> None:
    topo = preset("cluster", world_size=world)
    assert (topo.ranks_per_node, topo.nodes_per_site, topo.num_sites) == (ranks_per_node, num_nodes, 1)


def test_cluster_tiers_and_explicit_ranks_per_node() -> None:
    topo = preset("cluster", world_size=8, ranks_per_node=2)
    assert topo.nodes_per_site == 4
    assert topo.tier_of([0, 1]).name == "NVLINK"
    assert topo.tier_of([0, 2]).name == "IB"
    assert topo.tier_of([0, 1, 2]).name == "IB"


def test_lan_is_one_node_of_any_size() -> None:
    for world in (1, 2, 3, 7):
        topo = preset("lan", world_size=world)
        assert topo.ranks_per_node == world and topo.world_size == world


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_alpha_beta_formulas(p: int) -> None:
    topo = preset("wan", world_size=2 * p)
    ranks = [0] + [topo.ranks_per_node + i for i in range(p - 1)]  # rank 0 + p-1 ranks on site 1
    assert topo.tier_of(ranks).name == "WAN"
    n = 4 * MIB
    log_p = math.ceil(math.log2(p))
    ring = 2 * (p - 1) * A + 2 * (p - 1) / p * n / BW
    tree = 2 * log_p * (A + n / BW)
    assert topo.collective_time_s("all_reduce", n, ranks) == pytest.approx(min(ring, tree))
    assert topo.collective_cost("all_reduce", n, ranks).algorithm == ("ring" if ring <= tree else "tree")
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert topo.collective_time_s(op, n, ranks) == pytest.approx((p - 1) * A + (p - 1) / p * n / BW)
    bcast = min(log_p * (A + n / BW), (log_p + p - 1) * A + 2 * (p - 1) / p * n / BW)
    assert topo.collective_time_s("broadcast", n, ranks) == pytest.approx(bcast)
    assert topo.collective_time_s("barrier", 0, ranks) == pytest.approx(log_p * A)
    assert topo.collective_time_s("send_recv", n, ranks[:2]) == pytest.approx(A + n / BW)


def test_hand_computed_numbers() -> None:
    wan = preset("wan", world_size=2)
    # 2 ranks, 1 MiB: ring = 2*8.3 ms + 1048576 B / 125e6 B/s = 16.6 ms + 8.388608 ms
    assert wan.collective_time_s("all_reduce", MIB, [0, 1]) == pytest.approx(0.024988608)
    # 4 ranks, 64 B: ring = 6*8.3 = 49.8 ms > tree = 2*2*8.3 = 33.2 ms > hierarchical (issue 15:
    # 2 LAN steps inside each site + 2 WAN steps between the sites) = 2*50 us + 2*8.3 ms = 16.7 ms
    wan4 = preset("wan", world_size=4)
    cost = wan4.collective_cost("all_reduce", 64, range(4))
    assert cost.algorithm == "hierarchical" and cost.tier == "WAN"
    assert cost.time_s == pytest.approx(2 * 50e-6 + 64 / 1.25e9 + 2 * A + 64 / BW)
    # cluster, 2 NVLINK ranks, 300 MB: 2*3 us + 300e6/300e9 s = 1.006 ms
    cl = preset("cluster", world_size=4)
    assert cl.collective_time_s("all_reduce", 300_000_000, [0, 1]) == pytest.approx(6e-6 + 1e-3)
    assert cl.collective_time_s("all_reduce", 300_000_000, [0]) == 0.0


def test_planner_scale_is_cheap() -> None:
    topo = preset("cluster", world_size=1024)
    assert topo.tier_of(range(1024)).name == "IB"
    assert topo.collective_time_s("all_gather", 1 << 30, range(0, 1024, 8)) > 0


def test_toml_round_trip_and_dict_round_trip(tmp_path) -> None:
    for name in PRESETS:
        spec, placed = preset(name), preset(name, world_size=4)
        assert isinstance(spec, TopologySpec) and isinstance(placed, Topology)
        assert parse_topology_toml(spec.to_toml()) == spec
        assert TopologySpec.from_dict(spec.to_dict()) == spec
        # a placed topology writes every count: it reads back as a spec that places on its world size only
        assert parse_topology_toml(placed.to_toml()) == placed.spec()
        assert parse_topology_toml(placed.to_toml()).place(4) == placed == Topology.from_dict(placed.to_dict())
    path = tmp_path / "mine.toml"
    jittery = TopologySpec(name="mine", tiers=(Tier(name="X", latency_s=1e-3, bandwidth_bytes_per_s=1e9,
                                                     latency_jitter_frac=0.25, bandwidth_jitter_frac=0.125),),
                           intra_node_tier="X", ranks_per_node=4)
    path.write_text(jittery.to_toml())
    assert "latency_jitter_frac = 0.25\nbandwidth_jitter_frac = 0.125\n" in path.read_text()
    assert load_topology(path) == jittery
    assert load_topology(path).tier("X").bandwidth_jitter_frac == 0.125
    assert resolve_topology(str(path), world_size=4) == jittery.place(4)
    assert resolve_topology(str(path), world_size=4).world_size == jittery.fixed_world_size == 4


def test_cluster_slow_ib_is_a_preset_like_the_others() -> None:
    topo = resolve_topology("cluster-slow-ib", world_size=4)  # the sharding suite's default, registered here
    assert (topo.num_sites, topo.nodes_per_site, topo.ranks_per_node) == (1, 2, 2)
    assert (topo.tier("IB").latency_s, topo.tier("IB").bandwidth_bytes_per_s) == (1e-3, 150e6)
    assert topo.tier("NVLINK") == preset("cluster").tier("NVLINK")
    assert topo.tier_of([0, 2]).name == "IB" and PRESETS["cluster-slow-ib"] == topo.description


def test_wan_variable_preset_is_wan_with_jitter() -> None:
    wan, variable = preset("wan", world_size=4), preset("wan-variable", world_size=4)
    assert resolve_topology("wan-variable", world_size=4) == variable
    w = variable.tier("WAN")
    assert (w.latency_jitter_frac, w.bandwidth_jitter_frac) == (0.3, 0.5)
    assert (w.latency_s, w.bandwidth_bytes_per_s) == (wan.tier("WAN").latency_s, wan.tier("WAN").bandwidth_bytes_per_s)
    assert variable.tier("LAN") == wan.tier("LAN") and not variable.tier("LAN").is_variable
    assert (variable.num_sites, variable.nodes_per_site, variable.ranks_per_node) == (2, 1, 2)
    # the planner's (mean) costs are wan's, bit for bit
    for ranks in ([0, 1], [0, 2], range(4)):
        assert variable.collective_cost("all_reduce", MIB, ranks).time_s == wan.collective_cost(
            "all_reduce", MIB, ranks).time_s
    assert "±30 %" in PRESETS["wan-variable"] and "±50 %" in PRESETS["wan-variable"]
    assert variable.description == PRESETS["wan-variable"]


def test_toml_jitter_keys_and_the_old_alias() -> None:
    text = BASE + "latency_jitter_frac = 0.3\nbandwidth_jitter_frac = 0.5\n"
    tier = parse_topology_toml(text, source="t.toml").tier("LAN")
    assert (tier.latency_jitter_frac, tier.bandwidth_jitter_frac) == (0.3, 0.5)
    # jitter_frac = j (the one knob before) still reads, as both fractions = j; it is never written
    old = parse_topology_toml(BASE + "jitter_frac = 0.05\n", source="t.toml")
    assert (old.tier("LAN").latency_jitter_frac, old.tier("LAN").bandwidth_jitter_frac) == (0.05, 0.05)
    assert not any(line.startswith("jitter_frac") for line in old.to_toml().splitlines())
    assert parse_topology_toml(old.to_toml()) == old
    # a dict saved before the split (a plan's JSON) loads too
    saved = {"name": "x", "tiers": [{"name": "A", "latency_s": 1e-3, "bandwidth_bytes_per_s": 1e9, "jitter_frac": 0.0}],
             "intra_node_tier": "A", "ranks_per_node": 2, "world_size": 2}
    assert Topology.from_dict(saved).tier("A") == Tier(name="A", latency_s=1e-3, bandwidth_bytes_per_s=1e9)


def test_toml_open_count_is_filled_by_place() -> None:
    text = """
name = "two-sites"
[placement]
nodes_per_site = 2
num_sites = 2
[levels]
intra_node = "NVLINK"
inter_node = "IB"
inter_site = "WAN"
[tiers.NVLINK]
latency_s = 3e-6
bandwidth_bytes_per_s = 300e9
[tiers.IB]
latency_s = 5e-6
bandwidth_bytes_per_s = 25e9
[tiers.WAN]
latency_s = 8.3e-3
bandwidth_bytes_per_s = 125e6
"""
    topo = parse_topology_toml(text).place(16)
    assert topo.ranks_per_node == 4
    assert [topo.tier_of(g).name for g in ([0, 3], [0, 4], [0, 8])] == ["NVLINK", "IB", "WAN"]


def test_format_ranks() -> None:
    assert format_ranks([0, 1, 2, 3, 8, 9, 10, 11]) == "0-3,8-11"
    assert format_ranks([5]) == "5"
    assert format_ranks([2, 0]) == "0,2"


BASE = """
[placement]
ranks_per_node = 2
[levels]
intra_node = "LAN"
[tiers.LAN]
latency_s = 1e-4
bandwidth_bytes_per_s = 1e9
"""


def _bad_base(old: str, new: str):
    """Parsing BASE with ``old`` replaced by ``new`` (as file t.toml)."""
    return lambda: parse_topology_toml(BASE.replace(old, new), source="t.toml")


ERRORS = [
    (lambda: preset("moon"),
     "unknown topology preset 'moon'; use one of lan, wan, wan-variable, cluster, multisite, cluster-slow-ib, "
     "cluster-slower-ib or a path to a .toml file"),
    (lambda: preset("wan", world_size=3),
     "topology 'wan' needs a world size divisible by 2 (2 site(s) x 1 node(s) x ? rank(s)); got 3; "
     "run a multiple of 2 ranks or use a TOML file"),
    (lambda: preset("cluster", world_size=11),
     "preset 'cluster' cannot choose ranks_per_node for world size 11; "
     "pass ranks_per_node (--ranks-per-node) or use a TOML file"),
    (lambda: preset("lan", world_size=0), "world_size = 0 is invalid; set it to a whole number >= 1"),
    (lambda: preset("wan", world_size=2).place(4),
     "topology 'wan' places 2 ranks (2 site(s) x 1 node(s) x 1 rank(s)) but the world size is 4; "
     "change its placement or run 2 ranks"),
    (lambda: Topology(**{**preset("wan").__dict__, "ranks_per_node": None}),  # an open count is a spec's
     "topology 'wan': ranks_per_node is unset, but a placed Topology has every placement count; leave it open in a "
     "TopologySpec and call place(world_size)"),
    (lambda: Topology.from_dict(preset("wan").to_dict()),  # a plan's JSON holds a placed topology
     "topology 'wan': ranks_per_node is unset, but a placed Topology has every placement count; leave it open in a "
     "TopologySpec and call place(world_size)"),
    (lambda: preset("wan", world_size=2).tier_between(0, 5),
     "rank 5 is outside topology 'wan' (world size 2); use 0..1"),
    (lambda: preset("wan", world_size=2).collective_time_s("gossip", 1, [0, 1]),
     "op = 'gossip' is not a modeled collective; use one of all_reduce, all_gather, reduce_scatter, broadcast, "
     "barrier, all_to_all, send_recv"),
    (lambda: preset("wan", world_size=2).collective_time_s("all_reduce", -1, [0, 1]),
     "num_bytes = -1 is invalid; pass a whole number of bytes >= 0"),
    (lambda: Tier(name="WAN", latency_s=-1.0, bandwidth_bytes_per_s=1e9),
     "tiers.WAN.latency_s = -1.0 is invalid; set it to a finite number >= 0"),
    (lambda: Tier(name="WAN", latency_s=1e-3, bandwidth_bytes_per_s=0),
     "tiers.WAN.bandwidth_bytes_per_s = 0 is invalid; set it to a finite number > 0"),
    (lambda: Tier(name="WAN", latency_s=1e-3, bandwidth_bytes_per_s=1e9, jitter_frac=1.5),
     "tiers.WAN.jitter_frac = 1.5 is invalid; set it to a fraction in [0, 1), such as 0.05 for ±5 %"),
    (lambda: Tier(name="WAN", latency_s=1e-3, bandwidth_bytes_per_s=1e9, latency_jitter_frac=-0.1),
     "tiers.WAN.latency_jitter_frac = -0.1 is invalid; set it to a fraction in [0, 1), such as 0.3 for ±30 %"),
    (lambda: Tier(name="WAN", latency_s=1e-3, bandwidth_bytes_per_s=1e9, bandwidth_jitter_frac=1.0),
     "tiers.WAN.bandwidth_jitter_frac = 1.0 is invalid; set it to a fraction in [0, 1), such as 0.5 for ±50 %"),
    (_bad_base("bandwidth_bytes_per_s = 1e9", "bandwidth_bytes_per_s = 1e9\nbandwidth_jitter_frac = 1"),
     "tiers.LAN.bandwidth_jitter_frac = 1 is invalid; set it to a fraction in [0, 1), such as 0.5 for ±50 %"),
    (_bad_base("bandwidth_bytes_per_s = 1e9", "bandwidth_bytes_per_s = 1e9\nlatency_jitter_frac = '30 %'"),
     "tiers.LAN.latency_jitter_frac = '30 %' is invalid; set it to a fraction in [0, 1), such as 0.3 for ±30 %"),
    (_bad_base("bandwidth_bytes_per_s = 1e9",
               "bandwidth_bytes_per_s = 1e9\njitter_frac = 0.1\nlatency_jitter_frac = 0.2"),
     "tiers.LAN: jitter_frac = 0.1 is the old name of latency_jitter_frac and bandwidth_jitter_frac; "
     "remove it and keep the new keys"),
    (lambda: Tier(name="a b", latency_s=1e-3, bandwidth_bytes_per_s=1e9),
     "tier name 'a b' is invalid; use a short identifier such as 'IB' or 'WAN'"),
    (_bad_base('intra_node = "LAN"', 'intra_node = "IB"'),
     "topology 't': intra_node_tier = 'IB' is not a defined tier; use one of LAN or add [tiers.IB]"),
    (_bad_base("latency_s", "latency_ms"),
     "t.toml [tiers.LAN]: unknown key 'latency_ms'; use one of bandwidth_bytes_per_s, bandwidth_jitter_frac, "
     "collective_overhead_s, latency_jitter_frac, latency_s"),
    (_bad_base("latency_s = 1e-4\n", ""),
     "t.toml [tiers.LAN]: latency_s is missing; add latency_s = <number>"),
    (_bad_base("ranks_per_node = 2", "ranks_per_node = 0"),
     "ranks_per_node = 0 is invalid; set it to a whole number >= 1 (or \"auto\" in a TOML [placement])"),
    (_bad_base("ranks_per_node = 2", "ranks_per_node = 2\nnum_sites = 2"),
     "topology 't': inter_site_tier is unset but num_sites = 2; name the tier between sites or set num_sites = 1"),
    (_bad_base("ranks_per_node = 2", "nodes_per_site = 2"),
     "topology 't': inter_node_tier is unset but nodes_per_site = 2; "
     "name the tier between nodes or set nodes_per_site = 1"),
    (lambda: parse_topology_toml(BASE + "\nspeed = 3\n", source="t.toml"),
     "t.toml [tiers.LAN]: unknown key 'speed'; use one of bandwidth_bytes_per_s, bandwidth_jitter_frac, "
     "collective_overhead_s, latency_jitter_frac, latency_s"),
    (lambda: parse_topology_toml("name = 'x'\nsites = 2\n", source="t.toml"),
     # "faults": the [faults] table a topology TOML may hold since issue 15
     "t.toml: unknown key 'sites'; use one of description, faults, levels, name, placement, tiers"),
    (lambda: parse_topology_toml("name = \n", source="t.toml"),
     "t.toml: not valid TOML (Invalid value (at line 1, column 8)); fix the syntax"),
    (lambda: load_topology("/nonexistent/x.toml"),
     "topology file '/nonexistent/x.toml' cannot be read (No such file or directory); check the path"),
    (lambda: TopologySpec(name="t", tiers=(Tier(name="A", latency_s=0, bandwidth_bytes_per_s=1),),
                          intra_node_tier="A", ranks_per_node=None, nodes_per_site=None),
     "topology 't': ranks_per_node and nodes_per_site are both unset; leave at most one placement count unset "
     "(it is derived from the world size)"),
]


@pytest.mark.parametrize(("make", "message"), ERRORS)
def test_validation_errors_are_exact(make, message: str) -> None:
    with pytest.raises(TopologyError) as info:
        make()
    assert str(info.value) == message


# ---- cpdpkit topology show ---------------------------------------------------------------------
runner = CliRunner()


def test_show_wan_variable_gives_jitter_and_the_range_beside_the_mean() -> None:
    result = runner.invoke(app, ["topology", "show", "wan-variable", "--world-size", "2"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    (wan_row,) = [line for line in lines if line.startswith("│ WAN")]
    assert "latency ±30%, transfer ±50% (0.667-2 Gbit/s)" in wan_row
    assert [line for line in lines if line.startswith("│ LAN")][0].rstrip(" │").endswith("-")
    assert "time (mean)" in result.stdout and "range (min-max)" in result.stdout
    # all_reduce of 4 MiB on 2 ranks: 16.6 ms latency + 33.554432 ms transfer = 50.154 ms;
    # min 0.7 x 16.6 + 0.5 x 33.554 = 28.397 ms, max 1.3 x 16.6 + 1.5 x 33.554 = 71.912 ms
    (all_reduce,) = [line for line in lines if line.startswith("│ all_reduce")]
    assert [cell.strip() for cell in all_reduce.split("│")[4:6]] == ["50.154 ms", "28.397-71.912 ms"]
    (barrier,) = [line for line in lines if line.startswith("│ barrier")]
    assert "5.810-10.790 ms" in barrier and "8.300 ms" in barrier


def test_show_steady_topology_has_no_range_column() -> None:
    result = runner.invoke(app, ["topology", "show", "wan", "--world-size", "2"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert "50.154 ms" in result.stdout and "range" not in result.stdout and "mean" not in result.stdout


@pytest.mark.parametrize(("line", "message"), [
    ("bandwidth_jitter_frac = 1.5",
     "tiers.LAN.bandwidth_jitter_frac = 1.5 is invalid; set it to a fraction in [0, 1), such as 0.5 for ±50 %"),
    ("latency_jitter_frac = -0.2",
     "tiers.LAN.latency_jitter_frac = -0.2 is invalid; set it to a fraction in [0, 1), such as 0.3 for ±30 %"),
])
def test_show_bad_jitter_is_one_line_and_exit_2(tmp_path, line: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(BASE + line + "\n")
    result = runner.invoke(app, ["topology", "show", str(path)], env={"COLUMNS": "300"})
    assert result.exit_code == 2
    assert result.stderr.strip() == f"error: {path}: {message}"  # load_topology names the file in every error


# ---- the multisite preset (three tiers, two sites) -------------------------------------------------
def test_multisite_places_two_sites_of_two_nodes_and_prices_each_tier() -> None:
    topo = resolve_topology("multisite", world_size=4)
    assert (topo.num_sites, topo.nodes_per_site, topo.ranks_per_node) == (2, 2, 1)
    assert [topo.site_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert [topo.node_of(r) for r in range(4)] == [0, 1, 2, 3]
    # the tiers are the cluster preset's NVLINK and IB and the wan preset's WAN
    assert topo.tier("WAN") == preset("wan").tier("WAN")
    assert (topo.tier("NVLINK"), topo.tier("IB")) == (preset("cluster").tier("NVLINK"), preset("cluster").tier("IB"))
    assert [topo.tier_of(g).name for g in ([0, 1], [2, 3], [0, 2], [1, 3], [1, 2], range(4))] == \
        ["IB", "IB", "WAN", "WAN", "WAN", "WAN"]
    # all_reduce of n bytes on 2 ranks (ring): 2α + n/B, with the IB numbers inside a site, the WAN's across
    n = 4 * MIB
    inside, across = topo.collective_cost("all_reduce", n, [0, 1]), topo.collective_cost("all_reduce", n, [1, 3])
    assert (inside.tier, across.tier) == ("IB", "WAN")
    assert inside.time_s == pytest.approx(2 * 5e-6 + n / 25e9)
    assert across.time_s == pytest.approx(2 * A + n / BW)
    wide = preset("multisite", world_size=8)  # 2 ranks per node: NVLINK joins them
    assert wide.ranks_per_node == 2 and wide.tier_of([0, 1]).name == "NVLINK" and wide.tier_of([0, 2]).name == "IB"
    assert wide.collective_cost("all_reduce", n, [0, 1]).time_s == pytest.approx(2 * 3e-6 + n / 300e9)


@pytest.mark.parametrize(("world", "ranks_per_node", "nodes_per_site"),
                         [(4, 1, 2), (16, 4, 2), (12, 3, 2), (12, 2, 3), (8, 1, 4), (6, 3, 1)])
def test_multisite_placement_rule(world: int, ranks_per_node: int, nodes_per_site: int) -> None:
    given = None if world // ranks_per_node == 4 and nodes_per_site == 2 else ranks_per_node
    topo = preset("multisite", world_size=world, ranks_per_node=given)
    assert (topo.num_sites, topo.nodes_per_site, topo.ranks_per_node) == (2, nodes_per_site, ranks_per_node)
    assert topo.site_of(world // 2 - 1) == 0 and topo.site_of(world // 2) == 1


def test_multisite_refuses_a_world_size_not_divisible_by_4() -> None:
    with pytest.raises(TopologyError) as info:
        resolve_topology("multisite", world_size=6)
    assert str(info.value) == (
        "preset 'multisite' places world_size/4 ranks on each of 2 nodes x 2 sites, but world_size = 6 is not "
        "divisible by 4; run a multiple of 4 ranks or pass ranks_per_node (--ranks-per-node R gives "
        "world_size/(2R) nodes per site)")
    result = runner.invoke(app, ["topology", "show", "multisite", "--world-size", "6"], env={"COLUMNS": "300"})
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith("error: preset 'multisite' places world_size/4 ranks")


def test_multisite_is_a_preset_everywhere_presets_are_resolved() -> None:
    from cpdpkit._env import topology_from_env  # what the emulator and torchrun children resolve

    assert "multisite" in PRESETS and preset("multisite").description == PRESETS["multisite"]
    assert topology_from_env({"CPDPKIT_TOPOLOGY": "multisite"}, world_size=4) == preset("multisite", world_size=4)
    result = runner.invoke(app, ["topology", "show", "multisite", "--world-size", "4"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert "topology multisite: 2 site(s) x 2 node(s) x 1 rank(s)" in result.stdout
    (wan_row,) = [line for line in result.stdout.splitlines() if line.startswith("│ WAN")]
    assert "between sites" in wan_row
    (ib_row,) = [line for line in result.stdout.splitlines() if line.startswith("│ IB")]
    assert "same site" in ib_row
