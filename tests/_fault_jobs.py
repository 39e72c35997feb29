"""One rank of a fault-injection or emulator-fidelity job (tests/test_faults.py, tests/test_emulator_fidelity.py).

Run as ``python tests/_fault_jobs.py JOB RANK WORLD DIR TIMEOUT_S`` (:func:`run_ranks` starts them
through tests/_ranks.py): each rank its own process, so a test sees every rank's exit code and
stderr. The faults come from ``CPDPKIT_FAULTS`` (set by the test), as a launched rank gets them.
A rank ends like the CLI does: a ``CpdpkitError`` is one line on stderr and exit code 2; anything
else would be a traceback (which the tests refuse).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cpdpkit.emulator import init_distributed, meter
from cpdpkit.emulator.metering import makespan_s
from cpdpkit.errors import CpdpkitError
from cpdpkit.topology import Tier, TopologySpec

# Two sites of up to 2 ranks: a 5 ms WAN keeps every collective short and still far above gloo's own time.
TOPOLOGY = TopologySpec(
    name="fault-wan",
    tiers=(Tier(name="LAN", latency_s=1e-3, bandwidth_bytes_per_s=1e9),
           Tier(name="WAN", latency_s=5e-3, bandwidth_bytes_per_s=100e6)),
    intra_node_tier="LAN", inter_site_tier="WAN", ranks_per_node=None, nodes_per_site=1, num_sites=2,
)
NUM_STEPS = 8
NUM_BYTES = 4096
CONTEND_BYTES = 1 << 20
LATE_S, P2P_LATE_S = 0.08, 0.05  # how late rank 1 arrives in the skew job


# The rank's own CLOCK_MONOTONIC stamps (one clock for every process of the machine): the fault plan's
# origin, the issue of its latest collective; on a one-line error also when it was raised.
_STAMPS: dict[str, float | None] = {}


@dataclass
class RankRun:
    returncode: int
    stderr: str
    ended_after_s: float  # after the start of the processes: start-up included
    result: dict[str, Any] | None
    stamps: dict[str, float | None] | None  # a rank that ended with a one-line error: _STAMPS and "error_s"


def run_ranks(job: str, tmp_path: Path, *, faults: str = "", timeout_s: float = 10.0, world: int = 2,
              wall_s: float = 60.0) -> list[RankRun]:
    """Start ``world`` rank processes of ``job`` (the test process's side: this file as a script per
    rank); each one's exit code, stderr, end time and result. A rank still running after ``wall_s``
    fails the test as a hang."""
    from _ranks import run_processes

    env = {**os.environ, "CPDPKIT_FAULTS": faults, "OMP_NUM_THREADS": "1"}
    ended = run_processes([[sys.executable, __file__, job, str(r), str(world), str(tmp_path), str(timeout_s)]
                           for r in range(world)], wall_s=wall_s, env=env)
    runs = []
    for r, end in enumerate(ended):
        out, stamps = tmp_path / f"rank{r}.json", tmp_path / f"rank{r}.error.json"
        runs.append(RankRun(end.returncode, end.output, end.ended_after_s,
                            json.loads(out.read_text()) if out.exists() else None,
                            json.loads(stamps.read_text()) if stamps.exists() else None))
    return runs


def _train(rank: int, steps: int) -> dict[str, Any]:
    """``steps`` all-reduces of a gradient-sized tensor, each timed and metered on its own."""
    torch.manual_seed(0)
    param = torch.zeros(NUM_BYTES // 4)
    calls = []
    for step in range(steps):
        grad = torch.full_like(param, float(rank + step))
        with meter() as m:
            issue_s, t0 = time.monotonic(), time.perf_counter()
            _STAMPS["issue_s"] = issue_s
            dist.all_reduce(grad)
            done_s = time.monotonic()
            calls.append({"elapsed_s": time.perf_counter() - t0, "issue_s": issue_s, "done_s": done_s,
                          "modeled_s": sum(m.modeled_s_by_tier.values()), "blocked_s": m.blocked_s})
        param -= 0.1 * grad
    return {"calls": calls, "param_sum": float(param.sum())}


def _timed(issue: Callable[[], list[Any]], gloo: Any, *, group: int = 0, late_s: float = 0.0,
           first: bool = False) -> dict[str, float]:
    """One timed collective, two ways: ``wall_s``, its makespan on the wall clock (:func:`makespan_s`:
    what the model bounds from below; the load of the moment only adds to it), and ``schedule_s``, the
    end the emulator scheduled for its last member less the last member's issue, both stamped by the
    issuing threads' own calls on the host's CLOCK_MONOTONIC (what the model bounds from above: a
    rank descheduled before its issue, or woken late after the end, moves neither stamp's difference).

    ``issue()`` issues this rank's collectives with ``async_op=True`` and returns their Works (none
    when this rank takes no part)."""
    stamps: list[tuple[float, float]] = []

    def run() -> None:
        for work in issue():
            work.wait()
            stamps.append((work._booking.issued_s, work._booking.end_s))  # the emulated Work's own stamps

    wall_s = makespan_s(run, gloo, group=group, late_s=late_s, first=first)
    mine = torch.tensor([max(s) for s in zip(*stamps)] if stamps else [float("nan")] * 2, dtype=torch.float64)
    every = [torch.zeros(2, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine, group=gloo)
    rows = [t.tolist() for t in every if not t.isnan().any()]
    return {"wall_s": wall_s, "schedule_s": max(end for _, end in rows) - max(issued for issued, _ in rows)}


def _skew(rank: int, gloo: Any) -> dict[str, Any]:
    """Rank 1 arrives 80 ms late at an all-reduce of the world, then 50 ms late at a send to rank 0."""
    x = torch.ones(NUM_BYTES // 4)
    dist.all_reduce(x)  # warm-up
    # the first rank to complete: an on-time rank (before issue 15 it did not wait for the late one)
    out = {name: _timed(lambda: [dist.all_reduce(x, async_op=True)], gloo, late_s=late_s if rank == 1 else 0.0,
                        first=True)
           for name, late_s in (("on_time", 0.0), ("late", LATE_S))}

    def p2p() -> list[Any]:
        return [dist.isend(x, 0)] if rank == 1 else [dist.irecv(x, 1)] if rank == 0 else []

    out["p2p"] = _timed(p2p, gloo, group=0 if rank < 2 else -1, late_s=P2P_LATE_S if rank == 1 else 0.0, first=True)
    return out


def _contend(rank: int, gloo: Any) -> dict[str, Any]:
    """2 nodes x 2 ranks: the groups {0, 2} and {1, 3} cross the same two node uplinks."""
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mine = pairs[rank % 2]
    x = torch.ones(CONTEND_BYTES // 4)
    dist.all_reduce(x, group=mine)  # warm-up

    def alone() -> list[Any]:
        return [dist.all_reduce(x, group=mine, async_op=True)] if rank % 2 == 0 else []

    return {"alone": _timed(alone, gloo, group=0 if rank % 2 == 0 else -1),
            "together": _timed(lambda: [dist.all_reduce(x, group=mine, async_op=True)], gloo, group=rank % 2),
            # the world: 2 levels (LAN inside a site, WAN between), priced hierarchically
            "world": _timed(lambda: [dist.all_reduce(x, async_op=True)], gloo)}


def main(job: str, rank: int, world: int, folder: str, timeout_s: float) -> None:
    torch.set_num_threads(1)
    info = init_distributed(topology=TOPOLOGY, init_method=f"file://{folder}/store", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    group = dist.group.WORLD
    result: dict[str, Any] = {"group_name": group.group_name}
    faults = group._session.faults
    result["fault_origin_s"] = _STAMPS["fault_origin_s"] = faults.start_s if faults is not None else None
    if job == "train":
        result.update(_train(rank, NUM_STEPS))
    elif job == "train_long":
        result.update(_train(rank, 10 * NUM_STEPS))
    else:
        gloo = dist.new_group(backend="gloo")  # job "fidelity"
        result.update(_skew(rank, gloo))
        if world == 4:
            result.update(_contend(rank, gloo))
        dist.barrier(gloo)
    result["world_size"] = info.world_size
    Path(folder, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], float(sys.argv[5]))
    except CpdpkitError as exc:
        error_s = time.monotonic()
        Path(sys.argv[4], f"rank{sys.argv[2]}.error.json").write_text(json.dumps({**_STAMPS, "error_s": error_s}))
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
