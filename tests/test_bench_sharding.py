"""cpdpkit bench sharding: one quick end-to-end run (fsdp2, hsdp, planned, two-stage over the emulated
slow-IB cluster), the one-line refusals of bad configurations (exit 2, before any launch), the
sub-command's own options and defaults, and the deprecated ``cpdpkit bench --suite sharding``."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import typer.main
from typer.testing import CliRunner

from cpdpkit.bench.gpt import GPT_PRESETS
from cpdpkit.bench.sharding import SHARDING_STRATEGIES, ShardingBenchConfig
from cpdpkit.cli import app

RESULT_KEYS = {"strategy": str, "step_s": float, "exposed_comm_s_per_step": float, "tier_bytes_per_step": dict,
               "optimizer_state_bytes_per_rank": int, "peak_mem_bytes": int, "final_loss": float}
SHARDING_OPTIONS = {"--strategies", "--model", "--world-size", "--topology", "--batch-size", "--lr", "--steps",
                    "--optimizer", "--memory-budget", "--max-grad-norm", "--quick", "--profile", "--json",
                    "--work-dir"}
NOTICE = "note: `cpdpkit bench --suite sharding` is deprecated; use `cpdpkit bench sharding` (same options)"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_quick_sharding_suite_runs_all_four_and_two_stage_matches_hsdp(tmp_path):
    out = tmp_path / "s.json"
    proc = subprocess.run([sys.executable, "-m", "cpdpkit.cli", "bench", "sharding", "--quick",
                           "--json", str(out)], capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "two-stage" in proc.stdout and "exposed ms/step" in proc.stdout
    assert "deprecated" not in proc.stderr
    report = json.loads(out.read_text())
    assert report["config"]["topology"] == "cluster-slow-ib" and report["config"]["world_size"] == 4
    assert report["config"]["model"] == "gpt-micro" and report["config"]["steps"] == 4
    results = {r["strategy"]: r for r in report["results"]}
    assert list(results) == ["fsdp2", "hsdp", "planned", "two-stage"]
    for r in results.values():
        assert r["status"] == "ok", r
        for key, kind in RESULT_KEYS.items():
            assert isinstance(r[key], kind), (r["strategy"], key, r[key])
        assert all(isinstance(t, str) and isinstance(b, int) and b > 0 for t, b in r["tier_bytes_per_step"].items())
        # every strategy waits on the 1 ms IB link at least once a step, and waiting is part of the step
        assert 0 < r["exposed_comm_s_per_step"] < r["step_s"], r
    hsdp, two = results["hsdp"], results["two-stage"]
    replicas = report["config"]["num_replicas"]
    assert replicas == 2
    assert two["optimizer_state_bytes_per_rank"] * replicas == hsdp["optimizer_state_bytes_per_rank"]
    assert abs(two["final_loss"] - hsdp["final_loss"]) <= 1e-4
    # Computed independently of the emulator's count: with a node-sharded mesh, the only IB traffic is the
    # all-reduce of each rank's fp32 gradient shard (1/ranks_per_node of the model, no padding for gpt-micro's
    # even shapes) across the 2 replicas, where a ring sends 2 (r - 1) / r = 1 shard.
    shard_bytes = GPT_PRESETS["gpt-micro"].num_params * 4 // report["config"]["ranks_per_node"]
    for name in ("hsdp", "planned", "two-stage"):
        assert results[name]["tier_bytes_per_step"]["IB"] == shard_bytes, name
    assert report["goals"]["optimizer_state_met"] and report["goals"]["final_loss_met"]


@pytest.mark.slow
@pytest.mark.timeout(30)
@pytest.mark.parametrize("args, expect", [
    (["--world-size", "3"], "world size 3 does not factor into topology 'cluster-slow-ib'"),
    (["--world-size", "2"], "the sharding suite needs >= 2 nodes"),
    (["--optimizer", "adafactor"], "optimizer 'adafactor' is not elementwise"),
    (["--memory-budget", "1MiB"], "memory budget 1.00 MiB per rank is too small"),
    (["--model", "resnet50"], "unknown model 'resnet50'"),
    (["--max-grad-norm", "0"], "--max-grad-norm must be > 0, got 0.0: e.g. --max-grad-norm 1.0"),
])
def test_bad_sharding_configuration_is_one_line_exit_2(args, expect, tmp_path):
    result = CliRunner().invoke(app, ["bench", "sharding", "--work-dir", str(tmp_path / "w"), *args])
    text = result.output.strip()
    assert result.exit_code == 2, text
    assert expect in text and len(text.splitlines()) == 1, text
    assert not (tmp_path / "w").exists()  # nothing launched


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
    assert documented.pop("strategies") == "all four" and config.strategies == SHARDING_STRATEGIES
    assert documented.pop("memory_budget") == "no limit" and config.memory_budget is None
    assert documented.pop("max_grad_norm") == "no clipping" and config.max_grad_norm is None
    assert documented == {name: str(getattr(config, name)) for name in documented}
    assert set(documented) == {"model", "world_size", "topology", "batch_size", "lr", "steps", "optimizer"}


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
    assert lines[1].startswith("error: world size 3 does not factor into topology 'cluster-slow-ib'")
    assert not (tmp_path / "w").exists()
