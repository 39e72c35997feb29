"""Configuration of :class:`~cpdpkit.sync.PeriodicSyncOptimizer` and its step schedule.

The schedule is pure arithmetic on the step counter ``n`` (optimizer steps, counted from 1):

* ``ddp``: every step all-reduces gradients.
* other strategies: steps ``n <= warmup_steps`` all-reduce gradients (warm-up, as DDP);
  afterwards step ``n`` is a *reconciliation* when ``(n - warmup_steps) % period == 0`` and a
  *local step* (no communication across the slow group) otherwise.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

from cpdpkit.errors import ConfigError

__all__ = [
    "STRATEGIES",
    "BUFFER_POLICIES",
    "STATE_POLICIES",
    "StepKind",
    "SyncConfig",
]

STRATEGIES = ("ddp", "localsgd", "slowmo", "cpdp")
BUFFER_POLICIES = ("average", "broadcast", "local")
STATE_POLICIES = ("keep", "average", "reset")


class StepKind(enum.StrEnum):
    """What one optimizer step does to communicate."""

    DDP = "ddp"  # gradient all-reduce every step (strategy "ddp")
    WARMUP = "warmup"  # n <= warmup_steps: gradient all-reduce, like DDP
    LOCAL = "local"  # no communication across the group
    RECONCILE = "reconcile"  # the communicating step of a period


def _choice(field: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(
            f"unknown {field} {value!r}: choose one of {', '.join(choices)}"
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True)
class SyncConfig:
    """Everything that decides when and how :class:`PeriodicSyncOptimizer` communicates.

    ``period`` is K (steps between reconciliations); ``warmup_steps`` is W;
    ``slowmo_momentum`` is β and ``slowmo_lr`` is α of SlowMo. ``bucket_cap_mb`` bounds one
    all-reduce's payload, as DDP's argument of the same name. ``timeout_s`` bounds every
    wait on a collective (``None``: the process group's own timeout).

    These declarations are the only defaults: ``PeriodicSyncOptimizer`` takes either
    ``config=SyncConfig(...)`` or these fields as keyword options, never both.
    """

    strategy: str = "cpdp"
    period: int = 4
    warmup_steps: int = 0
    slowmo_momentum: float = 0.5
    slowmo_lr: float = 1.0
    buffers: str = "average"
    optimizer_state: str = "keep"
    bucket_cap_mb: float = 25.0
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        _choice("strategy", self.strategy, STRATEGIES)
        _choice("buffers", self.buffers, BUFFER_POLICIES)
        _choice("optimizer_state", self.optimizer_state, STATE_POLICIES)
        if not _is_int(self.period) or self.period < 1:
            raise ConfigError(
                f"period must be an integer >= 1, got {self.period!r}: "
                "pass period=1 to reconcile every step, or a larger K"
            )
        if not _is_int(self.warmup_steps) or self.warmup_steps < 0:
            raise ConfigError(
                f"warmup_steps must be an integer >= 0, got {self.warmup_steps!r}: "
                "pass 0 for no warm-up"
            )
        if not 0.0 <= float(self.slowmo_momentum) < 1.0:
            raise ConfigError(
                f"slowmo_momentum must be in [0, 1), got {self.slowmo_momentum!r}: "
                "SlowMo's β is usually 0.5-0.8"
            )
        if not float(self.slowmo_lr) > 0.0:
            raise ConfigError(
                f"slowmo_lr must be > 0, got {self.slowmo_lr!r}: pass 1.0 for SlowMo's default α"
            )
        if not float(self.bucket_cap_mb) > 0.0:
            raise ConfigError(
                f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb!r}: DDP's default is 25"
            )
        if self.timeout_s is not None and not float(self.timeout_s) > 0.0:
            raise ConfigError(
                f"timeout_s must be > 0 or None, got {self.timeout_s!r}: "
                "pass None to use the process group's timeout"
            )

    # -- schedule ---------------------------------------------------------------------
    def step_kind(self, n: int) -> StepKind:
        """The kind of step ``n`` (counted from 1)."""
        assert n >= 1, n
        if self.strategy == "ddp":
            return StepKind.DDP
        if n <= self.warmup_steps:
            return StepKind.WARMUP
        if (n - self.warmup_steps) % self.period == 0:
            return StepKind.RECONCILE
        return StepKind.LOCAL

    def syncs_gradients(self, n: int) -> bool:
        """Whether step ``n`` all-reduces gradients across the whole group before its step."""
        kind = self.step_kind(n)
        if kind in (StepKind.DDP, StepKind.WARMUP):
            return True
        return kind is StepKind.RECONCILE and self.strategy == "cpdp"

    def averages_parameters(self, n: int) -> bool:
        """Whether step ``n`` averages parameters after its inner step."""
        return self.step_kind(n) is StepKind.RECONCILE

    @property
    def uses_slowmo(self) -> bool:
        return self.strategy in ("slowmo", "cpdp")

    @property
    def bucket_cap_bytes(self) -> int:
        return max(1, int(float(self.bucket_cap_mb) * 1024 * 1024))

    # -- (de)serialisation -------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SyncConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(
                f"unknown SyncConfig field(s) {unknown}: known fields are {sorted(names)}"
            )
        return cls(**data)

    def fingerprint(self) -> list[tuple[str, int, tuple[str, ...] | None]]:
        """``(name, value, labels)`` that must agree on every rank, checked before training."""
        return [
            ("strategy", STRATEGIES.index(self.strategy), STRATEGIES),
            ("period", self.period, None),
            ("warmup_steps", self.warmup_steps, None),
            ("buffers", BUFFER_POLICIES.index(self.buffers), BUFFER_POLICIES),
            ("optimizer_state", STATE_POLICIES.index(self.optimizer_state), STATE_POLICIES),
            ("bucket_cap_bytes", self.bucket_cap_bytes, None),
        ]
