"""cpdpkit bench --suite sharding: one quick end-to-end run (fsdp2, hsdp, planned, two-stage over the
emulated slow-IB cluster) and the one-line refusals of bad configurations (exit 2, before any launch)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from cpdpkit.cli import app

RESULT_KEYS = {"strategy": str, "step_s": float, "exposed_comm_s_per_step": float, "tier_bytes_per_step": dict,
               "optimizer_state_bytes_per_rank": int, "peak_mem_bytes": int, "final_loss": float}


@pytest.mark.slow
@pytest.mark.timeout(80)
def test_quick_sharding_suite_runs_all_four_and_two_stage_matches_hsdp(tmp_path):
    out = tmp_path / "s.json"
    proc = subprocess.run([sys.executable, "-m", "cpdpkit.cli", "bench", "--suite", "sharding", "--quick",
                           "--json", str(out)], capture_output=True, text=True, timeout=75)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "two-stage" in proc.stdout and "exposed ms/step" in proc.stdout
    report = json.loads(out.read_text())
    assert report["config"]["topology"] == "cluster-slow-ib" and report["config"]["world_size"] == 4
    results = {r["strategy"]: r for r in report["results"]}
    assert list(results) == ["fsdp2", "hsdp", "planned", "two-stage"]
    for r in results.values():
        assert r["status"] == "ok", r
        for key, kind in RESULT_KEYS.items():
            assert isinstance(r[key], kind), (r["strategy"], key, r[key])
        assert all(isinstance(t, str) and isinstance(b, int) and b > 0 for t, b in r["tier_bytes_per_step"].items())
        assert r["step_s"] > 0 and r["exposed_comm_s_per_step"] >= 0
    hsdp, two = results["hsdp"], results["two-stage"]
    replicas = report["config"]["num_replicas"]
    assert replicas == 2
    assert two["optimizer_state_bytes_per_rank"] * replicas == hsdp["optimizer_state_bytes_per_rank"]
    assert abs(two["final_loss"] - hsdp["final_loss"]) <= 1e-4
    assert "IB" in hsdp["tier_bytes_per_step"] and "IB" in two["tier_bytes_per_step"]
    assert report["goals"]["optimizer_state_met"] and report["goals"]["final_loss_met"]


@pytest.mark.slow
@pytest.mark.timeout(30)
@pytest.mark.parametrize("args, expect", [
    (["--world-size", "3"], "world size 3 does not factor into topology 'cluster-slow-ib'"),
    (["--world-size", "2"], "the sharding suite needs >= 2 nodes"),
    (["--optimizer", "adafactor"], "optimizer 'adafactor' is not elementwise"),
    (["--memory-budget", "1MiB"], "memory budget 1.00 MiB per rank is too small"),
    (["--model", "resnet50"], "unknown model 'resnet50' for --suite sharding"),
    (["--max-grad-norm", "0"], "--max-grad-norm must be > 0, got 0.0: e.g. --max-grad-norm 1.0"),
])
def test_bad_sharding_configuration_is_one_line_exit_2(args, expect, tmp_path):
    result = CliRunner().invoke(app, ["bench", "--suite", "sharding", "--work-dir", str(tmp_path / "w"), *args])
    text = result.output.strip()
    assert result.exit_code == 2, text
    assert expect in text and len(text.splitlines()) == 1, text
    assert not (tmp_path / "w").exists()  # nothing launched
