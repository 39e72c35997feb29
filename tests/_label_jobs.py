"""Multi-process job for tests/test_labels.py: what a torch.profiler sees of cpdpkit's collectives.

Each spawned rank trains a few steps with :class:`PeriodicSyncOptimizer` (cpdp, optimizer state
averaged, a BatchNorm buffer) and with :class:`TwoStageExecutor` (2 replicas x 2 shards) under
``torch.profiler.profile`` and saves every CPU event's name, thread and interval.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

import _planner_jobs as pj
from _ranks import run_spawned

NUM_STEPS = 4


def spawn(tmp_path: Path, plan: dict[str, Any], timeout_s: float = 60.0) -> list[dict[str, Any]]:
    out = tmp_path / "labels"
    out.mkdir()
    return run_spawned(_entry, (4, str(out), plan), 4, out, timeout_s)


def _events(prof: Any) -> list[tuple[str, int, float, float]]:
    return [(e.name, e.thread, e.time_range.start, e.time_range.end) for e in prof.events()]


def _sync_events(rank: int) -> list[tuple[str, int, float, float]]:
    from cpdpkit.sync import PeriodicSyncOptimizer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    gen = torch.Generator().manual_seed(10 + rank)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        opt = PeriodicSyncOptimizer(inner, model=model, strategy="cpdp", period=2, optimizer_state="average")
        for _ in range(NUM_STEPS):
            opt.zero_grad()
            nn.functional.mse_loss(model(torch.randn(5, 6, generator=gen)), torch.randn(5, 2, generator=gen)).backward()
            opt.step()
        opt.average_parameters()
    return _events(prof)


def _executor_events(rank: int, plan_dict: dict[str, Any]) -> list[tuple[str, int, float, float]]:
    from torch.distributed.device_mesh import init_device_mesh

    from cpdpkit.planner import ShardingPlan
    from cpdpkit.shard.executor import TwoStageExecutor

    plan = ShardingPlan.from_dict(plan_dict)
    mesh = init_device_mesh("cpu", plan.mesh.shape, mesh_dim_names=("replicate", "shard"))
    net = pj.make_net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ex = TwoStageExecutor(net, plan, lambda groups: torch.optim.AdamW(groups, lr=0.01), mesh=mesh,
                              max_grad_norm=0.05)
    gen = torch.Generator().manual_seed(100 + rank)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            ex.zero_grad()
            nn.functional.mse_loss(net(torch.randn(6, 8, generator=gen)), torch.randn(6, 5, generator=gen)).backward()
            ex.step()
        ex.wait_exchanges()
    return _events(prof)


def _entry(rank: int, world_size: int, out: str, plan_dict: dict[str, Any]) -> None:
    pj.init_rank(rank, world_size, out, emulated=False)
    saved = {"sync": _sync_events(rank), "executor": _executor_events(rank, plan_dict)}
    pj.finish_rank(rank, out, saved)
