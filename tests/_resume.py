"""The resume-and-compare job of the sync tests (tests/test_sync_outer.py, tests/test_sync_compression.py).

:func:`straight_and_resumed` trains one optimizer straight through, and another that stops after a step,
saves its model's and optimizer's state, loads it into fresh objects and trains on: a test then checks
that the two end bit-identically, and whatever it wants of the saved state.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cpdpkit.sync import PeriodicSyncOptimizer
from sync_reference import batch


def train(opt: PeriodicSyncOptimizer, model: nn.Module, rank: int, steps: range) -> None:
    """Steps ``steps`` (numbered from 1) on this rank's batches of tests/sync_reference.py (MSE loss)."""
    for n in steps:
        opt.zero_grad()
        x, y = batch(rank, n)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@dataclass
class Resumed:
    straight: list[torch.Tensor]  # the parameters trained straight through
    resumed: list[torch.Tensor]  # the same steps, stopped, saved and resumed into fresh objects
    saved: dict[str, Any]  # {"model": ..., "opt": ...} as the fresh objects loaded it
    opt: PeriodicSyncOptimizer  # the resumed optimizer, after its last step


def straight_and_resumed(build: Callable[[], tuple[nn.Module, PeriodicSyncOptimizer]], rank: int, *, stop: int,
                         steps: int, through_bytes: bool = True) -> Resumed:
    """Train ``build()``'s pair for steps 1..``steps``; then a fresh pair for 1..``stop``, its state saved
    (``through_bytes``: written with ``torch.save`` and read back with ``weights_only=True``, as a checkpoint
    file would be; else the state dicts as they are), loaded into a third pair that trains ``stop+1..steps``."""
    model, opt = build()
    train(opt, model, rank, range(1, steps + 1))
    straight = params(model)
    model, opt = build()
    train(opt, model, rank, range(1, stop + 1))
    saved = {"model": model.state_dict(), "opt": opt.state_dict()}
    if through_bytes:
        buf = io.BytesIO()
        torch.save(saved, buf)
        saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    model, opt = build()
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    train(opt, model, rank, range(stop + 1, steps + 1))
    return Resumed(straight, params(model), saved, opt)
