"""``cpdpkit bench --compression`` (a swept list) and ``--fragments``: the runs they make, what results record,
the issue-24 goals read from them, and bad input (exit 2, one line, before anything starts). No ranks start."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from cpdpkit.bench.periodic.config import BenchConfig, RunSpec
from cpdpkit.bench.periodic.goals import overlap_and_auto_goals
from cpdpkit.bench.periodic.report import aggregate
from cpdpkit.cli import app


@pytest.mark.parametrize(("args", "message"), [
    (["--compression", "zip"], "--compression: compression 'zip' is not a codec: pass one of 'none', 'bf16', 'int8' "
                               "or 'topk:F' with F in (0, 1], e.g. 'topk:0.02'"),
    (["--compression", "none,topk:2"], "--compression: compression 'topk:2': the top-k fraction '2' must be in "
                                       "(0, 1]; pass e.g. 'topk:0.02' for the largest 2 % of each payload"),
    (["--compression", "int8,int8"], "--compression names int8 more than once: list each codec once"),
    (["--compression", ","], "--compression must name at least one codec, got (): e.g. --compression "
                             "none,int8,topk:0.02"),
    (["--fragments", "0"], "--fragments must be an integer >= 1, got 0: e.g. --fragments 4 (1: the whole model "
                           "at once)"),
    (["--fragments", "2", "--optimizer-state", "reset"],
     "--fragments 2 with --optimizer-state reset: a policy on the whole optimizer cannot follow fragments; use "
     "--optimizer-state keep or --fragments 1"),
])
def test_bad_compression_options_exit_2_with_one_line(args, message, tmp_path):
    result = CliRunner().invoke(app, ["bench", *args, "--work-dir", str(tmp_path)])
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0] == f"error: {message}", result.output
    assert not any(Path(tmp_path).iterdir()), "nothing may start before the options are valid"


def test_compression_is_swept_for_our_fixed_k_strategies_only():
    cfg = BenchConfig(strategies=("ddp", "localsgd-torch", "cpdp", "cpdp-overlap", "cpdp-auto",
                                  "cpdp-step-then-average"), periods=(4,), compression=("none", "int8"), fragments=4)
    runs = [(r.label, r.sync.compression, r.sync.fragments) for r in cfg.runs()]
    assert runs == [("ddp", "none", 1), ("localsgd-torch K=4", "none", 1),
                    ("cpdp K=4 fragments=4", "none", 4), ("cpdp K=4 int8 fragments=4", "int8", 4),
                    ("cpdp-overlap K=4 fragments=4", "none", 4), ("cpdp-overlap K=4 int8 fragments=4", "int8", 4),
                    ("cpdp-auto", "none", 1),
                    ("cpdp-step-then-average K=4", "none", 1), ("cpdp-step-then-average K=4 int8", "int8", 1)]
    spec = cfg.runs()[3]
    assert RunSpec.from_dict(spec.to_dict()) == spec  # spec.json keeps the codec and the fragments
    assert spec.to_dict()["compression"] == "int8" and spec.to_dict()["fragments"] == 4
    assert cfg.to_dict()["compression"] == ["none", "int8"] and cfg.to_dict()["fragments"] == 4
    assert BenchConfig().runs()[0].sync.compression == "none"  # the default: uncompressed


def _run(strategy: str, codec: str, fragments: int, *, acc: float, bytes_: float, most: float,
         period: int | None = 4) -> dict:
    variant = " ".join(([codec] if codec != "none" else []) + ([f"fragments={fragments}"] if fragments > 1 else []))
    return {"spec": {"strategy": strategy, "period": period, "seed": 0, "variant": variant or None,
                     "topology": "wan", "compression": codec, "fragments": fragments},
            "status": "ok", "peak_test_acc": acc, "final_test_acc": acc, "wall_s": 1.0, "step_s": 0.01,
            "exposed_sync_s_per_step": 0.001, "bytes_per_step": bytes_, "max_bytes_per_step": most,
            "collectives_per_step": 1.0}


def test_results_record_codec_fragments_and_the_largest_step_and_the_goals_read_them():
    runs = [_run("ddp", "none", 1, acc=0.5, bytes_=800.0, most=800.0, period=None),
            _run("cpdp", "none", 1, acc=0.50, bytes_=400.0, most=800.0),
            _run("cpdp", "int8", 1, acc=0.498, bytes_=101.0, most=202.0),
            _run("cpdp", "topk:0.02", 1, acc=0.49, bytes_=10.0, most=20.0),
            _run("cpdp-overlap", "none", 1, acc=0.50, bytes_=400.0, most=1600.0),
            _run("cpdp-overlap", "none", 4, acc=0.50, bytes_=380.0, most=400.0)]
    report = aggregate({"topology": "wan"}, runs).to_dict()
    by_label = {(r["strategy"], r["variant"]): r for r in report["results"]}
    assert by_label[("cpdp", "int8")]["compression"] == "int8" and by_label[("cpdp", "int8")]["fragments"] == 1
    assert by_label[("cpdp-overlap", "fragments=4")]["fragments"] == 4
    assert by_label[("cpdp-overlap", "fragments=4")]["max_bytes_per_step"] == 400.0
    assert by_label[("cpdp", "int8")]["seeds"][0]["max_bytes_per_step"] == 202.0
    goals = {g.name: g for g in overlap_and_auto_goals(report)}
    assert goals["cpdp_int8_f1_bytes"].met and goals["cpdp_int8_f1_bytes"].measured == "101 / 400 B = 0.253×"
    assert goals["cpdp_int8_f1_accuracy"].met  # −0.2 pp within 0.3
    assert goals["cpdp_topk:0.02_f1_bytes"].met
    assert not goals["cpdp_topk:0.02_f1_accuracy"].met  # −1.0 pp is outside 0.5
    assert goals["cpdp-overlap_none_f4_bytes"].met and goals["cpdp-overlap_none_f4_bytes"].measured.endswith("0.250×")


def test_hybrid_compression_is_validated_and_carried_in_the_spec():
    from cpdpkit.bench.hybrid.suite import HybridBenchConfig
    from cpdpkit.errors import ConfigError

    assert HybridBenchConfig(compression="int8").to_dict()["compression"] == "int8"
    assert HybridBenchConfig().to_dict()["compression"] == "none"
    with pytest.raises(ConfigError) as exc:
        HybridBenchConfig(compression="int4")
    assert str(exc.value) == ("--compression: compression 'int4' is not a codec: pass one of 'none', 'bf16', 'int8' "
                              "or 'topk:F' with F in (0, 1], e.g. 'topk:0.02'")


def test_hybrid_slowmo_momentum_is_validated_and_carried_in_the_spec():
    from cpdpkit.bench.hybrid.suite import HybridBenchConfig
    from cpdpkit.errors import ConfigError

    assert HybridBenchConfig(slowmo_momentum=0.5).to_dict()["slowmo_momentum"] == 0.5
    assert HybridBenchConfig().to_dict()["slowmo_momentum"] is None  # the library's default by replicas
    with pytest.raises(ConfigError) as exc:
        HybridBenchConfig(slowmo_momentum=1.0)
    assert str(exc.value) == ("--slowmo-momentum: slowmo_momentum must be in [0, 1) or None, got 1.0: pass None "
                              "for the measured default by replicas (slowmo_beta_for), or e.g. 0.2")


def test_bench_hybrid_bad_slowmo_momentum_exits_2_before_any_launch(tmp_path):
    result = CliRunner().invoke(app, ["bench", "hybrid", "--slowmo-momentum", "-0.1", "--work-dir", str(tmp_path)])
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert lines == ["error: --slowmo-momentum: slowmo_momentum must be in [0, 1) or None, got -0.1: pass None for "
                     "the measured default by replicas (slowmo_beta_for), or e.g. 0.2"], result.output
    assert not any(Path(tmp_path).iterdir()), "nothing may start before the options are valid"
