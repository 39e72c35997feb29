"""cpdpkit bench's overlap and auto-K strategies and --topologies, without launching: the config's checks,
the runs it plans, aggregation by topology (and JSON from before it), K over time, the goals and how the CLI
and tools/docs_tables.py print them."""

from __future__ import annotations

import dataclasses
import io
import json

import pytest
from rich.console import Console

from _docs_tables import docs_tables as load_docs_tables
from cpdpkit.bench.periodic.config import BenchConfig, RunSpec
from cpdpkit.bench.periodic.goals import best_fixed_period, k_over_time_lines, overlap_and_auto_goals
from cpdpkit.bench.periodic.report import aggregate
from cpdpkit.errors import ConfigError

pytestmark = pytest.mark.timeout(60)



# ---- BenchConfig ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"overlap_steps": 0}, "--overlap-steps must be an integer >= 1, got 0: the steps an overlapped average may "
                               "run behind, e.g. --overlap-steps 2"),
        ({"overlap_steps": 1.5}, "--overlap-steps must be an integer >= 1, got 1.5: the steps an overlapped average "
                                 "may run behind, e.g. --overlap-steps 2"),
        ({"target_exposed_frac": 1.0}, "--target-exposed-frac must be in (0, 1), got 1.0: the share of step time "
                                       "cpdp-auto may leave exposed to sync, e.g. --target-exposed-frac 0.1"),
        ({"target_exposed_frac": 0}, "--target-exposed-frac must be in (0, 1), got 0: the share of step time "
                                     "cpdp-auto may leave exposed to sync, e.g. --target-exposed-frac 0.1"),
        ({"k_min": 0}, "--k-min must be an integer >= 1, got 0: e.g. --k-min 1 --k-max 8"),
        ({"k_min": 9}, "--k-min 9 is above --k-max 8: give k-min <= k-max, e.g. --k-min 1 --k-max 8"),
        ({"k_min": 4, "k_max": 2}, "--k-min 4 is above --k-max 2: give k-min <= k-max, e.g. --k-min 1 --k-max 8"),
        ({"max_divergence": 0.0}, "--max-divergence must be > 0, got 0.0: e.g. --max-divergence 0.01, or leave it "
                                  "out for no cap"),
        ({"topologies": ("lan", "moon")}, "unknown topology 'moon' in --topologies: choose from lan, wan, "
                                          "wan-variable, cluster, multisite, cluster-slow-ib, cluster-slower-ib "
                                          "(a TOML file: --topology FILE)"),
        ({"topologies": ()}, "--topologies is empty: name at least one preset, e.g. --topologies lan,wan"),
        ({"topologies": ("wan", "lan", "wan")}, "--topologies names wan more than once: list each topology once"),
        ({"optimizer_state": "average"}, "--optimizer-state average cannot be applied late, as cpdp-overlap would: "
                                         "use --optimizer-state keep, or leave the -overlap strategies out of "
                                         "--strategies"),
    ],
)
def test_config_refuses_bad_overlap_auto_and_topology_options(kwargs, message):
    with pytest.raises(ConfigError) as info:
        BenchConfig(**kwargs)
    assert str(info.value) == message


def test_runs_cover_each_topology_and_carry_the_new_options():
    config = BenchConfig(strategies=("ddp", "cpdp-overlap", "cpdp-auto"), periods=(4,), topologies=("lan", "wan"),
                         overlap_steps=2, k_max=16, max_divergence=0.02, target_exposed_frac=0.2,
                         profile_dir="traces")
    runs = config.runs()
    assert [(r.topology, r.label) for r in runs] == [
        ("lan", "ddp"), ("lan", "cpdp-overlap K=4"), ("lan", "cpdp-auto"),
        ("wan", "ddp"), ("wan", "cpdp-overlap K=4"), ("wan", "cpdp-auto")]
    assert {(r.overlap_steps, r.sync.k_min, r.sync.k_max, r.sync.max_divergence, r.sync.target_exposed_frac)
            for r in runs} == {
        (2, 1, 16, 0.02, 0.2)}
    assert [r.profile_dir for r in runs[::3]] == ["traces/lan", "traces/wan"]  # traces of one topology apart
    assert config.to_dict()["topologies"] == ["lan", "wan"]
    single = BenchConfig(strategies=("ddp",), profile_dir="traces").runs()
    assert single[0].topology == "wan" and single[0].profile_dir == "traces"
    # a spec.json from before these options still loads
    old = {k: v for k, v in runs[0].to_dict().items()
           if k not in ("overlap_steps", "target_exposed_frac", "k_min", "k_max", "max_divergence", "topology")}
    loaded = RunSpec.from_dict(old)
    assert loaded.topology is None and loaded.overlap_steps == BenchConfig().overlap_steps


def test_run_folders_name_the_topology_only_when_there_are_several(tmp_path):
    from cpdpkit.bench.periodic.runner import _run_dir

    several = BenchConfig(strategies=("cpdp",), periods=(4,), topologies=("lan", "wan"))
    one = BenchConfig(strategies=("cpdp",), periods=(4,), topologies=("lan",))
    assert _run_dir(tmp_path, several.runs()[1], several).name == "wan-cpdp-k4-seed0"
    assert _run_dir(tmp_path, one.runs()[0], one).name == "cpdp-k4-seed0"


# ---- our strategies' options and K over time -------------------------------------------------------
def test_sync_options_of_each_bench_strategy():
    from cpdpkit.bench.periodic.strategies import run_sync_config, sync_options
    from cpdpkit.sync.config import SyncConfig

    kw = {"overlap_steps": 2}
    assert sync_options("cpdp", 4, **kw) == {"strategy": "cpdp", "period": 4}
    assert sync_options("cpdp-overlap", 4, **kw) == {"strategy": "cpdp", "period": 4, "overlap_steps": 2}
    assert sync_options("slowmo-overlap", 2, **kw) == {"strategy": "slowmo", "period": 2, "overlap_steps": 2}
    assert sync_options("cpdp-step-then-average", 4, **kw) == {"strategy": "cpdp", "period": 4,
                                                               "cpdp_order": "step-then-average"}
    # the bench's SyncConfig reaches the optimizer as it is, with the strategy's own part set
    outer = SyncConfig(outer_optimizer="diloco", slowmo_momentum=0.2, target_exposed_frac=0.2)
    got = run_sync_config("cpdp-overlap", 4, outer, **kw)
    assert got == SyncConfig(strategy="cpdp", period=4, overlap_steps=2, outer_optimizer="diloco",
                             slowmo_momentum=0.2, target_exposed_frac=0.2)
    assert (got.outer_optimizer, got.outer_lr) == ("diloco", None)
    assert run_sync_config("localsgd", 4, outer, **kw) == SyncConfig(  # no outer step
        strategy="localsgd", period=4, slowmo_momentum=0.2, target_exposed_frac=0.2)
    auto = SyncConfig(target_exposed_frac=0.2, k_min=1, k_max=8, max_divergence=None)
    assert run_sync_config("cpdp-auto", None, auto, **kw) == SyncConfig(
        strategy="cpdp", period="auto", target_exposed_frac=0.2, k_min=1, k_max=8, max_divergence=None)


def test_period_history_from_the_optimizers_stats():
    from cpdpkit.bench.periodic.strategies import period_history

    @dataclasses.dataclass
    class Decision:  # what SyncStats.to_dict() may hold instead of a dict
        step: int
        period: int
        exposed_frac: float
        divergence: float | None

    stats = {"steps": 16, "reconciliations": 4,
             "period_decisions": [{"step": 1, "period": 2, "exposed_frac": 0.5, "divergence": None},
                                  Decision(step=3, period=4, exposed_frac=0.2, divergence=0.01)]}
    history, mean = period_history(stats, 1)
    assert history == [{"step": 0, "period": 1},
                       {"step": 1, "period": 2, "exposed_frac": 0.5, "divergence": None},
                       {"step": 3, "period": 4, "exposed_frac": 0.2, "divergence": 0.01}]
    assert mean == 4.0
    assert period_history({"steps": 3, "reconciliations": 0}, 4) == ([{"step": 0, "period": 4}], None)


# ---- aggregation by topology ---------------------------------------------------------------------
def _run(strategy, period, seed, acc, wall, *, topology="wan", exposed=None, status="ok", history=None, **extra):
    spec = {"strategy": strategy, "period": period, "seed": seed}
    if topology is not None:
        spec["topology"] = topology
    out = {"spec": spec, "status": status, "reason": None if status == "ok" else "rank 1 crashed",
           "peak_test_acc": acc, "final_test_acc": acc, "wall_s": wall, "step_s": wall / 100,
           "exposed_sync_s_per_step": wall / 200 if exposed is None else exposed, "bytes_per_step": 100.0,
           "collectives_per_step": 1.0, "harness_total_s": 2.0,
           "curve": [{"epoch": 1, "wall_s": wall, "test_acc": acc}], **extra}
    if history is not None:
        out["period_history"], out["mean_period"] = history, 100 / max(1, len(history) - 1)
    return out


_CONFIG = {"model": "char-mlp", "dataset": "stdlib-text", "world_size": 2, "topology": "wan", "lr": 0.1,
           "epochs": 1, "seeds": 2, "topologies": ["lan", "wan"]}


def test_aggregate_groups_by_topology_and_pairs_deltas_within_it():
    runs = [_run("ddp", None, s, a, w, topology="lan") for s, a, w in ((0, 0.50, 10.0), (1, 0.52, 10.0))]
    runs += [_run("cpdp", 4, s, a, w, topology="lan") for s, a, w in ((0, 0.51, 5.0), (1, 0.55, 5.0))]
    runs += [_run("ddp", None, s, a, w, topology="wan") for s, a, w in ((0, 0.60, 20.0), (1, 0.60, 20.0))]
    runs += [_run("cpdp", 4, s, a, w, topology="wan") for s, a, w in ((0, 0.58, 10.0), (1, 0.58, 10.0))]
    report = aggregate(_CONFIG, runs)
    assert [(r.topology, r.label) for r in report.results] == [
        ("lan", "ddp"), ("lan", "cpdp K=4"), ("wan", "ddp"), ("wan", "cpdp K=4")]
    assert report.topologies == ("lan", "wan")
    lan, wan = report.result("cpdp", 4, "lan"), report.result("cpdp", 4, "wan")
    assert lan.delta_acc_pp == pytest.approx(2.0) and lan.paired_seeds == 2  # d = [1, 3] pp against lan's ddp
    assert lan.delta_wall_pct == pytest.approx(-50.0)
    assert wan.delta_acc_pp == pytest.approx(-2.0) and wan.delta_wall_s == pytest.approx(-10.0)
    assert report.result("cpdp", 4) is lan  # no topology: the first that has it
    assert report.result("cpdp", 4, "cluster") is None
    out = json.loads(json.dumps(report.to_dict()))["results"]
    assert [r["topology"] for r in out] == ["lan", "lan", "wan", "wan"]


def test_a_topology_without_ddp_has_no_deltas():
    runs = [_run("ddp", None, 0, 0.5, 10.0, topology="lan"), _run("cpdp", 4, 0, 0.5, 5.0, topology="wan")]
    report = aggregate(_CONFIG, runs)
    assert report.result("cpdp", 4, "wan").delta_acc_pp is None


def test_runs_from_before_topologies_are_on_the_configs_topology():
    runs = [_run("ddp", None, 0, 0.50, 10.0, topology=None), _run("cpdp", 4, 0, 0.53, 5.0, topology=None)]
    report = aggregate({**_CONFIG, "topology": "lan", "topologies": None}, runs)
    assert report.topologies == ("lan",) and report.result("cpdp", 4, "lan").delta_acc_pp == pytest.approx(3.0)


def test_seeds_keep_k_over_time():
    history = [{"step": 0, "period": 1}, {"step": 1, "period": 2}]
    report = aggregate(_CONFIG, [_run("cpdp-auto", None, 0, 0.5, 5.0, history=history)])
    seed = report.to_dict()["results"][0]["seeds"][0]
    assert seed["period_history"] == history and seed["mean_period"] == 100.0


# ---- the goals -----------------------------------------------------------------------------------
def _goal_report(auto_acc=0.530, auto_wall=10.2, overlap_exposed=0.005, overlap_acc=0.528):
    """On wan: ddp; cpdp at K=1,2,4,8 (K=8 fastest but 0.5 pp below the best; K=4 the fastest within 0.3 pp);
    cpdp-overlap K=4; cpdp-auto. On lan: cpdp K=2 and cpdp-auto only."""
    runs = [_run("ddp", None, 0, 0.540, 30.0, exposed=0.020),
            *(_run("cpdp", k, 0, a, w) for k, a, w in ((1, 0.531, 25.0), (2, 0.532, 15.0), (4, 0.530, 10.0),
                                                         (8, 0.527, 8.0))),
            _run("cpdp-overlap", 4, 0, overlap_acc, 9.0, exposed=overlap_exposed),
            _run("cpdp-auto", None, 0, auto_acc, auto_wall),
            _run("cpdp", 2, 0, 0.60, 4.0, topology="lan"), _run("cpdp-auto", None, 0, 0.59, 4.4, topology="lan")]
    return aggregate(_CONFIG, runs).to_dict()


def test_best_fixed_k_is_the_fastest_within_tolerance_of_the_most_accurate():
    report = _goal_report()
    best, ks = best_fixed_period(report, "wan")
    assert best["period"] == 4 and ks == [1, 2, 4, 8]  # K=8 is faster, but 0.5 pp below K=2
    best, ks = best_fixed_period(report, "lan")
    assert best["period"] == 2 and ks == [2]
    assert best_fixed_period(report, "cluster") is None


def test_goals_met():
    goals = {(g.name, g.topology): g for g in overlap_and_auto_goals(_goal_report())}
    assert list(goals) == [("overlap_exposed", "wan"), ("overlap_accuracy", "wan"), ("auto_wall", "wan"),
                           ("auto_accuracy", "wan"), ("auto_wall", "lan"), ("auto_accuracy", "lan")]
    g = goals[("overlap_exposed", "wan")]
    assert g.text == "cpdp-overlap K=4 exposed sync per step <= 0.30 × ddp's on wan"
    assert g.measured == "5.00 / 20.00 ms = 0.250×" and g.met
    g = goals[("overlap_accuracy", "wan")]
    assert g.text == "cpdp-overlap K=4 mean peak accuracy >= cpdp K=4's − 0.3 pp on wan"
    assert g.measured == "52.80 % vs cpdp K=4's 53.00 % (-0.20 pp)" and g.met
    g = goals[("auto_wall", "wan")]
    assert g.text == "cpdp-auto wall clock <= 1.05 × the best fixed K's on wan"
    assert g.measured == "10.20 s / cpdp K=4's 10.00 s = 1.020× (best fixed K=4 of K=1,2,4,8)" and g.met
    g = goals[("auto_accuracy", "wan")]
    assert g.measured == "53.00 % vs cpdp K=4's 53.00 % (+0.00 pp)" and g.met
    # lan: 4.4 / 4.0 = 1.1x, and 1 pp below
    assert not goals[("auto_wall", "lan")].met and not goals[("auto_accuracy", "lan")].met


def test_goals_not_met_and_exactly_at_the_tolerance():
    goals = {(g.name, g.topology): g for g in overlap_and_auto_goals(
        _goal_report(auto_acc=0.5269, auto_wall=10.6, overlap_exposed=0.0061, overlap_acc=0.527))}
    assert not goals[("overlap_exposed", "wan")].met  # 0.305x
    assert goals[("overlap_accuracy", "wan")].met  # exactly -0.3 pp
    assert not goals[("auto_wall", "wan")].met and not goals[("auto_accuracy", "wan")].met


def test_goals_only_when_their_runs_are_there():
    report = _goal_report()
    no_overlap = {**report, "results": [r for r in report["results"] if r["strategy"] != "cpdp-overlap"]}
    assert {g.name for g in overlap_and_auto_goals(no_overlap)} == {"auto_wall", "auto_accuracy"}
    no_fixed = {**report, "results": [r for r in report["results"] if r["strategy"] != "cpdp"]}
    assert [g.name for g in overlap_and_auto_goals(no_fixed)] == ["overlap_exposed"]  # nor cpdp K=4 to compare
    failed = aggregate(_CONFIG, [_run("cpdp", 4, 0, 0.5, 5.0), _run("cpdp-auto", None, 0, 0, 0, status="failed")])
    goals = overlap_and_auto_goals(failed.to_dict())
    assert [(g.name, g.measured, g.met) for g in goals] == [("auto_wall", "cpdp-auto failed", False),
                                                           ("auto_accuracy", "cpdp-auto failed", False)]


def test_k_over_time_lines_show_the_changes():
    history = [{"step": 0, "period": 1}, {"step": 1, "period": 2}, {"step": 3, "period": 4},
               {"step": 7, "period": 8}, *({"step": s, "period": 8} for s in (15, 23, 31))]
    report = aggregate(_CONFIG, [_run("ddp", None, 0, 0.5, 5.0),
                                 _run("cpdp-auto", None, 0, 0.5, 5.0, history=history)]).to_dict()
    report["results"][1]["seeds"][0]["mean_period"] = 7.6
    assert k_over_time_lines(report) == ["cpdp-auto on wan, seed 0: K 1→2→4→8→8 at steps 0,1,3,7,31 (mean K 7.6)"]
    swings = [{"step": s, "period": 1 + s % 2} for s in range(30)]
    line = k_over_time_lines(aggregate(_CONFIG, [_run("cpdp-auto", None, 1, 0.5, 5.0, history=swings)]).to_dict())[0]
    assert line.startswith("cpdp-auto on wan, seed 1: K 1→2→1→2→1→2→…→2→1→2→1→2 at steps 0,1,2,3,4,5,…,25,26,27,28,29")


# ---- printing: the CLI and tools/docs_tables.py ---------------------------------------------------
def test_cli_prints_a_table_per_topology_then_k_over_time_and_goals(monkeypatch):
    import cpdpkit.cli.bench as cli_bench

    console = Console(file=io.StringIO(), width=300)
    monkeypatch.setattr(cli_bench, "out_console", console)
    history = [{"step": 0, "period": 1}, {"step": 1, "period": 2}]
    report = aggregate(_CONFIG, [_run("ddp", None, 0, 0.5, 5.0, topology="lan"),
                                 _run("cpdp-auto", None, 0, 0.5, 5.0, topology="lan", history=history),
                                 _run("cpdp", 2, 0, 0.5, 5.0, topology="lan"),
                                 _run("ddp", None, 0, 0.5, 5.0, topology="wan")])
    cli_bench._print_report(report)
    text = console.file.getvalue()
    assert "2 ranks, topology lan, lr 0.1" in text and "2 ranks, topology wan, lr 0.1" in text
    assert "cpdp-auto on lan, seed 0: K 1→2 at steps 0,1 (mean K 100.0)" in text
    assert ("goal: cpdp-auto wall clock <= 1.05 × the best fixed K's on lan: 5.00 s / cpdp K=2's 5.00 s = 1.000× "
            "(best fixed K=2 of K=2) met") in text
    assert text.index("topology lan") < text.index("topology wan") < text.index("K 1→2") < text.index("goal:")


def test_docs_tables_renders_each_topology_and_the_goals(tmp_path):
    docs_tables = load_docs_tables()
    path = tmp_path / "bench.json"
    report = _goal_report()
    report["config"] = {**BenchConfig(topologies=("wan", "lan")).to_dict(), "seeds": 1}
    path.write_text(json.dumps(report))
    text, _ = docs_tables.render(path)
    lines = text.splitlines()
    assert lines[0] == "### char-mlp on stdlib-text, 2 ranks, topologies wan, lan, lr 0.1, 4 epochs, 1 seed(s)"
    assert lines[2].startswith("`cpdpkit bench --topologies wan,lan --json ")
    assert lines.index("#### topology wan") < lines.index("#### topology lan")
    wan_rows = lines[lines.index("#### topology wan"): lines.index("#### topology lan")]
    assert any(row.startswith("| cpdp-auto | ok |") for row in wan_rows)
    assert "| cpdp-overlap K=4 mean peak accuracy >= cpdp K=4's − 0.3 pp on wan | 52.80 % vs cpdp K=4's 53.00 % " \
           "(-0.20 pp) | met |" in lines
    assert "| cpdp-auto wall clock <= 1.05 × the best fixed K's on lan | 4.40 s / cpdp K=2's 4.00 s = 1.100× " \
           "(best fixed K=2 of K=2) | **not met** |" in lines
    assert "\n\n\n" not in text


def test_docs_tables_renders_json_from_before_topologies(tmp_path):
    docs_tables = load_docs_tables()
    runs = [_run("ddp", None, 0, 0.50, 10.0, topology=None), _run("cpdp", 4, 0, 0.53, 5.0, topology=None)]
    report = aggregate({**_CONFIG, "topology": "lan", "topologies": None}, runs).to_dict()
    for r in report["results"]:
        del r["topology"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(report))
    text, _ = docs_tables.render(path)
    assert text.splitlines()[0].startswith("### char-mlp on stdlib-text, 2 ranks, topology lan, lr 0.1")
    assert "| cpdp K=4 | ok | 53.00±0.00 | 53.00 | +3.00 |" in text and "####" not in text
