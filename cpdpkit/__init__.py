"""cpdpkit: torch.distributed-native training when communication is the bottleneck.

Importing ``cpdpkit`` is cheap and torch-free (so ``cpdpkit.profiler`` runs where no torch is
installed); the torch-backed names below load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it (imported lazily)
_LAZY = {
    "PeriodicSyncOptimizer": "cpdpkit.sync",
    "SyncConfig": "cpdpkit.sync",
    "SyncStats": "cpdpkit.sync",
    "init_distributed": "cpdpkit.emulator",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'cpdpkit' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
