"""A rank killed in the middle of a checkpoint save (tests/test_checkpoint_kill.py).

    python kill_mid_save.py RANK WORLD STORE OUT {kill-in-write,kill-before-rename,restore}

``kill-*``: save step 2, train to step 4, and in the save of step 4 one rank SIGKILLs itself: rank 1
after DCP wrote its data file (before the metadata and the commit), or rank 0 after the manifest is
written, just before the rename that commits the folder. The other rank writes what it raised to
``OUT/survivor-rank<R>.txt``. ``restore``: restore from OUT, write the step and parameters to
``OUT/restored-rank<R>.pt``. The checkpointer's gloo group is its own (not the emulator's), so a link
cannot be taken down under it: a rank dying mid-save is the fault here.
"""

from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _train(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    torch.manual_seed(step)
    opt.zero_grad()
    model(torch.randn(4, 6)).square().mean().backward()
    opt.step()


def main(rank: int, world: int, store: str, out: Path, mode: str) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from cpdpkit.checkpoint import Checkpointer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}-{mode}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ckpt = Checkpointer(out, every=2, timeout_s=10)
    if mode == "restore":
        start = ckpt.restore(model=model, optimizer=opt)
        torch.save({"start": start, "params": {n: p.detach().clone() for n, p in model.named_parameters()}},
                   out / f"restored-rank{rank}.pt")
        return
    for step in (1, 2):
        _train(model, opt, step)
        ckpt.maybe_save(step, model=model, optimizer=opt)
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, out / f"saved-rank{rank}.pt")
    for step in (3, 4):
        _train(model, opt, step)
    if mode == "kill-in-write" and rank == 1:
        write = FileSystemWriter.write_data

        def write_then_die(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            future = write(self, *args, **kwargs)
            future.wait()
            _die()

        FileSystemWriter.write_data = write_then_die
    if mode == "kill-before-rename" and rank == 0:
        rename = os.rename

        def die_before_commit(src, dst):  # noqa: ANN001, ANN202
            if Path(src).name.startswith(".tmp-step") and (Path(src) / "cpdpkit-checkpoint.json").is_file():
                _die()
            rename(src, dst)

        os.rename = die_before_commit
    try:
        ckpt.maybe_save(4, model=model, optimizer=opt)
    except Exception as exc:  # noqa: BLE001 - what the survivor raised is what the test checks
        (out / f"survivor-rank{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
        return
    (out / f"survivor-rank{rank}.txt").write_text("no error")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), sys.argv[5])
    os._exit(0)  # the peer is dead: no destroy_process_group (it would wait for it)
