"""One rank of one ``cpdpkit bench hybrid`` run (launched by torchrun through :mod:`cpdpkit.launch`).

    python -m cpdpkit.bench.hybrid.worker RUN_DIR

reads ``RUN_DIR/spec.json`` (the suite's config and this run's strategy), trains
``warmup_steps + steps`` steps and rank 0 writes ``RUN_DIR/result.json`` with the fields of
:mod:`cpdpkit.bench.sharding.worker` (step time, exposed communication in total and by tier, wire
bytes by tier, peak RSS, final loss, ``loss_curve_rank_mean``: every step's loss, warm-up included,
averaged over ranks) and, measured after the last step (max over ranks; the suite runs whole
periods, so the last step is a reconciliation and, with ``overlap_steps``, its average is still in
flight then: the state's peak):

* ``param_shard_bytes_per_rank``: this rank's parameters (FSDP2: the local shard).
* ``training_state_bytes_per_rank``: the state training keeps between steps: parameters, gradients,
  AdamW's moments and, for the ``cpdp-over-hsdp`` strategies, every tensor of the sync optimizer's
  own state (``state_dict()["cpdpkit"]``: SlowMo's anchor and slow momentum, and a reconciliation
  in flight). Each part is also reported (``*_bytes_per_rank``). Tensors are counted by their
  local part; 0-d counters are left out.

``ddp-global``'s all-reduce waits happen in DDP's C++ reducer, not in the emulated backend's
``Work.wait``; they are clocked as the sharding suite clocks its ZeRO peers' (the wait in
``backward()`` after the last bucket's hook returned).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cpdpkit.bench._gpt_rank import (
    Run,
    ddp_over_blocks,
    fully_shard_blocks,
    local_bytes,
    max_over_ranks,
    optimizer_factory,
    optimizer_step,
    run_rank,
)

__all__ = ["main"]


def _tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor inside nested dicts, lists and tuples."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return local_bytes(t for state in opt.state.values() for t in state.values())


def _memory_report(model: nn.Module, inner: torch.optim.Optimizer, sync: Any = None,
                   master: Sequence[torch.Tensor] = ()) -> dict[str, Any]:
    """The persistent training state on this rank, by part (collective: max over ranks); ``master``: an
    executor's fp32 slices, which its optimizer updates (counted with the parameters)."""
    params = list(model.parameters())
    parts = {
        "param_shard_bytes_per_rank": local_bytes([*params, *master]),
        "grad_bytes_per_rank": local_bytes(p.grad for p in params if p.grad is not None),
        "optimizer_state_bytes_per_rank": _state_bytes(inner),
        "sync_state_bytes_per_rank": local_bytes(_tensors(sync.state_dict()["cpdpkit"])) if sync is not None else 0,
    }
    out = {name: int(max_over_ranks(value)) for name, value in parts.items()}
    out["training_state_bytes_per_rank"] = int(max_over_ranks(sum(parts.values())))
    return out


def _ddp_run(spec: dict[str, Any], model: nn.Module) -> Run:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from cpdpkit.bench.sharding.zero_peers import WaitClock

    clock = WaitClock()
    ddp = ddp_over_blocks(model)
    ddp.register_comm_hook(None, clock.timed(allreduce_hook))
    opt = optimizer_factory(spec)(ddp.parameters())

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        opt.zero_grad(set_to_none=True)
        logits = ddp(x)  # through DDP's forward (it prepares the reducer)
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        clock.backward(loss)
        opt.step()
        return float(loss.detach())

    return Run(step=step, state_bytes=lambda: _state_bytes(opt),
               extra_blocked_s=lambda: clock.waited_s, report=lambda: _memory_report(model, opt))


def _sharded_run(spec: dict[str, Any], model: nn.Module) -> Run:
    """hsdp-global (FSDP2 HSDP over the 2-D mesh) or cpdp-over-hsdp (FSDP2 in the site + CPDP across sites)."""
    from torch.distributed.device_mesh import init_device_mesh

    strategy, sites = spec["strategy"], spec["num_sites"]
    mesh = init_device_mesh("cpu", (sites, dist.get_world_size() // sites), mesh_dim_names=("replicate", "shard"))
    inner = optimizer_factory(spec)
    sync = None
    if strategy == "hsdp-global":
        fully_shard_blocks(model, mesh)
        opt = inner(model.parameters())
    else:
        from cpdpkit.sync import PeriodicSyncOptimizer

        fully_shard_blocks(model, mesh["shard"])
        overlap = spec["overlap_steps"] if strategy == "cpdp-over-hsdp-overlap" else 0
        opt = sync = PeriodicSyncOptimizer(inner(model.parameters()), model=model,
                                           group=mesh["replicate"].get_group(), strategy="cpdp",
                                           period=spec["period"], overlap_steps=overlap,
                                           compression=spec.get("compression", "none"),
                                           slowmo_momentum=spec.get("slowmo_momentum"))
    inner_opt = sync.optim if sync is not None else opt
    return Run(step=optimizer_step(model, opt), state_bytes=lambda: _state_bytes(inner_opt),
               report=lambda: _memory_report(model, inner_opt, sync))


def _two_stage_run(spec: dict[str, Any], model: nn.Module) -> Run:
    """cpdp-over-two-stage: a TwoStageExecutor on each site's ranks (the site plan) + CPDP across sites."""
    from torch.distributed.device_mesh import init_device_mesh

    from cpdpkit.planner import ShardingPlan
    from cpdpkit.shard.executor import TwoStageExecutor
    from cpdpkit.sync import PeriodicSyncOptimizer

    sites = spec["num_sites"]
    mesh = init_device_mesh("cpu", (sites, dist.get_world_size() // sites, 1),
                            mesh_dim_names=("site", "replicate", "shard"))
    ex = TwoStageExecutor(model, ShardingPlan.from_dict(spec["site_plan"]), optimizer_factory(spec),
                          mesh=mesh["replicate", "shard"])
    sync = PeriodicSyncOptimizer(ex.optimizer, model=ex, group=mesh["site"].get_group(), strategy="cpdp",
                                 period=spec["period"], compression=spec.get("compression", "none"),
                                 slowmo_momentum=spec.get("slowmo_momentum"))

    def after_warmup() -> None:  # the sharding suite's calibration: its schedule from this machine's timings
        ex.calibrate()
        ex.reset_stats()

    return Run(step=optimizer_step(model, sync), state_bytes=lambda: _state_bytes(ex.optimizer),
               after_warmup=after_warmup, report=lambda: _memory_report(model, ex.optimizer, sync, ex.slice_params))


def _setup(spec: dict[str, Any], model: nn.Module, priming_batch: tuple[torch.Tensor, torch.Tensor]) -> Run:
    """This run's strategy on this rank."""
    if spec["strategy"] == "ddp-global":
        return _ddp_run(spec, model)
    if spec["strategy"] == "cpdp-over-two-stage":
        return _two_stage_run(spec, model)
    return _sharded_run(spec, model)


def main(argv: list[str] | None = None) -> None:
    run_rank(_setup, argv=argv)


if __name__ == "__main__":
    main()
