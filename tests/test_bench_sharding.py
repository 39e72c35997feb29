"""cpdpkit bench sharding: one quick end-to-end run (hsdp, the ZeRO peers and both executors over the
emulated slow-IB cluster), the goals' arithmetic, the ZeRO peers' unsupported cases (clipping with
overlap, torch's refusal of gloo), the one-line refusals of bad configurations (exit 2, before any
launch), the sub-command's own options and defaults, and the deprecated ``cpdpkit bench --suite
sharding``."""

from __future__ import annotations

import json
import re

import pytest
import typer.main
from typer.testing import CliRunner

from _ranks import SPAWN_TIMEOUT_S
from _suite_jobs import run_suite, share_suite
from cpdpkit.bench.models.gpt import GPT_PRESETS
from cpdpkit.bench.sharding.suite import SHARDING_STRATEGIES, ShardingBenchConfig
from cpdpkit.cli import app

RESULT_KEYS = {"strategy": str, "step_s": float, "exposed_comm_s_per_step": float, "tier_bytes_per_step": dict,
               "optimizer_state_bytes_per_rank": int, "peak_mem_bytes": int, "final_loss": float}
SHARDING_OPTIONS = {"--strategies", "--model", "--world-size", "--topology", "--batch-size", "--lr", "--steps",
                    "--optimizer", "--memory-budget", "--min-unit-bytes", "--max-grad-norm", "--quick", "--profile",
                    "--json", "--work-dir"}
QUICK_STRATEGIES = ("hsdp", "zero1", "zero1-overlap", "two-stage", "partial")
NOTICE = "note: `cpdpkit bench --suite sharding` is deprecated; use `cpdpkit bench sharding` (same options)"


SHARDING_ARGS = ["sharding", "--quick", "--strategies", ",".join(QUICK_STRATEGIES)]
# Its jobs run in the session's shared group of 4 processes (tests/_suite_jobs.py): ~2 s each instead of a
# 4-rank torchrun launch each (~12 s of start-up on a quiet machine, 30-60 s loaded).
share_suite(__name__, SHARDING_ARGS)


@pytest.mark.slow
@pytest.mark.timeout(SPAWN_TIMEOUT_S)  # the first test to ask for planner_spawn waits for all of it
def test_quick_sharding_suite_runs_the_peers_and_executors_and_judges_their_goals(tmp_path, planner_spawn):
    # The strategies with code of their own in the suite: fsdp2 and planned run the same FSDP2 branch of the
    # worker as hsdp (apply_plan has its own tests) and are left out.
    out = tmp_path / "s.json"
    result = run_suite(__name__, [*SHARDING_ARGS, "--json", str(out)], planner_spawn)
    assert result.exit_code == 0, result.output[-4000:]
    assert "two-stage" in result.stdout and "exposed ms/step" in result.stdout and "stage1 meas/pred" in result.stdout
    assert "deprecated" not in result.stderr
    report = json.loads(out.read_text())
    cfg = report["config"]
    assert cfg["topology"] == "cluster-slow-ib" and cfg["world_size"] == 4
    assert cfg["model"] == "gpt-micro" and cfg["steps"] == 4
    assert cfg["plan"]["strategy"] != "partial" and cfg["partial_plan"]["strategy"] == "partial"
    results = {r["strategy"]: r for r in report["results"]}
    assert list(results) == list(QUICK_STRATEGIES)
    for r in results.values():
        assert r["status"] == "ok", r
        for key, kind in RESULT_KEYS.items():
            assert isinstance(r[key], kind), (r["strategy"], key, r[key])
        assert all(isinstance(t, str) and isinstance(b, int) and b > 0 for t, b in r["tier_bytes_per_step"].items())
        # every strategy waits on the 1 ms IB link at least once a step, and waiting is part of the step
        assert 0 < r["exposed_comm_s_per_step"] < r["step_s"], r
        # the same waits split by the tier of the group waited on (each tier's max over ranks)
        by_tier = r["exposed_comm_s_per_step_by_tier"]
        assert by_tier.get("IB", 0) > 0 and set(by_tier) <= {"IB", "NVLINK"}, r
        assert all(v <= r["exposed_comm_s_per_step"] + 1e-9 for v in by_tier.values()), r
    hsdp, two, partial = results["hsdp"], results["two-stage"], results["partial"]
    replicas, rpn, world = cfg["num_replicas"], cfg["ranks_per_node"], cfg["world_size"]
    assert replicas == 2
    assert two["optimizer_state_bytes_per_rank"] * replicas == hsdp["optimizer_state_bytes_per_rank"]
    # partial shards the state over the whole world: hsdp's node shard split once more over the replicas
    assert partial["optimizer_state_bytes_per_rank"] * world == hsdp["optimizer_state_bytes_per_rank"] * rpn
    for name in ("two-stage", "zero1", "zero1-overlap", "partial"):  # same seed, data and optimizer as hsdp
        assert abs(results[name]["final_loss"] - hsdp["final_loss"]) <= 1e-4, name
    # Computed independently of the emulator's count: with a node-sharded mesh, the only IB traffic is the
    # all-reduce of each rank's fp32 gradient shard (1/ranks_per_node of the model, no padding for gpt-micro's
    # even shapes) across the 2 replicas, where a ring sends 2 (r - 1) / r = 1 shard; partial sends the same
    # shard as a reduce-scatter and an all-gather of its halves. DDP (the ZeRO peers) all-reduces the whole
    # model over the world, which the network model prices hierarchically (in-node reduce-scatter, the
    # 1/ranks_per_node shard all-reduced across the replicas: the same IB bytes, in-node all-gather), then
    # ZeRO broadcasts the updated parameters: at least partial's IB bytes, and NVLINK bytes as well.
    model_bytes = GPT_PRESETS["gpt-micro"].num_params * 4
    for name in ("hsdp", "two-stage", "partial"):
        assert results[name]["tier_bytes_per_step"]["IB"] == model_bytes // rpn, name
    for name in ("zero1", "zero1-overlap"):
        assert set(results[name]["tier_bytes_per_step"]) == {"IB", "NVLINK"}, name
        assert results[name]["tier_bytes_per_step"]["IB"] >= model_bytes // rpn, name
    for name in ("two-stage", "partial"):
        r = results[name]
        assert isinstance(r["num_units"], int) and r["num_units"] >= 1 and r["calibrated"] is True, r
        assert 0 <= r["stage1_units"] <= r["num_units"] and 0 <= r["stage1_units_predicted"] <= r["num_units"], r
        assert r["clip_speculated"] == 0 and r["clip_mispredicted"] == 0, r  # no --max-grad-norm
    goals = report["goals"]
    for name in ("two-stage", "partial"):
        g = goals[name]
        assert g["step_time"]["peers"] == ["zero1", "zero1-overlap"], g  # hsdp shards parameters: no peer
        assert g["optimizer_state"]["met"] and set(g["stage1"]) >= {"measured", "predicted", "abs_diff", "met"}, g
    assert set(goals["partial"]["bytes"]["by_peer"]) == {"zero1", "zero1-overlap"}
    assert goals["final_loss"]["reference"] == "zero1"
    assert all(g["met"] for g in goals["final_loss"]["by_strategy"].values())
    for line in ("partial vs fastest partially sharded peer (", "two-stage final loss |diff|",
                 "partial bytes/step per link vs zero1's on the same link: IB x", "partial optimizer state",
                 "partial stage-1 exchanges per step: measured"):
        assert line in result.stdout, line


@pytest.mark.slow
@pytest.mark.timeout(30)
@pytest.mark.parametrize("args, expect", [
    (["--world-size", "3"], "topology 'cluster-slow-ib' needs a world size divisible by 2 (1 site(s) x ? node(s) x "
                            "2 rank(s)); got 3"),
    (["--world-size", "2"], "the sharding suite needs >= 2 nodes"),
    (["--optimizer", "adafactor"], "optimizer 'adafactor' is not elementwise"),
    (["--memory-budget", "1MiB"], "memory budget 1.00 MiB per rank is too small"),
    (["--model", "resnet50"], "unknown model 'resnet50'"),
    (["--max-grad-norm", "0"], "--max-grad-norm must be > 0, got 0.0: e.g. --max-grad-norm 1.0"),
    (["--strategies", "zero2"], "unknown strategy 'zero2' for cpdpkit bench sharding: choose from fsdp2, "
                                "fsdp2-zero2, hsdp, zero1, zero1-overlap, planned, two-stage, partial"),
])
def test_bad_sharding_configuration_is_one_line_exit_2(args, expect, tmp_path):
    result = CliRunner().invoke(app, ["bench", "sharding", "--work-dir", str(tmp_path / "w"), *args])
    text = result.output.strip()
    assert result.exit_code == 2, text
    assert expect in text and len(text.splitlines()) == 1, text
    assert not (tmp_path / "w").exists()  # nothing launched


@pytest.mark.timeout(30)
@pytest.mark.parametrize("command", [["bench", "sharding"], ["bench", "--quick"]])
def test_an_unwritable_json_path_is_refused_before_any_run(command, tmp_path):
    (tmp_path / "file").write_text("")
    bad = tmp_path / "file" / "out.json"  # its folder would have to be a file
    result = CliRunner().invoke(app, [*command, "--work-dir", str(tmp_path / "w"), "--json", str(bad)])
    text = result.output.strip()
    assert result.exit_code == 2, text
    assert text.startswith(f"error: --json {str(bad)!r} cannot be written (") and len(text.splitlines()) == 1, text
    assert not (tmp_path / "w").exists()  # nothing launched
    made = tmp_path / "new" / "dir" / "out.json"
    from cpdpkit.cli._app import prepare_output

    prepare_output(str(made), "--json")  # a folder that does not exist yet is made
    assert made.parent.is_dir()


def test_main_job_options_before_the_suite_name_are_refused(tmp_path):
    result = CliRunner().invoke(app, ["bench", "--quick", "--world-size", "4", "sharding", "--work-dir", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert result.output.strip() == (
        "error: --quick --world-size 4 before 'sharding' would be ignored: put the options after the suite's name, "
        "e.g. cpdpkit bench sharding --quick --world-size 4")


def _sharding_command():  # type: ignore[no-untyped-def]
    return typer.main.get_command(app).commands["bench"].commands["sharding"]  # type: ignore[attr-defined]


def test_sharding_help_lists_only_its_options():
    params = {opt for p in _sharding_command().params for opt in p.opts}
    assert params == SHARDING_OPTIONS
    result = CliRunner().invoke(app, ["bench", "sharding", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert set(re.findall(r"--[a-z][a-z-]*", result.output)) == SHARDING_OPTIONS | {"--help"}


def test_sharding_help_defaults_are_the_configs():
    config = ShardingBenchConfig()
    documented = {p.name: str(p.show_default).split(";")[0].strip() for p in _sharding_command().params
                  if isinstance(p.show_default, str)}
    assert documented.pop("strategies") == "all eight" and config.strategies == SHARDING_STRATEGIES
    assert documented.pop("memory_budget") == "no limit" and config.memory_budget is None
    assert documented.pop("max_grad_norm") == "no clipping" and config.max_grad_norm is None
    assert documented.pop("min_unit_bytes") == "0" and config.min_unit_bytes is None  # 0: the planner's units
    assert documented == {name: str(getattr(config, name)) for name in documented}
    assert set(documented) == {"model", "world_size", "topology", "batch_size", "lr", "steps", "optimizer"}


def test_min_unit_bytes_zero_is_the_planners_units_with_stage_1_and_one_is_per_block():
    from cpdpkit.bench.sharding.suite import RANK_FLOPS_PER_S, prepare
    from cpdpkit.cli._bench_sharding import sharding_config

    auto = sharding_config(strategies="two-stage", quick=False, profile=None, min_unit_bytes=0)
    per_block = sharding_config(strategies="two-stage", quick=False, profile=None, min_unit_bytes=1)
    assert auto.min_unit_bytes is None and per_block.min_unit_bytes == 1
    assert [u.name for u in prepare(per_block).plan.units] == ["<root>", *(f"blocks.{i}" for i in range(4))]
    # the planner's own units on the suite's compute model leave updated-parameter exchanges to run under
    # backward (stage 1), for both executors: with one merged unit of the blocks none could
    both = prepare(sharding_config(strategies="two-stage,partial", quick=False, profile=None, min_unit_bytes=0))
    for plan in (both.plan, both.partial_plan):
        assert plan.config.flops_per_s == RANK_FLOPS_PER_S, plan.config
        assert plan.schedule.num_stage1 >= 1, (plan.strategy, [u.name for u in plan.units])


def _captured_config(monkeypatch: pytest.MonkeyPatch, args: list[str]) -> tuple[object, CliRunner]:
    import cpdpkit.cli.bench as bench_cli

    seen = []
    monkeypatch.setattr(bench_cli, "run_sharding_suite", lambda config, **kw: seen.append((config, kw)))
    result = CliRunner().invoke(app, ["bench", *args])
    assert result.exit_code == 0, result.output
    (captured,) = seen
    return captured, result


def test_deprecated_suite_option_runs_the_same_suite_with_a_notice(monkeypatch, tmp_path):
    opts = ["--quick", "--world-size", "6", "--optimizer", "sgd", "--steps", "9", "--json", str(tmp_path / "s.json")]
    new, new_result = _captured_config(monkeypatch, ["sharding", *opts])
    old, old_result = _captured_config(monkeypatch, ["--suite", "sharding", *opts])
    assert old == new
    config, kw = new
    assert (config.model, config.world_size, config.optimizer, config.steps, config.warmup_steps) == (
        "gpt-micro", 6, "sgd", 4, 1)
    assert kw == {"json_out": str(tmp_path / "s.json"), "work_dir": None}
    assert old_result.stderr.strip() == NOTICE and old_result.stdout == ""
    assert new_result.stderr == "" and new_result.stdout == ""


def test_deprecated_suite_option_keeps_one_line_errors(tmp_path):
    result = CliRunner().invoke(app, ["bench", "--suite", "sharding", "--world-size", "3",
                                      "--work-dir", str(tmp_path / "w")])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert lines[0] == NOTICE and len(lines) == 2, result.stderr
    assert lines[1].startswith("error: topology 'cluster-slow-ib' needs a world size divisible by 2")
    assert not (tmp_path / "w").exists()


def _ok(strategy: str, step_ms: float, exposed_ms: float, state: int, loss: float = 5.0, **extra: object) -> dict:
    return {"strategy": strategy, "status": "ok", "step_s": step_ms / 1e3, "exposed_comm_s_per_step": exposed_ms / 1e3,
            "optimizer_state_bytes_per_rank": state, "final_loss": loss,
            "tier_bytes_per_step": {"IB": 200, "NVLINK": 300}, **extra}


def test_goals_judge_the_executors_against_the_fastest_partially_sharded_peer():
    from cpdpkit.bench.sharding.goals import goal_lines, judge

    results = [_ok("fsdp2", 10, 5, 400), _ok("hsdp", 120, 40, 800), _ok("zero1", 80, 30, 200),
               {"strategy": "zero1-overlap", "status": "unsupported", "reason": "no clipping"},
               _ok("fsdp2-zero2", 100, 20, 200, tier_bytes_per_step={"IB": 100, "NVLINK": 300}),
               _ok("two-stage", 60, 15, 400, loss=5.00005, stage1_units=1.5, stage1_units_predicted=3, num_units=4),
               _ok("partial", 70, 20, 400, loss=5.001, tier_bytes_per_step={"IB": 110, "NVLINK": 302},
                   stage1_units=0.0, stage1_units_predicted=0, num_units=4)]
    goals = judge(results, topology="cluster-slow-ib", inter_node_tier="IB", num_replicas=2)
    two, partial = goals["two-stage"], goals["partial"]
    # fsdp2 (fully sharded) is faster but no peer; zero1-overlap did not run: the fastest peer is zero1
    assert two["step_time"]["peers"] == ["zero1", "fsdp2-zero2"] and two["step_time"]["fastest_peer"] == "zero1"
    assert two["step_time"]["ratio"] == pytest.approx(0.75) and two["step_time"]["met"]
    assert partial["step_time"]["ratio"] == pytest.approx(0.875) and not partial["step_time"]["met"]
    assert two["step_time"]["exposed_comm_ratio"] == {"zero1": pytest.approx(0.5), "fsdp2-zero2": pytest.approx(0.75)}
    # stage 1: two-stage is 1.5 off its prediction; partial is within 1 but empty, which misses the goal
    assert two["stage1"]["abs_diff"] == 1.5 and not two["stage1"]["met"]
    assert partial["stage1"]["abs_diff"] == 0 and not partial["stage1"]["met"]
    # bytes per link against each peer's on that link: IB 110 is 0.55x zero1's 200 (its target), 1.1x fsdp2-zero2's
    by_peer = partial["bytes"]["by_peer"]
    assert by_peer["zero1"]["IB"] == {"bytes": 110, "peer_bytes": 200, "ratio": pytest.approx(0.55), "target": 0.55,
                                      "met": True}
    assert by_peer["zero1"]["NVLINK"]["target"] == 1.01 and by_peer["zero1"]["NVLINK"]["met"]
    assert not by_peer["fsdp2-zero2"]["IB"]["met"] and not partial["bytes"]["met"]
    assert partial["optimizer_state"] == {"bytes": 400, "target": 400, "ratio": 1.0, "met": True}
    assert goals["final_loss"]["reference"] == "zero1"
    assert set(goals["final_loss"]["by_strategy"]) == {"fsdp2", "hsdp", "fsdp2-zero2", "two-stage", "partial"}
    assert goals["final_loss"]["by_strategy"]["two-stage"]["met"]
    assert not goals["final_loss"]["by_strategy"]["partial"]["met"]
    lines = goal_lines(goals)
    assert lines[0] == ("partial vs fastest partially sharded peer (zero1 of zero1, fsdp2-zero2): step time x0.875 "
                        "(target <= 0.85) not met")
    assert "partial bytes/step per link vs zero1's on the same link: IB x0.550 (<= 0.55), NVLINK x1.007 (<= 1.01) met" \
        in lines
    assert not any("hsdp:" in line or "vs hsdp" in line for line in lines)  # no goal against a fully sharded peer
    # communication-dominated: partial's target is 0.70
    slower = judge(results, topology="cluster-slower-ib", inter_node_tier="IB", num_replicas=2)
    assert slower["partial"]["step_time"]["target"] == 0.70 and slower["two-stage"]["step_time"]["target"] == 0.85
    # a missing strategy leaves its goals out; nothing to judge is {}
    assert set(judge([results[-1]], topology="x", inter_node_tier="IB", num_replicas=2)) == {"partial"}
    assert judge([results[0]], topology="x", inter_node_tier="IB", num_replicas=2) == {}


@pytest.mark.timeout(60)
def test_zero1_overlap_with_clipping_is_reported_unsupported_without_a_launch(tmp_path):
    from cpdpkit.bench.sharding.zero_peers import OVERLAP_CLIP_REASON

    out = tmp_path / "s.json"
    result = CliRunner().invoke(app, ["bench", "sharding", "--strategies", "zero1-overlap", "--max-grad-norm", "1",
                                      "--work-dir", str(tmp_path / "w"), "--json", str(out)])
    assert result.exit_code == 0, result.output
    (r,) = json.loads(out.read_text())["results"]
    assert (r["status"], r["reason"], r["launch_s"]) == ("unsupported", OVERLAP_CLIP_REASON, 0.0)
    assert not (tmp_path / "w" / "zero1-overlap").exists()  # not launched
    assert f"zero1-overlap unsupported: {OVERLAP_CLIP_REASON}" in " ".join(result.output.split())


@pytest.mark.timeout(60)
def test_zero1_overlap_on_plain_gloo_is_unsupported_with_torchs_reason():
    import torch
    import torch.distributed as dist

    from cpdpkit.bench.models.gpt import TinyGPT, gpt_preset, token_batch
    from cpdpkit.bench.sharding.zero_peers import ZeroPeerUnsupported, build_zero_peer

    cfg = gpt_preset("gpt-micro")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ZeroPeerUnsupported) as info:
            build_zero_peer("zero1-overlap", TinyGPT(cfg), optimizer_class=torch.optim.AdamW,
                            optimizer_kwargs={"lr": 1e-3}, max_grad_norm=None,
                            priming_batch=token_batch(cfg, seed=0, step=0, global_batch=1, rank=0, batch_size=1))
    finally:
        dist.destroy_process_group()
    assert str(info.value) == ("torch's hook_with_zero_step on backend 'gloo': Gloo backend using Overlapping DDP "
                               "with ZeRO may meet hangs")
