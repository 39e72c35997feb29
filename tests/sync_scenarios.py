"""Per-rank scenario functions for the sync tests (run by tests/_ranks.py run_ranks).

Each returns plain tensors/values so the test process can compare them with the reference
in tests/sync_reference.py or with torch's own peers.
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cpdpkit.sync import PeriodicSyncOptimizer, SyncConfig, hierarchical_groups
from sync_reference import Workload, batch, make_model, make_optimizer


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _train(opt: PeriodicSyncOptimizer, model: nn.Module, rank: int, steps: range,
           snapshots: list | None = None, sched: Any = None) -> None:
    for n in steps:
        model.train()
        opt.zero_grad()
        x, y = batch(rank, n)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if sched is not None:
            sched.step()
        if snapshots is not None and opt.config.averages_parameters(n):
            snapshots.append((n, _params(model)))


def run_workloads(rank: int, world: int, workloads: list[dict], hierarchical: bool = False) -> list:
    """Train every workload; return final params and post-reconciliation snapshots."""
    out = []
    groups = hierarchical_groups(2) if hierarchical else (None, None)
    for spec in workloads:
        w = Workload(**spec)
        model = make_model(0, w.batchnorm)
        if rank != 0:  # construction must make ranks identical (broadcast from rank 0)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
        opt = PeriodicSyncOptimizer(
            make_optimizer(w.optimizer, model), model=model, strategy=w.strategy,
            period=None if w.strategy == "ddp" else w.period, warmup_steps=w.warmup_steps, slowmo_momentum=w.beta,
            slowmo_lr=w.alpha, buffers=w.buffers, optimizer_state=w.optimizer_state,
            overlap_steps=w.overlap_steps, fast_group=groups[0], slow_group=groups[1], timeout_s=60,
            cpdp_order=w.cpdp_order,
        )
        snaps: list = []
        _train(opt, model, rank, range(1, w.steps + 1), snaps)
        out.append({"params": _params(model), "buffers": [b.clone() for b in model.buffers()],
                    "snapshots": snaps, "stats": opt.stats.to_dict()})
    return out


def against_torch_peers(rank: int, world: int, optimizer: str, period: int) -> dict:
    """ddp vs torch DDP and localsgd vs torch PostLocalSGDOptimizer, on the same data."""
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    steps = range(1, 3 * period + 2)
    results: dict[str, Any] = {}
    # ddp: ours on a plain module vs torch's DDP
    ours = make_model(0)
    opt = PeriodicSyncOptimizer(make_optimizer(optimizer, ours), model=ours, strategy="ddp")
    _train(opt, ours, rank, steps)
    peer = DDP(make_model(0))
    peer_opt = make_optimizer(optimizer, peer)
    for n in steps:
        peer_opt.zero_grad()
        x, y = batch(rank, n)
        nn.functional.mse_loss(peer(x), y).backward()
        peer_opt.step()
    results["ddp"] = (_params(ours), _params(peer.module))
    # localsgd: ours vs PostLocalSGDOptimizer(PeriodicModelAverager(K, warmup K-1))
    ours = make_model(0)
    opt = PeriodicSyncOptimizer(make_optimizer(optimizer, ours), model=ours,
                                strategy="localsgd", period=period)
    _train(opt, ours, rank, steps)
    peer_model = make_model(0)
    peer_opt = PostLocalSGDOptimizer(
        make_optimizer(optimizer, peer_model),
        PeriodicModelAverager(period=period, warmup_steps=period - 1),
    )
    for n in steps:
        peer_opt.zero_grad()
        x, y = batch(rank, n)
        nn.functional.mse_loss(peer_model(x), y).backward()
        peer_opt.step()
    results["localsgd"] = (_params(ours), _params(peer_model))
    return results


def ddp_wrapped_vs_plain(rank: int, world: int, strategy: str, period: int) -> dict:
    """The same strategy on a DDP-wrapped module and on the plain module."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    steps = range(1, 3 * period + 1)
    plain = make_model(0)
    opt = PeriodicSyncOptimizer(make_optimizer("sgd", plain), model=plain,
                                strategy=strategy, period=period, warmup_steps=2)
    _train(opt, plain, rank, steps)
    wrapped = DDP(make_model(0))
    opt2 = PeriodicSyncOptimizer(make_optimizer("sgd", wrapped), model=wrapped,
                                 strategy=strategy, period=period, warmup_steps=2)
    _train(opt2, wrapped, rank, steps)
    return {"plain": _params(plain), "ddp": _params(wrapped.module),
            "stats_plain": opt.stats.to_dict(), "stats_ddp": opt2.stats.to_dict()}


def checkpoint_resume(rank: int, world: int, strategy: str, stop_at: int, total: int,
                      overlap_steps: int = 0, batchnorm: bool = False) -> dict:
    """An uninterrupted run vs one saved at ``stop_at`` and resumed in fresh objects (the
    config= form, and the LR scheduler attached to the wrapper)."""
    def build():
        model = make_model(0, batchnorm)
        opt = PeriodicSyncOptimizer(make_optimizer("adamw", model), model=model,
                                    config=SyncConfig(strategy=strategy, period=3,
                                                      warmup_steps=1, overlap_steps=overlap_steps))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
        return model, opt, sched

    model, opt, sched = build()
    _train(opt, model, rank, range(1, total + 1), sched=sched)
    straight = _params(model)

    model, opt, sched = build()
    _train(opt, model, rank, range(1, stop_at + 1), sched=sched)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "sched": sched.state_dict()}, buf)
    del model, opt, sched
    model, opt, sched = build()  # fresh objects, as after a restart
    ckpt = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    model.load_state_dict(ckpt["model"])
    if strategy == "slowmo":  # code that replaces .data: the wrapper must re-bind its flat buffer
        for p in model.parameters():
            p.data = p.data.clone()
    opt.load_state_dict(ckpt["opt"])
    sched.load_state_dict(ckpt["sched"])
    _train(opt, model, rank, range(stop_at + 1, total + 1), sched=sched)
    return {"straight": straight, "resumed": _params(model), "step": opt.step_count,
            "saved_keys": sorted(ckpt["opt"]), "saved_step": ckpt["opt"]["cpdpkit"]["step"],
            "lr": opt.optim.param_groups[0]["lr"],
            "saved_in_flight": ckpt["opt"]["cpdpkit"]["in_flight"] is not None}


def auto_period(rank: int, world: int, runs: list[dict]) -> list[dict]:
    """``period="auto"`` runs: per step the kind and this rank's parameters after the inner step (before
    any averaging) and after the whole step (an overlapped launch sends these: a pending average is
    applied first); the decisions; the labelled spans of the run."""
    out = []
    for options in runs:
        model = make_model(0)
        inner = make_optimizer("sgd", model)
        snapshots: dict[int, list[torch.Tensor]] = {}
        options = {"strategy": "cpdp", **options}
        opt = PeriodicSyncOptimizer(inner, model=model, period="auto", timeout_s=60, **options)
        def snapshot(*_: Any, opt=opt, model=model, snapshots=snapshots) -> None:
            snapshots[opt.step_count + 1] = _params(model)

        inner.register_step_post_hook(snapshot)
        kinds = []
        after_step: dict[int, list[torch.Tensor]] = {}
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for n in range(1, 25):
                kinds.append(opt.next_step_kind().value)
                _train(opt, model, rank, range(n, n + 1))
                after_step[n] = _params(model)
        names = sorted({e.name for e in prof.events() if e.name.startswith("cpdpkit::sync::")})
        stats = opt.stats.to_dict()
        out.append({"kinds": kinds, "snapshots": snapshots, "after_step": after_step, "stats": stats, "names": names,
                    "params": _params(model)})
    return out


def with_scheduler(rank: int, world: int, strategy: str) -> dict[str, list[torch.Tensor]]:
    """Two param groups and an LR scheduler attached to the inner optimizer or the wrapper."""
    out = {}
    for attach in ("inner", "wrapper"):
        model = make_model(0)
        inner = make_optimizer("sgd2groups", model)
        opt = PeriodicSyncOptimizer(inner, model=model, strategy=strategy, period=2)
        sched = torch.optim.lr_scheduler.StepLR(inner if attach == "inner" else opt,
                                                step_size=3, gamma=0.5)
        _train(opt, model, rank, range(1, 9), sched=sched)
        out[attach] = _params(model)
    return out


def bad_input(rank: int, world: int) -> dict:
    """Errors that need a process group: each returns its message instead of hanging."""
    out: dict[str, str] = {}
    model = make_model(0)
    only_zero = dist.new_group([0])
    try:
        PeriodicSyncOptimizer(make_optimizer("sgd", model), model=model, group=only_zero)
        out["group"] = "no error"
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        out["group"] = f"{type(exc).__name__}: {exc}"
    try:
        PeriodicSyncOptimizer(make_optimizer("sgd", model), model=model, strategy="cpdp",
                              period=2 if rank == 0 else 4)
        out["mismatch"] = "no error"
    except Exception as exc:  # noqa: BLE001
        out["mismatch"] = f"{type(exc).__name__}: {exc}"
    return out


def stats_and_buckets(rank: int, world: int) -> dict:
    """Collectives per reconciliation with a model bigger than one bucket."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])  # ~2 MB of fp32
    opt = PeriodicSyncOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model=model,
                                strategy="cpdp", period=4, bucket_cap_mb=1.0)
    counts = []
    for n in range(1, 9):
        before = opt.stats
        opt.zero_grad()
        model(torch.randn(4, 256)).sum().backward()
        opt.step()
        after = opt.stats
        counts.append((n, after.collectives - before.collectives,
                       after.bytes_sent - before.bytes_sent))
    return {"counts": counts, "stats": opt.stats.to_dict(),
            "param_bytes": sum(p.numel() * 4 for p in model.parameters())}


def as_dict(w: Workload) -> dict:
    return dataclasses.asdict(w)


def profiled_labels(rank: int, world: int) -> dict:
    """Profile a few cpdp steps: which cpdpkit::sync labels appear, and where bucket launches
    happen relative to backward (they must start inside it: overlap, as DDP)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    opt = PeriodicSyncOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model=model,
                                strategy="cpdp", period=2, bucket_cap_mb=0.3)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(4):
            opt.zero_grad()
            loss = model(torch.randn(8, 256)).sum()
            with record_function("test::backward"):
                loss.backward()
            opt.step()
    events = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()]
    return {"names": sorted({n for n, _, _ in events if n.startswith("cpdpkit::")}),
            "backward": [(s, e) for n, s, e in events if n == "test::backward"],
            "launches": [(s, e) for n, s, e in events if n == "cpdpkit::sync::grad_allreduce"]}


def emulated_vs_plain(rank: int, world: int) -> dict:
    """cpdp (plain module) and localsgd (DDP-wrapped) over an emulated WAN group vs gloo."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from cpdpkit.emulator import EmulatorConfig, meter, register_emulated_backend
    from cpdpkit.topology import preset

    register_emulated_backend(EmulatorConfig(topology=preset("wan", world_size=world)))
    emu = dist.new_group(backend="emu")
    out: dict[str, Any] = {}
    with meter(emu) as m:  # the default group is gloo: meter the emu group's session
        for label, group in (("gloo", None), ("emu", emu)):
            model = make_model(0, batchnorm=True)
            opt = PeriodicSyncOptimizer(make_optimizer("adamw", model), model=model, strategy="cpdp",
                                        period=2, warmup_steps=1, group=group)
            _train(opt, model, rank, range(1, 6))
            wrapped = DDP(make_model(0), process_group=group)
            opt2 = PeriodicSyncOptimizer(make_optimizer("sgd", wrapped), model=wrapped,
                                         strategy="localsgd", period=2, group=group)
            _train(opt2, wrapped, rank, range(1, 6))
            out[label] = (_params(model), [b.clone() for b in model.buffers()], _params(wrapped.module))
    out["emulated_ops"] = m.op_counts
    return out


def overlap_and_auto(rank: int, world: int, overlap: list[dict], auto_runs: list[dict]) -> dict:
    """tests/test_sync_overlap_auto.py's whole job: overlap workloads, checkpoints with a
    reconciliation in flight, and period="auto" runs."""
    return {
        "overlap": run_workloads(rank, world, overlap),
        # stopped with an average in flight: cpdp (average-then-step) launches at 3, 6, ...; slowmo at 4, 7, ...
        "checkpoint": [checkpoint_resume(rank, world, strategy=s, stop_at=stop, total=12,
                                         overlap_steps=2, batchnorm=bn)
                       for s, bn, stop in (("cpdp", False, 6), ("slowmo", True, 5))],
        "auto": auto_period(rank, world, auto_runs),
    }
