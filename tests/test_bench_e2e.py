"""cpdpkit bench end to end: real launches over the emulated WAN, failures, bad options."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cpdpkit.bench.config import BenchConfig, RunSpec
from cpdpkit.bench.runner import run_one
from cpdpkit.cli import app

RESULT_KEYS = {"strategy", "period", "peak_test_acc", "final_test_acc", "wall_s", "step_s",
               "exposed_sync_s_per_step", "bytes_per_step", "seeds"}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_quick_bench_writes_table_json_plot_and_traces(tmp_path):
    out, png, traces = tmp_path / "b.json", tmp_path / "b.png", tmp_path / "traces"
    proc = subprocess.run(
        [sys.executable, "-m", "cpdpkit.cli", "bench", "--quick", "--strategies", "ddp,cpdp",
         "--epochs", "2", "--json", str(out), "--plot", str(png), "--profile", str(traces)],
        capture_output=True, text=True, timeout=220,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "cpdp K=4" in proc.stdout and "exposed ms/step" in proc.stdout
    report = json.loads(out.read_text())
    assert report["config"]["topology"] == "wan" and report["config"]["quick"] is True
    ddp, cpdp = report["results"]
    assert set(ddp) >= RESULT_KEYS and ddp["period"] is None and cpdp["period"] == 4
    for r in (ddp, cpdp):
        assert r["status"] == "ok" and 0.0 <= r["final_test_acc"] <= r["peak_test_acc"] <= 1.0
        assert len(r["seeds"]) == 1 and r["seeds"][0]["steps"] > 0
    # ddp all-reduces every step; cpdp K=4 twice (gradients, parameters) every 4 steps
    assert ddp["collectives_per_step"] == pytest.approx(1.0)
    assert cpdp["collectives_per_step"] == pytest.approx(0.5, abs=0.05)
    assert cpdp["bytes_per_step"] == pytest.approx(ddp["bytes_per_step"] / 2, rel=0.05)
    # over a 16.6 ms RTT link, every ddp step waits at least one round trip
    assert ddp["exposed_sync_s_per_step"] > 0.0166
    assert png.stat().st_size > 10_000
    assert sorted(p.name for p in (traces / "ddp").iterdir()) == [
        "rank0.pt.trace.json", "rank1.pt.trace.json", "run.json"]
    run_info = json.loads((traces / "cpdp-k4" / "run.json").read_text())
    assert run_info["strategy"] == "cpdp" and run_info["period"] == 4


def _spec(**kw) -> RunSpec:
    base = dict(strategy="cpdp", period=2, seed=0, model="cnn", dataset="synthetic",
                data_dir=None, epochs=1, batch_size=32, lr=0.1, momentum=0.0,
                slowmo_momentum=0.5, quick=True)
    base.update(kw)
    return RunSpec(**base)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_failed_and_diverged_runs_are_reported_with_their_reason(tmp_path):
    config = BenchConfig(world_size=2, topology="lan")
    crashed = run_one(_spec(dataset="cifar100", data_dir=str(tmp_path / "nothing")), config, tmp_path)
    assert crashed["status"] == "failed"
    assert crashed["reason"].startswith("rank ") and "holds no CIFAR-100" in crashed["reason"]
    diverged = run_one(_spec(lr=1e6, epochs=2), config, tmp_path)
    assert diverged["status"] == "diverged"
    assert diverged["reason"].startswith("training loss became ") and "in epoch 1" in diverged["reason"]
    assert math.isnan(diverged["peak_test_acc"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--periods", "0"], "period K must be an integer >= 1, got 0: e.g. --periods 2,4"),
        (["--periods", "two"], "--periods 'two' is not a comma-separated list of integers"),
        (["--strategies", "ddp,fedavg"], "unknown strategy 'fedavg': choose from ddp"),
        (["--model", "gpt9"], "unknown model 'gpt9': choose one of cnn, resnet18"),
        (["--dataset", "cifar100", "--data-dir", "/nonexistent"],
         "--data-dir '/nonexistent' holds no CIFAR-100"),
        (["--topology", "moon"], "unknown topology preset 'moon'"),
    ],
)
def test_bad_options_exit_2_with_one_line_before_anything_starts(args, message, tmp_path):
    result = CliRunner().invoke(app, ["bench", *args, "--work-dir", str(tmp_path)])
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.output
    assert not any(Path(tmp_path).iterdir()), "nothing may start before the options are valid"
