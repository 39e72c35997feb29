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
    assert set(data) >= {"runs", "errors"}
    for run in data["runs"]:
        assert isinstance(run["name"], str) and isinstance(run["path"], str)
        assert run["strategy"] is None or isinstance(run["strategy"], str)
        for rank in run["ranks"]:
            assert isinstance(rank["rank"], int)
            for key in ("comm_us", "exposed_us", "hidden_us", "compute_us", "overlap_pct"):
                assert isinstance(rank[key], float), key
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
    assert "--baseline 'slowmo' is not one of the runs: ddp" in result.output
    assert "Traceback" not in result.output


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
