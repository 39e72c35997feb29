"""One rank of one ``cpdpkit bench sharding`` run (launched by torchrun through :mod:`cpdpkit.launch`).

    python -m cpdpkit.bench.sharding_worker RUN_DIR

reads ``RUN_DIR/spec.json`` (the suite's config, this run's strategy and the plan), trains
``warmup_steps + steps`` steps and rank 0 writes ``RUN_DIR/result.json``. Measures, over the
timed steps only (after a barrier; max over ranks unless said otherwise):

* ``step_s``: wall time per step.
* ``exposed_comm_s_per_step``: seconds the training thread spent blocked in the emulated
  backend's ``Work.wait()`` (every collective of FSDP2 and the executors is waited there: a
  harness measure, not a trace analysis), plus, for the ZeRO peers, the waits on DDP's all-reduce
  futures that DDP does in C++ and :mod:`cpdpkit.bench.zero_peers` clocks.
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
  (:class:`~cpdpkit.bench.zero_peers.ZeroPeerUnsupported`).
"""

from __future__ import annotations

import contextlib
import json
import resource
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cpdpkit.bench._rank_io import RESULT_FILE, SPEC_FILE, finish_rank

__all__ = ["main", "SPEC_FILE", "RESULT_FILE"]



def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize()


def _optimizer(spec: dict[str, Any]) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The suite's optimizer class and hyperparameters (ZeRO takes them apart, the others a factory)."""
    name, lr = spec["optimizer"], spec["lr"]
    if name == "adamw":
        return torch.optim.AdamW, {"lr": lr, "weight_decay": 0.01}
    if name == "adam":
        return torch.optim.Adam, {"lr": lr}
    return torch.optim.SGD, {"lr": lr, "momentum": 0.9}


def _optimizer_factory(spec: dict[str, Any]):  # noqa: ANN202
    cls, kwargs = _optimizer(spec)
    return lambda params: cls(params, **kwargs)


@dataclass(frozen=True)
class _Run:
    """One rank's strategy: its step and what the harness asks of it around the timed steps."""

    step: Callable[[torch.Tensor, torch.Tensor], float]
    state_bytes: Callable[[], int]
    after_warmup: Callable[[], None] = lambda: None  # collective: every rank, same point
    extra_blocked_s: Callable[[], float] = lambda: 0.0  # waits the emulated Work.wait does not see
    report: Callable[[], dict[str, Any]] = dict  # collective: extra result fields after the timed steps


def _fully_shard_blocks(model: torch.nn.Module, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _executor_run(spec: dict[str, Any], model: torch.nn.Module) -> _Run:
    """two-stage or partial: the executor, calibrated after the warm-up, with its stage-1 evidence."""
    from cpdpkit.planner import ShardingPlan

    plan = ShardingPlan.from_dict(spec["plan"])
    if spec["strategy"] == "two-stage":
        from cpdpkit.planner.executor import TwoStageExecutor as Executor
    else:
        from cpdpkit.planner.partial import PartialShardExecutor as Executor
    ex = Executor(model, plan, _optimizer_factory(spec), max_grad_norm=spec.get("max_grad_norm"))
    calibrate = spec["warmup_steps"] > 0  # calibration needs measured steps

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        ex.zero_grad()
        loss = model.loss(x, y)
        loss.backward()
        ex.step()
        return float(loss.detach())

    def after_warmup() -> None:
        if calibrate:  # re-plan the exchange schedule from this machine's unit timings
            ex.calibrate()
        ex.reset_stats()

    def report() -> dict[str, Any]:
        predicted = ex.measured_schedule()  # collective: the timings measured since reset_stats()
        stats = {k: _mean(float(v)) for k, v in sorted(ex.stats.items()) if isinstance(v, (int, float))}
        return {"stage1_units": stats.get("stage1_units"),
                "stage1_units_predicted": predicted.num_stage1 if predicted is not None else None,
                "num_units": len(predicted.slots) if predicted is not None else None, "calibrated": calibrate,
                "clip_speculated": stats.get("clip_speculated"), "clip_mispredicted": stats.get("clip_mispredicted"),
                "executor_stats": stats}

    return _Run(step=step, state_bytes=ex.state_bytes, after_warmup=after_warmup, report=report)


def _zero_run(spec: dict[str, Any], model: torch.nn.Module, priming_batch: tuple[torch.Tensor, torch.Tensor]) -> _Run:
    from cpdpkit.bench.zero_peers import build_zero_peer

    cls, kwargs = _optimizer(spec)
    peer = build_zero_peer(spec["strategy"], model, optimizer_class=cls, optimizer_kwargs=kwargs,
                           max_grad_norm=spec.get("max_grad_norm"), priming_batch=priming_batch)
    return _Run(step=peer.step, state_bytes=peer.state_bytes, extra_blocked_s=peer.ddp_wait_s)


def _setup(spec: dict[str, Any], model: torch.nn.Module, priming_batch: tuple[torch.Tensor, torch.Tensor]) -> _Run:
    """This run's strategy on this rank."""
    strategy = spec["strategy"]
    if strategy in ("two-stage", "partial"):
        return _executor_run(spec, model)
    if strategy in ("zero1", "zero1-overlap"):
        return _zero_run(spec, model, priming_batch)
    from torch.distributed.device_mesh import init_device_mesh

    from cpdpkit.planner import ShardingPlan, apply_plan
    from cpdpkit.planner.executor import optimizer_state_bytes

    world = dist.get_world_size()
    if strategy == "fsdp2":
        _fully_shard_blocks(model, init_device_mesh("cpu", (world,), mesh_dim_names=("shard",)))
    elif strategy == "hsdp":
        s = spec["ranks_per_node"]
        _fully_shard_blocks(model, init_device_mesh("cpu", (world // s, s), mesh_dim_names=("replicate", "shard")))
    else:  # planned
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # StateShardingNotApplied: expected here
            apply_plan(model, ShardingPlan.from_dict(spec["plan"]))
    opt = _optimizer_factory(spec)(model.parameters())
    max_norm = spec.get("max_grad_norm")

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        opt.zero_grad()
        loss = model.loss(x, y)
        loss.backward()
        if max_norm is not None:  # FSDP2's DTensor gradients: clip_grad_norm_ reduces the norm
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        return float(loss.detach())

    return _Run(step=step, state_bytes=lambda: optimizer_state_bytes(opt))


def _profiled(spec: dict[str, Any]):  # noqa: ANN202
    if not spec.get("profile_dir"):
        return contextlib.nullcontext(None)
    from cpdpkit.tracing import default_schedule, trace_rank

    active = min(3, spec["steps"])
    return trace_rank(Path(spec["profile_dir"]) / spec["strategy"],
                      schedule=default_schedule(wait=max(0, spec["warmup_steps"] - 1), warmup=1, active=active),
                      run_info={"strategy": spec["strategy"], "suite": "sharding"})


def _max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _mean(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def _batches(spec: dict[str, Any], rank: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from cpdpkit.bench.gpt import gpt_preset, token_batch

    cfg = gpt_preset(spec["model"])
    return [token_batch(cfg, seed=spec["seed"], step=i, global_batch=world * spec["batch_size"], rank=rank,
                        batch_size=spec["batch_size"]) for i in range(spec["warmup_steps"] + spec["steps"])]


def _train(spec: dict[str, Any], run: _Run, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    from cpdpkit.emulator import EmulatedProcessGroup, meter

    emulated = isinstance(dist.group.WORLD, EmulatedProcessGroup)
    loss, losses, m, extra0 = float("nan"), [], None, 0.0
    with _profiled(spec) as prof, contextlib.ExitStack() as measured:
        for i, (x, y) in enumerate(batches):
            if i == spec["warmup_steps"]:
                run.after_warmup()
                dist.barrier()
                m = measured.enter_context(meter()) if emulated else None
                extra0 = run.extra_blocked_s()
                start = time.perf_counter()
            loss = run.step(x, y)
            losses.append(loss)
            if prof is not None:
                prof.step()
        elapsed = time.perf_counter() - start
    extra = run.extra_blocked_s() - extra0  # DDP's all-reduce waits: on the world group
    blocked = (m.blocked_s if m is not None else 0.0) + extra
    blocked_tiers = dict(m.blocked_s_by_tier) if m is not None else {}
    if extra:
        world_tier = getattr(dist.group.WORLD, "tier_name", None) or "LOCAL"
        blocked_tiers[world_tier] = blocked_tiers.get(world_tier, 0.0) + extra
    tiers = {t: b / spec["steps"] for t, b in m.bytes_by_tier.items()} if m is not None else {}
    return {"elapsed": elapsed, "blocked": blocked, "blocked_tiers": blocked_tiers, "tiers": tiers, "loss": loss,
            "losses": losses}


def main(argv: list[str] | None = None) -> None:
    from cpdpkit.bench.gpt import TinyGPT, gpt_preset
    from cpdpkit.bench.zero_peers import ZeroPeerUnsupported
    from cpdpkit.emulator import init_distributed

    argv = sys.argv[1:] if argv is None else argv
    run_dir = Path(argv[0])
    spec = json.loads((run_dir / SPEC_FILE).read_text())
    torch.set_num_threads(1)
    info = init_distributed()
    rank, world = info.rank, info.world_size
    batches = _batches(spec, rank, world)
    rss0 = _rss_bytes()
    torch.manual_seed(spec["seed"])
    model = TinyGPT(gpt_preset(spec["model"]))
    head = {"strategy": spec["strategy"], "world_size": world,
            "topology": info.topology.name if info.topology else None, "steps": spec["steps"]}
    try:
        run = _setup(spec, model, batches[0])
    except ZeroPeerUnsupported as exc:  # every rank refuses alike (same backend, same options)
        finish_rank(run_dir, rank, {**head, "status": "unsupported", "reason": str(exc)})
        return
    out = _train(spec, run, batches)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0
    steps = spec["steps"]
    names = ("NVLINK", "IB", "WAN", "LAN", "LOCAL")
    tiers = {t: int(round(_mean(out["tiers"].get(t, 0.0)))) for t in names}
    exposed_tiers = {t: _max(out["blocked_tiers"].get(t, 0.0)) / steps for t in names}
    result = {
        **head, "status": "ok", "reason": None,
        "step_s": _max(out["elapsed"]) / steps,
        "exposed_comm_s_per_step": _max(out["blocked"]) / steps,
        "exposed_comm_s_per_step_by_tier": {t: v for t, v in exposed_tiers.items() if v},
        "tier_bytes_per_step": {t: b for t, b in tiers.items() if b},
        "optimizer_state_bytes_per_rank": int(_max(run.state_bytes())),
        "peak_mem_bytes": int(_max(peak)),
        "final_loss": _mean(out["loss"]),
        "loss_curve_rank_mean": [_mean(v) for v in out["losses"]],
        **run.report(),
    }
    finish_rank(run_dir, rank, result)


if __name__ == "__main__":
    main()
