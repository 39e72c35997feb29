"""``cpdpkit plan`` end to end through typer's CliRunner."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cpdpkit.cli import app
from cpdpkit.planner import ShardingPlan

pytestmark = pytest.mark.timeout(60)

SUMMARY_KEYS = {"world_size", "plan_seconds", "max_rank_bytes", "mean_rank_bytes", "padding_bytes", "model_bytes",
                "tier_bytes_per_step", "predicted_comm_s_per_step", "baseline"}


def test_plan_llama70b_tables_and_json(tmp_path):
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(app, ["plan", "--model", "llama-70b", "--topology", "cluster", "--world-size", "64",
                                      "--memory-budget", "80GiB", "--json", str(out)])
    assert result.exit_code == 0, result.output
    for text in ("hsdp-node+state", "fully_shard units: 81 (FSDP2 default: 81)", "plan vs FSDP2 default",
                 "layers.0 ... layers.79", "NVLINK bytes sent", "IB time", "predicted comm time", "fits 80.00 GiB",
                 "FSDP2 alone cannot execute that", "candidates evaluated: 8", "why hsdp-node+state: fastest of the 3 "
                 "candidates that fit 80.00 GiB", "partial would be"):
        assert text in result.output, text
    chosen = [line for line in result.output.splitlines() if line.startswith("│ * ")]
    assert len(chosen) == 1 and "hsdp-node+state" in chosen[0]
    rows = [line for line in result.output.splitlines() if " ms │" in line]  # the candidates table's rows
    assert len(rows) == 8 and sum(line.rstrip().endswith("NO │") for line in rows) == 5  # over 80 GiB
    data = json.loads(out.read_text())
    summary = data["summary"]
    assert SUMMARY_KEYS <= set(summary)
    assert SUMMARY_KEYS - {"plan_seconds", "baseline"} <= set(summary["baseline"])
    assert summary["world_size"] == 64 and summary["plan_seconds"] < 30
    assert set(summary["tier_bytes_per_step"]) == {"NVLINK", "IB"}
    assert summary["max_rank_bytes"] < summary["baseline"]["max_rank_bytes"]
    plan = ShardingPlan.load(out)
    assert plan.to_dict() == data["plan"] and plan.mesh.shape == (8, 8)
    assert len(data["plan"]["candidates"]) == 8 and data["plan"]["choice_reason"] == summary["choice_reason"]
    assert plan.choice_reason in " ".join(result.output.split())


def test_plan_param_sharding_replicated_says_why(tmp_path):
    out = tmp_path / "partial.json"
    result = CliRunner().invoke(app, ["plan", "--model", "llama-7b", "--world-size", "16", "--param-sharding",
                                      "replicated", "--json", str(out)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for text in ("partial, planned in", "units (parameters replicated): 33", "replicated", "peak memory, plain DDP",
                 "why partial: the only candidate (param_sharding='replicated'), and it fits 80.00 GiB",
                 "two-stage exchange schedule on the IB link"):
        assert text in result.output, text
    plan = ShardingPlan.load(out)
    assert (plan.strategy, plan.param_sharding, plan.state_sharding.axis) == ("partial", "replicated", "world")
    assert len(plan.candidates) == 1 and plan.candidates[0].chosen
    bad = CliRunner().invoke(app, ["plan", "--model", "llama-7b", "--world-size", "16", "--param-sharding", "both"])
    assert bad.exit_code == 2 and "Traceback" not in bad.output


def test_plan_vit_shows_balance_gain_over_fsdp2():
    result = CliRunner().invoke(app, ["plan", "--model", "vit-s", "--world-size", "16", "--no-state-sharding"])
    assert result.exit_code == 0, result.output
    assert "Shard(2)x2" in result.output  # cls_token and pos_embed shard on their hidden dim
    assert "imbalance max/mean" in result.output


def test_plan_module_factory():
    result = CliRunner().invoke(app, ["plan", "--model", "_planner_jobs:make_net", "--topology", "lan",
                                      "--world-size", "4", "--param-dtype", "fp32", "--grad-dtype", "fp32"])
    assert result.exit_code == 0, result.output
    assert "_planner_jobs:make_net" in result.output


@pytest.mark.parametrize(("args", "message"), [
    (["--model", "gpt-9", "--world-size", "8"], "error: unknown model preset 'gpt-9'"),
    (["--model", "llama-7b", "--world-size", "60", "--ranks-per-node", "8"],
     "error: topology 'cluster' needs a world size divisible by 8"),
    (["--model", "llama-70b", "--world-size", "64", "--memory-budget", "10GiB"],
     "error: memory budget 10.00 GiB per rank is too small for llama-70b on 64 ranks"),
    (["--model", "llama-7b", "--world-size", "8", "--memory-budget", "lots"], "error: size 'lots' is not understood"),
    (["--model", "vit-s", "--topology", "lan", "--world-size", "4", "--param-sharding", "replicated"],
     "error: param_sharding = 'replicated' needs at least 2 nodes"),
])
def test_plan_errors_are_one_line_and_exit_2(args, message):
    result = CliRunner().invoke(app, ["plan", *args])
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output


def test_help_shows_the_schedules_default_estimates():
    import typer.main

    from cpdpkit.planner.schedule import DEFAULT_FLOPS_PER_S, DEFAULT_TOKENS_PER_RANK

    shown = {p.name: p.show_default for p in typer.main.get_command(app).commands["plan"].params}  # type: ignore[attr-defined]
    assert shown["tokens_per_rank"] == str(DEFAULT_TOKENS_PER_RANK)
    assert float(shown["tflops"]) == DEFAULT_FLOPS_PER_S / 1e12
    result = CliRunner().invoke(app, ["plan", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and f"[default: ({DEFAULT_TOKENS_PER_RANK})]" in result.output
