"""Multi-process jobs for tests/test_planner_partial.py: PartialShardExecutor vs a plain reference.

Each spawned rank joins through a ``file://`` rendezvous (no port), builds the plan's
``(replicate, shard)`` mesh, and per case trains the same replicated model with a plain
reference (gradients all-reduced with mean over the world, the whole model's optimizer, optionally
``clip_grad_norm_``) and with :class:`PartialShardExecutor`, using the case keys of
tests/_executor_jobs.py. Cases with ``"k"`` are checkpoint round trips (``resume_case``). On the
emulated backend a ``"bytes"`` case meters the wire bytes per tier of the training steps.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import _executor_jobs as ej
import _planner_jobs as pj


def spawn(tmp_path: Path, plan: dict[str, Any], cases: list[dict[str, Any]], *, emulated: bool,
          timeout_s: float = 150.0) -> list[dict[str, Any]]:
    return ej.spawn_job(_entry, 4, tmp_path, "emu" if emulated else "gloo", (plan, cases, emulated), timeout_s)


def plain_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _entry(rank: int, world_size: int, out: str, plan_dict: dict[str, Any], cases: list[dict[str, Any]],
           emulated: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from cpdpkit.planner import ShardingPlan
    from cpdpkit.shard.partial import PartialShardExecutor

    info = pj.init_rank(rank, world_size, out, emulated=emulated)
    plan = ShardingPlan.from_dict(plan_dict)
    mesh = init_device_mesh("cpu", plan.mesh.shape, mesh_dim_names=("replicate", "shard"))
    results = []
    for case in cases:
        if "k" in case:
            ckpt = Path(out, f"ckpt-{case['name']}")
            results.append(ej.resume_case(rank, plan, mesh, case, ckpt, PartialShardExecutor, plain_params))
        elif case.get("bytes"):
            results.append(_metered(rank, plan, mesh, case))
        elif case.get("buckets"):
            results.append(_buckets(rank, plan, mesh, case))
        else:
            results.append(_run_case(rank, plan, mesh, case))
    pj.finish_rank(rank, out, {"backend": info.backend, "cases": results})


def _reference(rank: int, case: dict[str, Any], clip: float | None) -> dict[str, Any]:
    """Plain data parallelism: every rank the whole model, gradients averaged over the world."""
    from cpdpkit.shard.executor import optimizer_state_bytes

    def all_reduce_mean(net: nn.Module) -> None:
        for p in net.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)

    net = ej.make_net(case)
    opt = ej.OPTIMIZERS[case["optimizer"]](net.parameters())
    run = ej.train_reference(net, opt, case, ej.batches(rank, ej.NUM_STEPS * case.get("accum", 1)), clip,
                             reduce_grads=all_reduce_mean)
    return {**run, "params": plain_params(net), "state_bytes": optimizer_state_bytes(opt)}


def _executor(rank: int, plan: Any, mesh: Any, case: dict[str, Any], clip: float | None, *,
              update_in_backward: bool = True) -> dict[str, Any]:
    from cpdpkit.shard.partial import PartialShardExecutor

    net = ej.make_net(case)
    ex = PartialShardExecutor(net, plan, ej.OPTIMIZERS[case["optimizer"]], mesh=mesh, max_grad_norm=clip,
                              update_in_backward=update_in_backward)
    return ej.exercise_executor(ex, net, case, ej.batches(rank, ej.NUM_STEPS * case.get("accum", 1)), plain_params)


def _run_case(rank: int, plan: Any, mesh: Any, case: dict[str, Any]) -> dict[str, Any]:
    clip = case.get("max_grad_norm")
    if clip == "alternate":
        clip = ej.alternate_max_norm(_reference(rank, case, 1e30)["norms"], ej.loss_scales(case))
    out = {"name": case["name"], "max_grad_norm": clip, "ref": _reference(rank, case, clip),
           "ex": _executor(rank, plan, mesh, case, clip)}
    if case.get("exact"):
        out["exact"] = _executor(rank, plan, mesh, case, clip, update_in_backward=False)
    return out


def _metered(rank: int, plan: Any, mesh: Any, case: dict[str, Any]) -> dict[str, Any]:
    """Wire bytes per tier of ``NUM_STEPS`` training steps (the executor built outside the block)."""
    from cpdpkit.emulator import meter
    from cpdpkit.shard.partial import PartialShardExecutor

    net = ej.make_net(case)
    ex = PartialShardExecutor(net, plan, ej.OPTIMIZERS[case["optimizer"]], mesh=mesh)
    data = ej.batches(rank)
    with meter() if dist.get_backend() != "gloo" else contextlib.nullcontext() as m:
        ej.train_executor(ex, net, case, data)
    return {"name": case["name"], "bytes_by_tier": m.bytes_by_tier if m else {},
            "op_counts": m.op_counts if m else {}, "params": plain_params(net)}


def _inside(t: torch.Tensor, base: torch.Tensor) -> bool:
    start, storage = base.untyped_storage().data_ptr(), base.untyped_storage().nbytes()
    return start <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= start + storage


def _buckets(rank: int, plan: Any, mesh: Any, case: dict[str, Any]) -> dict[str, Any]:
    """The flat-bucket path: the initial broadcast (every rank starts from another init), parameters and
    gradients as views of the buckets (no copy on the hot path), and bf16 compute with fp32 or bf16
    reductions against the fp32 reference."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from cpdpkit.shard.partial import PartialShardExecutor

    torch.manual_seed(1234 + rank)  # a different init on every rank: the executor broadcasts mesh rank 0's
    net = pj.Net()
    before = plain_params(net)
    ex = PartialShardExecutor(net, plan, ej.OPTIMIZERS[case["optimizer"]], mesh=mesh)
    start = plain_params(net)
    x, y = ej.batches(rank)[0]
    ex.zero_grad()
    nn.functional.mse_loss(net(x), y).backward()
    views = {"params": all(any(_inside(p, u.flat_param) for u in ex._units) for p in net.parameters()),
             "grads": all(p.grad is not None and any(_inside(p.grad, u.flat_grad) for u in ex._units)
                          for p in net.parameters())}
    ex.step()
    ex.wait_exchanges()
    mixed = {}
    for reduce in ("float32", "bfloat16"):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=getattr(torch, reduce))
        low = ej.make_net(case)
        lex = PartialShardExecutor(low, plan, ej.OPTIMIZERS[case["optimizer"]], mesh=mesh, mp_policy=policy)
        run = ej.train_executor(lex, low, case, ej.batches(rank))
        errors = []
        try:
            lex.state_dict()
        except Exception as exc:  # noqa: BLE001 (the message is the result)
            errors.append(str(exc))
        mixed[reduce] = {"losses": run["losses"], "dtypes": sorted({str(p.dtype) for p in low.parameters()}),
                         "params": {n: p.detach().float() for n, p in low.named_parameters()}, "errors": errors}
    return {"name": case["name"], "before": before, "start": start, "views": views, "mixed": mixed,
            "ref": _reference(rank, case, None)}
