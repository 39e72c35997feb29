"""Injected faults (cpdpkit.faults.FaultPlan, applied by the emulator): parsing, and each kind on
2 real gloo ranks, each rank its own process (tests/_fault_jobs.py) so every exit code and every
line of stderr is checked: training goes on (spikes, a slow rank, a short link outage) or every
rank ends within its timeout with one line naming the op, the group and the missing ranks."""

from __future__ import annotations

import random
import tomllib
from pathlib import Path

import pytest

from _fault_jobs import NUM_BYTES, TOPOLOGY, RankRun, run_ranks
from cpdpkit._env import faults_from_env
from cpdpkit.emulator._sync import _ARRIVED_GRACE_S
from cpdpkit.emulator.faults import _HANG_PAST_TIMEOUT_S, FaultInjector, LinkDownError
from cpdpkit.errors import DistributedSetupError, TopologyError
from cpdpkit.faults import FaultPlan
from cpdpkit.topology import parse_topology_toml

NUM_STEPS = 8  # tests/_fault_jobs.py's
# How late a thread may wake past a deadline it slept or waited to (the error's own stamp less the deadline):
# a 2-core machine running two copies of the suite deschedules it for a while, never for seconds.
WAKE_S = 1.5


def _one_line(run: RankRun) -> str:
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert "Traceback" not in run.stderr, run.stderr
    assert len(lines) == 1, run.stderr
    return lines[0]


# ---- parsing (no process group) ---------------------------------------------------------------
def test_the_env_line_and_the_toml_table_give_the_same_plan(tmp_path: Path) -> None:
    line = ("seed=3;latency_spikes:probability=0.25,extra_s=0.05;slow_rank:rank=1,factor=1.5,extra_s=0.02;"
            "link_down:pair=0-1,start_s=1,duration_s=2;dead_peer:rank=1,at_collective=20,mode=hang")
    plan = faults_from_env({"CPDPKIT_FAULTS": line})
    assert plan == FaultPlan(seed=3, latency_spikes=(0.25, 0.05), slow_rank=(1, 1.5, 0.02),
                             link_down=(None, (0, 1), 1.0, 2.0), dead_peer=(1, 20, None, "hang"))
    toml = """
[faults]
seed = 3
latency_spikes = {probability = 0.25, extra_s = 0.05}
slow_rank = {rank = 1, factor = 1.5, extra_s = 0.02}
link_down = {pair = [1, 0], start_s = 1, duration_s = 2}
dead_peer = {rank = 1, at_collective = 20, mode = "hang"}
"""
    (tmp_path / "faults.toml").write_text(toml)
    assert faults_from_env({"CPDPKIT_FAULTS": str(tmp_path / "faults.toml")}) == plan
    topo = parse_topology_toml('name = "t"\n[placement]\nranks_per_node = 1\n[levels]\nintra_node = "LAN"\n'
                               '[tiers.LAN]\nlatency_s = 1e-4\nbandwidth_bytes_per_s = 1e9\n' + toml)
    assert topo.faults == plan
    # written back (a placed topology reaches launched ranks as a TOML file): the same plan, the same topology
    for kept in (plan, FaultPlan(seed=1, link_down=("WAN", None, 0.5, 1.0), dead_peer=(0, None, 2.5, "exit"))):
        assert FaultPlan.from_mapping(tomllib.loads(kept.to_toml())["faults"]) == kept
    assert parse_topology_toml(topo.to_toml()) == topo and "[faults]\nseed = 3\n" in topo.to_toml()
    assert faults_from_env({}) is None and faults_from_env({"CPDPKIT_FAULTS": " "}) is None


@pytest.mark.parametrize(("line", "message"), [
    ("latency_spikes:probability=2,extra_s=1",
     r"^faults.latency_spikes.probability = 2.0 is invalid; set it in \[0, 1\]$"),
    ("slow_rank:factor=2", r"^faults.slow_rank: rank is missing; e.g. slow_rank = \{rank = 1"),
    ("link_down:start_s=1,duration_s=1", r"^faults.link_down needs exactly one of tier or pair"),
    ("dead_peer:rank=1,at_s=1,mode=explode",
     r"^faults.dead_peer.mode = 'explode' is invalid; use \"exit\" or \"hang\"$"),
    ("gremlins:rank=1", r"^CPDPKIT_FAULTS: unknown key 'gremlins'; use seed or one of latency_spikes"),
    ("seed", r"^CPDPKIT_FAULTS: 'seed' is not 'seed=N' nor 'kind:key=value,...'"),
])
def test_bad_faults_are_one_line(line: str, message: str) -> None:
    with pytest.raises(TopologyError, match=message):
        FaultPlan.parse(line)


# ---- faults on 2 gloo ranks --------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(90)
def test_spikes_slow_rank_and_a_short_outage_let_training_go_on(tmp_path: Path) -> None:
    """One run, three faults that training survives; each one's effect is checked on its own."""
    spikes, extra_s, factor, late_s, down_s = 0.5, 0.04, 1.5, 0.03, 0.5
    faults = (f"seed=7;latency_spikes:probability={spikes},extra_s={extra_s};"
              f"slow_rank:rank=1,factor={factor},extra_s={late_s};link_down:tier=WAN,start_s=0,duration_s={down_s}")
    runs = run_ranks("train", tmp_path, faults=faults, timeout_s=10.0)
    assert [r.returncode for r in runs] == [0, 0], [r.stderr for r in runs]
    r0, r1 = (r.result for r in runs)
    assert r0["param_sum"] == r1["param_sum"]  # the data path is untouched
    # spikes: collective n spikes iff its draw of (seed, "<group>:<n>") is under the probability
    base = TOPOLOGY.place(2).collective_time_s("all_reduce", NUM_BYTES, [0, 1]) * factor  # the slow rank's link
    spiked = [random.Random(f"7:spike:{r0['group_name']}:{n}").random() < spikes for n in range(1, NUM_STEPS + 1)]
    assert 0 < sum(spiked) < NUM_STEPS
    expect = [base + extra_s * s for s in spiked]
    for result in (r0, r1):
        assert [c["modeled_s"] for c in result["calls"]] == pytest.approx(expect, rel=1e-9)
    # the link was down for the first down_s seconds: the first all-reduce ended after it came back
    assert r0["calls"][0]["done_s"] >= r0["fault_origin_s"] + down_s + base
    # the slow rank arrives late_s after it calls each collective, and rank 0 waits for it each time:
    # no collective ends before the slow rank's arrival + the modeled time (monotonic clocks of one
    # machine; a bound that scheduling noise cannot break, where rank 0's blocked time could)
    for n, (c0, c1) in enumerate(zip(r0["calls"], r1["calls"])):
        assert c0["done_s"] >= c1["issue_s"] + late_s + expect[n], (n, c0, c1)


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["exit", "hang"])
def test_a_dead_peer_ends_every_rank_with_one_line(tmp_path: Path, mode: str) -> None:
    timeout_s = 3.0
    runs = run_ranks("train", tmp_path, faults=f"dead_peer:rank=1,at_collective=4,mode={mode}", timeout_s=timeout_s)
    (r0, r1) = runs
    assert r0.returncode == 2 and r1.returncode == 1, (r0.stderr, r1.stderr)
    line = _one_line(r0)
    assert line.startswith("error: emu all_reduce on group world (ranks 0-1): ranks [1] did not arrive"), line
    assert "check its log" in line
    if mode == "hang":
        assert f"within {timeout_s:g} s" in line and "raise the timeout" in line
    said = f"cpdpkit emulator: rank 1 (injected fault dead_peer, mode {mode}) at its collective 4"
    if mode == "exit":
        assert _one_line(r1) == f"{said} exits with code 1"
    else:
        assert r1.stderr.splitlines() == [f"{said} stops answering; it exits in {timeout_s + 4:g} s",
                                          f"{said} exits with code 1"]
    # rank 0's failing call, timed by its own stamps (its issue, the error; start-up is not in them), ended
    # within the timeout and the arrival check's grace: before the hung peer's exit (timeout + 4 s) would
    # have broken the connection, and in hang mode only after the whole timeout
    assert r0.result is None and r0.stamps is not None
    waited_s = r0.stamps["error_s"] - r0.stamps["issue_s"]
    assert waited_s <= timeout_s + _ARRIVED_GRACE_S + WAKE_S < timeout_s + _HANG_PAST_TIMEOUT_S, r0.stamps
    if mode == "hang":
        assert waited_s >= timeout_s, r0.stamps


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_link_down_past_the_timeout_ends_both_ranks_with_one_line(tmp_path: Path) -> None:
    start_s, timeout_s = 0.5, 2.0
    runs = run_ranks("train_long", tmp_path, faults=f"link_down:tier=WAN,start_s={start_s},duration_s=60",
                     timeout_s=timeout_s)
    for run in runs:
        assert run.returncode == 2, run.stderr
        line = _one_line(run)
        assert line.startswith("error: emu all_reduce on group world (ranks 0-1): the WAN link is down "
                               "(injected fault link_down at 0.5 s for 60 s) and stayed down past the group's 2 s "
                               "timeout"), line
    # by the ranks' own stamps (start-up is not in them): the collective the outage caught started at its last
    # member's issue or at the outage, whichever came later, and each rank gave up one timeout after that,
    # not when the link came back 60 s later
    stamps = [run.stamps for run in runs]
    assert all(s is not None for s in stamps), stamps
    down_s = stamps[0]["fault_origin_s"] + start_s
    blocked_from = max(down_s, *(s["issue_s"] for s in stamps))
    for s in stamps:
        assert s["fault_origin_s"] == stamps[0]["fault_origin_s"], stamps  # one origin, agreed by the group
        assert down_s + timeout_s <= s["error_s"] <= blocked_from + timeout_s + WAKE_S, stamps


# ---- the injector's decisions (no process group) ------------------------------------------------
def test_the_injectors_decisions_are_seeded_and_shared_by_the_group() -> None:
    topo = TOPOLOGY.place(2)
    group = topo.group([0, 1])
    plan = FaultPlan.parse("seed=5;latency_spikes:probability=0.3,extra_s=0.1;slow_rank:rank=1,factor=2;"
                           "link_down:tier=WAN,start_s=10,duration_s=5")
    ranks = [FaultInjector(plan, rank=r, topology=topo) for r in (0, 1)]
    draws = [[inj.modeled_s(group, f"0:{n}", 1.0) for n in range(1, 41)] for inj in ranks]
    assert draws[0] == draws[1]  # every member prices a collective the same
    assert set(draws[0]) == {2.0, 2.1} and 0.15 < draws[0].count(2.1) / 40 < 0.45  # factor 2, spikes ~30 %
    assert draws[0] == [FaultInjector(plan, rank=0, topology=topo).modeled_s(group, f"0:{n}", 1.0)
                        for n in range(1, 41)]  # the same seed replays the same spikes
    assert ranks[0].modeled_s(topo.group([0]), "x:1", 1.0) == 1.0  # a one-rank group: no link, no spike
    inj = ranks[0]
    inj.start_s = 100.0
    hold = inj.link_down(group, 30.0, lambda: "emu all_reduce on group world (ranks 0-1)")
    assert hold(105.0, 1.0) == (105.0, 106.0)  # before the outage
    assert hold(111.0, 1.0) == (115.0, 116.0)  # during it: starts when the link is back
    assert hold(109.5, 1.0) == (109.5, 115.5)  # across its start: paused for the outage
    assert inj.link_down(topo.group([0]), 30.0, str) is None
    short = FaultInjector(FaultPlan.parse("link_down:pair=0-1,start_s=0,duration_s=60"), rank=0, topology=topo)
    with pytest.raises(LinkDownError, match=r"^emu all_reduce on group world \(ranks 0-1\): the link between ranks "
                                            r"0 and 1 is down .* past the group's 0.01 s timeout"):
        short.link_down(group, 0.01, lambda: "emu all_reduce on group world (ranks 0-1)")(short.start_s, 1.0)


def test_faults_naming_what_is_not_there_are_one_line() -> None:
    topo = TOPOLOGY.place(2)
    with pytest.raises(DistributedSetupError, match=r"^faults.dead_peer.rank = 5 is outside the world \(size 2\)"):
        FaultInjector(FaultPlan.parse("dead_peer:rank=5,at_s=1"), rank=0, topology=topo)
    with pytest.raises(DistributedSetupError, match=r"^faults.link_down.tier = 'IB' is not a tier of topology"):
        FaultInjector(FaultPlan.parse("link_down:tier=IB,start_s=1,duration_s=1"), rank=0, topology=topo)


def test_the_topologys_faults_reach_the_emulator_unless_overridden() -> None:
    import dataclasses

    from cpdpkit.emulator import EmulatorConfig

    table = FaultPlan.parse("seed=2;latency_spikes:probability=0.5,extra_s=0.01")
    topo = dataclasses.replace(TOPOLOGY, faults=table).place(2)
    assert EmulatorConfig(topology=topo).fault_plan == table
    other = FaultPlan.parse("slow_rank:rank=0,extra_s=0.01")
    assert EmulatorConfig(topology=topo, faults=other).fault_plan == other  # CPDPKIT_FAULTS / faults= win
    assert EmulatorConfig(topology=TOPOLOGY.place(2), faults=FaultPlan(seed=3)).fault_plan is None  # nothing to inject
