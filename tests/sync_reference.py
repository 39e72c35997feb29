"""An independent reference for PeriodicSyncOptimizer: N simulated workers in one process.

Written from the issue's definitions with plain tensors (no flat buffers, no process group),
so it shares no code with the implementation it checks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["Workload", "simulate", "make_model", "make_optimizer", "batch"]


def make_model(seed: int = 0, batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(8, 16)]
    if batchnorm:
        layers.append(nn.BatchNorm1d(16))
    layers += [nn.Tanh(), nn.Linear(16, 4)]
    return nn.Sequential(*layers)


def make_optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    params = list(model.parameters())
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)
    if kind == "sgd2groups":  # two param groups with different learning rates
        return torch.optim.SGD(
            [{"params": params[:2], "lr": 0.05}, {"params": params[2:], "lr": 0.02}],
            lr=0.05, momentum=0.9,
        )
    raise ValueError(kind)


def batch(rank: int, step: int, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * step + 104729 * rank + 17)
    return torch.randn(size, 8, generator=g), torch.randn(size, 4, generator=g)


@dataclass
class Workload:
    strategy: str
    optimizer: str = "sgd"
    period: int = 3
    warmup_steps: int = 0
    steps: int = 9
    beta: float = 0.5
    alpha: float = 1.0
    batchnorm: bool = False
    buffers: str = "average"
    optimizer_state: str = "keep"
    overlap_steps: int = 0  # τ: the average of step n applied at min(n + τ, next reconciliation)
    cpdp_order: str = "average-then-step"


def _averages_first(w: Workload) -> bool:
    return w.strategy == "cpdp" and w.cpdp_order == "average-then-step"


def _reconciles(w: Workload, n: int) -> bool:
    return w.strategy != "ddp" and n > w.warmup_steps and (n - w.warmup_steps) % w.period == 0


def _mean(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(tensors).mean(dim=0)


def simulate(w: Workload, world: int, schedulers: Callable | None = None) -> list[list[torch.Tensor]]:
    """Final parameters of every simulated worker."""
    models = [make_model(0, w.batchnorm) for _ in range(world)]
    opts = [make_optimizer(w.optimizer, m) for m in models]
    scheds = [schedulers(o) for o in opts] if schedulers else []
    params = [list(m.parameters()) for m in models]
    anchor = [p.detach().clone() for p in params[0]]
    momentum = [torch.zeros_like(p) for p in anchor]
    lr_of = [gi for gi, g in enumerate(opts[0].param_groups) for _ in g["params"]]
    pending: dict | None = None  # an overlapped reconciliation: its means and what each rank had
    if _averages_first(w):
        _simulate_average_first(w, world, models, opts, scheds, params, anchor, momentum, lr_of)
        return [[p.detach().clone() for p in ps] for ps in params]
    for n in range(1, w.steps + 1):
        for r in range(world):
            models[r].train()
            opts[r].zero_grad()
            x, y = batch(r, n)
            nn.functional.mse_loss(models[r](x), y).backward()
        sync_grads = w.strategy == "ddp" or n <= w.warmup_steps or (
            w.strategy == "cpdp" and _reconciles(w, n)
        )
        if sync_grads:
            for i in range(len(params[0])):
                g = _mean([params[r][i].grad for r in range(world)])
                for r in range(world):
                    params[r][i].grad = g.clone()
        for r in range(world):
            opts[r].step()
        with torch.no_grad():
            if _reconciles(w, n) and w.overlap_steps:
                if pending is not None:
                    _apply_late(w, world, models, opts, params, anchor, momentum, lr_of, pending)
                pending = _launch(w, world, models, params, n)
            elif pending is not None and n >= pending["due"]:
                _apply_late(w, world, models, opts, params, anchor, momentum, lr_of, pending)
                pending = None
            elif _reconciles(w, n):
                _reference_reconcile(w, world, models, opts, params, anchor, momentum, lr_of)
            elif sync_grads and w.batchnorm:
                _sync_buffers(w, world, models)
            if w.strategy in ("slowmo", "cpdp") and n == w.warmup_steps:
                anchor[:] = [p.detach().clone() for p in params[0]]
        for s in scheds:
            s.step()
    return [[p.detach().clone() for p in ps] for ps in params]


def _backward(world, models, opts, n) -> None:
    for r in range(world):
        models[r].train()
        opts[r].zero_grad()
        x, y = batch(r, n)
        nn.functional.mse_loss(models[r](x), y).backward()


def _mean_grads(world, params) -> None:
    for i in range(len(params[0])):
        g = _mean([params[r][i].grad for r in range(world)])
        for r in range(world):
            params[r][i].grad = g.clone()


def _simulate_average_first(w, world, models, opts, scheds, params, anchor, momentum, lr_of) -> None:
    """cpdp, average-then-step: the average (and outer update) at the end of step n - 1, step n
    synchronous; with τ >= 1 the synchronous step is the one after the late average is applied."""
    sync_step = w.warmup_steps + 1 if _reconciles(w, w.warmup_steps + 1) else None
    pending: dict | None = None
    for n in range(1, w.steps + 1):
        _backward(world, models, opts, n)
        warm = n <= w.warmup_steps
        if warm or n == sync_step:
            _mean_grads(world, params)
        for r in range(world):
            opts[r].step()
        with torch.no_grad():
            if warm:
                if w.batchnorm:
                    _sync_buffers(w, world, models)
            elif _reconciles(w, n + 1) and w.overlap_steps:
                if pending is not None:  # the one in flight is applied first: the next step follows it
                    _apply_late(w, world, models, opts, params, anchor, momentum, lr_of, pending)
                    sync_step = n + 1
                pending = _launch(w, world, models, params, n)
            elif _reconciles(w, n + 1):
                _reference_reconcile(w, world, models, opts, params, anchor, momentum, lr_of)
                sync_step = n + 1
            elif pending is not None and n >= pending["due"]:
                _apply_late(w, world, models, opts, params, anchor, momentum, lr_of, pending)
                pending = None
                sync_step = n + 1
            if n == w.warmup_steps:
                anchor[:] = [p.detach().clone() for p in params[0]]
        for s in scheds:
            s.step()


def _outer(w, opts, anchor, momentum, lr_of, i, xbar):
    if w.strategy in ("slowmo", "cpdp"):
        lr = opts[0].param_groups[lr_of[i]]["lr"]
        momentum[i] = w.beta * momentum[i] + (anchor[i] - xbar) / lr
        anchor[i] = anchor[i] - w.alpha * lr * momentum[i]
        return anchor[i]
    return xbar


def _launch(w, world, models, params, n) -> dict:
    """What an overlapped reconciliation sends at step n: the means, and each rank's values."""
    bufs = [list(m.buffers()) for m in models]
    buffer_means = []
    for i in range(len(bufs[0])):
        if w.buffers == "average" and bufs[0][i].is_floating_point():
            buffer_means.append(_mean([bufs[r][i] for r in range(world)]))
        else:
            buffer_means.append(bufs[0][i].clone())
    return {
        "due": n + w.overlap_steps,
        "means": [_mean([params[r][i] for r in range(world)]) for i in range(len(params[0]))],
        "had": [[p.detach().clone() for p in params[r]] for r in range(world)],
        "buffer_means": buffer_means,
        "buffers_had": [[b.clone() for b in bufs[r]] for r in range(world)],
    }


def _apply_late(w, world, models, opts, params, anchor, momentum, lr_of, pending) -> None:
    """x <- x~ + (x - x at launch), x~ the outer update of the launch's means (the issue's formula)."""
    for i in range(len(params[0])):
        new = _outer(w, opts, anchor, momentum, lr_of, i, pending["means"][i])
        for r in range(world):
            params[r][i].copy_(new + (params[r][i] - pending["had"][r][i]))
    if w.buffers != "local":
        for r in range(world):
            for i, b in enumerate(models[r].buffers()):
                b.copy_(pending["buffer_means"][i] + (b - pending["buffers_had"][r][i]))
    if w.optimizer_state == "reset":
        for o in opts:
            o.state.clear()


def _reference_reconcile(w, world, models, opts, params, anchor, momentum, lr_of) -> None:
    for i in range(len(params[0])):
        xbar = _mean([params[r][i] for r in range(world)])
        new = _outer(w, opts, anchor, momentum, lr_of, i, xbar)
        for r in range(world):
            params[r][i].copy_(new)
    _sync_buffers(w, world, models)
    if w.optimizer_state == "average":
        for i in range(len(params[0])):
            keys = [k for k, v in opts[0].state[params[0][i]].items()
                    if k != "step" and torch.is_tensor(v) and v.is_floating_point()]
            for k in keys:
                m = _mean([opts[r].state[params[r][i]][k] for r in range(world)])
                for r in range(world):
                    opts[r].state[params[r][i]][k].copy_(m)
    elif w.optimizer_state == "reset":
        for o in opts:
            o.state.clear()


def _sync_buffers(w, world, models) -> None:
    bufs = [list(m.buffers()) for m in models]
    for i in range(len(bufs[0])):
        if w.buffers == "local":
            continue
        if w.buffers == "average" and bufs[0][i].is_floating_point():
            v = _mean([bufs[r][i] for r in range(world)])
        else:
            v = bufs[0][i].clone()
        for r in range(world):
            bufs[r][i].copy_(v)
