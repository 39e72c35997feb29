"""What every suite that runs one launched job per strategy returns (``cpdpkit bench sharding``,
``cpdpkit bench hybrid``); the main job's aggregate over seeds is :mod:`cpdpkit.bench.periodic.report`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["SuiteReport", "verdict"]


def verdict(ok: bool | None) -> str:
    """How a goal line ends (the suites' goals.py; the CLI colours it): ``met``, else ``not met``."""
    return "met" if ok else "not met"


@dataclass(frozen=True)
class SuiteReport:
    """What ``cpdpkit bench sharding`` and ``cpdpkit bench hybrid`` return: one result per strategy's job and
    the goals judged on them (``to_dict()`` is their ``--json`` schema, docs/json.md)."""

    config: dict[str, Any]
    results: tuple[dict[str, Any], ...]
    goals: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config, "results": list(self.results), "goals": self.goals}
