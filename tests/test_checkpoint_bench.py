"""``cpdpkit bench --inject-fault kill:rank=R:step=S``: a bench run killed once, restarted, resumed from its
checkpoint, and compared with the same run without the fault; and the one-line refusal of a bad fault."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cpdpkit.bench.periodic.faults import Fault, parse_fault
from cpdpkit.cli import app

FORMAT = "kill:rank=R:step=S (R a rank below the world size, S >= 1 the optimizer step), e.g. kill:rank=1:step=40"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_fault_restarts_resumes_and_ends_bit_identical(tmp_path: Path) -> None:
    out, work = tmp_path / "fault.json", tmp_path / "runs"
    # 2 epochs of 16 steps; checkpoints every 8: the kill after step 28 resumes from 24, mid-epoch
    proc = subprocess.run(
        [sys.executable, "-m", "cpdpkit.cli", "bench", "--quick", "--strategies", "cpdp", "--periods", "4",
         "--epochs", "2", "--inject-fault", "kill:rank=1:step=28", "--json", str(out), "--work-dir", str(work)],
        capture_output=True, text=True, timeout=220, env={**os.environ, "COLUMNS": "250"},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "fault kill:rank=1:step=28 on cpdp K=4 seed 0: 1 restart(s), resumed from step 24; final parameters of " \
           "every rank equal to the uninterrupted run's" in proc.stdout, proc.stdout[-2000:]
    (result,) = json.loads(out.read_text())["results"]
    (seed,) = result["seeds"]
    fault = seed["fault"]
    assert seed["status"] == "ok" and seed["restarts"] == 1 and seed["steps"] == 32
    assert fault["injected"] == "kill:rank=1:step=28" and fault["resumed_from_step"] == 24
    assert fault["uninterrupted_status"] == "ok" and fault["final_params_equal_uninterrupted"] is True
    assert len(fault["final_params_sha256"]) == 2
    assert fault["final_params_sha256"] == fault["uninterrupted_params_sha256"]
    assert [p["epoch"] for p in result["curve"]] == [1, 2]  # the epoch evaluated before the kill was kept
    attempts = sorted(p.name for p in (work / "cpdp-k4-seed0" / "logs").glob("*/attempt_*"))
    assert attempts == ["attempt_0", "attempt_1"]
    assert not list((work / "cpdp-k4-seed0-uninterrupted" / "logs").glob("*/attempt_1"))


@pytest.mark.parametrize(("value", "why"), [
    ("kill:1:40", "is not a fault"),
    ("kill:rank=1", "is not a fault"),
    ("stop:rank=1:step=4", "is not a fault"),
    ("kill:rank=-1:step=4", "is not a fault"),
    ("kill:rank=1:step=0", "step must be >= 1"),
    ("kill:rank=2:step=40", "rank 2 does not exist with --world-size 2"),
])
def test_bad_fault_is_one_line_exit_2(tmp_path: Path, value: str, why: str) -> None:
    result = CliRunner().invoke(app, ["bench", "--quick", "--inject-fault", value, "--work-dir", str(tmp_path)])
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert "\n" not in line and line.startswith(f"error: --inject-fault {value!r}") and why in line, line
    assert line.endswith(f"use {FORMAT}"), line


def test_parse_fault() -> None:
    assert parse_fault(" kill:rank=0:step=7 ", world_size=2) == Fault(rank=0, step=7)
    assert str(Fault(rank=1, step=40)) == "kill:rank=1:step=40"
