"""cpdpkit bench (the main job) end to end: real launches over the emulated WAN, failures, bad options,
and how its options resolve (``--quick``'s reduced defaults, the defaults ``--help`` documents)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from cpdpkit.bench.periodic.config import BENCH_STRATEGIES, DEFAULT_STRATEGIES, BenchConfig, RunSpec
from cpdpkit.bench.periodic.runner import run_one, run_together
from cpdpkit.cli import app
from cpdpkit.cli.bench import _bench_config
from cpdpkit.sync.config import SyncConfig

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
                sync=SyncConfig(slowmo_momentum=0.5), quick=True)
    base.update(kw)
    return RunSpec(**base)


# what a run computes, independent of the machine's speed: equal for the same spec however it was launched
_DETERMINED = ("status", "steps", "final_params_sha256", "final_loss", "peak_test_acc", "final_test_acc",
               "bytes_per_step", "max_bytes_per_step", "collectives_per_step", "world_size", "topology")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_runs_launched_together_equal_their_own_launch_and_failures_keep_their_reason(tmp_path):
    config = BenchConfig(world_size=2, topology="lan")
    ok = _spec()
    again = dataclasses.replace(ok, variant="again")  # the same run under another label (its own run folder)
    specs = [_spec(lr=1e6, epochs=2, variant="diverging"), ok,
             _spec(dataset="cifar100", data_dir=str(tmp_path / "nothing"), variant="crashing"), again]
    events = []
    # one launch runs the diverged run, then `ok` on the same ranks, then fails in the crashed run; the run
    # after it gets a launch of its own (a fresh set of ranks, as every run had before)
    diverged, together, crashed, alone = run_together(specs, config, tmp_path, events.append, topology="lan")
    assert crashed["status"] == "failed"
    assert crashed["reason"].startswith("rank ") and "holds no CIFAR-100" in crashed["reason"]
    assert diverged["status"] == "diverged"
    assert diverged["reason"].startswith("training loss became ") and "in epoch 1" in diverged["reason"]
    assert math.isnan(diverged["peak_test_acc"])
    logs = [(Path(r["run_dir"]) / "logs").is_dir() for r in (diverged, together, crashed, alone)]
    assert logs == [True, False, False, True], logs  # two launches: the first in the diverged run's folder
    assert together["status"] == "ok" and together["steps"] > 0
    assert {k: together[k] for k in _DETERMINED} == {k: alone[k] for k in _DETERMINED}
    assert [(c["test_acc"], c["loss"]) for c in together["curve"]] == [(c["test_acc"], c["loss"])
                                                                       for c in alone["curve"]]
    assert [e[1] for e in events if e[0] == "start"] == specs  # each as it started
    assert [e[1] for e in events if e[0] == "done"] == specs  # each launch's as it ended
    assert [e[1:] for e in events if e[0] == "epoch"] == [(ok, 1, 1), (again, 1, 1)]
    assert all(r["launch_s"] > 0 and r["run_dir"] for r in (diverged, together, crashed, alone))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_auto_k_run_reports_its_k_over_time(tmp_path):
    config = BenchConfig(world_size=2, topologies=("lan", "wan"))
    spec = _spec(strategy="cpdp-auto", period=None, sync=SyncConfig(slowmo_momentum=0.5, k_max=4), topology="wan")
    result = run_one(spec, config, tmp_path)
    assert result["status"] == "ok", result.get("reason")
    assert Path(result["run_dir"]).name == "wan-cpdp-auto-seed0" and result["topology"] == "wan"
    history = result["period_history"]
    assert history[0]["step"] == 0 and len(history) >= 2
    assert [h["step"] for h in history] == sorted(h["step"] for h in history)
    assert all(1 <= h["period"] <= 4 for h in history)
    assert result["mean_period"] == pytest.approx(result["steps"] / (len(history) - 1), rel=0.5)


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
        (["--suite", "fedavg"], "unknown --suite 'fedavg': drop --suite for the main job"),
        (["--steps", "3", "--optimizer", "sgd"], "--steps, --optimizer: option(s) of the sharding suite only"),
        (["--lr-schedule", "linear"], "--lr-schedule 'linear' is not one of constant, cosine, step: "
                                      "e.g. --lr-schedule cosine"),
        (["--optimizer-state", "sync"], "--optimizer-state 'sync' is not one of keep, average, reset"),
        (["--slowmo-momentum", "1.0"], "--slowmo-momentum must be in [0, 1), got 1.0"),
        (["--topology", "lan", "--topologies", "lan,wan"], "--topology lan and --topologies lan,wan both given: use "
                                                           "--topologies for several presets, or --topology for one"),
        (["--topologies", "lan,moon"], "unknown topology 'moon' in --topologies: choose from lan, wan, wan-variable"),
        (["--k-min", "9"], "--k-min 9 is above --k-max 8: give k-min <= k-max, e.g. --k-min 1 --k-max 8"),
        (["--overlap-steps", "0"], "--overlap-steps must be an integer >= 1, got 0"),
        (["--outer-optimizer", "Foo"], "--outer-optimizer 'Foo' is not a torch optimizer: pass slowmo, diloco or "
                                       "the name of a torch.optim.Optimizer class, e.g. --outer-optimizer SGD"),
        (["--outer-lr", "0.5"], "--outer-lr with --outer-optimizer slowmo: SlowMo's outer LR is --slowmo-lr"),
        (["--lr", "0.1,0.2"], "--lr takes one value, got '0.1,0.2': the swept options are --periods, "
                              "--slowmo-momentum and --outer-lr; run once per value of --lr"),
        (["--slowmo-momentum", "0,x"], "--slowmo-momentum '0,x' is not a number or a comma-separated list of numbers"),
    ],
)
def test_bad_options_exit_2_with_one_line_before_anything_starts(args, message, tmp_path):
    result = CliRunner().invoke(app, ["bench", *args, "--work-dir", str(tmp_path)])
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.output
    assert not any(Path(tmp_path).iterdir()), "nothing may start before the options are valid"


_NONE = dict(strategies=None, periods=None, epochs=None, model=None, batch_size=None, lr=None, world_size=None,
             topology=None, profile_dir=None, momentum=None, slowmo_momentum=None, slowmo_lr=None,
             warmup_steps=None, optimizer_state=None, lr_schedule=None)


@pytest.mark.parametrize(("given", "expect"), [
    ({}, BenchConfig()),
    ({"quick": True}, BenchConfig(strategies=("ddp", "localsgd-torch", "cpdp"), periods=(4,), epochs=3, quick=True)),
    ({"quick": True, "strategies": "ddp,slowmo", "periods": "2", "epochs": 2},
     BenchConfig(strategies=("ddp", "slowmo"), periods=(2,), epochs=2, quick=True)),
    ({"quick": True, "epochs": 10}, BenchConfig(strategies=("ddp", "localsgd-torch", "cpdp"), periods=(4,),
                                                epochs=3, quick=True)),  # --quick caps the epochs, as it always did
    ({"strategies": "cpdp", "world_size": 4, "topology": "cluster", "lr": 0.05},
     BenchConfig(strategies=("cpdp",), world_size=4, topology="cluster", lr=0.05)),
    ({"strategies": "ddp,slowmo,cpdp", "momentum": 0.0, "slowmo_momentum": 0.7, "slowmo_lr": 0.5, "warmup_steps": 8,
      "optimizer_state": "average", "lr_schedule": "cosine"},
     BenchConfig(strategies=("ddp", "slowmo", "cpdp"), momentum=0.0, slowmo_momentum=0.7, slowmo_lr=0.5,
                 warmup_steps=8, optimizer_state="average", lr_schedule="cosine")),
    ({"topologies": "lan,wan-variable", "overlap_steps": 3, "target_exposed_frac": 0.2, "k_min": 2, "k_max": 16,
      "max_divergence": 0.05},
     BenchConfig(topologies=("lan", "wan-variable"), overlap_steps=3, target_exposed_frac=0.2, k_min=2, k_max=16,
                 max_divergence=0.05)),
])
def test_options_resolve_to_the_config(given, expect):
    kw = {**_NONE, "quick": False, "dataset": None, "data_dir": None, "seeds": 1, **given}
    assert _bench_config(**kw) == expect


def test_help_documents_the_configs_defaults():
    bench = typer.main.get_command(app).commands["bench"]  # type: ignore[attr-defined]
    documented = {p.name: str(p.show_default).split(";")[0].strip() for p in bench.params
                  if isinstance(p.show_default, str)}
    quick = _bench_config(**{**_NONE, "quick": True, "dataset": None, "data_dir": None, "seeds": 1})
    config = BenchConfig()
    assert documented.pop("strategies") == "all but slowmo-overlap and cpdp-step-then-average"
    assert config.strategies == DEFAULT_STRATEGIES
    assert set(BENCH_STRATEGIES) - set(DEFAULT_STRATEGIES) == {"slowmo-overlap", "cpdp-step-then-average"}
    assert documented.pop("slowmo_momentum").startswith("0 at every replica count") and config.slowmo_momentum is None
    assert documented.pop("outer_lr") == "diloco 0.7, a torch.optim class 1.0" and config.outer_lr is None
    assert documented.pop("periods") == ",".join(map(str, config.periods))
    assert documented.pop("max_divergence") == "no cap" and config.max_divergence is None
    assert documented.pop("compression") == ",".join(config.compression)
    assert documented == {name: str(getattr(config, name)) for name in documented}
    assert set(documented) == {"model", "dataset", "epochs", "batch_size", "lr", "world_size", "topology", "momentum",
                               "slowmo_lr", "warmup_steps", "optimizer_state", "lr_schedule", "seeds",
                               "overlap_steps", "target_exposed_frac", "k_min", "k_max", "outer_optimizer",
                               "fragments"}
    quick_doc = {p.name: str(p.show_default).split("--quick:")[1].strip() for p in bench.params
                 if isinstance(p.show_default, str) and "--quick:" in p.show_default}
    assert quick_doc == {"strategies": ",".join(quick.strategies), "periods": ",".join(map(str, quick.periods)),
                         "epochs": f"at most {quick.epochs}"}
    result = CliRunner().invoke(app, ["bench", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "sharding" in result.output
    assert all(name in result.output for name in BENCH_STRATEGIES)
    # the sharding suite's (--optimizer-state is the main job's)
    assert "--steps" not in result.output and not re.search(r"--optimizer(?![-\w])", result.output)
