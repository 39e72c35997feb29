"""4-rank jobs for tests/test_sync_sharded.py: PeriodicSyncOptimizer over FSDP2 sharded inside a "site".

Ranks {0, 1} and {2, 3} are the sites (the shard groups), {0, 2} and {1, 3} the replicate groups,
as ``init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))`` lays them out and as
the ``multisite`` topology places 4 ranks. Each job returns plain data for the test to assert on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

STEPS = 6
CLIP_NORM = 0.2  # below most steps' gradient norm: the clipping acts


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def batch(rank: int, step: int, outputs: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 8, generator=g), torch.randn(8, outputs, generator=g)


def shard(model: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def train(model: nn.Module, opt: Any, rank: int, steps: range, outputs: int = 4) -> list[float]:
    losses = []
    for step in steps:
        x, y = batch(rank, step, outputs)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def full(model: nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() if hasattr(p, "full_tensor") else p.detach().clone()
            for p in model.parameters()]


def _mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def job_numerics(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """HSDP vs ours at K=1 with SlowMo off; ours at K=4 vs the plain path's fast/slow groups; a checkpoint."""
    from cpdpkit.checkpoint import Checkpointer
    from cpdpkit.sync import PeriodicSyncOptimizer

    mesh = _mesh()
    replicate = mesh["replicate"].get_group()
    out: dict[str, Any] = {"errors": errors(mesh)}
    # FSDP2's HSDP, every step, against cpdp at K=1 with SlowMo off
    hsdp = shard(make_model(), mesh)
    out["hsdp_loss"] = train(hsdp, adamw(hsdp), rank, range(STEPS))
    out["hsdp"] = full(hsdp)
    ours = shard(make_model(), mesh["shard"])
    opt = PeriodicSyncOptimizer(adamw(ours), model=ours, group=replicate, strategy="cpdp", period=1,
                                slowmo_momentum=0.0, slowmo_lr=1.0, timeout_s=60)
    out["k1_loss"] = train(ours, opt, rank, range(STEPS))
    out["k1"] = full(ours)
    # cpdp K=4 with SlowMo: sharded against the plain module with fast (site) and slow (replicate) groups
    sites = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    for overlap in (0, 1):
        plain = make_model()
        ref = PeriodicSyncOptimizer(adamw(plain), model=plain, strategy="cpdp", period=4, warmup_steps=1,
                                    overlap_steps=overlap, fast_group=sites[rank // 2], slow_group=replicate,
                                    optimizer_state="keep" if overlap else "average", timeout_s=60)
        out[f"plain_loss_{overlap}"] = train(plain, ref, rank, range(STEPS))
        out[f"plain_{overlap}"] = full(plain)
    for overlap in (0, 1):
        ours = shard(make_model(), mesh["shard"])
        opt = PeriodicSyncOptimizer(adamw(ours), model=ours, group=replicate, strategy="cpdp", period=4,
                                    warmup_steps=1, overlap_steps=overlap,
                                    optimizer_state="keep" if overlap else "average", timeout_s=60)
        out[f"k4_loss_{overlap}"] = train(ours, opt, rank, range(STEPS))
        out[f"k4_{overlap}"] = full(ours)
    out["stats"] = opt.stats
    out["local_numel"] = sum(p.to_local().numel() for p in ours.parameters())
    out["slowmo"] = [(t.numel(), t.dtype) for key in ("anchor", "slow_momentum")
                     for t in opt.state_dict()["cpdpkit"][key]]
    # DiLoCo's outer step over the shards: its momentum is shard-sized too
    dil = shard(make_model(), mesh["shard"])
    opt_dil = PeriodicSyncOptimizer(adamw(dil), model=dil, group=replicate, strategy="cpdp", period=2,
                                    outer_optimizer="diloco", timeout_s=60)
    train(dil, opt_dil, rank, range(STEPS))
    out["outer"] = [(t.numel(), t.dtype) for s in opt_dil.state_dict()["cpdpkit"]["outer"]["state"]
                    for t in s.values()]
    # int8 compression over the shards: the residuals are shard-sized, only compressed shards cross
    comp = shard(make_model(), mesh["shard"])
    opt_c = PeriodicSyncOptimizer(adamw(comp), model=comp, group=replicate, strategy="cpdp", period=2,
                                  compression="int8", timeout_s=60)
    train(comp, opt_c, rank, range(STEPS))
    out["compressed_stats"] = opt_c.stats
    out["residuals"] = [(t.numel(), t.dtype, bool(t.abs().max() > 0))
                        for t in opt_c.state_dict()["cpdpkit"]["residuals"]]
    out["grad_residuals"] = [(t.numel(), bool(t.abs().max() > 0))
                             for t in opt_c.state_dict()["cpdpkit"]["grad_residuals"]]
    # a checkpoint mid-period (step 3 of K=4, overlap in flight), resumed into fresh objects
    ckpt = Checkpointer(Path(tmp) / "ckpt", every=3, timeout_s=60)
    a = shard(make_model(), mesh["shard"])
    opt_a = PeriodicSyncOptimizer(adamw(a), model=a, group=replicate, strategy="cpdp", period=4, overlap_steps=1,
                                  timeout_s=60)
    train(a, opt_a, rank, range(3))
    ckpt.save(3, model=a, optimizer=opt_a)
    b = shard(make_model(), mesh["shard"])
    opt_b = PeriodicSyncOptimizer(adamw(b), model=b, group=replicate, strategy="cpdp", period=4, overlap_steps=1,
                                  timeout_s=60)
    out["restored_step"] = ckpt.restore(model=b, optimizer=opt_b)
    out["resumed_loss"] = train(b, opt_b, rank, range(3, STEPS))
    out["resumed"] = full(b)
    out["straight_loss"] = train(a, opt_a, rank, range(3, STEPS))
    out["straight"] = full(a)
    out["exp_avg_is_dtensor"] = all(type(s["exp_avg"]).__name__ == "DTensor" for s in opt_b.optim.state.values())
    out.update(clipping(rank, mesh, sites))
    out.update(executor(rank, tmp, replicate, sites))
    return out


def clipping(rank: int, mesh: Any, sites: list[Any]) -> dict[str, Any]:
    """cpdp K=2 with ``opt.clip_grad_norm_`` on every step: over FSDP2 shards and on the plain path (fast = site,
    slow = replicate group); the norms returned, and the parameters."""
    from cpdpkit.sync import PeriodicSyncOptimizer

    def run(model: nn.Module, **groups: Any) -> tuple[list[float], list[torch.Tensor]]:
        opt = PeriodicSyncOptimizer(adamw(model), model=model, strategy="cpdp", period=2, timeout_s=60, **groups)
        norms = []
        for step in range(STEPS):
            x, y = batch(rank, step)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            norms.append(float(opt.clip_grad_norm_(CLIP_NORM)))
            opt.step()
        return norms, full(model)

    replicate = mesh["replicate"].get_group()
    sharded_norms, sharded = run(shard(make_model(), mesh["shard"]), group=replicate)
    plain_norms, plain = run(make_model(), fast_group=sites[rank // 2], slow_group=replicate)
    return {"clip_sharded": sharded, "clip_sharded_norms": sharded_norms, "clip_plain": plain,
            "clip_plain_norms": plain_norms}


def executor(rank: int, tmp: str, replicate: Any, sites: list[Any]) -> dict[str, Any]:
    """cpdp K=4 over a TwoStageExecutor per site (its mesh: the site's 2 ranks as replicate x shard 1)."""
    import dataclasses

    from torch.distributed.device_mesh import init_device_mesh

    import _executor_jobs as ej
    import _planner_jobs as pj
    from cpdpkit.checkpoint import Checkpointer
    from cpdpkit.contracts import OuterSync, SyncedExecutor
    from cpdpkit.planner import PlannerConfig, plan_sharding
    from cpdpkit.shard.executor import TwoStageExecutor
    from cpdpkit.sync import PeriodicSyncOptimizer
    from cpdpkit.topology import resolve_topology

    config = PlannerConfig(param_dtype="float32", grad_dtype="float32", optim_state_bytes_per_param=8,
                           min_unit_bytes=1000, shard_size=1)
    with torch.device("meta"):
        spec = pj.Net()
    plan = plan_sharding(spec, resolve_topology("cluster", world_size=2, ranks_per_node=1), world_size=2,
                         config=config)
    plan = ej.with_stage1_schedule(dataclasses.replace(plan))
    mesh3 = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("site", "replicate", "shard"))
    site_mesh, cross = mesh3["replicate", "shard"], mesh3["site"].get_group()

    def make_ex() -> Any:
        return TwoStageExecutor(pj.make_net(), plan, lambda g: torch.optim.AdamW(g, lr=0.01, weight_decay=0.1),
                                mesh=site_mesh)

    def build(**kw: Any) -> tuple[Any, Any]:
        ex = make_ex()
        return ex, PeriodicSyncOptimizer(ex.optimizer, model=ex, group=cross, strategy="cpdp", period=4,
                                         warmup_steps=1, timeout_s=60, **kw)

    out: dict[str, Any] = {"ex_plan": (plan.mesh.shape, plan.state_sharding.axis), "ex_errors": []}
    for attempt in (lambda: TwoStageExecutor(pj.make_net(), plan, torch.optim.AdamW, mesh=site_mesh, max_grad_norm=1.0),
                    lambda: PeriodicSyncOptimizer(torch.optim.AdamW(pj.make_net().parameters()), model=make_ex(),
                                                  group=cross),
                    lambda: make_ex().attach_periodic_sync(object())):
        try:
            attempt()
        except Exception as exc:  # noqa: BLE001 - the test asserts the type and message
            out["ex_errors"].append(f"{type(exc).__name__}: {exc}")
    plain = pj.make_net()
    ref = PeriodicSyncOptimizer(torch.optim.AdamW(plain.parameters(), lr=0.01, weight_decay=0.1), model=plain,
                                strategy="cpdp", period=4, warmup_steps=1, fast_group=sites[rank // 2],
                                slow_group=replicate, timeout_s=60)
    out["ex_ref_loss"] = train(plain, ref, rank, range(STEPS), 5)
    out["ex_ref"] = full(plain)
    ex, opt = build()
    out["ex_contract"] = (isinstance(ex, SyncedExecutor), isinstance(opt, OuterSync))
    out["ex_loss"] = train(ex.model, opt, rank, range(STEPS), 5)
    ex.wait_exchanges()  # stage-2 units reach the model at the next forward otherwise
    out["ex"] = full(ex.model)
    out["ex_stats"] = (opt.stats, ex.stats["stage1_launched"], ex.stats["stage1_scheduled"])
    out["ex_slice_numel"] = sum(p.numel() for p in ex.slice_params)
    out["ex_num_slices"] = len(ex.slice_params)
    # each step: the collectives across sites launched by backward, and whether the step synced gradients;
    # with the default bucket cap all slices share one bucket, with a tiny one each slice is its own
    for cap, key in ((None, "ex_launched_in_backward"), (1e-6, "ex_launched_in_backward_per_slice")):
        ex2, opt2 = build(**({} if cap is None else {"bucket_cap_mb": cap}))
        out[key] = []
        for step in range(STEPS):
            x, y = batch(rank, step, 5)
            opt2.zero_grad()
            loss = nn.functional.mse_loss(ex2.model(x), y)
            before = opt2.stats
            loss.backward()
            in_backward = opt2.stats.collectives - before.collectives
            opt2.step()
            out[key].append((in_backward, opt2.stats.gradient_syncs - before.gradient_syncs))
        ex2.wait_exchanges()
        out[key + "_params"] = full(ex2.model)
    out.update(partial_executor(rank, spec, config, site_mesh, cross))
    # DiLoCo's outer step over the executor's slices (its momentum slice-sized), through a DCP checkpoint
    ckpt = Checkpointer(Path(tmp) / "ckpt-ex", every=3, timeout_s=60)
    a, opt_a = build(overlap_steps=1, outer_optimizer="diloco")
    train(a.model, opt_a, rank, range(3), 5)
    ckpt.save(3, model=a.model, optimizer=opt_a)
    b, opt_b = build(overlap_steps=1, outer_optimizer="diloco")
    out["ex_restored"] = ckpt.restore(model=b.model, optimizer=opt_b)
    out["ex_resumed_loss"] = train(b.model, opt_b, rank, range(3, STEPS), 5)
    opt_b.flush()
    out["ex_resumed"] = full(b.model)
    out["ex_straight_loss"] = train(a.model, opt_a, rank, range(3, STEPS), 5)
    opt_a.flush()
    out["ex_straight"] = full(a.model)
    out["ex_outer"] = [(t.numel(), t.dtype) for s in opt_a.state_dict()["cpdpkit"]["outer"]["state"]
                       for t in s.values()]
    return out


def partial_executor(rank: int, spec: nn.Module, config: Any, site_mesh: Any, cross: Any) -> dict[str, Any]:
    """cpdp K=4 over a PartialShardExecutor per site: the site's 2 ranks as 2 nodes of 1 rank (the
    `multisite` layout), so gradients are reduce-scattered and slices all-gathered inside the site."""
    import dataclasses

    import _planner_jobs as pj
    from cpdpkit.planner import plan_sharding
    from cpdpkit.shard.partial import PartialShardExecutor
    from cpdpkit.sync import PeriodicSyncOptimizer
    from cpdpkit.topology import resolve_topology

    plan = plan_sharding(spec, resolve_topology("cluster", world_size=2, ranks_per_node=1), world_size=2,
                         config=dataclasses.replace(config, param_sharding="replicated"))
    ex = PartialShardExecutor(pj.make_net(), plan, lambda g: torch.optim.AdamW(g, lr=0.01, weight_decay=0.1),
                              mesh=site_mesh)
    opt = PeriodicSyncOptimizer(ex.optimizer, model=ex, group=cross, strategy="cpdp", period=4, warmup_steps=1,
                                timeout_s=60)
    out: dict[str, Any] = {"partial_mesh": tuple(plan.mesh.shape)}
    out["partial_loss"] = train(ex.model, opt, rank, range(STEPS), 5)
    ex.wait_exchanges()
    out["partial"] = full(ex.model)
    out["partial_stats"] = opt.stats
    out["partial_slice_numel"] = sum(p.numel() for p in ex.slice_params)
    return out


def errors(mesh: Any) -> list[str]:
    """The one-line refusals, all before the first collective (each would otherwise hang its peers)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    from cpdpkit.sync import PeriodicSyncOptimizer
    from cpdpkit.topology import resolve_topology

    replicate = mesh["replicate"].get_group()
    topo = resolve_topology("multisite", world_size=4)
    messages = []

    def refused(model: nn.Module, group: Any, **kw: Any) -> None:
        try:
            PeriodicSyncOptimizer(adamw(model), model=model, group=group, **{"strategy": "cpdp", "period": 4, **kw})
        except Exception as exc:  # noqa: BLE001 - the test asserts the type and message
            messages.append(f"{type(exc).__name__}: {exc}")
        else:
            messages.append("accepted")

    refused(shard(make_model(), mesh), replicate)  # HSDP itself
    refused(shard(make_model(), init_device_mesh("cpu", (4,))), replicate)  # sharded over the world
    refused(shard(make_model(), mesh["shard"]), replicate, period="auto")
    # the mesh transposed: shard groups {0,2} {1,3} span the two sites
    transposed = DeviceMesh("cpu", torch.arange(4).view(2, 2).t(), mesh_dim_names=("replicate", "shard"))
    refused(shard(make_model(), transposed["shard"]), transposed["replicate"].get_group(), topology=topo)
    # one rank per shard group, and the world as the replicate group: two ranks of each site in it
    single = init_device_mesh("cpu", (4, 1), mesh_dim_names=("replicate", "shard"))
    refused(shard(make_model(), single["shard"]), single["replicate"].get_group(), topology=topo)
    return messages
