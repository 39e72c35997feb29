"""Aggregating per-seed run results into the comparison ``cpdpkit bench`` reports.

Analysis only: this module returns data (``BenchReport.to_dict()`` is the ``--json``
schema); tables and plots are drawn by the CLI layer.

Differences to ``ddp`` are paired by seed: seed ``i`` of every strategy sees the same data order
and initial parameters, so the per-seed differences ``d_i`` cancel what the seed alone explains.
With ``n`` seeds where both finished, the difference is ``mean(d)`` and its 95 % confidence
interval ``mean(d) ± t(0.975, n-1) · sd(d) / √n`` (none for ``n < 2``). A difference is
*significant* when that interval excludes 0.

Results are grouped by (topology, strategy, period, variant: a point of a swept outer step), and
differences are paired within one topology. A run names its topology in ``spec["topology"]``; runs
from before ``--topologies`` (and their JSON) name none and are on ``config["topology"]``.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = ["StrategyResult", "BenchReport", "aggregate", "paired_difference", "run_topology",
           "significant", "t_quantile_975"]


_MEAN_KEYS = ("peak_test_acc", "final_test_acc", "wall_s", "step_s", "exposed_sync_s_per_step",
              "bytes_per_step", "max_bytes_per_step", "collectives_per_step")


# Student's t, 0.975 quantile, for 1..30 degrees of freedom (beyond: the expansion below).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
         2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
         2.052, 2.048, 2.045, 2.042)
_Z975 = 1.959963984540054


def t_quantile_975(df: int) -> float:
    """Student's t 0.975 quantile with ``df`` degrees of freedom (the two-sided 95 % factor)."""
    if not isinstance(df, int) or df < 1:
        raise ValueError(f"degrees of freedom must be an integer >= 1, got {df!r}")
    if df <= len(_T975):
        return _T975[df - 1]
    # Cornish-Fisher expansion around the normal quantile (Abramowitz & Stegun 26.7.5):
    # off by < 1e-5 for df > 30, where no table entry is needed.
    z = _Z975
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    return z + g1 / df + g2 / df**2 + g3 / df**3


def paired_difference(diffs: list[float]) -> tuple[float | None, tuple[float, float] | None]:
    """``(mean, (low, high))`` of per-seed differences: the mean and its 95 % t interval.

    ``(None, None)`` without a difference; the interval is None for a single one.
    """
    if not diffs:
        return None, None
    mean = statistics.fmean(diffs)
    if len(diffs) < 2:
        return mean, None
    half = t_quantile_975(len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
    return mean, (mean - half, mean + half)


def significant(ci: tuple[float, float] | list[float] | None) -> bool:
    """Whether a confidence interval excludes 0 (False when there is none)."""
    return ci is not None and (ci[0] > 0.0 or ci[1] < 0.0)


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
    topology: str | None = None
    reasons: tuple[str, ...]
    means: dict[str, float]
    stds: dict[str, float]
    seeds: tuple[dict[str, Any], ...]
    harness_s: float
    delta_acc_pp: float | None = None  # mean over paired seeds of (peak acc - ddp's) x 100
    delta_acc_ci95_pp: tuple[float, float] | None = None
    delta_wall_pct: float | None = None  # ratio of the mean wall clocks, minus 1, x 100
    delta_wall_s: float | None = None  # mean over paired seeds of (wall_s - ddp's)
    delta_wall_ci95_s: tuple[float, float] | None = None
    paired_seeds: int = 0  # seeds where this strategy and ddp both finished
    curve: tuple[dict[str, float], ...] = field(default_factory=tuple)
    variant: str | None = None  # the point beyond strategy and K ("β=0.2", "int8 fragments=4"); None: none
    compression: str = "none"  # the run's codec (spec["compression"]; older runs: none)
    fragments: int = 1

    @property
    def label(self) -> str:
        base = self.strategy if self.period is None else f"{self.strategy} K={self.period}"
        return base if self.variant is None else f"{base} {self.variant}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy, "period": self.period, "variant": self.variant, "topology": self.topology,
            "compression": self.compression, "fragments": self.fragments, "status": self.status,
            "reasons": list(self.reasons), **self.means,
            "std": self.stds, "delta_acc_pp_vs_ddp": self.delta_acc_pp,
            "delta_acc_ci95_pp": _as_list(self.delta_acc_ci95_pp),
            "delta_wall_pct_vs_ddp": self.delta_wall_pct, "delta_wall_s_vs_ddp": self.delta_wall_s,
            "delta_wall_ci95_s": _as_list(self.delta_wall_ci95_s),
            "paired_seeds_vs_ddp": self.paired_seeds, "harness_overhead_s": self.harness_s,
            "curve": list(self.curve), "seeds": list(self.seeds),
        }


def _as_list(ci: tuple[float, float] | None) -> list[float] | None:
    return None if ci is None else [ci[0], ci[1]]


@dataclass(frozen=True, kw_only=True)
class BenchReport:
    config: dict[str, Any]
    results: tuple[StrategyResult, ...]

    def result(self, strategy: str, period: int | None = None, topology: str | None = None) -> StrategyResult | None:
        """The result of ``strategy`` at ``period`` on ``topology`` (None: the first topology that has it)."""
        for r in self.results:
            if r.strategy == strategy and r.period == period and topology in (None, r.topology):
                return r
        return None

    @property
    def topologies(self) -> tuple[str | None, ...]:
        """The topologies of the results, in first-seen order."""
        return tuple(dict.fromkeys(r.topology for r in self.results))

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config, "results": [r.to_dict() for r in self.results]}


def _seed_entry(run: dict[str, Any]) -> dict[str, Any]:
    keep = ("status", "reason", "peak_test_acc", "final_test_acc", "wall_s", "step_s", "steps",
            "exposed_sync_s_per_step", "bytes_per_step", "max_bytes_per_step", "collectives_per_step", "final_loss",
            "harness_s", "launch_s", "curve", "dataset_info", "period_history", "mean_period")
    faulted = {k: run[k] for k in ("restarts", "fault") if k in run}  # --inject-fault runs only
    return {"seed": run["spec"]["seed"], **{k: run.get(k) for k in keep}, **faulted}


def _mean_curve(runs: list[dict[str, Any]]) -> tuple[dict[str, float], ...]:
    """Per epoch: mean wall clock and accuracy over the seeds, and the accuracy's std (0 for one)."""
    curves = [r.get("curve") or [] for r in runs]
    length = min((len(c) for c in curves), default=0)
    out = []
    for i in range(length):
        acc, acc_std = _mean_std([c[i]["test_acc"] for c in curves])
        out.append({"epoch": i + 1, "wall_s": statistics.fmean(c[i]["wall_s"] for c in curves),
                    "test_acc": acc, "test_acc_std": acc_std})
    return tuple(out)


def _one(topology: str | None, strategy: str, period: int | None, variant: str | None,
         runs: list[dict[str, Any]]) -> StrategyResult:
    ok = [r for r in runs if r.get("status") == "ok"]
    means, stds = {}, {}
    for key in _MEAN_KEYS:
        means[key], stds[key] = _mean_std([float(r[key]) for r in ok if key in r])  # older runs lack newer keys
    reasons = tuple(f"seed {r['spec']['seed']}: {r.get('reason')}" for r in runs if r.get("status") != "ok")
    status = "ok" if ok else (runs[0].get("status") or "failed")
    harness = statistics.fmean(r.get("harness_total_s", 0.0) for r in runs) if runs else 0.0
    spec = runs[0]["spec"] if runs else {}
    return StrategyResult(strategy=strategy, period=period, variant=variant, topology=topology, status=status,
                          compression=spec.get("compression", "none"), fragments=int(spec.get("fragments", 1)),
                          reasons=reasons,
                          means=means, stds=stds, seeds=tuple(_seed_entry(r) for r in runs),
                          harness_s=harness, curve=_mean_curve(ok))


def run_topology(run: dict[str, Any], config: dict[str, Any]) -> str | None:
    """The topology a run trained on: its spec's, else the config's (runs from before --topologies)."""
    return run["spec"].get("topology") or config.get("topology")


def aggregate(config: dict[str, Any], runs: list[dict[str, Any]]) -> BenchReport:
    """Group run results by (topology, strategy, period, variant), in first-seen order; add deltas vs that
    topology's ddp."""
    grouped: dict[tuple[str | None, str, int | None, str | None], list[dict[str, Any]]] = {}
    for run in runs:  # dicts keep first-seen order
        spec = run["spec"]
        key = (run_topology(run, config), spec["strategy"], spec["period"], spec.get("variant"))
        grouped.setdefault(key, []).append(run)
    plain = {key: _one(*key, group) for key, group in grouped.items()}
    results = []
    for key, r in plain.items():
        base_key = (key[0], "ddp", None, None)
        base = plain.get(base_key)
        ok = base is not None and base.status == "ok"
        results.append(_with_delta(r, base, grouped[key], grouped[base_key]) if ok else r)
    return BenchReport(config=config, results=tuple(results))


def _by_seed(runs: list[dict[str, Any]], key: str) -> dict[int, float]:
    return {r["spec"]["seed"]: float(r[key]) for r in runs if r.get("status") == "ok"}


def _with_delta(r: StrategyResult, base: StrategyResult, runs: list[dict[str, Any]],
                base_runs: list[dict[str, Any]]) -> StrategyResult:
    if r.status != "ok":
        return r
    acc, base_acc = _by_seed(runs, "peak_test_acc"), _by_seed(base_runs, "peak_test_acc")
    wall, base_wall = _by_seed(runs, "wall_s"), _by_seed(base_runs, "wall_s")
    paired = sorted(set(acc) & set(base_acc))
    delta_acc, acc_ci = paired_difference([(acc[i] - base_acc[i]) * 100.0 for i in paired])
    delta_wall, wall_ci = paired_difference([wall[i] - base_wall[i] for i in paired])
    if r is base:  # the baseline's difference to itself is 0 by construction, not an estimate
        acc_ci = wall_ci = None
    wall_pct = (r.means["wall_s"] / base.means["wall_s"] - 1.0) * 100.0
    return replace(r, delta_acc_pp=delta_acc, delta_acc_ci95_pp=acc_ci, delta_wall_pct=wall_pct,
                   delta_wall_s=delta_wall, delta_wall_ci95_s=wall_ci, paired_seeds=len(paired))
