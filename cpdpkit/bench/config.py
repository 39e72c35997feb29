"""Configuration of ``cpdpkit bench`` (the whole comparison) and of one run in it.

Everything is validated here, before any process starts: a bad option costs nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from cpdpkit.bench.data import DATASETS, find_cifar100
from cpdpkit.bench.models import check_model_available
from cpdpkit.errors import ConfigError

__all__ = ["BENCH_STRATEGIES", "PERIODIC", "BenchConfig", "RunSpec"]

BENCH_STRATEGIES = ("ddp", "localsgd-torch", "localsgd", "slowmo", "cpdp")
PERIODIC = ("localsgd-torch", "localsgd", "slowmo", "cpdp")


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One strategy at one period and one seed: what a launched rank trains."""

    strategy: str
    period: int | None
    seed: int
    model: str
    dataset: str
    data_dir: str | None
    epochs: int
    batch_size: int
    lr: float
    momentum: float
    slowmo_momentum: float
    quick: bool
    profile_dir: str | None = None

    @property
    def label(self) -> str:
        return self.strategy if self.period is None else f"{self.strategy} K={self.period}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunSpec:
        return cls(**data)


def _positive(name: str, value: Any, fix: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name} must be > 0, got {value!r}: {fix}")


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """The comparison ``cpdpkit bench`` runs (defaults: the CPDP paper's setting, on digits)."""

    strategies: tuple[str, ...] = BENCH_STRATEGIES
    periods: tuple[int, ...] = (2, 4)
    model: str = "cnn"
    dataset: str = "digits"
    data_dir: str | None = None
    epochs: int = 30
    batch_size: int = 32
    lr: float = 0.1
    momentum: float = 0.0
    slowmo_momentum: float = 0.5
    world_size: int = 2
    topology: str = "wan"
    seeds: int = 1
    quick: bool = False
    profile_dir: str | None = None

    def __post_init__(self) -> None:
        for s in self.strategies:
            if s not in BENCH_STRATEGIES:
                raise ConfigError(
                    f"unknown strategy {s!r}: choose from {', '.join(BENCH_STRATEGIES)}"
                )
        if not self.strategies:
            raise ConfigError("--strategies is empty: name at least one, e.g. --strategies ddp,cpdp")
        for k in self.periods:
            if not isinstance(k, int) or isinstance(k, bool) or k < 1:
                raise ConfigError(f"period K must be an integer >= 1, got {k!r}: e.g. --periods 2,4")
        if any(s in PERIODIC for s in self.strategies) and not self.periods:
            raise ConfigError("--periods is empty: give at least one K, e.g. --periods 4")
        if self.dataset not in DATASETS:
            raise ConfigError(f"unknown dataset {self.dataset!r}: choose one of {', '.join(DATASETS)}")
        if self.dataset == "cifar100":
            if self.data_dir is None:
                raise ConfigError("--dataset cifar100 needs --data-dir: the folder holding cifar-100-python/")
            find_cifar100(self.data_dir)
        check_model_available(self.model)
        for name, value, fix in (
            ("--epochs", self.epochs, "e.g. --epochs 30"),
            ("--batch-size", self.batch_size, "e.g. --batch-size 32"),
            ("--lr", self.lr, "the paper's setting is --lr 0.1"),
            ("--world-size", self.world_size, "e.g. --world-size 2"),
            ("--seeds", self.seeds, "e.g. --seeds 3"),
        ):
            _positive(name, value, fix)
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"--momentum must be in [0, 1), got {self.momentum!r}: e.g. --momentum 0.9")

    def runs(self) -> list[RunSpec]:
        """Every (strategy, period, seed) to run, ddp first (the baseline)."""
        out = []
        for seed in range(self.seeds):
            for strategy in self.strategies:
                for period in (self.periods if strategy in PERIODIC else (None,)):
                    out.append(RunSpec(
                        strategy=strategy, period=period, seed=seed, model=self.model,
                        dataset=self.dataset, data_dir=self.data_dir,
                        epochs=self.epochs, batch_size=self.batch_size, lr=self.lr,
                        momentum=self.momentum, slowmo_momentum=self.slowmo_momentum,
                        quick=self.quick, profile_dir=self.profile_dir,
                    ))
        return out

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["strategies"], out["periods"] = list(self.strategies), list(self.periods)
        return out
