"""The strategies ``cpdpkit bench`` compares, behind one interface with one exposed-time measure.

* ``ddp``: torch's ``DistributedDataParallel`` (the real peer).
* ``localsgd-torch``: torch's ``PostLocalSGDOptimizer`` with ``PeriodicModelAverager(period=K,
  warmup_steps=K-1)`` on the plain module (the real peer).
* ``localsgd``, ``slowmo``, ``cpdp``: :class:`cpdpkit.sync.PeriodicSyncOptimizer`.
* ``slowmo-overlap``, ``cpdp-overlap``: the same with ``overlap_steps`` (the parameter average
  launched asynchronously and applied τ steps later); ``cpdp-auto``: cpdp with ``period="auto"``
  (a controller picks K at run time); ``cpdp-step-then-average``: cpdp's order before
  ``cpdp_order`` (the synchronous step, then the average: equal to slowmo with plain SGD).
  :func:`sync_options` maps a bench strategy to its options.

Every strategy's inner optimizer is SGD (``lr``, ``momentum``), and the LR schedule
(:func:`build_lr_scheduler`) applies to all of them, stepped after every optimizer step: on the
wrapper for ours (a complete torch ``Optimizer``), on the plain SGD for ``ddp``, on the SGD inside
``PostLocalSGDOptimizer`` for ``localsgd-torch`` (the same param groups). SlowMo's options, the
warm-up and the optimizer-state policy exist only in ours.

Exposed synchronisation time is "seconds the training loop was blocked on communication",
measured the same way for all: ``PeriodicSyncOptimizer.stats.blocked_s`` for ours; for
``localsgd-torch`` the wall time of the averager's call when it communicates; for ``ddp``,
from a communication hook that wraps torch's default all-reduce hook: the time from the last
bucket's launch (the end of backward's compute) until every bucket's all-reduce finished,
which is how long ``backward()`` waits in DDP's ``finalize_backward``.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cpdpkit.bench.periodic.config import LR_SCHEDULES
from cpdpkit.sync import PeriodicSyncOptimizer
from cpdpkit.sync.config import SyncConfig

__all__ = ["Meter", "StrategyRunner", "build_lr_scheduler", "build_strategy", "period_history", "sync_options"]


def build_lr_scheduler(optimizer: torch.optim.Optimizer, schedule: str,
                       total_steps: int) -> torch.optim.lr_scheduler.LRScheduler | None:
    """The per-step LR schedule of a run of ``total_steps`` optimizer steps (None: constant).

    ``cosine``: ``CosineAnnealingLR(T_max=total_steps)``, from ``lr`` down to 0 at the end.
    ``step``: ``MultiStepLR`` dividing the lr by 10 after 50 % and again after 75 % of the steps.
    """
    from torch.optim.lr_scheduler import CosineAnnealingLR, MultiStepLR

    if schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown LR schedule {schedule!r}: choose one of {', '.join(LR_SCHEDULES)}")
    if schedule == "constant":
        return None
    if schedule == "cosine":
        return CosineAnnealingLR(optimizer, T_max=max(1, total_steps))
    return MultiStepLR(optimizer, milestones=[total_steps // 2, (3 * total_steps) // 4], gamma=0.1)


@dataclass
class Meter:
    """What a strategy communicated: exposed seconds, collectives, payload bytes."""

    exposed_s: float = 0.0
    collectives: int = 0
    bytes_sent: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"exposed_s": self.exposed_s, "collectives": self.collectives,
                "bytes_sent": self.bytes_sent}


class StrategyRunner:
    """``train_step(x, y) -> loss``; ``module`` is the plain module to evaluate."""

    def __init__(self, module: nn.Module, forward: nn.Module, optimizer: Any) -> None:
        self.module, self._forward, self.optimizer = module, forward, optimizer
        self.meter = Meter()
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self.max_step_bytes = 0  # the largest payload one training step sent (this rank)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        before = self.bytes_sent()
        self.optimizer.zero_grad()
        loss = nn.functional.cross_entropy(self._forward(x), y)
        loss.backward()
        self._after_backward()
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.max_step_bytes = max(self.max_step_bytes, self.bytes_sent() - before)
        return float(loss.detach())

    def bytes_sent(self) -> int:
        """Payload bytes this rank's strategy has sent so far."""
        return self.meter.bytes_sent

    def _after_backward(self) -> None:
        pass

    def finish(self) -> Meter:
        return self.meter

    def period_history(self) -> tuple[list[dict[str, Any]], float | None] | None:
        """K over time, ``(history, mean K)``, for PeriodicSyncOptimizer's strategies; None for the peers."""
        return None


def sync_options(strategy: str, period: int | None, *, overlap_steps: int) -> dict[str, Any]:
    """What the name of one of our bench strategies sets in its :class:`SyncConfig`: the strategy, the
    period (``"auto"`` for cpdp-auto), τ (the -overlap ones) and cpdp's order."""
    if strategy == "cpdp-auto":
        return {"strategy": "cpdp", "period": "auto"}
    if period is None:
        raise ValueError(f"bench strategy {strategy!r} needs a period K")
    if strategy in ("slowmo-overlap", "cpdp-overlap"):
        return {"strategy": strategy.removesuffix("-overlap"), "period": period, "overlap_steps": overlap_steps}
    if strategy == "cpdp-step-then-average":
        return {"strategy": "cpdp", "period": period, "cpdp_order": "step-then-average"}
    return {"strategy": strategy, "period": period}


def run_sync_config(strategy: str, period: int | None, sync: SyncConfig, *, overlap_steps: int) -> SyncConfig:
    """``sync`` (the run's :attr:`RunSpec.sync`) with ``strategy``'s own part (:func:`sync_options`); a strategy
    without an outer step (localsgd) takes none (the outer optimizer is slowmo's, unused)."""
    options = sync_options(strategy, period, overlap_steps=overlap_steps)
    if options["strategy"] not in ("slowmo", "cpdp"):
        options.update(outer_optimizer="slowmo", outer_lr=None, outer_momentum=None)
    return dataclasses.replace(sync, **options)


def period_history(stats: dict[str, Any], initial_period: int | None) -> tuple[list[dict[str, Any]], float | None]:
    """``(history, mean K)`` from ``opt.stats.to_dict()``: K at step 0, then each decision of the controller.

    Each history entry is ``{"step", "period", ...}`` (a decision's other fields kept); the mean K is
    steps per reconciliation (None before the first reconciliation).
    """
    history: list[dict[str, Any]] = [] if initial_period is None else [{"step": 0, "period": initial_period}]
    for decision in stats.get("period_decisions") or ():
        entry = dict(decision) if isinstance(decision, dict) else dataclasses.asdict(decision)
        history.append({"step": entry.pop("step"), "period": entry.pop("period"), **entry})
    reconciliations = stats.get("reconciliations") or 0
    mean = stats.get("steps", 0) / reconciliations if reconciliations else None
    return history, mean


class _Ours(StrategyRunner):
    def __init__(self, module: nn.Module, optimizer: PeriodicSyncOptimizer, period: int | None) -> None:
        super().__init__(module, module, optimizer)
        # K before any decision: the current K the stats report (cpdp-auto's first pick), else the fixed one
        self.initial_period = getattr(optimizer.stats, "period", None) or period

    def finish(self) -> Meter:
        stats = self.optimizer.stats
        return Meter(stats.blocked_s, stats.collectives, stats.bytes_sent)

    def bytes_sent(self) -> int:
        return self.optimizer.stats.bytes_sent

    def period_history(self) -> tuple[list[dict[str, Any]], float | None]:
        return period_history(self.optimizer.stats.to_dict(), self.initial_period)


class _TorchLocalSGD(StrategyRunner):
    def __init__(self, module: nn.Module, inner: torch.optim.Optimizer, period: int) -> None:
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        from torch.distributed.optim import PostLocalSGDOptimizer

        self._averager = PeriodicModelAverager(period=period, warmup_steps=period - 1)
        super().__init__(module, module, PostLocalSGDOptimizer(inner, self._averager))
        original = self._averager.average_parameters
        param_bytes = sum(p.numel() * p.element_size() for p in module.parameters())

        def timed_average(params: Any) -> None:
            avg = self._averager
            communicates = avg.step >= avg.warmup_steps and (avg.step - avg.warmup_steps) % avg.period == 0
            start = time.perf_counter()
            original(params)
            if communicates:
                self.meter.exposed_s += time.perf_counter() - start
                self.meter.collectives += 1
                self.meter.bytes_sent += param_bytes

        self._averager.average_parameters = timed_average  # type: ignore[method-assign]


class _TorchDDP(StrategyRunner):
    def __init__(self, module: nn.Module, make_optimizer: Any) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(module)
        super().__init__(module, ddp, make_optimizer(ddp.parameters()))
        self._launched: list[float] = []
        self._done: list[float] = []

        # No annotations: DDP inspects them, and this module's are strings (PEP 563).
        def hook(state, bucket):  # noqa: ANN001, ANN202
            self._launched.append(time.perf_counter())
            self.meter.collectives += 1
            self.meter.bytes_sent += bucket.buffer().numel() * bucket.buffer().element_size()
            fut = allreduce_hook(state, bucket)

            def done(f: torch.futures.Future) -> torch.Tensor:
                self._done.append(time.perf_counter())
                return f.value()

            return fut.then(done)

        ddp.register_comm_hook(None, hook)

    def _after_backward(self) -> None:
        if self._launched:
            self.meter.exposed_s += max(0.0, max(self._done, default=0.0) - max(self._launched))
        self._launched.clear()
        self._done.clear()


def build_strategy(strategy: str, period: int | None, module: nn.Module, *, lr: float, momentum: float,
                   lr_schedule: str, total_steps: int, sync: SyncConfig, overlap_steps: int) -> StrategyRunner:
    """The runner for ``strategy`` (one of :data:`cpdpkit.bench.periodic.config.BENCH_STRATEGIES`).

    ``sync`` (the run's :attr:`~cpdpkit.bench.periodic.config.RunSpec.sync`) goes to
    :class:`PeriodicSyncOptimizer` with the strategy's own part set (:func:`run_sync_config`; τ =
    ``overlap_steps`` for the -overlap ones); the peers (ddp, localsgd-torch) ignore it. ``lr_schedule``
    over ``total_steps`` applies to every strategy. No defaults here: they live in
    :class:`~cpdpkit.bench.periodic.config.BenchConfig` (one source).
    """
    def sgd(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=lr, momentum=momentum)

    runner: StrategyRunner
    if strategy == "ddp":
        runner = _TorchDDP(module, sgd)
        scheduled = runner.optimizer
    elif strategy == "localsgd-torch":
        assert period is not None
        with torch.no_grad():  # PostLocalSGD does not broadcast; DDP would at construction
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t, src=0)
        # PostLocalSGDOptimizer is not a complete torch Optimizer: schedule the SGD inside it
        scheduled = sgd(module.parameters())
        runner = _TorchLocalSGD(module, scheduled, period)
    else:
        opt = PeriodicSyncOptimizer(sgd(module.parameters()), model=module,
                                    config=run_sync_config(strategy, period, sync, overlap_steps=overlap_steps))
        runner = _Ours(module, opt, period)
        scheduled = opt
    runner.scheduler = build_lr_scheduler(scheduled, lr_schedule, total_steps)
    return runner
