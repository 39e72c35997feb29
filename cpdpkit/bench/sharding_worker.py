"""One rank of one ``cpdpkit bench sharding`` run (launched by torchrun through :mod:`cpdpkit.launch`).

    python -m cpdpkit.bench.sharding_worker RUN_DIR

reads ``RUN_DIR/spec.json`` (the suite's config, this run's strategy and the plan), trains
``warmup_steps + steps`` steps and rank 0 writes ``RUN_DIR/result.json``. Measures, over the
timed steps only (after a barrier; max over ranks unless said otherwise):

* ``step_s``: wall time per step.
* ``exposed_comm_s_per_step``: seconds the training thread spent blocked in the emulated
  backend's ``Work.wait()`` (every collective of every strategy, FSDP2's included, is waited
  there: a harness measure, not a trace analysis).
* ``tier_bytes_per_step``: wire bytes this rank sent in its collectives, by the tier of their
  process group, as the network model counts them (``cpdpkit.emulator.meter()``, the bytes a plan
  prices; mean over ranks).
* ``optimizer_state_bytes_per_rank``: the optimizer's per-element state on this rank (local parts).
* ``peak_mem_bytes``: RSS high-water mark (``ru_maxrss``) minus RSS just before the model was
  built: includes activations, communication buffers and allocator slack.
* ``final_loss``: the last step's loss averaged over ranks.
"""

from __future__ import annotations

import contextlib
import json
import resource
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cpdpkit.bench._rank_io import RESULT_FILE, SPEC_FILE, finish_rank

__all__ = ["main", "SPEC_FILE", "RESULT_FILE"]



def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize()


def _optimizer_factory(spec: dict[str, Any]):  # noqa: ANN202
    name, lr = spec["optimizer"], spec["lr"]
    if name == "adamw":
        return lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    if name == "adam":
        return lambda params: torch.optim.Adam(params, lr=lr)
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)


def _fully_shard_blocks(model: torch.nn.Module, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _setup(spec: dict[str, Any], model: torch.nn.Module):  # noqa: ANN202
    """(step function, state-bytes function) for this run's strategy."""
    from torch.distributed.device_mesh import init_device_mesh

    from cpdpkit.planner import ShardingPlan, apply_plan
    from cpdpkit.planner.executor import optimizer_state_bytes

    factory, world = _optimizer_factory(spec), dist.get_world_size()
    strategy = spec["strategy"]
    if strategy == "two-stage":
        from cpdpkit.planner.executor import TwoStageExecutor

        ex = TwoStageExecutor(model, ShardingPlan.from_dict(spec["plan"]), factory,
                              max_grad_norm=spec.get("max_grad_norm"))

        def step(x: torch.Tensor, y: torch.Tensor) -> float:
            ex.zero_grad()
            loss = model.loss(x, y)
            loss.backward()
            ex.step()
            return float(loss.detach())

        return step, ex.state_bytes
    if strategy == "fsdp2":
        _fully_shard_blocks(model, init_device_mesh("cpu", (world,), mesh_dim_names=("shard",)))
    elif strategy == "hsdp":
        s = spec["ranks_per_node"]
        _fully_shard_blocks(model, init_device_mesh("cpu", (world // s, s), mesh_dim_names=("replicate", "shard")))
    else:  # planned
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # StateShardingNotApplied: expected here
            apply_plan(model, ShardingPlan.from_dict(spec["plan"]))
    opt = factory(model.parameters())
    max_norm = spec.get("max_grad_norm")

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        opt.zero_grad()
        loss = model.loss(x, y)
        loss.backward()
        if max_norm is not None:  # FSDP2's DTensor gradients: clip_grad_norm_ reduces the norm
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        return float(loss.detach())

    return step, lambda: optimizer_state_bytes(opt)


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


def _train(spec: dict[str, Any], step_fn: Any, rank: int, world: int) -> dict[str, Any]:
    from cpdpkit.bench.gpt import gpt_preset, token_batch
    from cpdpkit.emulator import EmulatedProcessGroup, meter

    cfg = gpt_preset(spec["model"])
    emulated = isinstance(dist.group.WORLD, EmulatedProcessGroup)
    total = spec["warmup_steps"] + spec["steps"]
    batches = [token_batch(cfg, seed=spec["seed"], step=i, global_batch=world * spec["batch_size"], rank=rank,
                           batch_size=spec["batch_size"]) for i in range(total)]
    loss, losses, m = float("nan"), [], None
    with _profiled(spec) as prof, contextlib.ExitStack() as measured:
        for i, (x, y) in enumerate(batches):
            if i == spec["warmup_steps"]:
                dist.barrier()
                m = measured.enter_context(meter()) if emulated else None
                start = time.perf_counter()
            loss = step_fn(x, y)
            losses.append(loss)
            if prof is not None:
                prof.step()
        elapsed = time.perf_counter() - start
    blocked = m.blocked_s if m is not None else 0.0
    tiers = {t: b / spec["steps"] for t, b in m.bytes_by_tier.items()} if m is not None else {}
    return {"elapsed": elapsed, "blocked": blocked, "tiers": tiers, "loss": loss, "losses": losses}


def main(argv: list[str] | None = None) -> None:
    from cpdpkit.bench.gpt import TinyGPT, gpt_preset
    from cpdpkit.emulator import init_distributed

    argv = sys.argv[1:] if argv is None else argv
    run_dir = Path(argv[0])
    spec = json.loads((run_dir / SPEC_FILE).read_text())
    torch.set_num_threads(1)
    info = init_distributed()
    rank, world = info.rank, info.world_size
    rss0 = _rss_bytes()
    torch.manual_seed(spec["seed"])
    model = TinyGPT(gpt_preset(spec["model"]))
    step_fn, state_bytes = _setup(spec, model)
    out = _train(spec, step_fn, rank, world)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0
    steps = spec["steps"]
    tiers = {t: int(round(_mean(out["tiers"].get(t, 0.0)))) for t in ("NVLINK", "IB", "WAN", "LAN", "LOCAL")}
    result = {
        "strategy": spec["strategy"], "status": "ok", "reason": None, "world_size": world,
        "topology": info.topology.name if info.topology else None, "steps": steps,
        "step_s": _max(out["elapsed"]) / steps,
        "exposed_comm_s_per_step": _max(out["blocked"]) / steps,
        "tier_bytes_per_step": {t: b for t, b in tiers.items() if b},
        "optimizer_state_bytes_per_rank": int(_max(state_bytes())),
        "peak_mem_bytes": int(_max(peak)),
        "final_loss": _mean(out["loss"]),
        "loss_curve_rank_mean": [_mean(v) for v in out["losses"]],
    }
    finish_rank(run_dir, rank, result)


if __name__ == "__main__":
    main()
