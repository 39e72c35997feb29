"""Multi-process jobs for tests/test_planner_executor.py: TwoStageExecutor vs FSDP2 HSDP.

Each spawned rank joins through a ``file://`` rendezvous in the test's tmp dir (no port), on
plain gloo or on the emulated backend, builds one ``(replicate, shard)`` mesh, and per case
trains the same model with FSDP2 HSDP (``apply_plan``, a whole-shard optimizer, optionally
``clip_grad_norm_``) and with :class:`TwoStageExecutor`; it writes what it saw to ``rank<R>.pt``.
"""

from __future__ import annotations

import contextlib
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
    out = tmp_path / f"w{world_size}{'emu' if emulated else 'gloo'}"
    out.mkdir()
    return pj.run_spawned(_entry, (world_size, str(out), plan, cases, emulated), world_size, out, timeout_s)


def _plan_and_mesh(plan_dict: dict[str, Any]) -> tuple[Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from cpdpkit.planner import ShardingPlan

    plan = ShardingPlan.from_dict(plan_dict)
    return plan, init_device_mesh("cpu", plan.mesh.shape, mesh_dim_names=("replicate", "shard"))


def _entry(rank: int, world_size: int, out: str, plan_dict: dict[str, Any], cases: list[dict[str, Any]],
           emulated: bool) -> None:
    info = pj.init_rank(rank, world_size, out, emulated=emulated)
    from cpdpkit.emulator import meter

    with meter() if emulated else contextlib.nullcontext() as m:
        plan, mesh = _plan_and_mesh(plan_dict)
        results = [_run_case(rank, plan, mesh, case) for case in cases]
    pj.finish_rank(rank, out, {"backend": info.backend, "cases": results, "op_counts": m.op_counts if m else {}})


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + rank)  # every rank its own batch
    return [(torch.randn(6, 8, generator=gen), torch.randn(6, 5, generator=gen)) for _ in range(NUM_STEPS)]


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
        "hsdp_params": pj.full_params(hsdp), "ex_params": pj.full_params(net),
        "hsdp_state_bytes": optimizer_state_bytes(opt), "ex_state_bytes": ex.state_bytes(),
        "stages": {u.name: (u.stage, u.order) for u in ex._units}, "pending": pending,
    }


# ---- checkpoint / resume through torch.distributed.checkpoint -----------------------------------
def spawn_resume(world_size: int, tmp_path: Path, plan: dict[str, Any], cases: list[dict[str, Any]],
                 timeout_s: float = 25.0) -> list[dict[str, Any]]:
    """Per case: an uninterrupted run vs one saved with ``dcp.save`` after ``case["k"]`` steps and
    resumed into a fresh model/executor (another init) with ``dcp.load``."""
    out = tmp_path / f"resume{world_size}"
    out.mkdir()
    return pj.run_spawned(_resume_entry, (world_size, str(out), plan, cases), world_size, out, timeout_s)


def _resume_entry(rank: int, world_size: int, out: str, plan_dict: dict[str, Any],
                  cases: list[dict[str, Any]]) -> None:
    pj.init_rank(rank, world_size, out, emulated=False)
    plan, mesh = _plan_and_mesh(plan_dict)
    results = [_resume_case(rank, plan, mesh, case, Path(out, f"ckpt-{case['name']}")) for case in cases]
    pj.finish_rank(rank, out, {"cases": results})


def _train(net: nn.Module, ex: Any, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    losses = []
    for x, y in batches:
        ex.zero_grad()
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        ex.step()
        losses.append(loss.item())
    return losses


def _resume_case(rank: int, plan: Any, mesh: Any, case: dict[str, Any], ckpt: Path) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from cpdpkit.planner import PlannerError
    from cpdpkit.planner.executor import TwoStageExecutor

    factory, clip, k = OPTIMIZERS[case["optimizer"]], case.get("max_grad_norm"), case["k"]
    batches = _batches(rank)

    net = pj.make_net()
    ex = TwoStageExecutor(net, plan, factory, mesh=mesh, max_grad_norm=clip)
    full_losses = _train(net, ex, batches)
    ex.wait_exchanges()
    full_params = pj.full_params(net)

    net1 = pj.make_net()
    ex1 = TwoStageExecutor(net1, plan, factory, mesh=mesh, max_grad_norm=clip)
    first_losses = _train(net1, ex1, batches[:k])
    if case.get("stateful"):  # the executor itself as a DCP Stateful
        dcp.save({"executor": ex1}, storage_writer=dcp.FileSystemWriter(str(ckpt)))
    else:
        dcp.save(ex1.state_dict(), storage_writer=dcp.FileSystemWriter(str(ckpt)))
    dist.barrier()
    # keep training the saved run: the checkpoint must not depend on what happens afterwards
    _train(net1, ex1, batches[k:])

    torch.manual_seed(4321 + rank)  # another init, new objects
    net2 = pj.Net()
    ex2 = TwoStageExecutor(net2, plan, factory, mesh=mesh, max_grad_norm=clip)
    fresh_differs = any(not torch.equal(a, full_params[n]) for n, a in pj.full_params(net2).items())
    if case.get("stateful"):
        dcp.load({"executor": ex2}, storage_reader=dcp.FileSystemReader(str(ckpt)))
    else:
        sd = ex2.state_dict()
        dcp.load(sd, storage_reader=dcp.FileSystemReader(str(ckpt)))
        ex2.load_state_dict(sd)
    errors = []
    sd2 = ex2.state_dict(include_model=False)
    key = next(iter(sd2["optim"]))
    for bad in ({"optim": {"rep9of9_shard0of2": sd2["optim"][key]}},
                {"optim": {key: {**sd2["optim"][key], "layout": sd2["optim"][key]["layout"].replace(
                    '"numel": ', '"numel": 1')}}}):
        try:
            ex2.load_state_dict(bad)
        except PlannerError as exc:
            errors.append(str(exc))
    resumed_losses = _train(net2, ex2, batches[k:])
    ex2.wait_exchanges()
    return {"name": case["name"], "full_params": full_params, "resumed_params": pj.full_params(net2),
            "full_losses": full_losses, "resumed_losses": first_losses + resumed_losses,
            "fresh_differs": fresh_differs, "errors": errors, "optim_keys": sorted(sd2["optim"])}
