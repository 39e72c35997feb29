"""Multi-process jobs for tests/test_planner_executor.py: TwoStageExecutor vs FSDP2 HSDP.

Each spawned rank joins through a ``file://`` rendezvous in the test's tmp dir (no port), on
plain gloo or on the emulated backend, builds one ``(replicate, shard)`` mesh, and per case
trains the same model with FSDP2 HSDP (``apply_plan``, a whole-shard optimizer, optionally
``clip_grad_norm_``) and with :class:`TwoStageExecutor`; it writes what it saw to ``rank<R>.pt``.
"""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import _planner_jobs as pj

NUM_STEPS = 4
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1),
}


def spawn(world_size: int, tmp_path: Path, plan: dict[str, Any], cases: list[dict[str, Any]], *, emulated: bool,
          timeout_s: float = 50.0) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    out = tmp_path / f"w{world_size}{'emu' if emulated else 'gloo'}"
    out.mkdir()
    ctx = mp.start_processes(_entry, args=(world_size, str(out), plan, cases, emulated), nprocs=world_size,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"{world_size} ranks did not finish in {timeout_s} s")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def _entry(rank: int, world_size: int, out: str, plan_dict: dict[str, Any], cases: list[dict[str, Any]],
           emulated: bool) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh

    from cpdpkit.emulator import emulated_op_counts, init_distributed
    from cpdpkit.planner import ShardingPlan

    info = init_distributed(backend=None if emulated else "gloo", topology=pj.FAST_WAN if emulated else None,
                            init_method=f"file://{out}/store", rank=rank, world_size=world_size)
    plan = ShardingPlan.from_dict(plan_dict)
    mesh = init_device_mesh("cpu", plan.mesh.shape, mesh_dim_names=("replicate", "shard"))
    results = [_run_case(rank, plan, mesh, case) for case in cases]
    torch.save({"backend": info.backend, "cases": results, "op_counts": emulated_op_counts()},
               Path(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + rank)  # every rank its own batch
    return [(torch.randn(6, 8, generator=gen), torch.randn(6, 5, generator=gen)) for _ in range(NUM_STEPS)]


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _run_case(rank: int, plan: Any, mesh: Any, case: dict[str, Any]) -> dict[str, Any]:
    from cpdpkit.planner import apply_plan
    from cpdpkit.planner.executor import TwoStageExecutor, optimizer_state_bytes

    factory, clip = OPTIMIZERS[case["optimizer"]], case.get("max_grad_norm")

    hsdp = pj.make_net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        apply_plan(hsdp, plan, mesh)
    opt = factory(hsdp.parameters())
    hsdp_losses, hsdp_norms = [], []
    for x, y in _batches(rank):
        opt.zero_grad()
        loss = nn.functional.mse_loss(hsdp(x), y)
        loss.backward()
        if clip is not None:
            hsdp_norms.append(float(torch.nn.utils.clip_grad_norm_(hsdp.parameters(), clip).full_tensor()))
        opt.step()
        hsdp_losses.append(loss.item())

    net = pj.make_net()
    ex = TwoStageExecutor(net, plan, factory, mesh=mesh, max_grad_norm=clip)
    ex_losses, ex_norms, pending = [], [], []
    for x, y in _batches(rank):
        ex.zero_grad()
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        norm = ex.step()
        # stage-2 exchanges are still in flight after step(); the next forward waits for them
        pending.append({u.name: u.pending_ag is not None for u in ex._units})
        ex_norms.append(norm)
        ex_losses.append(loss.item())
    ex.wait_exchanges()
    return {
        "name": case["name"], "hsdp_losses": hsdp_losses, "ex_losses": ex_losses,
        "hsdp_norms": hsdp_norms, "ex_norms": ex_norms,
        "hsdp_params": _full(hsdp), "ex_params": _full(net),
        "hsdp_state_bytes": optimizer_state_bytes(opt), "ex_state_bytes": ex.state_bytes(),
        "stages": {u.name: (u.stage, u.order) for u in ex._units}, "pending": pending,
    }
