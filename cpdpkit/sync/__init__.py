"""Communication-controlled data parallelism: DDP, LocalSGD, SlowMo and CPDP in one wrapper."""

from cpdpkit.sync.config import (
    BUFFER_POLICIES,
    CPDP_ORDERS,
    STATE_POLICIES,
    STRATEGIES,
    StepKind,
    SyncConfig,
    slowmo_beta_for,
)
from cpdpkit.sync.groups import hierarchical_groups
from cpdpkit.sync.optimizer import PeriodicSyncOptimizer
from cpdpkit.sync.stats import SyncStats

__all__ = [
    "PeriodicSyncOptimizer",
    "SyncConfig",
    "SyncStats",
    "StepKind",
    "STRATEGIES",
    "BUFFER_POLICIES",
    "STATE_POLICIES",
    "CPDP_ORDERS",
    "hierarchical_groups",
    "slowmo_beta_for",
]
