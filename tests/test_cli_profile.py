"""``cpdpkit profile`` through typer's CliRunner: table, JSON schema, exit codes, plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from _trace_builder import cpu_op, cpu_scenario, step, trace_doc, write_trace
from cpdpkit.cli import app

pytestmark = pytest.mark.timeout(60)

TOTALS = {"comm_us": float, "exposed_us": float, "hidden_us": float}


def _runs(tmp_path: Path) -> list[Path]:
    folders = []
    for strategy, scale in (("ddp", 1.0), ("localsgd", 0.5), ("cpdp", 0.25)):
        folder = tmp_path / strategy
        for rank in (0, 1):
            doc = cpu_scenario(rank)
            if scale != 1.0:  # fewer exposed microseconds: shorten the gloo ops
                for e in doc["traceEvents"]:
                    if e.get("name", "").startswith("gloo:"):
                        e["dur"] *= scale
            write_trace(folder / f"rank{rank}.pt.trace.json", doc)
        (folder / "run.json").write_text(json.dumps({"strategy": strategy}))
        folders.append(folder)
    return folders


def _check_schema(data: dict, per_step: bool) -> None:
    assert set(data) >= {"runs", "errors", "regression"}
    for run in data["runs"]:
        assert isinstance(run["name"], str) and isinstance(run["path"], str)
        assert run["strategy"] is None or isinstance(run["strategy"], str)
        assert isinstance(run["baseline"], bool)
        overlap = run["summary"]["overlap_pct"]
        assert overlap is None or isinstance(overlap, float)
        for rank in run["ranks"]:
            assert isinstance(rank["rank"], int)
            for key in ("comm_us", "exposed_us", "hidden_us", "compute_us"):
                assert isinstance(rank[key], float), key
            # null for a rank without communication (HTA: NaN), never 0 %
            assert (rank["overlap_pct"] is None) == (rank["comm_us"] == 0)
            assert rank["overlap_pct"] is None or isinstance(rank["overlap_pct"], float)
            for totals in rank["by_kind"].values():
                assert {k: type(v) for k, v in totals.items()} == TOTALS
            assert ("steps" in rank) == per_step
            for s in rank.get("steps", []):
                assert isinstance(s["step"], int)
                for key in ("duration_us", "comm_us", "exposed_us", "hidden_us"):
                    assert isinstance(s[key], float)
                assert isinstance(s["by_kind"], dict)
    for err in data["errors"]:
        assert set(err) == {"path", "error"}


def test_table_json_and_baseline(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    result = CliRunner().invoke(app, ["profile", *map(str, _runs(tmp_path)), "--json", str(out), "--per-step"])
    assert result.exit_code == 0, result.output
    for word in ("ddp", "localsgd", "cpdp", "exposed", "overlap %", "baseline", "Per step"):
        assert word in result.output
    data = json.loads(out.read_text())
    _check_schema(data, per_step=True)
    by_name = {r["name"]: r for r in data["runs"]}
    assert by_name["ddp"]["ranks"][0]["exposed_us"] == 120.0
    assert [r["baseline"] for r in data["runs"]] == [True, False, False] and data["regression"] is None
    assert [s["step"] for s in by_name["ddp"]["ranks"][0]["steps"]] == [0, 1]
    assert data["errors"] == []


def test_explicit_baseline_and_plot(tmp_path: Path) -> None:
    png = tmp_path / "plot.png"
    result = CliRunner().invoke(app, ["profile", *map(str, _runs(tmp_path)), "--baseline", "cpdp", "--plot", str(png)])
    assert result.exit_code == 0, result.output
    assert "exposed vs cpdp" in result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_baseline_is_one_line_exit_2(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["profile", str(_runs(tmp_path)[0]), "--baseline", "slowmo"])
    assert result.exit_code == 2
    assert result.output.strip() == ("error: --baseline 'slowmo' is not one of the runs: ddp, nor a file or folder; "
                                     "pass a run's name or the path of the baseline's traces (a run folder or "
                                     "trace file)")


def test_bad_input_exit_2_and_json_still_written(tmp_path: Path) -> None:
    good = tmp_path / "good"
    write_trace(good / "rank0.json", trace_doc([step(0, 0, 10), cpu_op("aten::mm", 0, 10)]))
    write_trace(good / "rank1.json.gz", b"\x1f\x8b\x08\x00garbage", gz=False)
    out = tmp_path / "r.json"
    result = CliRunner().invoke(app, ["profile", str(good), str(tmp_path / "nope"), "--json", str(out)])
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    assert f"{tmp_path / 'nope'}: no such file or folder" in result.output
    assert f"{good / 'rank1.json.gz'}: truncated gzip file" in result.output
    data = json.loads(out.read_text())
    _check_schema(data, per_step=False)
    assert [r["rank"] for r in data["runs"][0]["ranks"]] == [0]
    assert {e["path"] for e in data["errors"]} == {str(tmp_path / "nope"), str(good / "rank1.json.gz")}


def test_nothing_loadable(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    result = CliRunner().invoke(app, ["profile", str(tmp_path / "empty")])
    assert result.exit_code == 2
    assert "no trace files (*.json, *.json.gz) in this folder" in result.output


def test_no_communication_is_null_not_zero(tmp_path: Path) -> None:
    """A run without collectives (as public traces of one GPU are): overlap is "no communication"."""
    run = tmp_path / "solo"
    write_trace(run / "rank0.json", trace_doc([step(0, 0, 100), cpu_op("aten::mm", 0, 100),
                                               step(1, 100, 100), cpu_op("aten::mm", 100, 100)], world_size=1))
    out = tmp_path / "r.json"
    result = CliRunner().invoke(app, ["profile", str(run), "--json", str(out), "--per-step"])
    assert result.exit_code == 0, result.output
    assert "no communication" in result.output and "overlap % '-': no communication in that step" in result.output
    data = json.loads(out.read_text())
    _check_schema(data, per_step=True)
    (solo,) = data["runs"]
    assert solo["ranks"][0]["overlap_pct"] is None and solo["summary"]["overlap_pct"] is None
    assert solo["summary"]["spread"]["overlap_pct"] == {"min": None, "median": None, "max": None}
    png = tmp_path / "p.png"
    assert CliRunner().invoke(app, ["profile", str(run), "--plot", str(png)]).exit_code == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_missing_rank_is_a_warning_and_exit_2_with_strict(tmp_path: Path) -> None:
    run = tmp_path / "ddp"
    for rank in (0, 1, 2):
        doc = cpu_scenario(rank)
        doc["distributedInfo"]["world_size"] = 4
        write_trace(run / f"rank{rank}.pt.trace.json", doc)
    out = tmp_path / "r.json"
    missing = f"{run}: world size 4, but no trace of rank 3 (found 3 of 4); the present ranks are analysed"
    assert CliRunner().invoke(app, ["profile", str(run)]).exit_code == 0
    result = CliRunner().invoke(app, ["profile", str(run), "--json", str(out), "--per-step", "--strict"])
    assert result.exit_code == 2
    assert f"warning: {missing}" in result.output
    assert "Per step" in result.output and "Traceback" not in result.output
    data = json.loads(out.read_text())
    assert [r["rank"] for r in data["runs"][0]["ranks"]] == [0, 1, 2]
    assert data["errors"] == [{"path": str(run), "error": missing, "warning": True}]
