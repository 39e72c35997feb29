"""The strategies ``cpdpkit bench`` compares, behind one interface with one exposed-time measure.

* ``ddp``: torch's ``DistributedDataParallel`` (the real peer).
* ``localsgd-torch``: torch's ``PostLocalSGDOptimizer`` with ``PeriodicModelAverager(period=K,
  warmup_steps=K-1)`` on the plain module (the real peer).
* ``localsgd``, ``slowmo``, ``cpdp``: :class:`cpdpkit.sync.PeriodicSyncOptimizer`.

Exposed synchronisation time is "seconds the training loop was blocked on communication",
measured the same way for all: ``PeriodicSyncOptimizer.stats.blocked_s`` for ours; for
``localsgd-torch`` the wall time of the averager's call when it communicates; for ``ddp``,
from a communication hook that wraps torch's default all-reduce hook: the time from the last
bucket's launch (the end of backward's compute) until every bucket's all-reduce finished,
which is how long ``backward()`` waits in DDP's ``finalize_backward``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cpdpkit.sync import PeriodicSyncOptimizer

__all__ = ["Meter", "StrategyRunner", "build_strategy"]


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

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.optimizer.zero_grad()
        loss = nn.functional.cross_entropy(self._forward(x), y)
        loss.backward()
        self._after_backward()
        self.optimizer.step()
        return float(loss.detach())

    def _after_backward(self) -> None:
        pass

    def finish(self) -> Meter:
        return self.meter


class _Ours(StrategyRunner):
    def finish(self) -> Meter:
        stats = self.optimizer.stats
        return Meter(stats.blocked_s, stats.collectives, stats.bytes_sent)


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


def build_strategy(strategy: str, period: int | None, module: nn.Module, *, lr: float,
                   momentum: float, slowmo_momentum: float) -> StrategyRunner:
    """The runner for ``strategy`` (one of :data:`cpdpkit.bench.config.BENCH_STRATEGIES`)."""
    def sgd(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=lr, momentum=momentum)

    if strategy == "ddp":
        return _TorchDDP(module, sgd)
    assert period is not None
    if strategy == "localsgd-torch":
        with torch.no_grad():  # PostLocalSGD does not broadcast; DDP would at construction
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t, src=0)
        return _TorchLocalSGD(module, sgd(module.parameters()), period)
    opt = PeriodicSyncOptimizer(sgd(module.parameters()), model=module, strategy=strategy,
                                period=period, slowmo_momentum=slowmo_momentum)
    return _Ours(module, module, opt)
