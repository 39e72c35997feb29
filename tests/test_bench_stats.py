"""cpdpkit bench's statistics and options without launching: the paired 95 % CI against ddp, its
significance marks in the CLI's and the docs' tables, the JSON fields, BenchConfig's checks of the
optimizer options, and the LR schedules (one small 2-rank check that every strategy gets them)."""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path

import pytest
import torch
from rich.console import Console
from torch import nn

from _docs_tables import docs_tables as load_docs_tables
from _ranks import SPAWN_TIMEOUT_S, share_fn
from cpdpkit.bench.periodic.config import BenchConfig, RunSpec
from cpdpkit.bench.periodic.report import aggregate, paired_difference, significant, t_quantile_975
from cpdpkit.bench.periodic.strategies import StrategyRunner, build_lr_scheduler
from cpdpkit.errors import ConfigError

pytestmark = pytest.mark.timeout(60)



# ---- the t quantile and the paired interval -------------------------------------------------------
def test_t_quantiles_match_scipy():
    stats = pytest.importorskip("scipy.stats")  # scikit-learn's dependency: always there
    for df in [*range(1, 41), 60, 120, 1000]:
        assert t_quantile_975(df) == pytest.approx(stats.t.ppf(0.975, df), abs=6e-4), df
    assert t_quantile_975(1) == 12.706 and t_quantile_975(2) == 4.303
    with pytest.raises(ValueError, match="degrees of freedom must be an integer >= 1, got 0"):
        t_quantile_975(0)


def test_paired_difference_by_hand():
    # d = [1, 3, 2]: mean 2, sd 1, t(0.975, 2) = 4.303 -> 2 ± 4.303 / sqrt(3) = 2 ± 2.484338
    mean, ci = paired_difference([1.0, 3.0, 2.0])
    assert mean == 2.0 and ci == pytest.approx((-0.484338, 4.484338), abs=1e-6)
    # n = 2 uses t = 12.706: d = [1, 3], sd sqrt(2) -> 2 ± 12.706 * sqrt(2) / sqrt(2)
    mean, ci = paired_difference([1.0, 3.0])
    assert mean == 2.0 and ci == pytest.approx((-10.706, 14.706), abs=1e-9)
    assert paired_difference([1.5]) == (1.5, None)
    assert paired_difference([]) == (None, None)


def test_significant_means_the_interval_excludes_zero():
    assert significant((0.1, 2.0)) and significant([-3.0, -0.5])
    assert not significant((-0.1, 2.0)) and not significant((0.0, 1.0)) and not significant(None)


# ---- aggregate: deltas, intervals, JSON ----------------------------------------------------------
def _run(strategy, period, seed, acc, wall, status="ok"):
    curve = [{"epoch": 1, "wall_s": wall / 2, "test_acc": acc - 0.1, "loss": 1.0},
             {"epoch": 2, "wall_s": wall, "test_acc": acc, "loss": 0.5}]
    return {"spec": {"strategy": strategy, "period": period, "seed": seed}, "status": status,
            "reason": None if status == "ok" else "rank 1 crashed", "peak_test_acc": acc, "final_test_acc": acc,
            "wall_s": wall, "step_s": wall / 10, "exposed_sync_s_per_step": wall / 20, "bytes_per_step": 100.0,
            "collectives_per_step": 1.0, "harness_total_s": 2.0, "curve": curve}


_CONFIG = {"model": "cnn", "dataset": "digits", "world_size": 2, "topology": "wan", "lr": 0.1, "epochs": 2,
           "seeds": 3}


def _three_seeds():
    """ddp; cpdp: Δ acc = [1, 3, 2] pp (CI contains 0); slowmo: [2, 3, 3] pp (CI excludes 0)."""
    return [*(_run("ddp", None, s, a, w) for s, a, w in ((0, 0.80, 10.0), (1, 0.82, 12.0), (2, 0.81, 11.0))),
            # listed out of seed order: pairing is by seed, not by position
            *(_run("cpdp", 4, s, a, w) for s, a, w in ((2, 0.83, 10.0), (0, 0.81, 8.0), (1, 0.85, 9.0))),
            *(_run("slowmo", 4, s, a, w) for s, a, w in ((0, 0.82, 7.0), (1, 0.85, 9.0), (2, 0.84, 8.0)))]


def test_paired_ci_against_ddp_by_hand():
    ddp, cpdp, slowmo = aggregate(_CONFIG, _three_seeds()).results
    assert cpdp.delta_acc_pp == pytest.approx(2.0) and cpdp.paired_seeds == 3
    assert cpdp.delta_acc_ci95_pp == pytest.approx((-0.484338, 4.484338), abs=1e-6)
    # wall: d = [-2, -3, -1] s -> -2 ± 2.484338
    assert cpdp.delta_wall_s == pytest.approx(-2.0)
    assert cpdp.delta_wall_ci95_s == pytest.approx((-4.484338, 0.484338), abs=1e-6)
    # slowmo: d = [2, 3, 3]: mean 8/3, sd 1/sqrt(3) -> 8/3 ± 4.303 / 3
    assert slowmo.delta_acc_pp == pytest.approx(8 / 3)
    assert slowmo.delta_acc_ci95_pp == pytest.approx((8 / 3 - 4.303 / 3, 8 / 3 + 4.303 / 3), abs=1e-6)
    assert slowmo.delta_wall_ci95_s == pytest.approx((-3.0, -3.0))
    assert slowmo.delta_wall_pct == pytest.approx((8.0 / 11.0 - 1) * 100)
    # the baseline: 0 by construction, no interval
    assert ddp.delta_acc_pp == 0.0 and ddp.delta_acc_ci95_pp is None and ddp.delta_wall_ci95_s is None


def test_pairing_uses_only_seeds_where_both_finished():
    runs = [_run("ddp", None, 0, 0.50, 10.0), _run("ddp", None, 1, 0.70, 10.0), _run("ddp", None, 2, 0.90, 10.0),
            _run("cpdp", 4, 0, 0.51, 9.0), _run("cpdp", 4, 1, 0.0, 0.0, status="failed"),
            _run("cpdp", 4, 2, 0.93, 9.0)]
    cpdp = aggregate(_CONFIG, runs).results[1]
    # seeds 0 and 2: d = [1, 3] pp, n = 2 -> t = 12.706
    assert cpdp.paired_seeds == 2 and cpdp.delta_acc_pp == pytest.approx(2.0)
    assert cpdp.delta_acc_ci95_pp == pytest.approx((-10.706, 14.706), abs=1e-6)
    # an unpaired comparison would see ddp's spread across seeds (sd 20 pp); paired, a constant +1 pp is clear
    steady = aggregate(_CONFIG, [*runs[:3], _run("cpdp", 4, 0, 0.51, 9.0), _run("cpdp", 4, 1, 0.71, 9.0),
                                 _run("cpdp", 4, 2, 0.91, 9.0)]).results[1]
    assert steady.delta_acc_pp == pytest.approx(1.0) and significant(steady.delta_acc_ci95_pp)


def test_one_seed_has_a_delta_but_no_interval():
    report = aggregate({**_CONFIG, "seeds": 1}, [_run("ddp", None, 0, 0.80, 10.0), _run("cpdp", 4, 0, 0.83, 8.0)])
    cpdp = report.results[1]
    assert cpdp.delta_acc_pp == pytest.approx(3.0) and cpdp.delta_acc_ci95_pp is None
    out = json.loads(json.dumps(report.to_dict()))["results"][1]
    assert out["delta_acc_ci95_pp"] is None and out["delta_wall_ci95_s"] is None
    assert out["delta_wall_s_vs_ddp"] == pytest.approx(-2.0) and out["paired_seeds_vs_ddp"] == 1


def test_json_fields_and_per_seed_curves():
    out = json.loads(json.dumps(aggregate(_CONFIG, _three_seeds()).to_dict()))
    ddp, cpdp, slowmo = out["results"]
    assert cpdp["delta_acc_pp_vs_ddp"] == pytest.approx(2.0)
    assert cpdp["delta_acc_ci95_pp"] == pytest.approx([-0.484338, 4.484338], abs=1e-6)
    assert cpdp["delta_wall_s_vs_ddp"] == pytest.approx(-2.0)
    assert cpdp["delta_wall_ci95_s"] == pytest.approx([-4.484338, 0.484338], abs=1e-6)
    assert cpdp["paired_seeds_vs_ddp"] == 3 and ddp["delta_acc_ci95_pp"] is None
    # per-seed curves, in run order, kept for the plot's band
    assert [s["seed"] for s in cpdp["seeds"]] == [2, 0, 1]
    assert [p["test_acc"] for p in cpdp["seeds"][1]["curve"]] == pytest.approx([0.71, 0.81])
    # the mean curve carries the std across seeds at each epoch
    accs = [0.83, 0.81, 0.85]
    last = cpdp["curve"][-1]
    assert last["test_acc"] == pytest.approx(sum(accs) / 3) and last["wall_s"] == pytest.approx(9.0)
    assert last["test_acc_std"] == pytest.approx(0.02)
    assert slowmo["curve"][0]["test_acc_std"] == pytest.approx(0.015275, abs=1e-6)


# ---- the tables: CLI and docs ---------------------------------------------------------------------
def test_cli_table_marks_significant_differences():
    from cpdpkit.cli.bench import _row, _table

    report = aggregate(_CONFIG, _three_seeds())
    ddp, cpdp, slowmo = (_row(r) for r in report.results)
    assert ddp[4] == "+0.00" and ddp[6] == "+0.0"
    assert cpdp[4] == "+2.00 [-0.48, +4.48]" and cpdp[6] == "-18.2"  # wall CI [-4.48, +0.48] s: no mark
    assert slowmo[4] == "+2.67 [+1.23, +4.10]*" and slowmo[6] == "-27.3*"
    console = Console(file=io.StringIO(), width=400)
    console.print(_table(report))
    text = console.file.getvalue()
    assert "* = the CI excludes 0" in text and "+2.67 [+1.23, +4.10]*" in text
    one = aggregate({**_CONFIG, "seeds": 1}, [_run("ddp", None, 0, 0.8, 10.0), _run("cpdp", 4, 0, 0.83, 8.0)])
    assert _row(one.results[1])[4] == "+3.00"  # one seed: no interval, no mark


def test_docs_table_shows_the_same_cells(tmp_path):
    from cpdpkit.cli.bench import _row

    docs_tables = load_docs_tables()
    report = aggregate({**_CONFIG, "strategies": ["ddp", "cpdp", "slowmo"], "periods": [4]}, _three_seeds())
    assert docs_tables.main_rows(json.loads(json.dumps(report.to_dict()))) == [_row(r) for r in report.results]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(report.to_dict()))
    text, _ = docs_tables.render(path)
    assert "[95 % CI]; * = the CI excludes 0" in text
    assert "| slowmo K=4 | ok | 83.67±1.53 | 83.67 | +2.67 [+1.23, +4.10]* | 8.00±1.00 | -27.3* |" in text


def test_docs_tables_defaults_are_bench_configs():
    docs_tables = load_docs_tables()
    config = BenchConfig().to_dict()
    # every option but --quick (which the command spells out) must be there, or its value gets lost
    assert set(config) - set(docs_tables.MAIN_DEFAULTS) == {"quick"}
    assert {k: config[k] for k in docs_tables.MAIN_DEFAULTS} == docs_tables.MAIN_DEFAULTS
    cmd = docs_tables.main_command({**config, "lr_schedule": "cosine", "momentum": 0.0}, Path("b.json"))
    assert cmd == "cpdpkit bench --momentum 0.0 --lr-schedule cosine --json b.json"
    from cpdpkit.bench.sharding.suite import ShardingBenchConfig

    sharding = ShardingBenchConfig().to_dict()
    assert set(sharding) - set(docs_tables.SHARDING_DEFAULTS) == {"seed", "warmup_steps"}  # not CLI options
    assert {k: sharding[k] for k in docs_tables.SHARDING_DEFAULTS} == docs_tables.SHARDING_DEFAULTS
    cmd = docs_tables.sharding_command({**sharding, "min_unit_bytes": 1}, Path("s.json"))
    assert cmd == "cpdpkit bench sharding --min-unit-bytes 1 --json s.json"


# ---- BenchConfig: the optimizer options ----------------------------------------------------------
def test_defaults_are_sgd_with_momentum_and_reach_every_run():
    config = BenchConfig()
    assert (config.momentum, config.slowmo_momentum, config.slowmo_lr, config.warmup_steps,
            config.optimizer_state, config.lr_schedule) == (0.9, None, 1.0, 0, "keep", "constant")
    # β by replicas: 0 at every count (measured at 2, 4 and 8: docs/results.md, "Issue 23, 2026-12-03")
    assert [BenchConfig(world_size=n).betas for n in (2, 4, 6, 8, 16, 32)] == [(0.0,)] * 6
    assert [s.sync.slowmo_momentum
            for s in BenchConfig(world_size=8, strategies=("cpdp",), periods=(4,)).runs()] == [0.0]
    assert [s.sync.slowmo_momentum for s in BenchConfig(world_size=8, strategies=("cpdp",), periods=(4,),
                                                        slowmo_momentum=0.5).runs()] == [0.5]
    runs = BenchConfig(strategies=("ddp", "cpdp"), periods=(4,), momentum=0.5, slowmo_momentum=0.7,
                       slowmo_lr=0.8, warmup_steps=3, optimizer_state="reset", lr_schedule="step").runs()
    for spec in runs:
        assert (spec.momentum, spec.sync.slowmo_momentum, spec.sync.slowmo_lr, spec.sync.warmup_steps,
                spec.sync.optimizer_state, spec.lr_schedule) == (0.5, 0.7, 0.8, 3, "reset", "step")
        assert RunSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    old = {k: v for k, v in runs[0].to_dict().items()
           if k not in ("slowmo_lr", "warmup_steps", "optimizer_state", "lr_schedule")}
    assert RunSpec.from_dict(old).lr_schedule == "constant"  # a spec.json from before these options


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr_schedule": "linear"}, "--lr-schedule 'linear' is not one of constant, cosine, step: "
                                    "e.g. --lr-schedule cosine"),
        ({"optimizer_state": "sync"}, "--optimizer-state 'sync' is not one of keep, average, reset: "
                                      "e.g. --optimizer-state keep"),
        ({"slowmo_momentum": 1.0}, "--slowmo-momentum must be in [0, 1), got 1.0: SlowMo's β, e.g. "
                                   "--slowmo-momentum 0.2 (or a list to sweep: 0,0.2,0.5)"),
        ({"slowmo_momentum": (0.0, 1.5)}, "--slowmo-momentum must be in [0, 1), got 1.5: SlowMo's β, e.g. "
                                          "--slowmo-momentum 0.2 (or a list to sweep: 0,0.2,0.5)"),
        ({"slowmo_lr": 0.0}, "--slowmo-lr must be > 0, got 0.0: e.g. --slowmo-lr 1.0 (SlowMo's default α)"),
        ({"warmup_steps": -1}, "--warmup-steps must be an integer >= 0, got -1: e.g. --warmup-steps 0 for no "
                               "warm-up"),
        ({"warmup_steps": 1.5}, "--warmup-steps must be an integer >= 0, got 1.5: e.g. --warmup-steps 0 for no "
                                "warm-up"),
        ({"momentum": 1.0}, "--momentum must be in [0, 1), got 1.0: e.g. --momentum 0.9"),
    ],
)
def test_bench_config_rejects_bad_optimizer_options(kwargs, message):
    with pytest.raises(ConfigError) as info:
        BenchConfig(**kwargs)
    assert str(info.value) == message


# ---- LR schedules -------------------------------------------------------------------------------
def _lrs(schedule: str, total: int, lr: float = 0.1) -> list[float]:
    """The lr of each of ``total`` optimizer steps, the scheduler stepped after each."""
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=lr, momentum=0.9)
    sched = build_lr_scheduler(opt, schedule, total)
    out = []
    for _ in range(total):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        if sched is not None:
            sched.step()
    return out


def test_lr_schedules():
    assert _lrs("constant", 5) == [0.1] * 5
    cosine = _lrs("cosine", 8)  # 0.05 * (1 + cos(pi * n / 8))
    assert cosine[0] == pytest.approx(0.1) and cosine[4] == pytest.approx(0.05)
    assert cosine[2] == pytest.approx(0.0853553, abs=1e-7) and cosine[7] == pytest.approx(0.0038060, abs=1e-7)
    assert _lrs("step", 8) == pytest.approx([0.1] * 4 + [0.01] * 2 + [0.001] * 2)
    assert _lrs("step", 10) == pytest.approx([0.1] * 5 + [0.01] * 2 + [0.001] * 3)  # after steps 5 and 7
    with pytest.raises(ValueError, match="unknown LR schedule 'linear'"):
        _lrs("linear", 4)


def test_the_runner_steps_its_scheduler_after_each_optimizer_step():
    torch.manual_seed(0)
    module = nn.Linear(3, 2)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    runner = StrategyRunner(module, module, opt)
    runner.scheduler = build_lr_scheduler(opt, "step", 4)
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 0, 1])
    seen = []
    for _ in range(4):
        seen.append(opt.param_groups[0]["lr"])
        runner.train_step(x, y)
    assert seen == pytest.approx([0.1, 0.1, 0.01, 0.001])




def _bench_strategies_on_rank(rank: int, world: int) -> dict:
    """Every kind of bench runner, built as the worker builds it; the lr it trains with, its options."""
    from cpdpkit.bench.periodic.strategies import build_strategy
    from cpdpkit.sync.config import SyncConfig

    out = {}
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(8, 3, generator=g), torch.randint(0, 2, (8,), generator=g)
    for strategy in ("ddp", "localsgd-torch", "localsgd", "cpdp"):
        torch.manual_seed(0)
        sync = SyncConfig(slowmo_momentum=0.6, slowmo_lr=0.7, warmup_steps=2, optimizer_state="average")
        runner = build_strategy(strategy, 2, nn.Linear(3, 2), lr=0.1, momentum=0.9, lr_schedule="step",
                                total_steps=8, sync=sync, overlap_steps=3)
        lrs = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(8):
                lrs.append(runner.optimizer.param_groups[0]["lr"])
                runner.train_step(x, y)
        config = getattr(runner.optimizer, "config", None)
        out[strategy] = {"lrs": lrs, "momentum": runner.optimizer.param_groups[0]["momentum"],
                         "config": config.to_dict() if config is not None else None,
                         "warnings": [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]}
    return out


# on 2 ranks of the session's one spawned group (tests/conftest.py planner_spawn)
share_fn(__name__, "strategies", _bench_strategies_on_rank, 2, timeout_s=40.0)


@pytest.mark.slow
@pytest.mark.timeout(SPAWN_TIMEOUT_S)  # the first test to ask for planner_spawn waits for all of it
def test_every_bench_strategy_gets_the_schedule_and_ours_the_sync_options(planner_spawn):
    res = planner_spawn[__name__]["strategies"][0]
    for strategy, got in res.items():
        assert got["lrs"] == pytest.approx([0.1] * 4 + [0.01] * 2 + [0.001] * 2), strategy
        assert got["momentum"] == 0.9 and got["warnings"] == [], strategy
    for strategy in ("localsgd", "cpdp"):
        config = res[strategy]["config"]
        assert config["strategy"] == strategy and config["period"] == 2
        assert (config["slowmo_momentum"], config["slowmo_lr"], config["warmup_steps"],
                config["optimizer_state"]) == (0.6, 0.7, 2, "average")
    assert res["ddp"]["config"] is None and res["localsgd-torch"]["config"] is None


def test_swept_slowmo_momentum_and_outer_lr_run_every_point_and_group_apart():
    config = BenchConfig(strategies=("ddp", "localsgd", "cpdp"), periods=(2, 4), slowmo_momentum=(0.0, 0.5))
    assert [s.label for s in config.runs()] == ["ddp", "localsgd K=2", "localsgd K=4", "cpdp K=2 β=0", "cpdp K=2 β=0.5",
                                                "cpdp K=4 β=0", "cpdp K=4 β=0.5"]
    assert [s.sync.slowmo_momentum for s in config.runs() if s.strategy == "cpdp"] == [0.0, 0.5, 0.0, 0.5]
    assert config.to_dict()["slowmo_momentum"] == [0.0, 0.5]
    diloco = BenchConfig(strategies=("cpdp",), periods=(4,), outer_optimizer="diloco", outer_lr=(0.5, 0.7))
    assert [(s.label, s.sync.outer_lr) for s in diloco.runs()] == [("cpdp K=4 outer lr=0.5", 0.5),
                                                              ("cpdp K=4 outer lr=0.7", 0.7)]
    runs = [{"spec": {"strategy": "cpdp", "period": 4, "seed": 0, "variant": v}, "status": "failed", "reason": "x"}
            for v in ("β=0", "β=0.5")]
    report = aggregate(config.to_dict(), runs)
    assert [r.label for r in report.results] == ["cpdp K=4 β=0", "cpdp K=4 β=0.5"]
    assert [r.to_dict()["variant"] for r in report.results] == ["β=0", "β=0.5"]
