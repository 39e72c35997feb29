"""The two-stage schedule of updated-parameter exchanges on the slow (replicate) link.

With optimizer-state sharding across the replicate axis, each replica reduce-scatters a unit's
gradient across replicas, updates only its slice, and all-gathers the updated parameters
across replicas before that unit's next forward. A partial plan (``param_sharding =
"replicated"``) does the same on the replicate link with each unit's node slice
(``ceil(numel/S)`` elements): the cross-node level of its world-group reduce-scatter and
all-gather is the exchange scheduled here (their in-node level runs on the fast tier).

Issued naively (every all-gather after backward) that exchange is a long tail: the first units'
gradients are ready last in backward, yet their parameters are needed first in the next
forward. This module decides, per unit, when its exchange runs on the slow link.

**Timeline model** (one step; t = 0 at the start of backward; all times in seconds):

* Backward runs the units in reverse plan order; unit ``u``'s gradient is ready (``grad_ready_s``)
  when its backward compute ends. Backward ends at ``B`` = the sum of backward times.
* Its cross-replica gradient reduce-scatter occupies the slow link FIFO in ready order, as FSDP
  issues them, and is never delayed by an exchange (reduce-scatters have priority: they are fixed
  busy intervals computed first).
* Its update ends ``update_s`` after its reduce-scatter: the exchange is *released* then. The
  executors act only in their gradient-ready hooks, so (``at_points``, as :func:`plan_two_stage`
  builds every plan's schedule) a release during backward moves to the first gradient-ready point
  at or after it: the root unit (ready at the end of backward) and the last block before it can
  never be in stage 1 (the partial executor issues a unit's world-group reduce-scatter at the unit's
  own gradient-ready point; its in-node level is not modeled here).
* The next forward runs units in plan order; unit ``u``'s *deadline* is the time its forward
  starts when nothing waits: ``B`` + the forward times of the units before it.
* Each all-gather's duration is the α-β time of the replicate group's tier plus the tier's fixed
  ``collective_overhead_s`` (:meth:`cpdpkit.network.NetworkGroup.planned_s`, the same numbers as
  the plan's ``parameter all-gather`` phase; the emulator delays by the α-β part, the real
  collective under it pays the fixed part). One link, one transfer at a time.

**Algorithm: non-preemptive earliest-deadline-first with release times, backfilled into the
gaps between reduce-scatters.** Whenever the link is free, among exchanges already released
and that finish before the next reduce-scatter starts, the one with the earliest deadline
starts; if none fits, the link idles until the next reduce-scatter ends or the next release.
Why EDF: on one machine with release times and preemption, EDF (Horn's rule) meets every
deadline whenever any schedule can, and it minimises the maximum lateness; collectives cannot
be preempted, and the non-preemptive problem with release times is NP-hard (1|r_j|L_max), so
EDF is the standard greedy there. Backfilling a later-deadline exchange into a gap the
earliest one does not fit never delays anything: it ends before the reduce-scatter that closes
the gap, and the link would have idled. Once the last reduce-scatter is done the link is work
conserving in deadline order (= plan order), so every exchange ends no later than in the naive
schedule and the exposed tail is never worse than naive.

**Stages** are not chosen separately; they fall out of the start times: an exchange that ends
by the end of backward ran in link idle time during backward (stage 1), one that ends later
runs during the next forward (stage 2). The exposed time is simulated, not assumed: the forward
starts unit ``u`` at ``max(previous forward end, its exchange end)``; what that adds to the
forward's end is the exposed tail. The *naive* reference runs every exchange after backward and
the last reduce-scatter, in plan order, and starts the forward after the last one.
``lower_bound_exposed_s`` (max over units of release + transfer − deadline) is a floor no
schedule beats; the root unit (forward first, gradient last) usually sets it.

**Clipping** (``clip=True``). The executor clips by the exact global norm, speculatively: it
updates as above and checks the norm once every reduce-scatter is done. On a step where clipping
does not scale the gradient nothing changes, and that step is the model without ``clip``. On a
step where it does scale, no update may use an unscaled gradient: every unit's release becomes
the end of the *last* reduce-scatter + ``norm_s`` (one scalar all-reduce over the world;
:func:`plan_two_stage` prices 8 bytes over the world group) + ``update_s``. That release is
after backward ends, so stage 1 is lost that step: every exchange runs during the next forward.
``clip=True`` models that clipped step; a run's average lies between the two.

Not modeled: the shard-axis (fast tier) collectives, compute slowed by communication, and
per-unit update times that differ. Timings come from measurement or
:func:`estimate_unit_timings` (6·params·tokens FLOPs at a configurable rate).

The records (:class:`~cpdpkit.planner.timeline.TwoStageSchedule` and its parts) live in
:mod:`cpdpkit.planner.timeline`, which imports no algorithm, so a plan can carry a schedule.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from cpdpkit.planner.config import PlannerConfig, PlannerError, ceil_div
from cpdpkit.planner.plan import ShardingPlan
from cpdpkit.planner.timeline import (
    EPS_S,
    ExchangeSlot,
    LinkInterval,
    TwoStageSchedule,
    UnitTiming,
    check_seconds,
)
from cpdpkit.topology import Topology

__all__ = [
    "estimate_unit_timings",
    "compute_model",
    "unit_timing",
    "schedule_two_stage",
    "plan_two_stage",
    "exchange_schedule",
    "ALGORITHM",
    "DEFAULT_TOKENS_PER_RANK",
    "DEFAULT_FLOPS_PER_S",
]

ALGORITHM = "non-preemptive EDF with release times, reduce-scatters first, backfilled"
DEFAULT_TOKENS_PER_RANK = 4096  # one 4k-token sequence per rank per step
DEFAULT_FLOPS_PER_S = 125e12  # an A100's 312 TFLOP/s bf16 at 40 % MFU
_NORM_BYTES = 8  # the squared global norm: one fp64 (or two fp32) scalar all-reduced over the world


def compute_model(config: PlannerConfig) -> dict[str, float]:
    """:func:`estimate_unit_timings`' keyword arguments from a planner config (its defaults where unset)."""
    return {"tokens_per_rank": config.tokens_per_rank or DEFAULT_TOKENS_PER_RANK,
            "flops_per_s": config.flops_per_s or DEFAULT_FLOPS_PER_S}


def estimate_unit_timings(plan: ShardingPlan, *, tokens_per_rank: int = DEFAULT_TOKENS_PER_RANK,
                          flops_per_s: float = DEFAULT_FLOPS_PER_S) -> tuple[UnitTiming, ...]:
    """Per-unit compute from parameter counts: 6·params·tokens FLOPs, 1/3 forward, 2/3 backward.

    Every rank computes the whole unit on its own tokens (data parallel), so sharding does not
    divide it. Crude for embeddings (no matmul) and attention (quadratic in sequence length);
    pass measured :class:`UnitTiming` values to :func:`plan_two_stage` when you have them.
    """
    if not isinstance(tokens_per_rank, int) or isinstance(tokens_per_rank, bool) or tokens_per_rank < 1:
        raise PlannerError(f"tokens_per_rank = {tokens_per_rank!r} is invalid; use a whole number >= 1 (e.g. 4096)")
    if not isinstance(flops_per_s, (int, float)) or not math.isfinite(flops_per_s) or flops_per_s <= 0:
        raise PlannerError(f"flops_per_s = {flops_per_s!r} is invalid; use a positive rate such as 125e12")
    return tuple(unit_timing(u.name, u.numel, tokens_per_rank, flops_per_s) for u in plan.units)


def unit_timing(name: str, numel: int, tokens_per_rank: int, flops_per_s: float) -> UnitTiming:
    """One unit's estimate (:func:`estimate_unit_timings`' formula, inputs not checked)."""
    total_s = 6 * numel * tokens_per_rank / flops_per_s
    return UnitTiming(name=name, forward_s=total_s / 3, backward_s=2 * total_s / 3)


def _reduce_scatters(timings: Sequence[UnitTiming],
                     rs_s: Sequence[float]) -> tuple[list[float], list[tuple[float, float]]]:
    """Gradient-ready times and FIFO reduce-scatter intervals, both indexed by plan position."""
    n = len(timings)
    ready, rs = [0.0] * n, [(0.0, 0.0)] * n
    t = link = 0.0
    for i in reversed(range(n)):
        t += timings[i].backward_s
        ready[i] = t
        start = max(t, link)
        link = start + rs_s[i]
        rs[i] = (start, link)
    return ready, rs


def _at_points(release: list[float], ready: list[float], backward_s: float) -> list[float]:
    """Each release moved to the first gradient-ready point at or after it (an executor acts only in
    its hooks); a release after backward stays (``step()`` follows backward at once)."""
    points = sorted(ready)
    return [r if r > backward_s + EPS_S else next((p for p in points if p >= r - EPS_S), backward_s)
            for r in release]


def _edf(release: list[float], deadline: list[float], dur: list[float],
         busy: list[tuple[float, float]]) -> list[float]:
    """Start times: non-preemptive EDF with release times around fixed busy intervals."""
    busy = sorted(b for b in busy if b[1] > b[0])
    start = [math.nan] * len(release)
    todo = set(range(len(release)))
    t = 0.0
    while todo:
        inside = next((end for s, end in busy if s <= t + EPS_S < end), None)
        while inside is not None:  # the link is in a reduce-scatter (or back-to-back ones): wait
            t = inside
            inside = next((end for s, end in busy if s <= t + EPS_S < end), None)
        gap_end = next((s for s, _ in busy if s > t + EPS_S), math.inf)
        ready = [j for j in todo if release[j] <= t + EPS_S]
        fits = [j for j in ready if t + dur[j] <= gap_end + EPS_S]
        if fits:
            j = min(fits, key=lambda k: (deadline[k], k))
            start[j] = t
            t += dur[j]
            todo.discard(j)
            continue
        next_release = min((release[j] for j in todo if release[j] > t + EPS_S), default=math.inf)
        after_gap = next((end for s, end in busy if s >= gap_end - EPS_S), math.inf) if ready else math.inf
        t = min(next_release, after_gap)
        assert math.isfinite(t), "an exchange can always run after the last reduce-scatter"
    return start


def _forward_waits(ends: Sequence[float], forward: Sequence[float], begin_s: float) -> tuple[list[float], float]:
    """Per-unit wait of the next forward on its exchange, and the forward's end."""
    t, waits = begin_s, []
    for end, fwd in zip(ends, forward):
        waits.append(max(0.0, end - t))
        t = max(t, end) + fwd
    return waits, t


def schedule_two_stage(timings: Sequence[UnitTiming], *, reduce_scatter_s: Sequence[float],
                       all_gather_s: Sequence[float], num_bytes: Sequence[int], tier: str | None = None,
                       update_s: float = 0.0, clip: bool = False, norm_s: float = 0.0,
                       at_points: bool = False) -> TwoStageSchedule:
    """Schedule each unit's exchange; all sequences are in plan (forward) order, one per unit.

    ``clip=True`` models a step whose gradient clipping scales: every update waits for the last
    reduce-scatter and ``norm_s`` (module docstring). ``at_points=True``: an exchange starts no
    earlier than the first gradient-ready point after its release (the executors launch stage-1
    exchanges only in their hooks), as :func:`plan_two_stage` schedules.
    """
    n = len(timings)
    if n == 0 or not len(reduce_scatter_s) == len(all_gather_s) == len(num_bytes) == n:
        raise PlannerError(f"schedule_two_stage needs one timing, reduce-scatter time, all-gather time and byte "
                         f"count per unit (got {n}, {len(reduce_scatter_s)}, {len(all_gather_s)}, {len(num_bytes)})")
    check_seconds("update_s", update_s)
    check_seconds("norm_s", norm_s)
    for flag, value in (("clip", clip), ("at_points", at_points)):
        if not isinstance(value, bool):
            raise PlannerError(f"{flag} = {value!r} must be True or False")
    for i in range(n):
        check_seconds(f"reduce_scatter_s[{i}]", reduce_scatter_s[i])
        check_seconds(f"all_gather_s[{i}]", all_gather_s[i])
    ready, rs = _reduce_scatters(timings, reduce_scatter_s)
    backward_s = sum(t.backward_s for t in timings)
    forward = [t.forward_s for t in timings]
    deadline = [backward_s + sum(forward[:i]) for i in range(n)]
    if clip:  # the scaled step: the global norm needs every reduce-scatter, then one scalar all-reduce
        last_rs = max(end for _, end in rs)
        release = [last_rs + norm_s + update_s] * n
    else:
        release = [rs[i][1] + update_s for i in range(n)]
    if at_points:
        release = _at_points(release, ready, backward_s)
    dur = [float(x) for x in all_gather_s]
    start = _edf(release, deadline, dur, rs)
    end = [start[i] + dur[i] for i in range(n)]
    waits, makespan = _forward_waits(end, forward, backward_s)
    rank = {i: k for k, i in enumerate(sorted(range(n), key=lambda i: (start[i], i)))}
    slots = tuple(ExchangeSlot(
        unit=timings[i].name, num_bytes=int(num_bytes[i]), tier=tier, grad_ready_s=ready[i], release_s=release[i],
        deadline_s=deadline[i], duration_s=dur[i], start_s=start[i], end_s=end[i],
        stage=1 if end[i] <= backward_s + EPS_S else 2, order=rank[i], wait_s=waits[i]) for i in range(n))
    link = [LinkInterval(kind="reduce_scatter", unit=timings[i].name, start_s=rs[i][0], end_s=rs[i][1])
            for i in range(n)]
    link += [LinkInterval(kind="all_gather", unit=timings[i].name, start_s=start[i], end_s=end[i])
             for i in range(n)]
    link.sort(key=lambda x: (x.start_s, x.end_s))
    naive_exposed, naive_makespan = _naive(release, dur, rs, backward_s, sum(forward))
    return TwoStageSchedule(
        algorithm=ALGORITHM, tier=tier, update_s=float(update_s), backward_s=backward_s, forward_s=sum(forward),
        timings=tuple(timings), slots=slots, link_intervals=tuple(link), exposed_s=makespan - backward_s - sum(forward),
        makespan_s=makespan, naive_exposed_s=naive_exposed, naive_makespan_s=naive_makespan,
        lower_bound_exposed_s=max(0.0, max(release[i] + dur[i] - deadline[i] for i in range(n))),
        clip=clip, norm_s=float(norm_s) if clip else 0.0)


def _naive(release: list[float], dur: list[float], rs: list[tuple[float, float]], backward_s: float,
           forward_s: float) -> tuple[float, float]:
    """Every exchange after backward and the last reduce-scatter, in plan order; then the forward."""
    t = max(backward_s, max(end for _, end in rs))
    for r, d in zip(release, dur):
        t = max(t, r) + d
    return t - backward_s, t + forward_s


def plan_two_stage(plan: ShardingPlan, topology: Topology | None = None,
                   timings: Sequence[UnitTiming] | None = None, *, update_s: float = 0.0,
                   clip: bool = False) -> TwoStageSchedule | None:
    """The two-stage schedule of ``plan``'s replicate-axis exchanges; ``None`` without them.

    ``topology`` (default: the plan's) prices the collectives and must have the plan's world
    size; ``timings`` (any order, one per unit; default :func:`estimate_unit_timings`) give
    compute seconds. ``clip=True`` models a step whose clipping scales the gradient (the norm's
    all-reduce is 8 bytes over the world group). ``None`` when the plan has no replicate axis or
    does not shard state across it (a partial plan shards it across the world, replicate axis
    included).
    """
    if plan.mesh.replicate_size < 2 or plan.state_sharding.axis not in ("replicate", "world"):
        return None
    topo = plan.topology if topology is None else topology
    if topo.world_size != plan.world_size:
        raise PlannerError(f"topology {topo.name!r} places {topo.world_size} ranks but the plan has "
                           f"{plan.world_size}; pass a topology placed on {plan.world_size} ranks")
    by_name = {t.name: t for t in (timings if timings is not None else estimate_unit_timings(
        plan, **compute_model(plan.config)))}
    missing = [u.name for u in plan.units if u.name not in by_name]
    if missing or len(by_name) != len(plan.units):
        extra = sorted(set(by_name) - {u.name for u in plan.units})
        raise PlannerError(f"timings must name every unit of the plan exactly once; missing {missing[:3]}, "
                         f"unknown {extra[:3]} (unit names: {[u.name for u in plan.units][:3]}...)")
    norm_s = topo.group(range(plan.world_size)).planned_s("all_reduce", _NORM_BYTES) if clip else 0.0
    return exchange_schedule(plan.units, [by_name[u.name] for u in plan.units], topo, plan.config,
                             plan.mesh.shard_size, update_s=update_s, clip=clip, norm_s=norm_s)


def exchange_schedule(units: Sequence[Any], timings: Sequence[UnitTiming], topo: Topology, config: PlannerConfig,
                      shard_size: int, *, update_s: float = 0.0, clip: bool = False, norm_s: float = 0.0,
                      at_points: bool = True) -> TwoStageSchedule:
    """The schedule of ``units`` (plan order, each with ``padded_numel``) as their executor runs it: the
    replicate group's α-β times (plus its tier's ``collective_overhead_s``) of each unit's
    ``ceil(padded_numel / shard_size)`` elements, exchanges
    launched at gradient-ready points (``at_points``). The planner scores unit sizes with it before a
    plan exists; :func:`plan_two_stage` for a plan."""
    net = topo.group(range(0, topo.world_size, shard_size))
    # a sharded plan's padded_numel divides by S; a partial plan's node slice is ceil(numel / S)
    chunks = [ceil_div(u.padded_numel, shard_size) for u in units]
    pb, gb = config.param_bytes, config.grad_bytes
    return schedule_two_stage(
        timings, reduce_scatter_s=[net.planned_s("reduce_scatter", c * gb) for c in chunks],
        all_gather_s=[net.planned_s("all_gather", c * pb) for c in chunks],
        num_bytes=[c * pb for c in chunks], tier=net.tier.name if net.tier else None, update_s=update_s,
        clip=clip, norm_s=norm_s, at_points=at_points)
