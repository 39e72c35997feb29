"""``cpdpkit profile NEW --baseline OLD --max-regression PCT``: pairing, verdict lines, exit codes.

Every trace is a tiny CPU trace whose exposed communication per step is known exactly: each
step is a c10d call site of ``E`` us (the training thread blocked: exposed) then compute.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from _trace_builder import cpu_op, step, trace_doc, write_trace
from cpdpkit.cli import app
from cpdpkit.profiler import analyze
from cpdpkit.profiler.compare import check_regression, pair_runs

pytestmark = pytest.mark.timeout(60)


def _doc(rank: int, exposed_us: float, world: int) -> dict:
    events = []
    for n in (0, 1):
        t = n * 1000
        events += [step(n, t, 1000), cpu_op("c10d::allreduce_", t, exposed_us), cpu_op("aten::mm", t + exposed_us,
                                                                                      1000 - exposed_us)]
    return trace_doc(events, rank=rank, world_size=world)


def _run(folder: Path, strategy: str, exposed: dict[int, float], *, period: int | None = None,
         world: int | None = None) -> Path:
    for rank, e in exposed.items():
        write_trace(folder / f"rank{rank}.pt.trace.json", _doc(rank, e, world or len(exposed)))
    (folder / "run.json").write_text(json.dumps({"strategy": strategy, "period": period}))
    return folder


def _cli(*args: object):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(app, ["profile", *map(str, args)])


def test_per_step_exposed_of_the_synthetic_trace(tmp_path: Path) -> None:
    (run,) = analyze([_run(tmp_path / "a", "ddp", {0: 100, 1: 140})]).runs
    assert run.summary.per_step["exposed_us"] == 120
    assert [r.exposed_us for r in run.ranks] == [200, 280]  # two steps each


def test_no_regression_exit_0(tmp_path: Path) -> None:
    old = _run(tmp_path / "old", "ddp", {0: 100, 1: 100})
    new = _run(tmp_path / "new", "ddp", {0: 105, 1: 105})
    result = _cli(new, "--baseline", old, "--max-regression", "10")
    assert result.exit_code == 0, result.output
    assert (f"no regression over baseline ddp ({old}): exposed communication per step of 1 run, largest change "
            f"+5.0 % (run ddp mean over ranks) (limit 10 %)") in result.output
    assert "regression:" not in result.output
    assert "ddp (baseline)" in result.output  # the baseline path is shown, marked


def test_regression_of_one_rank_exit_1(tmp_path: Path) -> None:
    old = _run(tmp_path / "old", "ddp", {0: 100, 1: 100})
    new = _run(tmp_path / "new", "ddp", {0: 100, 1: 123.4})
    result = _cli(new, "--baseline", old, "--max-regression", "10%")
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("regression:")]
    assert lines == [
        f"regression: exposed communication per step of run ddp ({new}) mean over ranks grew 11.7 % over baseline "
        f"ddp ({old}): 0.112 ms vs 0.100 ms (limit 10 %)",
        f"regression: exposed communication per step of run ddp ({new}) rank 1 grew 23.4 % over baseline "
        f"ddp ({old}): 0.123 ms vs 0.100 ms (limit 10 %)",
    ]
    assert "no regression" not in result.output


def test_limit_zero_and_a_drop(tmp_path: Path) -> None:
    old = _run(tmp_path / "old", "ddp", {0: 100, 1: 100})
    faster = _run(tmp_path / "faster", "ddp", {0: 50, 1: 50})
    result = _cli(faster, "--baseline", old, "--max-regression", "0")
    assert result.exit_code == 0, result.output
    assert "largest change -50.0 %" in result.output and "(limit 0 %)" in result.output


def test_baseline_by_name_among_the_runs(tmp_path: Path) -> None:
    ddp = _run(tmp_path / "ddp", "ddp", {0: 100, 1: 100})
    cpdp = _run(tmp_path / "cpdp", "cpdp", {0: 50, 1: 150}, period=4)
    result = _cli(ddp, cpdp, "--baseline", "ddp", "--max-regression", "10")
    assert result.exit_code == 1, result.output
    assert (f"regression: exposed communication per step of run cpdp K=4 ({cpdp}) rank 1 grew 50.0 % over "
            f"baseline ddp ({ddp}): 0.150 ms vs 0.100 ms (limit 10 %)") in result.output
    assert "mean over ranks grew" not in result.output  # the mean is equal
    # the same through the baseline's path, which is one of the runs given: not analysed twice
    by_path = _cli(ddp, cpdp, "--baseline", ddp, "--max-regression", "10", "--json", tmp_path / "r.json")
    assert by_path.exit_code == 1, by_path.output
    data = json.loads((tmp_path / "r.json").read_text())
    assert [(r["name"], r["baseline"]) for r in data["runs"]] == [("ddp", True), ("cpdp K=4", False)]


def test_same_named_runs_are_paired(tmp_path: Path) -> None:
    _run(tmp_path / "old" / "ddp", "ddp", {0: 100, 1: 100})
    _run(tmp_path / "old" / "cpdp", "cpdp", {0: 40, 1: 40}, period=4)
    _run(tmp_path / "new" / "ddp", "ddp", {0: 100, 1: 100})
    _run(tmp_path / "new" / "cpdp", "cpdp", {0: 50, 1: 50}, period=4)
    _run(tmp_path / "new" / "slowmo", "slowmo", {0: 10, 1: 10}, period=4)
    out = tmp_path / "ci.json"
    result = _cli(tmp_path / "new", "--baseline", tmp_path / "old", "--max-regression", "10", "--json", out)
    assert result.exit_code == 1, result.output
    old, new = tmp_path / "old", tmp_path / "new"
    regressions = [line for line in result.output.splitlines() if line.startswith("regression:")]
    assert regressions[0] == (f"regression: exposed communication per step of run cpdp K=4 ({new / 'cpdp'}) mean "
                              f"over ranks grew 25.0 % over baseline cpdp K=4 ({old / 'cpdp'}): 0.050 ms vs "
                              f"0.040 ms (limit 10 %)")
    assert len(regressions) == 3 and all("run cpdp K=4" in line for line in regressions)
    assert (f"note: run slowmo K=4 ({new / 'slowmo'}) not compared: no baseline run is named 'slowmo K=4' "
            "(baseline runs: cpdp K=4, ddp)") in result.output
    data = json.loads(out.read_text())
    assert [(r["name"], r["baseline"]) for r in data["runs"]] == [
        ("cpdp K=4", True), ("ddp", True), ("cpdp K=4", False), ("ddp", False), ("slowmo K=4", False)]
    check = data["regression"]
    assert check["metric"] == "exposed_us_per_step" and check["max_regression_pct"] == 10.0
    assert check["passed"] is False and len(check["notes"]) == 1
    first = check["comparisons"][0]
    assert first == {"run": "cpdp K=4", "run_path": str(new / "cpdp"), "baseline": "cpdp K=4",
                     "baseline_path": str(old / "cpdp"), "rank": None, "exposed_us": 50.0,
                     "baseline_exposed_us": 40.0, "change_pct": 25.0, "regressed": True}
    assert [c["rank"] for c in check["comparisons"]] == [None, 0, 1, None, 0, 1]


def test_several_baseline_runs_and_no_name_in_common_exit_2(tmp_path: Path) -> None:
    _run(tmp_path / "old" / "ddp", "ddp", {0: 100, 1: 100})
    _run(tmp_path / "old" / "cpdp", "cpdp", {0: 40, 1: 40}, period=4)
    new = _run(tmp_path / "localsgd", "localsgd", {0: 10, 1: 10})
    result = _cli(new, "--baseline", tmp_path / "old", "--max-regression", "10")
    assert result.exit_code == 2, result.output
    old = tmp_path / "old"
    assert (f"error: 2 baseline runs (cpdp K=4 ({old / 'cpdp'}), ddp ({old / 'ddp'})) and none is named like a "
            "run to check (localsgd); pass one baseline run, or baseline runs named like the new ones") in result.output
    # without --max-regression the table is still shown, nothing compared
    plain = _cli(new, "--baseline", tmp_path / "old")
    assert plain.exit_code == 0, plain.output
    assert "exposed vs baseline" in plain.output


def test_a_rank_on_one_side_only_is_noted(tmp_path: Path) -> None:
    old = _run(tmp_path / "old", "ddp", {0: 100, 1: 100})
    new = _run(tmp_path / "new", "ddp", {0: 100, 1: 100, 2: 100})
    result = _cli(new, "--baseline", old, "--max-regression", "10")
    assert result.exit_code == 0, result.output
    assert (f"note: rank 2 of run ddp ({new}) not in baseline ddp ({old}): compared through the mean over ranks "
            "only") in result.output


def test_input_errors_win_over_a_regression(tmp_path: Path) -> None:
    old = _run(tmp_path / "old", "ddp", {0: 100, 1: 100})
    new = _run(tmp_path / "new", "ddp", {0: 200}, world=2)  # rank 1 missing
    result = _cli(new, "--baseline", old, "--max-regression", "10", "--strict")
    assert result.exit_code == 2, result.output
    assert (f"warning: {new}: world size 2, but no trace of rank 1 (found 1 of 2); the present ranks are "
            "analysed") in result.output
    assert (f"regression: exposed communication per step of run ddp ({new}) rank 0 grew 100.0 % over baseline "
            f"ddp ({old}): 0.200 ms vs 0.100 ms (limit 10 %)") in result.output
    assert f"note: rank 1 of baseline ddp ({old}) not in run ddp ({new})" in result.output


@pytest.mark.parametrize("value", ["-5", "abc", "nan", "inf", ""])
def test_bad_max_regression_is_one_line_exit_2(tmp_path: Path, value: str) -> None:
    run = _run(tmp_path / "ddp", "ddp", {0: 100, 1: 100})
    result = _cli(run, "--max-regression", value)
    assert result.exit_code == 2, result.output
    assert result.output.strip() == (f"error: --max-regression {value!r} is not a percentage >= 0; pass one such "
                                     "as 10 (exit 1 when exposed communication per step grows by more than 10 %)")


def test_max_regression_needs_a_baseline_and_a_new_run(tmp_path: Path) -> None:
    local = _run(tmp_path / "localsgd", "localsgd", {0: 100, 1: 100})
    result = _cli(local, "--max-regression", "10")
    assert result.exit_code == 2, result.output
    assert ("error: --max-regression needs a baseline: pass --baseline RUN or PATH (no run is named ddp)"
            in result.output)
    ddp = _run(tmp_path / "ddp", "ddp", {0: 100, 1: 100})
    alone = _cli(ddp, "--max-regression", "10")  # the default baseline, and nothing else
    assert alone.exit_code == 2, alone.output
    assert (f"error: --max-regression: no run to compare with the baseline ddp ({ddp}); pass the new runs' folders "
            "as well") in alone.output
    assert _cli(ddp, local, "--max-regression", "10").exit_code == 0  # ddp is the default baseline


def test_unknown_baseline_names_runs_and_paths(tmp_path: Path) -> None:
    run = _run(tmp_path / "ddp", "ddp", {0: 100, 1: 100})
    result = _cli(run, "--baseline", tmp_path / "nope")
    assert result.exit_code == 2
    assert result.output.strip() == (f"error: --baseline '{tmp_path / 'nope'}' is not one of the runs: ddp, nor a "
                                     "file or folder; pass a run's name or the path of the baseline's traces (a "
                                     "run folder or trace file)")


def test_pairing_and_check_api(tmp_path: Path) -> None:
    old = analyze([_run(tmp_path / "old", "ddp", {0: 0.0, 1: 100})]).runs
    new = analyze([_run(tmp_path / "new", "ddp", {0: 10, 1: 100})]).runs
    pairs, notes = pair_runs(new, old)
    assert pairs == [(new[0], old[0])] and notes == []
    check = check_regression(pairs, 5.0)
    by_rank = {c.rank: c for c in check.comparisons}
    assert by_rank[0].change_pct is None and by_rank[0].regressed  # from 0 exposed to some
    assert by_rank[1].change_pct == 0.0 and not by_rank[1].regressed
    assert not check.passed and check.regressions == (by_rank[None], by_rank[0])
