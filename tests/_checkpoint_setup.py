"""The small model and PeriodicSyncOptimizer that the checkpoint tests save and restore."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cpdpkit.sync import PeriodicSyncOptimizer

TOTAL_STEPS = 12


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 3))


def setup(options: dict[str, Any], seed: int = 0) -> tuple[nn.Module, PeriodicSyncOptimizer, Any]:
    """A model, its AdamW wrapped by ``PeriodicSyncOptimizer(**options)`` (period 4 unless ddp) and a
    cosine LR scheduler over ``TOTAL_STEPS``."""
    model = make_model(seed)
    period = {} if options.get("strategy") == "ddp" else {"period": 4}  # ddp has no period
    opt = PeriodicSyncOptimizer(torch.optim.AdamW(model.parameters(), lr=0.02), model=model, **period, **options)
    return model, opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=TOTAL_STEPS)
