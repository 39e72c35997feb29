"""Controlled K: the rule ``period="auto"`` uses to choose the next period, and the schedule.

At every reconciliation each rank contributes three numbers to the all-reduce it already runs
(the parameter average: three extra elements, no extra round trip), and every rank reads the same
means back, so every rank takes the same decision:

* ``S``, exposed sync seconds over the period just ended (the rank's blocked time from just
  before the previous reconciliation's launch to just before this one's: one reconciliation's
  average, plus this period's gradient waits);
* ``C``, compute seconds per step over that period (its wall time minus ``S``, per step);
* ``‖x_i − r‖²`` for the common reference ``r`` (SlowMo's anchor; for ``localsgd`` the last
  reconciled parameters), from which the replicas' divergence follows exactly:
  ``δ = sqrt(mean_i ‖x_i − r‖² − ‖x̄ − r‖²) / ‖x̄‖`` = ``sqrt(mean_i ‖x_i − x̄‖²) / ‖x̄‖``.

The rule (:func:`decide_period`), with ``K`` the period just measured and ``f`` the target
exposed fraction. ``S`` and ``C`` are first smoothed over reconciliations,
``S̃ = w·S + (1 − w)·S̃_previous`` (and ``C̃`` alike, ``w`` = :data:`SMOOTHING` = 0.3; the first
decision takes ``S`` and ``C`` as they are): ``S`` is mostly the ranks' skew at the
reconciliation, which varies a lot from one period to the next. One reconciliation per period
costs ``S̃`` against ``K'·C̃`` of compute, so the exposed fraction at period ``K'`` is
``S̃ / (S̃ + K'·C̃)``, and the smallest period meeting the target is
``K_time = ⌈S̃·(1 − f) / (f·C̃)⌉``. With ``max_divergence`` set and ``δ`` above it, divergence is
taken to grow in proportion to K and ``K_div = ⌊K·max_divergence/δ⌋`` (otherwise unbounded). Then

    K_next = clamp(min(K_time, K_div), max(k_min, ⌈K/2⌉), min(k_max, 2·K))

so K moves by at most a factor of two per reconciliation (one noisy period cannot swing it) and
stays in ``[k_min, k_max]``. The first period is ``k_min``.

When a decision takes effect (:class:`PeriodSchedule`): the gap after reconciliation ``r_i`` is the
K decided by the latest reconciliation whose result has been applied by the end of step ``r_i``:
``r_i`` itself when reconciling blocking, ``r_{i-1}`` with ``overlap_steps >= 1`` (its result is
applied while the next period runs). Torch-free: the rule is tested as plain arithmetic.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from cpdpkit.sync.config import StepKind, SyncConfig

__all__ = ["SMOOTHING", "PeriodDecision", "PeriodSchedule", "decide_period", "divergence"]

SMOOTHING = 0.3  # w: the weight of the newest period's S and C in the smoothed values


@dataclass(frozen=True, kw_only=True)
class PeriodDecision:
    """One decision of ``period="auto"``: the group's means and the K chosen from them.

    ``step`` is the reconciliation whose numbers were used; ``measured_period`` the K of the
    period they cover; ``measured_exposed_s`` and ``measured_compute_s_per_step`` the group's
    means over that period, ``exposed_s`` and ``compute_s_per_step`` their smoothed values the
    rule used; ``exposed_frac`` the exposed fraction measured over the period (``S/(S + K·C)``)
    and ``predicted_exposed_frac`` the one the rule expects at the chosen ``period``;
    ``limited_by`` names what set the result: ``"exposed"``, ``"divergence"``, ``"k_min"``,
    ``"k_max"`` or ``"step_limit"`` (at most ×2 or ÷2 per decision).
    """

    step: int
    measured_period: int
    period: int
    measured_exposed_s: float
    measured_compute_s_per_step: float
    exposed_s: float
    compute_s_per_step: float
    divergence: float
    exposed_frac: float
    predicted_exposed_frac: float
    limited_by: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PeriodDecision:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls)})

    @property
    def label_details(self) -> str:
        """The bracketed details of this decision's trace span."""
        return (f"[K={self.period},from={self.measured_period},exposed_frac={self.exposed_frac:.3f},"
                f"divergence={self.divergence:.3g},limited_by={self.limited_by}]")


def divergence(mean_progress_sq: float, mean_progress_of_average_sq: float, average_sq: float) -> float:
    """``sqrt(mean_i ‖x_i − r‖² − ‖x̄ − r‖²) / ‖x̄‖`` (0 for a zero ``x̄``; never negative).

    The subtraction loses what the reduction's dtype cannot hold (about 1e-7 of
    ``mean_i ‖x_i − r‖²`` in float32): divergences below ~3e-4 of the local progress read as 0.
    """
    spread = max(0.0, float(mean_progress_sq) - float(mean_progress_of_average_sq))
    if average_sq <= 0.0:
        return 0.0
    return math.sqrt(spread) / math.sqrt(float(average_sq))


def _exposed_frac(exposed_s: float, compute_s: float, period: int) -> float:
    total = exposed_s + period * compute_s
    return exposed_s / total if total > 0 else 0.0


def decide_period(config: SyncConfig, *, step: int, period: int, exposed_s: float,
                  compute_s_per_step: float, divergence: float,
                  previous: PeriodDecision | None = None) -> PeriodDecision:
    """The next K by the rule in the module docstring (pure arithmetic; same inputs, same K).

    ``exposed_s`` and ``compute_s_per_step`` are this period's measured means; ``previous`` is the
    last decision (its smoothed values carry the history), None for the first."""
    f = float(config.target_exposed_frac)
    measured_s, measured_c = max(0.0, float(exposed_s)), max(0.0, float(compute_s_per_step))
    exposed_s, compute_s = measured_s, measured_c
    if previous is not None:
        exposed_s = SMOOTHING * measured_s + (1.0 - SMOOTHING) * previous.exposed_s
        compute_s = SMOOTHING * measured_c + (1.0 - SMOOTHING) * previous.compute_s_per_step
    if compute_s <= 0.0:
        k_time = config.k_max if exposed_s > 0 else config.k_min
    else:
        k_time = max(1, math.ceil(exposed_s * (1.0 - f) / (f * compute_s) - 1e-9))
    k_div = math.inf
    if config.max_divergence is not None and divergence > float(config.max_divergence):
        k_div = max(1, math.floor(period * float(config.max_divergence) / divergence))
    wanted = min(k_time, k_div)
    lo, hi = max(config.k_min, math.ceil(period / 2)), min(config.k_max, 2 * period)
    chosen = int(min(max(wanted, lo), hi))
    if chosen == wanted:
        limited_by = "divergence" if k_div <= k_time else "exposed"
    elif chosen == config.k_max and wanted > chosen:
        limited_by = "k_max"
    elif chosen == config.k_min and wanted < chosen:
        limited_by = "k_min"
    else:
        limited_by = "step_limit"
    return PeriodDecision(
        step=step, measured_period=period, period=chosen, measured_exposed_s=measured_s,
        measured_compute_s_per_step=measured_c, exposed_s=exposed_s,
        compute_s_per_step=compute_s, divergence=float(divergence),
        exposed_frac=_exposed_frac(measured_s, measured_c, period),
        predicted_exposed_frac=_exposed_frac(exposed_s, compute_s, chosen), limited_by=limited_by,
    )


class PeriodSchedule:
    """Which step reconciles next, for a fixed K or one chosen at run time.

    With a fixed period it gives exactly :meth:`SyncConfig.step_kind`'s arithmetic. The
    optimizer calls :meth:`reconciled` at the end of every reconciliation step (after applying
    any result due) and :meth:`decided` when a decision's result is applied.
    """

    def __init__(self, config: SyncConfig, offset: int = 0) -> None:
        self._config = config
        self.period = config.k_min if config.auto else int(config.period)  # the K decided last
        self.last_reconcile = config.warmup_steps  # the last reconciliation (or the end of warm-up)
        # steps from last_reconcile to the next reconciliation; a fragment's first one trails by its offset
        self.gap = self.period + offset

    def kind(self, n: int) -> StepKind:
        c = self._config
        if c.strategy == "ddp":
            return StepKind.DDP
        if n <= c.warmup_steps:
            return StepKind.WARMUP
        # n == last_reconcile: average-then-step marks its reconciliation at the average, one step ahead
        due = n in (self.last_reconcile, self.last_reconcile + self.gap)
        return StepKind.RECONCILE if due else StepKind.LOCAL

    def reconciled(self, n: int) -> None:
        self.last_reconcile, self.gap = n, self.period

    def decided(self, period: int) -> None:
        self.period = int(period)

    def state_dict(self) -> dict[str, int]:
        return {"period": self.period, "last_reconcile": self.last_reconcile, "gap": self.gap}

    def load_state_dict(self, state: dict[str, int] | None, step: int) -> None:
        """Restore; ``None`` (a checkpoint from before the schedule was saved) rebuilds a fixed
        period's state from the step count."""
        if state is not None:
            self.period, self.last_reconcile, self.gap = (
                int(state["period"]), int(state["last_reconcile"]), int(state["gap"]))
            return
        w, k = self._config.warmup_steps, self.period
        self.last_reconcile = w + max(0, step - w) // k * k
        self.gap = k
