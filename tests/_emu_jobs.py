"""Multi-process jobs for tests/test_emulator*.py (spawned once, checked by several tests).

Each job runs on every rank, with the default process group on the emulated backend and a
plain gloo group beside it for references and fast barriers, and saves ``rank<R>.pt``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch._C._profiler import _ExperimentalConfig

from _ranks import run_spawned
from cpdpkit.emulator import EmulatorConfig, init_distributed, meter, register_emulated_backend
from cpdpkit.emulator.metering import timed_runs
from cpdpkit.topology import Tier, TopologySpec

# Modeled times of 30-145 ms (latency and bandwidth terms both matter) dwarf gloo's own time and CPU noise.
TEST_TOPOLOGY = TopologySpec(
    name="test-wan",
    tiers=(
        Tier(name="LAN", latency_s=2e-3, bandwidth_bytes_per_s=1e9),
        Tier(name="WAN", latency_s=25e-3, bandwidth_bytes_per_s=100e6),
    ),
    intra_node_tier="LAN",
    inter_site_tier="WAN",
    ranks_per_node=None,
    nodes_per_site=1,
    num_sites=2,
)
# The same link varying per collective (as the wan-variable preset): all-reduces of 40-81 ms.
JITTER_TOPOLOGY = replace(TEST_TOPOLOGY, name="test-wan-variable", tiers=(
    TEST_TOPOLOGY.tier("LAN"),
    replace(TEST_TOPOLOGY.tier("WAN"), latency_jitter_frac=0.3, bandwidth_jitter_frac=0.5),
))
JITTER_SEED = 11
NUM_JITTER_CALLS = 4
TIMED_BYTES = 1024 * 1024
FOUR_RANK_BYTES = 1024 * 1024
NUM_TIMED_RUNS = 5
OVERLAP_COMPUTE_S = 0.05  # a busy loop until this much wall time has passed
METER_BYTES = 1024
CALL_LABEL = "test::all_reduce_call"


def spawn_job(job: str, world_size: int, tmp_path: Path, timeout_s: float = 150.0) -> list[dict[str, Any]]:
    """Run ``job`` on ``world_size`` spawned ranks and return each rank's result."""
    out = tmp_path / job
    out.mkdir()
    return run_spawned(_entry, (job, world_size, str(out)), world_size, out, timeout_s)


def _entry(rank: int, job: str, world_size: int, out: str) -> None:
    torch.set_num_threads(1)
    init_distributed(topology=TEST_TOPOLOGY, init_method=f"file://{out}/store", rank=rank,
                     world_size=world_size)
    gloo = dist.new_group(backend="gloo")
    with meter() as m:
        result = JOBS[job](rank, world_size, gloo, out)
    result["op_counts"] = m.op_counts
    torch.save(result, Path(out, f"rank{rank}.pt"))
    dist.barrier(gloo)
    dist.destroy_process_group()


# ---- checks ------------------------------------------------------------------------------------
def _timed_runs(op: Callable[[], Any], gloo: Any) -> list[float]:
    """Seconds of each of ``NUM_TIMED_RUNS`` runs of ``op``, each timed from this rank's exit of a barrier."""
    return timed_runs(op, gloo, NUM_TIMED_RUNS)


def _scheduled_runs(issue: Callable[[], Any], gloo: Any) -> dict[str, list[float]]:
    """Each of ``NUM_TIMED_RUNS`` runs of the collective ``issue()`` issues (``async_op=True``), two ways:
    ``wall_s``, timed from this rank's exit of a barrier on ``gloo`` (the model bounds it from below;
    load only adds to it), and ``schedule_s``, the end the emulator scheduled less the last rank's issue,
    both stamped by the issuing threads' own calls on the host's CLOCK_MONOTONIC (the model bounds it
    from above: neither a late issue nor a late wake-up moves that difference)."""
    stamps = []

    def run() -> None:
        work = issue()
        work.wait()
        stamps.append((work._booking.issued_s, work._booking.end_s))  # the emulated Work's own stamps

    wall_s = _timed_runs(run, gloo)
    mine = torch.tensor(stamps, dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine, group=gloo)
    stacked = torch.stack(every)  # rank, run, (issue, end)
    return {"wall_s": wall_s, "schedule_s": (stacked[:, :, 1].amax(0) - stacked[:, :, 0].amax(0)).tolist()}


def collective_times(world: int, gloo: Any, num_bytes: int = TIMED_BYTES) -> dict[str, dict[str, list[float]]]:
    """Every run of all_reduce, all_gather and reduce_scatter of ``num_bytes`` on the emulated world
    (:func:`_scheduled_runs`)."""
    n = num_bytes // 4
    x = torch.ones(n)
    gathered = torch.empty(n)
    scattered = torch.empty(n // world)
    return {
        "all_reduce": _scheduled_runs(lambda: dist.all_reduce(x, async_op=True), gloo),
        "all_gather": _scheduled_runs(
            lambda: dist.all_gather_into_tensor(gathered, torch.ones(n // world), async_op=True), gloo),
        "reduce_scatter": _scheduled_runs(lambda: dist.reduce_scatter_tensor(scattered, x, async_op=True), gloo),
    }


def _busy_compute(seconds: float) -> None:
    a = torch.randn(64, 64)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


def overlap_times(gloo: Any) -> dict[str, Any]:
    """Every run of a step that computes (a busy loop of OVERLAP_COMPUTE_S) while an all-reduce runs."""
    x = torch.ones(TIMED_BYTES // 4)

    def step() -> None:
        work = dist.all_reduce(x, async_op=True)
        _busy_compute(OVERLAP_COMPUTE_S)
        work.wait()

    return {"step_s": _timed_runs(step, gloo)}


def _train(model: torch.nn.Module, rank: int, steps: int,
           sync: Callable[[torch.nn.Module], None] | None) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * rank + step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        if sync is not None:
            sync(model)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                               torch.nn.ReLU(), torch.nn.Linear(64, 4))


def ddp_and_allreduce_identical(rank: int, world: int, gloo: Any) -> dict[str, bool]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    def ddp(group: Any) -> list[torch.Tensor]:
        return _train(DDP(_mlp(), process_group=group, bucket_cap_mb=0.01), rank, 3, None)

    def allreduce_sync(group: Any) -> Callable[[torch.nn.Module], None]:
        def sync(model: torch.nn.Module) -> None:
            works = [dist.all_reduce(p.grad, group=group, async_op=True) for p in model.parameters()]
            for w, p in zip(works, model.parameters()):
                w.wait()
                p.grad /= world
        return sync

    plain_emu = _train(_mlp(), rank, 3, allreduce_sync(dist.group.WORLD))
    plain_gloo = _train(_mlp(), rank, 3, allreduce_sync(gloo))
    with meter() as m:
        ddp_emu = ddp(dist.group.WORLD)
    return {
        "ddp_counts": m.op_counts,
        "ddp_identical": all(torch.equal(a, b) for a, b in zip(ddp_emu, ddp(gloo))),
        "allreduce_identical": all(torch.equal(a, b) for a, b in zip(plain_emu, plain_gloo)),
    }


def hsdp_identical(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def run(mesh: Any) -> list[torch.Tensor]:
        model = _mlp()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        _train(model, rank, 3, None)
        return [p.full_tensor() for p in model.parameters()]

    names = ("replicate", "shard")
    emu_mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=names)
    gloo_mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=names,
                                 backend_override={"replicate": "gloo", "shard": "gloo"})
    tiers = {d: getattr(emu_mesh.get_group(d), "tier_name", None) for d in names}
    kinds = {d: type(gloo_mesh.get_group(d)).__name__ for d in names}
    with meter() as m:
        emu = run(emu_mesh)
    return {"hsdp_identical": all(torch.equal(a, b) for a, b in zip(emu, run(gloo_mesh))),
            "hsdp_tiers": tiers, "hsdp_reference_groups": kinds, "hsdp_counts": m.op_counts}


def every_path(rank: int, world: int) -> dict[str, Any]:
    """Issue each collective kind once under a profiler; count gloo, c10d and emu events."""
    n = 8
    all_threads = _ExperimentalConfig(profile_all_threads=True)
    with meter() as m, torch.profiler.profile(experimental_config=all_threads) as prof:
        t = torch.full((n,), float(rank))
        dist.broadcast(t, src=0)
        dist.barrier()
        dist.all_reduce(t)
        dist.all_gather([torch.empty(n) for _ in range(world)], t)
        dist.all_gather_into_tensor(torch.empty(n * world), t)
        dist.reduce_scatter(torch.empty(n), [torch.ones(n) for _ in range(world)])
        dist.reduce_scatter_tensor(torch.empty(n), torch.ones(n * world))
        dist.all_to_all_single(torch.empty(n * world), torch.ones(n * world))
        dist.all_reduce(t, async_op=True).wait()
        peer = rank ^ 1
        if rank % 2 == 0:
            dist.send(t, dst=peer)
        else:
            dist.recv(t, src=peer)
        dist.barrier()
    events = [e for e in prof.events() if e.name.startswith(("gloo:", "c10d::", "cpdpkit::emu::"))]
    kinds = Counter(e.name.split("[")[0] for e in events)
    return {
        "path_counts": m.op_counts,
        "num_gloo_events": sum(v for k, v in kinds.items() if k.startswith("gloo:")),
        "num_c10d_events": sum(v for k, v in kinds.items() if k.startswith("c10d::")),
        "num_emu_events": sum(v for k, v in kinds.items() if k.startswith("cpdpkit::emu::")),
        "event_kinds": dict(kinds),
    }


def profiler_events(rank: int, out: str, gloo: Any) -> dict[str, Any]:
    """One all-reduce under each profiler mode; return the emu event as exported in the trace."""
    x = torch.ones(TIMED_BYTES // 4)
    found: dict[str, Any] = {}
    for mode, config in (("all_threads", _ExperimentalConfig(profile_all_threads=True)), ("default", None)):
        kwargs = {"experimental_config": config} if config is not None else {}
        with torch.profiler.profile(**kwargs) as prof:
            dist.barrier(gloo)  # the event runs from this rank's arrival: arrive together
            with torch.profiler.record_function(CALL_LABEL):  # the call, timed by the profiler's own clock
                dist.all_reduce(x)
        path = os.path.join(out, f"trace-{mode}-{rank}.json")
        prof.export_chrome_trace(path)
        trace = json.loads(Path(path).read_text())
        names = {(e.get("pid"), e.get("tid")): e["args"]["name"] for e in trace["traceEvents"]
                 if e.get("ph") == "M" and e.get("name") == "thread_name"}
        emu = [e for e in trace["traceEvents"] if e.get("name", "").startswith("cpdpkit::emu::")]
        (call_us,) = [e["dur"] for e in trace["traceEvents"] if e.get("name") == CALL_LABEL]
        found[mode] = [{"name": e["name"], "dur_us": e["dur"], "cat": e.get("cat"),
                        "thread": names.get((e.get("pid"), e.get("tid")), str(e.get("tid"))),
                        "on_issuing_thread": e.get("tid") == threading.get_native_id(),
                        "call_us": call_us} for e in emu]
    return found


def counters(gloo: Any) -> dict[str, Any]:
    """What one synchronous 1 MiB all-reduce adds to the per-tier byte and blocked-time counters."""
    x = torch.ones(TIMED_BYTES // 4)
    dist.barrier(gloo)
    with meter() as m:
        start_s = time.monotonic()
        dist.all_reduce(x)
        call_s = time.monotonic() - start_s
    return {"tier_bytes": m.bytes_by_tier, "blocked_s": m.blocked_s, "modeled_s": m.modeled_s_by_tier,
            "call_s": call_s}


def meter_semantics() -> dict[str, Any]:
    """Nested meters, a group created inside the block, and a collective waited on by another thread."""
    x = torch.ones(METER_BYTES // 4)
    with meter() as outer:
        dist.all_reduce(x)
        sub = dist.new_group([0, 1])  # created inside the block: counts from zero
        dist.barrier(group=sub)  # a new group's first collective may pay for set-up in its issue
        with meter() as inner:
            start_s = time.monotonic()
            dist.all_reduce(x, group=sub)
            all_reduce_call_s = time.monotonic() - start_s
            other = threading.Thread(target=lambda: dist.broadcast(x, src=0, group=sub))
            other.start()
            other.join()  # its wait blocks the other thread, not this one
    return {"meter_outer_ops": outer.op_counts, "meter_inner_ops": inner.op_counts,
            "meter_inner_bytes": inner.bytes_by_tier, "meter_inner_blocked_s": inner.blocked_s,
            "meter_all_reduce_call_s": all_reduce_call_s}


def jittered_collectives(rank: int, world: int, gloo: Any) -> dict[str, Any]:
    """On a group of JITTER_TOPOLOGY: the time each all-reduce booked (its own draw) and took, and
    what a send and its recv booked. The default emulator configuration is restored after."""
    register_emulated_backend(EmulatorConfig(topology=JITTER_TOPOLOGY.place(world), jitter_seed=JITTER_SEED))
    try:
        group = dist.new_group(backend="emu")
        x = torch.ones(TIMED_BYTES // 4)
        calls = []
        for _ in range(NUM_JITTER_CALLS):
            dist.barrier(gloo)
            with meter(group) as m:
                t0 = time.monotonic()
                dist.all_reduce(x, group=group)
                done_s = time.monotonic()
            starts = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
            dist.all_gather(starts, torch.tensor([t0], dtype=torch.float64), group=gloo)
            # from the later rank's issue (one monotonic clock for the host's processes)
            calls.append({"measured_s": done_s - max(float(t) for t in starts), "modeled_s": m.modeled_s_by_tier})
        with meter(group) as p2p:
            if rank == 0:
                dist.send(x, dst=1, group=group)
            elif rank == 1:
                dist.recv(x, src=0, group=group)
        return {"jitter_group_name": group.group_name, "jitter_calls": calls,
                "jitter_p2p_modeled_s": p2p.modeled_s_by_tier}
    finally:
        register_emulated_backend(EmulatorConfig(topology=TEST_TOPOLOGY.place(world)))


def collective_timeout(rank: int) -> dict[str, Any]:
    """Rank 1 skips an all-reduce on a group with a 2 s timeout: rank 0 must get an error."""
    from datetime import timedelta

    group = dist.new_group(timeout=timedelta(seconds=2))
    if rank != 0:
        return {}
    t0 = time.perf_counter()
    try:
        dist.all_reduce(torch.ones(4), group=group)
    except RuntimeError as exc:
        return {"timeout_error": str(exc).splitlines()[0][:200], "timeout_after_s": time.perf_counter() - t0}
    return {"timeout_error": None, "timeout_after_s": time.perf_counter() - t0}


def job_two_ranks(rank: int, world: int, gloo: Any, out: str) -> dict[str, Any]:
    result: dict[str, Any] = {"times": collective_times(world, gloo), "overlap": overlap_times(gloo)}
    result.update(ddp_and_allreduce_identical(rank, world, gloo))
    result.update(every_path(rank, world))
    result["profiler"] = profiler_events(rank, out, gloo)
    result.update(counters(gloo))
    result.update(meter_semantics())
    result.update(jittered_collectives(rank, world, gloo))
    result.update(collective_timeout(rank))
    return result


def job_four_ranks(rank: int, world: int, gloo: Any, out: str) -> dict[str, Any]:
    result: dict[str, Any] = {"times": collective_times(world, gloo, num_bytes=FOUR_RANK_BYTES)}
    result.update(hsdp_identical(rank, world))
    result.update(every_path(rank, world))
    return result


COMPRESSION_STEPS, COMPRESSION_PERIOD = 8, 4


def job_compression(rank: int, world: int, gloo: Any, out: str) -> dict[str, Any]:
    """Compressed reconciliations over the emulated WAN: the bytes the emulator counted for each codec."""
    from cpdpkit.sync import PeriodicSyncOptimizer  # the sync package only where a job uses it

    result: dict[str, Any] = {}
    for codec in ("none", "bf16", "int8", "topk:0.1"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 300), torch.nn.Tanh(), torch.nn.Linear(300, 4))
        opt = PeriodicSyncOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model=model, strategy="localsgd",
                                    period=COMPRESSION_PERIOD, compression=codec, timeout_s=60)
        with meter() as m:
            for n in range(1, COMPRESSION_STEPS + 1):
                g = torch.Generator().manual_seed(31 * n + rank)
                opt.zero_grad()
                model(torch.randn(16, 8, generator=g)).square().mean().backward()
                opt.step()
        result[codec] = {"ops": m.op_counts, "bytes": m.bytes_by_tier, "sent": opt.stats.bytes_sent,
                         "numel": sum(p.numel() for p in model.parameters())}
    return result


JOBS: dict[str, Callable[[int, int, Any, str], dict[str, Any]]] = {
    "compression": job_compression,
    "two_ranks": job_two_ranks,
    "four_ranks": job_four_ranks,
}
