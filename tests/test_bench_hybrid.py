"""cpdpkit bench hybrid: one quick end-to-end run of four of the five strategies over the emulated ``multisite``
cluster (the JSON's shape, every strategy ran, the bytes and memory each must account for, the loss
curves, the plot), the goals' arithmetic, the one-line refusals of bad input (exit 2, before any
launch) and the sub-command's own options and defaults."""

from __future__ import annotations

import json
import re

import pytest
import typer.main
from typer.testing import CliRunner

from _ranks import SPAWN_TIMEOUT_S
from _suite_jobs import run_suite, share_suite
from cpdpkit.bench.hybrid.suite import HYBRID_STRATEGIES, HybridBenchConfig
from cpdpkit.bench.models.gpt import GPT_PRESETS
from cpdpkit.cli import app

RESULT_KEYS = {"strategy": str, "step_s": float, "exposed_comm_s_per_step": float, "tier_bytes_per_step": dict,
               "exposed_comm_s_per_step_by_tier": dict, "param_shard_bytes_per_rank": int,
               "grad_bytes_per_rank": int, "optimizer_state_bytes_per_rank": int, "sync_state_bytes_per_rank": int,
               "training_state_bytes_per_rank": int, "peak_mem_bytes": int, "final_loss": float,
               "loss_curve_rank_mean": list, "step_s_by_rank": list, "step_s_median": float}
HYBRID_OPTIONS = {"--strategies", "--model", "--world-size", "--topology", "--batch-size", "--lr", "--steps",
                  "--period", "--overlap-steps", "--compression", "--slowmo-momentum", "--quick", "--profile",
                  "--json", "--plot", "--work-dir"}


HYBRID_RAN = ("ddp-global", "hsdp-global", "cpdp-over-hsdp", "cpdp-over-two-stage")
HYBRID_ARGS = ["hybrid", "--quick", "--strategies", ",".join(HYBRID_RAN)]
# Its jobs run in the session's shared group of 4 processes (tests/_suite_jobs.py): ~2 s each instead of a
# 4-rank torchrun launch each (~12 s of start-up on a quiet machine, 30-60 s loaded).
share_suite(__name__, HYBRID_ARGS)


@pytest.mark.slow
@pytest.mark.timeout(SPAWN_TIMEOUT_S)  # the first test to ask for planner_spawn waits for all of it
def test_quick_hybrid_suite_runs_the_peers_and_ours_and_accounts_for_bytes_and_memory(tmp_path, planner_spawn):
    # gpt-micro, one period timed. The overlapped variant is left out: tests/test_sync_sharded.py checks its
    # numerics.
    out, plot, ran = tmp_path / "h.json", tmp_path / "loss.png", HYBRID_RAN
    result = run_suite(__name__, [*HYBRID_ARGS, "--json", str(out), "--plot", str(plot)], planner_spawn)
    assert result.exit_code == 0, result.output[-4000:]
    assert "WAN exp. ms" in result.stdout and "cpdp-over-hsdp vs hsdp-global: step time x" in result.stdout
    assert plot.stat().st_size > 0
    report = json.loads(out.read_text())
    cfg = report["config"]
    assert (cfg["topology"], cfg["world_size"], cfg["num_sites"], cfg["ranks_per_site"]) == ("multisite", 4, 2, 2)
    assert (cfg["model"], cfg["steps"], cfg["warmup_steps"], cfg["period"], cfg["optimizer"]) == (
        "gpt-micro", 4, 4, 4, "adamw")
    results = {r["strategy"]: r for r in report["results"]}
    assert list(results) == list(ran) and set(ran) < set(HYBRID_STRATEGIES)
    for r in results.values():
        assert r["status"] == "ok", r
        for key, kind in RESULT_KEYS.items():
            assert isinstance(r[key], kind), (r["strategy"], key, r[key])
        assert len(r["loss_curve_rank_mean"]) == cfg["warmup_steps"] + cfg["steps"]
        assert r["loss_curve_rank_mean"][-1] == r["final_loss"]
        assert 0 < r["exposed_comm_s_per_step"] < r["step_s"], r
        assert len(r["step_s_by_rank"]) == 4 and {len(s) for s in r["step_s_by_rank"]} == {cfg["steps"]}
        assert min(min(s) for s in r["step_s_by_rank"]) > 0
        # one period timed: its slowest rank's mean step; the plain mean is over the same steps (max over ranks)
        assert r["step_s_median"] == pytest.approx(max(sum(s) for s in r["step_s_by_rank"]) / cfg["steps"])
        assert r["step_s_median"] == pytest.approx(r["step_s"], rel=0.05)
    ddp, hsdp = results["ddp-global"], results["hsdp-global"]
    # Computed independently of the emulator's count (gpt-micro's shapes shard evenly over a site's 2 ranks):
    # hsdp-global all-reduces each rank's fp32 gradient shard across the 2 sites every step (a 2-rank ring sends
    # the shard once); CPDP sends the same shard twice per period (gradient all-reduce, parameter average);
    # DDP all-reduces the whole model over the 4-rank world, priced hierarchically as the network model does
    # (issue 28): a reduce-scatter and an all-gather inside each 2-rank site (the whole model over IB) around a
    # 2-site all-reduce of the half each rank holds (its shard, once, over the WAN).
    model_bytes = GPT_PRESETS["gpt-micro"].num_params * 4
    shard = model_bytes // 2
    assert hsdp["tier_bytes_per_step"]["WAN"] == shard
    assert ddp["tier_bytes_per_step"] == {"IB": model_bytes, "WAN": shard}
    ours = results["cpdp-over-hsdp"]
    assert ours["tier_bytes_per_step"]["WAN"] == 2 * shard // cfg["period"] < hsdp["tier_bytes_per_step"]["WAN"]
    assert ours["tier_bytes_per_step"]["IB"] == hsdp["tier_bytes_per_step"]["IB"]  # FSDP2 inside the site alike
    assert ours["param_shard_bytes_per_rank"] == shard
    # Persistent state: parameters, gradients and AdamW's two moments, on the shard (HSDP) or the model (DDP);
    # CPDP adds SlowMo's anchor and slow momentum, one fp32 shard each.
    assert hsdp["param_shard_bytes_per_rank"] == shard and hsdp["training_state_bytes_per_rank"] == 4 * shard
    assert ddp["param_shard_bytes_per_rank"] == model_bytes and ddp["training_state_bytes_per_rank"] == 4 * model_bytes
    assert ours["sync_state_bytes_per_rank"] == 2 * shard
    assert ours["training_state_bytes_per_rank"] - hsdp["training_state_bytes_per_rank"] == 2 * shard
    # DDP and HSDP average the same gradients over the world: the same training
    assert abs(ddp["final_loss"] - hsdp["final_loss"]) <= 1e-4
    # CPDP over the two-stage executor: the same shard's worth crosses the WAN (its slices: the optimizer state
    # is sharded over the site's 2 ranks); inside the site the gradient reduce-scatter and the parameter
    # all-gather each send half the model; it holds the whole model, its gradients and its fp32 slices
    two = results["cpdp-over-two-stage"]
    assert two["tier_bytes_per_step"] == {"IB": model_bytes, "WAN": 2 * shard // cfg["period"]}
    assert two["param_shard_bytes_per_rank"] == model_bytes + shard
    assert two["optimizer_state_bytes_per_rank"] == two["sync_state_bytes_per_rank"] == 2 * shard
    assert two["training_state_bytes_per_rank"] == 2 * model_bytes + 5 * shard
    # CPDP over either layout is the same training
    assert abs(two["final_loss"] - ours["final_loss"]) <= 1e-4
    goals = report["goals"]
    assert set(goals) == {"cpdp-over-hsdp", "cpdp-over-two-stage"}
    assert goals["cpdp-over-two-stage"]["training_state_over_hsdp_in_shards"] == 5.0
    g = goals["cpdp-over-hsdp"]
    assert g["step_time_ratio"] == pytest.approx(ours["step_s_median"] / hsdp["step_s_median"])
    assert g["training_state_met"] and g["training_state_over_hsdp_in_shards"] == 2.0
    assert g["wan_bytes_ratio"] == 2 / cfg["period"]
    assert g["final_loss_rel_diff"] == pytest.approx(abs(ours["final_loss"] - hsdp["final_loss"]) / hsdp["final_loss"])


def _ok(strategy: str, step_ms: float, state: int, loss: float, shard: int = 100) -> dict:
    return {"strategy": strategy, "status": "ok", "step_s": step_ms / 1e3 + 1, "step_s_median": step_ms / 1e3,
            "exposed_comm_s_per_step": step_ms / 2e3,
            "training_state_bytes_per_rank": state, "param_shard_bytes_per_rank": shard, "final_loss": loss,
            "tier_bytes_per_step": {"WAN": 1000 if strategy == "hsdp-global" else 250}, "peak_mem_bytes": 10**8}


def test_median_period_step_time_keeps_each_periods_slow_step():
    from cpdpkit.bench.hybrid.suite import median_period_step_s

    local, reconcile = 0.1, 0.5  # CPDP at K=4: three local steps, then the reconciliation
    periods = [[local] * 3 + [reconcile]] * 4 + [[local] * 3 + [9.0]]  # a burst of load in the last period
    rank0 = [s for p in periods for s in p]
    # the other site is delayed on another step of each period, and waits less at the reconciliation
    rank1 = [s for _ in periods for s in (0.3, local, local, 0.3)]
    assert median_period_step_s([rank0, rank1], 4) == pytest.approx(0.2)  # not (0.3 + 0.1 + 0.1 + 0.5) / 4
    assert median_period_step_s([[1.0, 3.0, 2.0, 4.0]], 2) == 2.5  # an even number of periods: the middle two


def test_goals_compare_each_of_ours_with_hsdp_global():
    from cpdpkit.bench.hybrid.suite import _goals

    results = [_ok("ddp-global", 50, 1600, 4.0), _ok("hsdp-global", 100, 400, 4.0),
               _ok("cpdp-over-hsdp", 50, 600, 4.08), _ok("cpdp-over-hsdp-overlap", 40, 800, 3.9)]
    goals = _goals(results)
    assert set(goals) == {"cpdp-over-hsdp", "cpdp-over-hsdp-overlap"}
    ours, overlap = goals["cpdp-over-hsdp"], goals["cpdp-over-hsdp-overlap"]
    assert ours["step_time_ratio"] == 0.5 and ours["step_time_met"]
    assert ours["training_state_target"] == 600 and ours["training_state_met"]
    assert ours["training_state_over_hsdp_in_shards"] == 2.0
    assert ours["final_loss_rel_diff"] == pytest.approx(0.02) and ours["wan_bytes_ratio"] == 0.25
    assert overlap["step_time_ratio"] == pytest.approx(0.4) and not overlap["training_state_met"]
    assert overlap["final_loss_rel_diff"] == pytest.approx(0.025) and not overlap["final_loss_met"]
    # a strategy that did not run leaves its goals out; without hsdp-global nothing is judged
    failed = {"strategy": "cpdp-over-hsdp-overlap", "status": "failed", "reason": "rank 0: boom"}
    assert set(_goals(results[:3] + [failed])) == {"cpdp-over-hsdp"}
    assert _goals([results[0], results[2]]) == {}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, expect", [
    (["--strategies", "zero1"], "error: unknown strategy 'zero1' for cpdpkit bench hybrid: choose from ddp-global, "
                                "hsdp-global, cpdp-over-hsdp, cpdp-over-hsdp-overlap, "
                                "cpdp-over-two-stage"),
    (["--strategies", ","], "error: --strategies is empty: e.g. --strategies hsdp-global,cpdp-over-hsdp"),
    (["--model", "resnet50"], "error: unknown model 'resnet50' for cpdpkit bench hybrid: choose one of gpt-tiny, "
                              "gpt-small, gpt-micro"),
    (["--steps", "10"], "error: --steps 10 is not a multiple of --period 4: the timed steps must be whole periods "
                        "(one reconciliation each), e.g. --steps 24"),
    (["--period", "0"], "error: --period must be a whole number >= 1, got 0"),
    (["--overlap-steps", "4"], "error: --overlap-steps 4 must be smaller than --period 4: an average is applied "
                               "before the next reconciliation, e.g. --overlap-steps 1"),
    (["--lr", "0"], "error: --lr must be > 0, got 0.0"),
    (["--topology", "cluster"], "error: topology 'cluster' places 4 ranks on 1 site: the hybrid suite needs >= 2 "
                                "sites (its replicate axis spans the link between them); use e.g. --topology "
                                "multisite"),
    (["--world-size", "6"], "error: preset 'multisite' places world_size/4 ranks on each of 2 nodes x 2 sites, but "
                            "world_size = 6 is not divisible by 4"),
])
def test_bad_hybrid_input_is_one_line_exit_2_before_any_launch(args, expect, tmp_path):
    result = CliRunner().invoke(app, ["bench", "hybrid", "--work-dir", str(tmp_path / "w"),
                                      "--json", str(tmp_path / "out" / "h.json"), *args])
    text = " ".join(result.output.split())
    assert result.exit_code == 2, text
    assert text.startswith(expect) and len(result.output.strip().splitlines()) == 1, text
    assert not (tmp_path / "w").exists() and not (tmp_path / "out").exists()  # nothing launched nor written


def _hybrid_command():  # type: ignore[no-untyped-def]
    return typer.main.get_command(app).commands["bench"].commands["hybrid"]  # type: ignore[attr-defined]


def test_hybrid_help_lists_its_options_and_the_configs_defaults():
    assert {opt for p in _hybrid_command().params for opt in p.opts} == HYBRID_OPTIONS
    result = CliRunner().invoke(app, ["bench", "hybrid", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert set(re.findall(r"--[a-z][a-z-]*", result.output)) == HYBRID_OPTIONS | {"--help"}
    config = HybridBenchConfig()
    documented = {p.name: str(p.show_default).split(";")[0].strip() for p in _hybrid_command().params
                  if isinstance(p.show_default, str)}
    assert documented.pop("strategies") == "all five" and config.strategies == HYBRID_STRATEGIES
    from cpdpkit.sync import slowmo_beta_for

    # None: the library's table, whose value at the default's 2 sites the help states
    assert documented.pop("slowmo_momentum") == f"the library's default by replicas: {slowmo_beta_for(2):g} at 2 sites"
    assert config.slowmo_momentum is None
    assert documented == {name: str(getattr(config, name)) for name in documented}
    assert set(documented) == {"model", "world_size", "topology", "batch_size", "lr", "steps", "period",
                               "overlap_steps", "compression"}
    assert config.warmup_steps == config.period  # "after one period of warm-up steps"


def test_quick_is_gpt_micro_and_one_period(monkeypatch):
    import cpdpkit.cli.bench as bench_cli

    seen = []
    monkeypatch.setattr(bench_cli, "run_hybrid_suite", lambda config, **kw: seen.append((config, kw)))
    result = CliRunner().invoke(app, ["bench", "hybrid", "--quick", "--period", "2", "--strategies",
                                      "hsdp-global,cpdp-over-hsdp"])
    assert result.exit_code == 0, result.output
    ((config, kw),) = seen
    assert (config.model, config.steps, config.warmup_steps, config.period) == ("gpt-micro", 2, 2, 2)
    assert config.strategies == ("hsdp-global", "cpdp-over-hsdp")
    assert kw == {"json_out": None, "plot": None, "work_dir": None}
