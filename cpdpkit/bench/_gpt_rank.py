"""The rank side the suites that time steps of the small GPT share (``cpdpkit bench sharding`` and
``cpdpkit bench hybrid``; their parents launch through :func:`cpdpkit.bench.launcher.run_per_strategy`).

On every rank: :func:`run_rank` builds the small GPT, asks the suite's
``setup`` for the strategy's :class:`Run`, trains ``warmup_steps + steps`` steps and measures the
timed ones (step time, the training thread's blocked time on communication by tier, wire bytes by
tier, peak RSS, the loss curve); :mod:`cpdpkit.bench.sharding.worker` documents every field.
"""

from __future__ import annotations

import contextlib
import resource
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cpdpkit.bench.launcher import finish_rank, read_spec
from cpdpkit.network import LOCAL_TIER

__all__ = ["Run", "run_rank", "optimizer_for", "optimizer_factory", "optimizer_step", "fully_shard_blocks",
           "ddp_over_blocks", "max_over_ranks", "mean_over_ranks", "mean_list_over_ranks", "local_bytes"]

TIER_NAMES = ("NVLINK", "IB", "WAN", "LAN", LOCAL_TIER)


# ---- every rank: the strategy, the training loop, the result -------------------------------------
@dataclass(frozen=True)
class Run:
    """One rank's strategy: its step and what the harness asks of it around the timed steps."""

    step: Callable[[torch.Tensor, torch.Tensor], float]
    state_bytes: Callable[[], int]
    after_warmup: Callable[[], None] = lambda: None  # collective: every rank, same point
    extra_blocked_s: Callable[[], float] = lambda: 0.0  # waits the emulated Work.wait does not see
    report: Callable[[], dict[str, Any]] = dict  # collective: extra result fields after the timed steps


def optimizer_for(spec: dict[str, Any]) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The suite's optimizer class and hyperparameters (ZeRO takes them apart, the others a factory)."""
    name, lr = spec["optimizer"], spec["lr"]
    if name == "adamw":
        return torch.optim.AdamW, {"lr": lr, "weight_decay": 0.01}
    if name == "adam":
        return torch.optim.Adam, {"lr": lr}
    return torch.optim.SGD, {"lr": lr, "momentum": 0.9}


def optimizer_factory(spec: dict[str, Any]):  # noqa: ANN201
    cls, kwargs = optimizer_for(spec)
    return lambda params: cls(params, **kwargs)


def optimizer_step(model: torch.nn.Module, opt: Any, max_grad_norm: float | None = None
                   ) -> Callable[[torch.Tensor, torch.Tensor], float]:
    """One training step with ``opt`` (anything with ``zero_grad()`` and ``step()``) on the model's own ``loss``."""

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        opt.zero_grad()
        loss = model.loss(x, y)
        loss.backward()
        if max_grad_norm is not None:  # FSDP2's DTensor gradients: clip_grad_norm_ reduces the norm
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        return float(loss.detach())

    return step


def fully_shard_blocks(model: torch.nn.Module, mesh: Any, *, reshard_after_forward: bool = True) -> None:
    """FSDP2 as the suites' peers use it: every block its own unit, then the root."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)


def ddp_over_blocks(model: torch.nn.Module) -> Any:
    """DDP as the suites' peers use it: buckets of one block's bytes (a model without blocks: one bucket)."""
    from torch.nn.parallel import DistributedDataParallel

    blocks = getattr(model, "blocks", None)
    unit = blocks[0] if blocks else model
    cap_mb = sum(p.numel() * p.element_size() for p in unit.parameters()) / 2**20
    return DistributedDataParallel(model, bucket_cap_mb=cap_mb, gradient_as_bucket_view=True)


def local_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the tensors' parts on this rank (DTensors: the local shard; 0-d tensors are counters, left out)."""
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            local = t.to_local() if hasattr(t, "to_local") else t
            total += local.numel() * local.element_size()
    return total


def max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def mean_over_ranks(value: float) -> float:
    return mean_list_over_ranks([value])[0]


def mean_list_over_ranks(values: list[float]) -> list[float]:
    """Each value's mean over the ranks (one collective for the whole list)."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def _by_rank(values: list[float]) -> list[list[float]]:
    """Every rank's ``values`` (one collective), in rank order."""
    t = torch.zeros(dist.get_world_size(), len(values), dtype=torch.float64)
    t[dist.get_rank()] = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize()


def _profiled(spec: dict[str, Any]):  # noqa: ANN202
    if not spec.get("profile_dir"):
        return contextlib.nullcontext(None)
    from cpdpkit.tracing import default_schedule, trace_rank

    active = min(3, spec["steps"])
    return trace_rank(Path(spec["profile_dir"]) / spec["strategy"],
                      schedule=default_schedule(wait=max(0, spec["warmup_steps"] - 1), warmup=1, active=active),
                      run_info={"strategy": spec["strategy"], "suite": spec.get("suite", "sharding")})


def _batches(spec: dict[str, Any], rank: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from cpdpkit.bench.models.gpt import gpt_preset, token_batch

    cfg = gpt_preset(spec["model"])
    return [token_batch(cfg, seed=spec["seed"], step=i, global_batch=world * spec["batch_size"], rank=rank,
                        batch_size=spec["batch_size"]) for i in range(spec["warmup_steps"] + spec["steps"])]


def _train(spec: dict[str, Any], run: Run, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    from cpdpkit.emulator import EmulatedProcessGroup, meter

    emulated = isinstance(dist.group.WORLD, EmulatedProcessGroup)
    loss, losses, ends, m, extra0 = float("nan"), [], [], None, 0.0
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
            if i >= spec["warmup_steps"]:
                ends.append(time.perf_counter())
            if prof is not None:
                prof.step()
        elapsed = time.perf_counter() - start
    extra = run.extra_blocked_s() - extra0  # DDP's all-reduce waits: on the world group
    blocked = (m.blocked_s if m is not None else 0.0) + extra
    blocked_tiers = dict(m.blocked_s_by_tier) if m is not None else {}
    if extra:
        world_tier = getattr(dist.group.WORLD, "tier_name", None) or LOCAL_TIER
        blocked_tiers[world_tier] = blocked_tiers.get(world_tier, 0.0) + extra
    tiers = {t: b / spec["steps"] for t, b in m.bytes_by_tier.items()} if m is not None else {}
    durations = [b - a for a, b in zip([start, *ends[:-1]], ends)]
    return {"elapsed": elapsed, "durations": durations, "blocked": blocked, "blocked_tiers": blocked_tiers,
            "tiers": tiers, "loss": loss, "losses": losses}


def run_rank(setup: Callable[[dict[str, Any], torch.nn.Module, tuple[torch.Tensor, torch.Tensor]], Run], *,
             argv: list[str] | None = None, unsupported: tuple[type[BaseException], ...] = ()) -> None:
    """One rank of one strategy's job: ``python WORKER RUN_DIR``; rank 0 writes ``RUN_DIR/result.json``.

    ``setup(spec, model, first_batch)`` wraps the freshly built model for the spec's strategy; an
    exception of an ``unsupported`` type (raised alike on every rank) is reported ``unsupported``.
    """
    from cpdpkit.bench.models.gpt import TinyGPT, gpt_preset
    from cpdpkit.emulator import init_distributed

    run_dir, spec = read_spec(sys.argv[1:] if argv is None else argv)
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
        run = setup(spec, model, batches[0])
    except unsupported as exc:  # every rank refuses alike (same backend, same options)
        finish_rank(run_dir, rank, {**head, "status": "unsupported", "reason": str(exc)})
        return
    out = _train(spec, run, batches)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0
    steps = spec["steps"]
    tiers = {t: int(round(mean_over_ranks(out["tiers"].get(t, 0.0)))) for t in TIER_NAMES}
    exposed_tiers = {t: max_over_ranks(out["blocked_tiers"].get(t, 0.0)) / steps for t in TIER_NAMES}
    result = {
        **head, "status": "ok", "reason": None,
        "step_s": max_over_ranks(out["elapsed"]) / steps,
        "step_s_by_rank": _by_rank(out["durations"]),
        "exposed_comm_s_per_step": max_over_ranks(out["blocked"]) / steps,
        "exposed_comm_s_per_step_by_tier": {t: v for t, v in exposed_tiers.items() if v},
        "tier_bytes_per_step": {t: b for t, b in tiers.items() if b},
        "optimizer_state_bytes_per_rank": int(max_over_ranks(run.state_bytes())),
        "peak_mem_bytes": int(max_over_ranks(peak)),
        "final_loss": mean_over_ranks(out["loss"]),
        "loss_curve_rank_mean": mean_list_over_ranks(out["losses"]),
        **run.report(),
    }
    finish_rank(run_dir, rank, result)
