"""``cpdpkit launch --max-restarts``: a rank SIGKILLed mid-period, torch elastic restarts the job, every
setup resumes from its last checkpoint, and the final parameters are bit-identical to an uninterrupted run.

One launched job trains six setups side by side (ddp, localsgd, slowmo, cpdp, cpdp with overlap_steps=3,
TwoStageExecutor; tests/data/restart_train.py), so one kill interrupts all of them in the same step.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cpdpkit.errors import ConfigError
from cpdpkit.launch import LaunchConfig, launch, torchrun_args

SCRIPT = str(Path(__file__).parent / "data" / "restart_train.py")
SETUPS = ("ddp", "localsgd", "slowmo", "cpdp", "cpdp-overlap", "two-stage")
PERIODIC = ("localsgd", "slowmo", "cpdp", "cpdp-overlap")


def _cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [str(Path(sys.executable).with_name("cpdpkit")), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=100, env={**os.environ, "COLUMNS": "200"})


def _finals(folder: Path) -> list[dict]:
    return [torch.load(folder / f"final-rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_rank_killed_mid_period_resumes_bit_identical(tmp_path: Path) -> None:
    killed, clean = tmp_path / "killed", tmp_path / "clean"
    killed.mkdir()
    clean.mkdir()
    # One launch: its first attempt's ranks (fresh processes, restart count 0) first train the uninterrupted
    # reference into clean/, then the run that rank 1 kills in step 17; the restarted attempt resumes only
    # that run (a second launch just for the reference cost a launcher and two ranks' start-up).
    proc = _cli("launch", "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", str(killed / "logs"), SCRIPT,
                str(killed), "--steps", "28", "--every", "8", "--kill-rank", "1", "--kill-step", "17",
                "--clean-first", str(clean))
    assert proc.returncode == 0, proc.stderr
    assert "restarted 1 time(s)" in proc.stdout, proc.stdout
    attempts = sorted(p.name for p in (killed / "logs").glob("*/attempt_*"))
    assert attempts == ["attempt_0", "attempt_1"], attempts

    for rank, (resumed, uninterrupted) in enumerate(zip(_finals(killed), _finals(clean))):
        assert resumed["restart"] == 1 and uninterrupted["restart"] == 0
        assert resumed["starts"] == dict.fromkeys(SETUPS, 16), resumed["starts"]  # the checkpoint before step 17
        assert uninterrupted["starts"] == dict.fromkeys(SETUPS, 0)
        for setup in SETUPS:
            got, want = resumed["params"][setup], uninterrupted["params"][setup]
            assert got.keys() == want.keys()
            for name in want:
                assert torch.equal(got[name], want[name]), f"{setup} {name} rank {rank}"
    # step 28 is mid-period (2 warm-up steps, K=4): the periodic setups' replicas really differ, so each
    # rank had to get its own state back
    rank0, rank1 = _finals(clean)
    for setup in PERIODIC:
        assert any(not torch.equal(rank0["params"][setup][n], rank1["params"][setup][n])
                   for n in rank0["params"][setup]), setup
    # the checkpoints themselves: the last two kept, each committed with its metadata
    assert sorted(p.name for p in (killed / "ckpt" / "cpdp").iterdir()) == ["step00000016", "step00000024"]


@pytest.mark.parametrize("value", [-1, 1.5, True, "2"])
def test_max_restarts_must_be_a_whole_number(value: object) -> None:
    with pytest.raises(ConfigError) as info:
        LaunchConfig(nproc_per_node=2, max_restarts=value)  # type: ignore[arg-type]
    message = str(info.value)
    assert message.startswith(f"max_restarts = {value!r} is invalid; use a whole number >= 0") and "\n" not in message


def test_cli_negative_max_restarts_is_one_line_exit_2(tmp_path: Path) -> None:
    proc = _cli("launch", "--max-restarts", "-1", SCRIPT, str(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: max_restarts = -1 is invalid; use a whole number >= 0 "
                                   "(0: a failed rank ends the job)")


def test_torchrun_args_pass_max_restarts() -> None:
    args = torchrun_args(LaunchConfig(nproc_per_node=2, max_restarts=3), "s.py", [], log_dir="/tmp/l")
    assert "--max-restarts=3" in args


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_restarts_are_counted_when_every_attempt_fails(tmp_path: Path) -> None:
    tiny = str(Path(__file__).parent / "data" / "launch_tiny.py")
    # one rank per launch: what is counted is the launcher's attempts, not the ranks (and it halves the start-ups)
    result = launch(LaunchConfig(nproc_per_node=1, max_restarts=1, log_dir=str(tmp_path / "logs")), tiny,
                    ["--fail-rank", "0"])
    assert not result.ok and result.restarts == 1
    assert result.error == "rank 0 failed (exit code 1): ValueError: rank 0 was told to fail"
    again = launch(LaunchConfig(nproc_per_node=1, log_dir=str(tmp_path / "logs")), tiny, [])  # the same log folder
    assert again.ok and again.restarts == 0  # an earlier launch's attempt folders are not counted
