"""Aggregating per-seed run results into the comparison ``cpdpkit bench`` reports.

Analysis only: this module returns data (``BenchReport.to_dict()`` is the ``--json``
schema); tables and plots are drawn by the CLI layer.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = ["StrategyResult", "BenchReport", "aggregate"]

_MEAN_KEYS = ("peak_test_acc", "final_test_acc", "wall_s", "step_s", "exposed_sync_s_per_step",
              "bytes_per_step", "collectives_per_step")


def _mean_std(values: list[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


@dataclass(frozen=True, kw_only=True)
class StrategyResult:
    """One strategy at one period: means (and std) over the seeds that finished."""

    strategy: str
    period: int | None
    status: str  # "ok", or "failed"/"diverged" when no seed finished
    reasons: tuple[str, ...]
    means: dict[str, float]
    stds: dict[str, float]
    seeds: tuple[dict[str, Any], ...]
    harness_s: float
    delta_acc_pp: float | None = None
    delta_wall_pct: float | None = None
    curve: tuple[dict[str, float], ...] = field(default_factory=tuple)

    @property
    def label(self) -> str:
        return self.strategy if self.period is None else f"{self.strategy} K={self.period}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy, "period": self.period, "status": self.status,
            "reasons": list(self.reasons), **self.means,
            "std": self.stds, "delta_acc_pp_vs_ddp": self.delta_acc_pp,
            "delta_wall_pct_vs_ddp": self.delta_wall_pct, "harness_overhead_s": self.harness_s,
            "curve": list(self.curve), "seeds": list(self.seeds),
        }


@dataclass(frozen=True, kw_only=True)
class BenchReport:
    config: dict[str, Any]
    results: tuple[StrategyResult, ...]

    def result(self, strategy: str, period: int | None = None) -> StrategyResult | None:
        for r in self.results:
            if r.strategy == strategy and r.period == period:
                return r
        return None

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config, "results": [r.to_dict() for r in self.results]}


def _seed_entry(run: dict[str, Any]) -> dict[str, Any]:
    keep = ("status", "reason", "peak_test_acc", "final_test_acc", "wall_s", "step_s", "steps",
            "exposed_sync_s_per_step", "bytes_per_step", "collectives_per_step", "final_loss",
            "harness_s", "launch_s")
    return {"seed": run["spec"]["seed"], **{k: run.get(k) for k in keep}}


def _mean_curve(runs: list[dict[str, Any]]) -> tuple[dict[str, float], ...]:
    curves = [r.get("curve") or [] for r in runs]
    length = min((len(c) for c in curves), default=0)
    return tuple(
        {"epoch": i + 1,
         "wall_s": statistics.fmean(c[i]["wall_s"] for c in curves),
         "test_acc": statistics.fmean(c[i]["test_acc"] for c in curves)}
        for i in range(length)
    )


def _one(strategy: str, period: int | None, runs: list[dict[str, Any]]) -> StrategyResult:
    ok = [r for r in runs if r.get("status") == "ok"]
    means, stds = {}, {}
    for key in _MEAN_KEYS:
        means[key], stds[key] = _mean_std([float(r[key]) for r in ok])
    reasons = tuple(f"seed {r['spec']['seed']}: {r.get('reason')}" for r in runs if r.get("status") != "ok")
    status = "ok" if ok else (runs[0].get("status") or "failed")
    harness = statistics.fmean(r.get("harness_total_s", 0.0) for r in runs) if runs else 0.0
    return StrategyResult(strategy=strategy, period=period, status=status, reasons=reasons,
                          means=means, stds=stds, seeds=tuple(_seed_entry(r) for r in runs),
                          harness_s=harness, curve=_mean_curve(ok))


def aggregate(config: dict[str, Any], runs: list[dict[str, Any]]) -> BenchReport:
    """Group run results by (strategy, period), in first-seen order; add deltas vs ddp."""
    order: list[tuple[str, int | None]] = []
    grouped: dict[tuple[str, int | None], list[dict[str, Any]]] = {}
    for run in runs:
        key = (run["spec"]["strategy"], run["spec"]["period"])
        if key not in grouped:
            order.append(key)
        grouped.setdefault(key, []).append(run)
    results = [_one(s, p, grouped[(s, p)]) for s, p in order]
    base = next((r for r in results if r.strategy == "ddp" and r.status == "ok"), None)
    if base is not None:
        results = [_with_delta(r, base) for r in results]
    return BenchReport(config=config, results=tuple(results))


def _with_delta(r: StrategyResult, base: StrategyResult) -> StrategyResult:
    if r.status != "ok":
        return r
    acc = (r.means["peak_test_acc"] - base.means["peak_test_acc"]) * 100.0
    wall = (r.means["wall_s"] / base.means["wall_s"] - 1.0) * 100.0
    return replace(r, delta_acc_pp=acc, delta_wall_pct=wall)
