"""A rank killed in the middle of a checkpoint save never leaves a folder that restore would take.

Two ranks save step 2, then one dies during the save of step 4 (tests/data/kill_mid_save.py): rank 1
after DCP wrote its data, or rank 0 after the manifest, just before the rename that commits the
folder. The survivor ends in one ``CheckpointError`` line within the checkpointer's timeout; the
folder holds no ``step00000004``; two fresh ranks restore step 2 with the parameters saved then. (The
checkpointer's gloo group is its own, outside the network emulator, so the fault is a dead rank, not
a link taken down.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from _ranks import run_processes
from cpdpkit.checkpoint import Checkpointer

SCRIPT = str(Path(__file__).parent / "data" / "kill_mid_save.py")


def _ranks(tmp_path: Path, mode: str) -> list:
    out = tmp_path / "ckpt"
    out.mkdir(exist_ok=True)
    return run_processes([[sys.executable, SCRIPT, str(r), "2", str(tmp_path / "store"), str(out), mode]
                          for r in range(2)], wall_s=90)


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize(("mode", "victim"), [("kill-in-write", 1), ("kill-before-rename", 0)])
def test_a_rank_killed_mid_save_leaves_no_folder_restore_would_take(tmp_path: Path, mode: str, victim: int) -> None:
    ended = _ranks(tmp_path, mode)
    survivor = 1 - victim
    assert ended[victim].returncode == -9, ended[victim].output
    assert ended[survivor].returncode == 0, ended[survivor].output
    said = (tmp_path / "ckpt" / f"survivor-rank{survivor}.txt").read_text()
    assert said.startswith("CheckpointError: ") and "\n" not in said, said
    ckpt = tmp_path / "ckpt"
    assert not (ckpt / "step00000004").exists()
    assert Checkpointer(ckpt, every=2).latest() == (2, ckpt / "step00000002")

    restored = _ranks(tmp_path, "restore")
    assert all(r.returncode == 0 for r in restored), [r.output for r in restored]
    for rank in range(2):
        got = torch.load(ckpt / f"restored-rank{rank}.pt", weights_only=True)
        saved = torch.load(ckpt / f"saved-rank{rank}.pt", weights_only=True)
        assert got["start"] == 2
        assert all(torch.equal(got["params"][n], saved[n]) for n in saved)
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["step00000002"]  # the partial one removed
