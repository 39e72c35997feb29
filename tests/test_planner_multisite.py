"""The planner on several sites with ``reconcile_period`` (CPDP across sites, sharded inside each site).

Pure logic: no process group, no torch. Every expected cost is recomputed here from the topology's
network model (:meth:`Topology.collective_cost`), not read back from the planner.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cpdpkit.cli import app
from cpdpkit.planner import PlannerConfig, PlannerError, ShardingPlan, fsdp2_default_plan, plan_sharding
from cpdpkit.topology import preset

pytestmark = pytest.mark.timeout(60)

K = 4
FLOAT32 = 4


def _plan(world: int = 4, topology: str = "multisite", **config) -> ShardingPlan:
    return plan_sharding("vit-s", topology, world_size=world, config=PlannerConfig(**config))


@pytest.mark.parametrize(("world", "ranks_per_site", "shard_tier"), [(4, 2, "IB"), (16, 8, "IB")])
def test_every_candidate_shards_inside_one_site(world: int, ranks_per_site: int, shard_tier: str) -> None:
    plan = _plan(world, reconcile_period=K)
    topo = plan.topology
    assert {c.shard_size for c in plan.candidates} == {ranks_per_site}
    assert not any(c.state_sharded for c in plan.candidates)  # nothing crosses the WAN on a local step
    assert {c.param_sharding for c in plan.candidates} == {"sharded"}  # no partial plan: it crosses sites every step
    assert plan.mesh.shape == (2, ranks_per_site) and plan.mesh.dim_names == ("replicate", "shard")
    assert (plan.mesh.shard_tier, plan.mesh.replicate_tier) == (shard_tier, "WAN")
    for rank in range(world):  # shard groups are consecutive ranks: every one lies inside one site
        start = rank - rank % plan.mesh.shard_size
        assert {topo.site_of(r) for r in range(start, start + plan.mesh.shard_size)} == {topo.site_of(rank)}
    assert all(phase.tier != "WAN" and phase.axis == "shard" for phase in plan.comm)
    assert plan.reconciliation is not None and plan.reconciliation.tier == "WAN"


def test_without_a_period_the_plan_is_todays() -> None:
    plan = _plan()
    assert plan.reconciliation is None
    assert any(c.state_sharded for c in plan.candidates) and any(c.shard_size == 4 for c in plan.candidates)
    data = json.loads(plan.to_json())
    assert data["format_version"] == 2 and "reconciliation" not in data and "reconcile_period" not in data["config"]
    assert plan.predicted_comm_s_per_step == sum(p.time_s for p in plan.comm)


def test_reconciliation_cost_is_the_network_models_all_reduce_over_the_cross_site_ranks_divided_by_k() -> None:
    plan = _plan(reconcile_period=K)
    topo, rec, cfg = plan.topology, plan.reconciliation, plan.config
    s = plan.mesh.shard_size
    chunks = [u.padded_numel // s for u in plan.units]  # each rank's shard of each unit
    assert sum(chunks) * s == sum(p.padded_numel for p in plan.placements)
    for cross_site in ([0, 2], [1, 3]):  # the ranks holding one shard, one per site: both groups cost the same
        grad = [topo.collective_cost("all_reduce", n * cfg.grad_bytes, cross_site) for n in chunks]
        param = topo.collective_cost("all_reduce", sum(chunks) * cfg.param_bytes, cross_site)
        assert {c.tier for c in grad} == {param.tier} == {"WAN"}
        expected_s = sum(c.time_s for c in grad) + param.time_s
        assert rec.time_s == pytest.approx(expected_s, rel=1e-12)
        assert rec.amortised_s_per_step == pytest.approx(expected_s / K, rel=1e-12)
        assert rec.wire_bytes_per_rank == sum(c.wire_bytes for c in grad) + param.wire_bytes
    assert (rec.period, rec.num_ranks, rec.num_groups) == (K, 2, 2)
    assert [(p.name, p.num_collectives) for p in rec.phases] == [("gradient all-reduce", len(chunks)),
                                                                ("parameter average", 1)]
    per_step = sum(p.time_s for p in plan.comm)
    assert plan.predicted_comm_s_per_step == pytest.approx(per_step + rec.amortised_s_per_step, rel=1e-12)
    chosen = next(c for c in plan.candidates if c.chosen)
    assert chosen.time_s == pytest.approx(plan.predicted_comm_s_per_step, rel=1e-12)
    assert plan.tier_bytes_per_step["WAN"] == round(rec.wire_bytes_per_rank / K)


def test_the_wan_all_reduce_leaves_every_step_and_the_anchor_joins_the_memory() -> None:
    # the same site-sharded candidate with and without the period
    every_step = _plan(shard_size=2, allow_state_sharding=False, reshard_after_forward=True)
    periodic = _plan(reconcile_period=K, reshard_after_forward=True)
    assert every_step.strategy == periodic.strategy == "hsdp-site" and every_step.units == periodic.units
    wan = [p for p in every_step.comm if p.tier == "WAN"]
    assert [(p.name, p.op) for p in wan] == [("gradient all-reduce", "all_reduce")]
    assert periodic.comm == tuple(p for p in every_step.comm if p.tier != "WAN")
    # SlowMo's anchor and slow momentum: 2 x this rank's parameter shard in float32
    before, after = every_step.rank_bytes, periodic.rank_bytes
    pb = periodic.config.param_bytes
    shard_numel = before.padded_param_bytes // pb
    assert after.peak_bytes - before.peak_bytes == 2 * shard_numel * FLOAT32
    assert after.fsdp2_peak_bytes - before.fsdp2_peak_bytes == 2 * shard_numel * FLOAT32
    assert periodic.reconciliation.slowmo_state_bytes == 2 * shard_numel * FLOAT32
    assert [a - b for a, b in zip(after.optim_bytes, before.optim_bytes)] == [2 * p // pb * FLOAT32
                                                                              for p in before.param_bytes]
    assert (after.param_bytes, after.grad_bytes) == (before.param_bytes, before.grad_bytes)


def test_a_longer_period_costs_less_per_step() -> None:
    times = {k: _plan(reconcile_period=k, reshard_after_forward=True) for k in (1, 4, 16)}
    rec = {k: p.reconciliation for k, p in times.items()}
    assert rec[1].time_s == rec[4].time_s == rec[16].time_s
    assert rec[1].amortised_s_per_step == pytest.approx(4 * rec[4].amortised_s_per_step, rel=1e-12)
    assert times[1].predicted_comm_s_per_step > times[4].predicted_comm_s_per_step > times[16].predicted_comm_s_per_step


def test_on_the_wan_preset_the_site_is_a_node() -> None:
    plan = _plan(topology="wan", reconcile_period=K)
    assert (plan.strategy, plan.mesh.shape, plan.mesh.shard_tier, plan.mesh.replicate_tier) == \
        ("hsdp-node", (2, 2), "LAN", "WAN")
    assert plan.reconciliation.tier == "WAN"


def test_fsdp2_default_ignores_the_period() -> None:
    cfg = PlannerConfig(reconcile_period=K)
    base = fsdp2_default_plan("vit-s", "multisite", world_size=4, config=cfg)
    assert base.reconciliation is None and base.config.reconcile_period is None
    assert any(p.tier == "WAN" and p.op == "all_reduce" for p in base.comm)


def test_json_round_trip_is_format_3() -> None:
    plan = _plan(reconcile_period=K)
    data = json.loads(plan.to_json())
    assert data["format_version"] == 3 and data["config"]["reconcile_period"] == K
    assert data["reconciliation"]["period"] == K and data["reconciliation"]["tier"] == "WAN"
    assert set(data["reconciliation"]) >= {"wire_bytes_per_rank", "time_s", "amortised_s_per_step",
                                           "slowmo_state_bytes", "phases", "anchor_dtype"}
    assert ShardingPlan.from_json(plan.to_json()) == plan
    assert plan.summary()["reconciliation"] == data["reconciliation"]
    assert "reconciliation" not in _plan().summary()


@pytest.mark.parametrize("k", [0, -1, 1.5, True, "4"])
def test_a_bad_period_is_refused_in_one_line(k) -> None:
    with pytest.raises(PlannerError) as info:
        PlannerConfig(reconcile_period=k)
    assert str(info.value) == (f"reconcile_period = {k!r} is invalid; use a whole number of steps >= 1 (CPDP's K, "
                               "such as 4) or None (all-reduce across sites every step)")


@pytest.mark.parametrize(("make", "message"), [
    (lambda: PlannerConfig(reconcile_period=4, param_sharding="replicated"),
     "param_sharding = 'replicated' exchanges gradients and parameters across the world every step, which "
     "reconcile_period = 4 forbids (the WAN carries only the reconciliation); use 'sharded' or None, or leave "
     "reconcile_period None"),
    (lambda: _plan(topology="cluster", reconcile_period=4),
     "reconcile_period = 4 reconciles across sites, but topology 'cluster' has one site (4 ranks); leave "
     "reconcile_period None or use a topology of several sites (multisite, wan, or a TOML with num_sites >= 2)"),
    (lambda: _plan(reconcile_period=4, shard_size=4),
     "shard_size = 4 contradicts reconcile_period = 4: the shard axis is then a site of 'multisite' (2 ranks); "
     "leave shard_size None or set it to 2"),
])
def test_a_period_that_cannot_apply_is_refused_in_one_line(make, message: str) -> None:
    with pytest.raises(PlannerError) as info:
        make()
    assert str(info.value) == message


def test_the_memory_budget_counts_the_anchor() -> None:
    budget = _plan(shard_size=2, allow_state_sharding=False, reshard_after_forward=True).rank_bytes.peak_bytes
    assert _plan(shard_size=2, allow_state_sharding=False, reshard_after_forward=True,
                 memory_budget_bytes=budget).rank_bytes.peak_bytes == budget  # fits without the period
    with pytest.raises(PlannerError, match=r"^memory budget .* is too small for vit-s on 4 ranks: the leanest plan "
                                           r"\(hsdp-site\) needs"):
        _plan(reconcile_period=K, reshard_after_forward=True, memory_budget_bytes=budget)


# ---- cpdpkit plan --reconcile-period ----------------------------------------------------------------
runner = CliRunner()
ARGS = ["plan", "--model", "vit-s", "--topology", "multisite", "--world-size", "4"]


def test_cli_shows_the_reconciliation_and_writes_it(tmp_path) -> None:
    out = tmp_path / "plan.json"
    result = runner.invoke(app, [*ARGS, "--reconcile-period", "4", "--json", str(out)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for text in ("cross-site reconciliation every 4 steps (WAN; 2 group(s) of 2 ranks, one per shard)",
                 "parameter average", "replicate 2 (WAN) x shard 2 (IB)", "every 4 steps", "CPDP across sites"):
        assert text in result.output, text
    data = json.loads(out.read_text())
    plan = ShardingPlan.load(out)
    assert plan.reconciliation is not None and plan.reconciliation.period == 4
    assert data["summary"]["reconciliation"]["amortised_s_per_step"] == plan.reconciliation.amortised_s_per_step
    (row,) = [line for line in result.output.splitlines() if line.startswith("│ reconciliation")]
    assert f"{plan.reconciliation.amortised_s_per_step:.4f} s" in row


def test_cli_hints_at_the_period_on_several_sites() -> None:
    result = runner.invoke(app, ARGS, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "hint: the replicate axis crosses the WAN every step" in result.output
    assert "--reconcile-period K" in result.output and "cross-site reconciliation" not in result.output


@pytest.mark.parametrize(("args", "message"), [
    (["--reconcile-period", "0"], "error: reconcile_period = 0 is invalid; use a whole number of steps >= 1"),
    (["--reconcile-period", "4", "--topology", "cluster"],
     "error: reconcile_period = 4 reconciles across sites, but topology 'cluster' has one site"),
])
def test_cli_bad_period_is_one_line_and_exit_2(args, message: str) -> None:
    result = runner.invoke(app, [*ARGS, *args], env={"COLUMNS": "300"})
    assert result.exit_code == 2
    assert result.stderr.startswith(message) and len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.output


def test_presets_agree_with_the_plan_topology() -> None:
    assert _plan(reconcile_period=K).topology == preset("multisite", world_size=4)
