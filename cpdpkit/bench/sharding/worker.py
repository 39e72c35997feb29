"""One rank of one ``cpdpkit bench sharding`` run (launched by torchrun through :mod:`cpdpkit.launch`).

    python -m cpdpkit.bench.sharding.worker RUN_DIR

reads ``RUN_DIR/spec.json`` (the suite's config, this run's strategy and the plan), trains
``warmup_steps + steps`` steps and rank 0 writes ``RUN_DIR/result.json``. Measures, over the
timed steps only (after a barrier; max over ranks unless said otherwise):

* ``step_s``: wall time per step; ``step_s_by_rank``: every timed step's wall time on each rank.
* ``exposed_comm_s_per_step``: seconds the training thread spent blocked in the emulated
  backend's ``Work.wait()`` (every collective of FSDP2 and the executors is waited there: a
  harness measure, not a trace analysis), plus, for the ZeRO peers, the waits on DDP's all-reduce
  futures that DDP does in C++ and :mod:`cpdpkit.bench.sharding.zero_peers` clocks.
  ``exposed_comm_s_per_step_by_tier``: the same split by the tier of the group waited on (each
  tier's maximum over ranks, so the tiers need not add up to the total).
* ``tier_bytes_per_step``: wire bytes this rank sent in its collectives, by the tier of their
  process group, as the network model counts them (``cpdpkit.emulator.meter()``, the bytes a plan
  prices; mean over ranks).
* ``optimizer_state_bytes_per_rank``: the optimizer's per-element state on this rank (local parts).
* ``peak_mem_bytes``: RSS high-water mark (``ru_maxrss``) minus RSS just before the model was
  built: includes activations, communication buffers and allocator slack.
* ``final_loss``: the last step's loss averaged over ranks.
* ``two-stage`` and ``partial`` only: after the warm-up steps the executor calibrates (every rank
  calls ``calibrate()``: it re-plans its exchange schedule from the unit timings measured here,
  replacing the planner's A100 estimate) and resets its stats; after the timed steps the result
  gets ``stage1_units`` (exchanges finished before backward ended, mean per step and rank),
  ``stage1_units_predicted`` (``measured_schedule().num_stage1``: the schedule fed with this run's
  measured timings), ``num_units`` and the clipping stats (``clip_speculated``,
  ``clip_mispredicted``; all numeric stats under ``executor_stats``).
* A strategy that cannot run here writes ``status: "unsupported"`` and the reason
  (:class:`~cpdpkit.bench.sharding.zero_peers.ZeroPeerUnsupported`).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

from cpdpkit.bench._gpt_rank import (
    Run,
    fully_shard_blocks,
    mean_over_ranks,
    optimizer_factory,
    optimizer_for,
    optimizer_step,
    run_rank,
)

__all__ = ["main"]


def _executor_run(spec: dict[str, Any], model: torch.nn.Module) -> Run:
    """two-stage or partial: the executor, calibrated after the warm-up, with its stage-1 evidence."""
    from cpdpkit.planner import ShardingPlan

    plan = ShardingPlan.from_dict(spec["plan"])
    if spec["strategy"] == "two-stage":
        from cpdpkit.shard.executor import TwoStageExecutor as Executor
    else:
        from cpdpkit.shard.partial import PartialShardExecutor as Executor
    ex = Executor(model, plan, optimizer_factory(spec), max_grad_norm=spec.get("max_grad_norm"))
    calibrate = spec["warmup_steps"] > 0  # calibration needs measured steps

    def after_warmup() -> None:
        if calibrate:  # re-plan the exchange schedule from this machine's unit timings
            ex.calibrate()
        ex.reset_stats()

    def report() -> dict[str, Any]:
        predicted = ex.measured_schedule()  # collective: the timings measured since reset_stats()
        stats = {k: mean_over_ranks(float(v)) for k, v in sorted(ex.stats.items()) if isinstance(v, (int, float))}
        return {"stage1_units": stats.get("stage1_units"),
                "stage1_units_predicted": predicted.num_stage1 if predicted is not None else None,
                "num_units": len(predicted.slots) if predicted is not None else None, "calibrated": calibrate,
                "clip_speculated": stats.get("clip_speculated"), "clip_mispredicted": stats.get("clip_mispredicted"),
                "executor_stats": stats}

    return Run(step=optimizer_step(model, ex), state_bytes=ex.state_bytes, after_warmup=after_warmup, report=report)


def _zero_run(spec: dict[str, Any], model: torch.nn.Module, priming_batch: tuple[torch.Tensor, torch.Tensor]) -> Run:
    from cpdpkit.bench.sharding.zero_peers import build_zero_peer

    cls, kwargs = optimizer_for(spec)
    peer = build_zero_peer(spec["strategy"], model, optimizer_class=cls, optimizer_kwargs=kwargs,
                           max_grad_norm=spec.get("max_grad_norm"), priming_batch=priming_batch)
    return Run(step=peer.step, state_bytes=peer.state_bytes, extra_blocked_s=peer.ddp_wait_s)


def _setup(spec: dict[str, Any], model: torch.nn.Module, priming_batch: tuple[torch.Tensor, torch.Tensor]) -> Run:
    """This run's strategy on this rank."""
    strategy = spec["strategy"]
    if strategy in ("two-stage", "partial"):
        return _executor_run(spec, model)
    if strategy in ("zero1", "zero1-overlap"):
        return _zero_run(spec, model, priming_batch)
    from torch.distributed.device_mesh import init_device_mesh

    from cpdpkit.planner import ShardingPlan
    from cpdpkit.shard import apply_plan
    from cpdpkit.shard.executor import optimizer_state_bytes

    world = dist.get_world_size()
    if strategy in ("fsdp2", "fsdp2-zero2"):  # zero2: parameters kept unsharded from forward to backward
        fully_shard_blocks(model, init_device_mesh("cpu", (world,), mesh_dim_names=("shard",)),
                           reshard_after_forward=strategy == "fsdp2")
    elif strategy == "hsdp":
        s = spec["ranks_per_node"]
        fully_shard_blocks(model, init_device_mesh("cpu", (world // s, s), mesh_dim_names=("replicate", "shard")))
    else:  # planned
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # StateShardingNotApplied: expected here
            apply_plan(model, ShardingPlan.from_dict(spec["plan"]))
    opt = optimizer_factory(spec)(model.parameters())
    return Run(step=optimizer_step(model, opt, spec.get("max_grad_norm")),
               state_bytes=lambda: optimizer_state_bytes(opt))


def main(argv: list[str] | None = None) -> None:
    from cpdpkit.bench.sharding.zero_peers import ZeroPeerUnsupported

    run_rank(_setup, argv=argv, unsupported=(ZeroPeerUnsupported,))


if __name__ == "__main__":
    main()
