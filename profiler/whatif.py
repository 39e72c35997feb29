"""What-if: re-time a measured run's collectives on another topology and predict its step.

``cpdpkit profile RUN --what-if TOPOLOGY`` keeps every rank's measured compute and the order
of its work, prices each collective with the one network model
(``topology.group(ranks).time_s(kind, num_bytes)``, :mod:`cpdpkit.network`: the model the
planner and the emulator use) and replays the rank's timeline.

**A rank's timeline** (:func:`rank_timeline`, read while its trace is loaded):

* steps: its ``ProfilerStep#N`` windows (the whole trace when it has none), with the measured
  duration and exposed time of the overlap analysis (:mod:`cpdpkit.profiler.overlap`);
* *gaps*: each step window minus the rank's compute (the overlap analysis' compute: the
  training thread's on CPU traces, the compute kernels on GPU traces) — where the compute
  timeline issued, waited for communication, or idled;
* collectives, each with a launch ``L``, a measured completion ``M``, a kind, a byte count and
  its group's ranks where the trace tells them:

  - ``cpdpkit::emu::<op>[bytes=..,ranks=..,modeled_us=..]`` labels (emulated runs), paired in
    order, per kind, with the backend ops (``gloo:*``) that moved the real data: all of the
    kind's ops when both have the same count, else those of the worker threads that hold one
    op per label, each starting after its label's call site (the emulator's arrival exchange is
    one more all-reduce per collective, on a side group's own threads: :func:`_data_ops`):
    ``L`` = the earlier of the op's start and ``label end − modeled_us`` (the modeled link
    start); the real data movement ends at the op's end ``R``; ``M = max(L + modeled_us, R)``
    (the emulator completes a collective when both are done), and for a collective matched
    across ranks at least the group's last ``L`` + ``modeled_us`` (the emulator starts the link
    when the last member arrives: an early rank's wait is the peer, :func:`_synchronised`).
    Bytes and ranks from the label;
  - otherwise backend ops (``gloo:*``) on CPU traces and NCCL kernels on GPU traces: ``L`` and
    ``M`` are the event's start and end; bytes from the kernel's ``In msg nelems`` × the size of
    its ``dtype`` (``Out msg nelems`` for all-gather) and ranks from ``Process Group Ranks``
    when torch wrote them (see :mod:`cpdpkit.profiler.trace`); gloo ops name neither.

**Replay rule.** A collective's *wait point* is the first gap that ends after both its launch
and ``M − WAIT_SLACK_US``; it is *waited* there when ``M`` falls at or after the gap's start
(the rank blocked on it), else it completed under compute and the wait point is where the rank
would block next. All ranks are replayed together, their events (launches, gap ends) in the
order of the run's common clock (``baseTimeNanoseconds`` + ``ts``, as the cross-rank analysis
aligns them). Per rank, ``δ`` = predicted minus measured time so far (0 at its trace's start):

* a launch at ``L`` happens at ``L' = L + δ``; its link time starts at ``max(L', the end of the
  previous collective on the same group)`` (collectives of one group share a link, as in the
  emulator) and lasts ``D' = time_s(kind, bytes)``;
* its predicted completion ``M'`` is the later of that link end and, when the collective is
  matched across ranks (the k-th collective of the same group on each rank, same kind), the
  group's synchronisation: ``last L' + D'`` (the link starts when the last rank arrives, as in
  the emulator) and, with a measured real data movement (``R``, emulated runs),
  ``R + (last L' − last L)`` (it ends as long after the last rank's arrival as measured, the
  arrivals on the common clock). An unmatched collective with ``R`` uses ``R + δ``; one whose
  bytes or group are unknown (*unmodeled*) keeps its measured duration, ``M' = M + δ``;
* a gap ``[g0, g1]`` starts at ``g0 + δ``; it ends at the latest of: its start (a gap with a
  waited collective may shrink to nothing) or its start plus its measured length (a gap with
  none: issuing, idling); ``M' + (g1 − M)`` for each collective waited there (the time from
  completion to resuming is kept); ``max(g0 + δ, M') + (g1 − g0)`` for each collective that
  completed under compute but is due there. Then ``δ`` becomes predicted minus measured at
  ``g1``.

**Compute under communication** (CPU traces). On a host whose cores the communication threads
share (gloo's workers, the emulator's helpers, other ranks), compute runs slower while a
collective is in flight. The rank's *slowdown* ``s`` is measured from its own trace
(:func:`compute_slowdown`): the training thread's top-level compute ops that contain no
communication call, each *under* communication (at least half of it inside ``[L, M]`` of one of
the rank's collectives) or *alone* (none of it); per op name with at least ``MIN_SAMPLES`` of
both, ``s`` = the names' summed time under communication / the same ops at their name's median
time alone (1 when no name has both; clamped to ``SLOWDOWN_RANGE``). Each compute segment (the
stretch between two gaps) of ``b`` µs under communication and ``a`` alone holds ``a + b / s`` µs
of work; replayed, it runs at rate ``1 / s`` inside the *predicted* in-flight intervals
``[L', M']`` of the rank's collectives launched so far and at rate 1 outside, for as long as
that work takes. So compute that the new network leaves under communication longer grows (and
hides more of it), and compute that it frees shrinks. The compute after a step's last gap keeps
its length. GPU traces keep ``s = 1`` (kernels are not slowed by NCCL's host threads).

Only gaps and compute segments stretch or shrink. A step's predicted duration is its measured
duration plus the change of its gaps and compute, and its predicted exposed time its measured
exposed time plus the change of its gaps (at least 0): a wait that grows is all exposed. Per run,
``per_step`` holds means over each rank's complete steps, then over ranks, as the measured
``summary.per_step`` does.

**Approximated.** Skew between ranks is re-derived, not kept: a rank waits for the *predicted*
arrival of the last rank of its group, so ranks stay in step. What a collective takes after the
last arrival beyond its link time (the real data movement of an emulated run, issuing, waking
up) is kept as measured, though on shared cores the real data movement depends on what else
runs meanwhile (the bench's 642 kB all-reduce: 1–10 ms on lan, 1–4 ms on wan, whose ranks sleep
through the link). A peer's launch not yet replayed when it is needed (clocks a few µs
apart) is taken at its current shift. The emulator's jitter is not drawn (``time_s`` is the mean
time). A hidden collective that the new network makes late waits at the next gap after its
measured completion, even if the program would have waited for it later. Compute's dependence
on the network is one factor per rank, from ops that ran both ways in the trace: a run whose
compute never overlapped communication gives no factor (``s = 1``); what else the host ran
(other jobs' load) is not modeled.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import Counter
from collections.abc import Sequence
from itertools import repeat
from operator import itemgetter
from typing import TYPE_CHECKING

from cpdpkit.errors import TopologyError
from cpdpkit.network import COLLECTIVE_OPS
from cpdpkit.profiler import intervals as iv
from cpdpkit.profiler._record import record
from cpdpkit.profiler._stats import median
from cpdpkit.profiler.classify import parse_emu_label, step_number
from cpdpkit.profiler.report import RankReport, WhatIf
from cpdpkit.profiler.trace import RankTrace

if TYPE_CHECKING:
    from cpdpkit.topology import Topology

__all__ = ["RankTimeline", "rank_timeline", "replay", "predict_run", "compute_slowdown", "WAIT_SLACK_US",
           "MIN_SAMPLES", "SLOWDOWN_RANGE"]

# a collective that completes this long after its gap ended still ended that wait (as
# overlap.WAIT_SLACK_US: a worker's event closes just after it wakes the waiter)
WAIT_SLACK_US = 100.0
# an op name counts for the compute slowdown with this many samples under communication and alone
MIN_SAMPLES = 2
# the compute slowdown is kept within this range (a few odd samples must not scale all compute)
SLOWDOWN_RANGE = (0.5, 4.0)
# the data ops of emulated collectives are searched among at most this many backend threads
MAX_BACKEND_THREADS = 12


@record(eq=False)
class RankTimeline:
    """One rank's measured timeline as the replay needs it (no topology yet).

    ``steps``: ``(duration_us, exposed_us, partial)`` per step; ``gap_*``: the gaps, sorted by
    end, with the index of their step; collectives (sorted by launch): ``launch_us``, ``done_us``
    (``M``), ``real_end_us`` (``R``, NaN: unknown), ``kind``, ``num_bytes`` (-1: unknown) and
    ``ranks`` (``None``: unknown). Each field holds one entry per gap or per collective.
    """

    rank: int
    steps: tuple[tuple[float, float, bool], ...]
    gap_start_us: tuple[float, ...]
    gap_end_us: tuple[float, ...]
    gap_step: tuple[int, ...]
    launch_us: tuple[float, ...]
    done_us: tuple[float, ...]
    real_end_us: tuple[float, ...]
    kind: tuple[str, ...]
    num_bytes: tuple[int, ...]
    ranks: tuple[tuple[int, ...] | None, ...]
    clock_us: float = 0.0  # add to a time of this rank to get the run's common clock
    wall_clock: bool = False  # whether clock_us comes from baseTimeNanoseconds
    slowdown: float = 1.0  # compute's time under communication over its time alone (compute_slowdown)
    # per gap: the compute segment before it (from the previous gap's end, or its step's start):
    # its length and the part of it under communication (µs)
    seg_us: tuple[float, ...] = ()
    seg_under_us: tuple[float, ...] = ()
    # per collective: its modeled link time as the emulator's label gave it (NaN: none)
    modeled_us: tuple[float, ...] = ()


# (launch L, completion M, real data movement's end R, kind, bytes, ranks, modeled link time)
_Collective = tuple[float, float, float, str, int, "tuple[int, ...] | None", float]
_Windows = tuple[list[tuple[float, float]], list[tuple[float, float, bool]]]


def _thread(trace: RankTrace) -> int | None:
    """The training thread: the one holding most ``ProfilerStep#N`` markers (``None``: no steps)."""
    rows = trace.rows_of(steps=True)
    return Counter(trace.thread_id[r] for r in rows).most_common(1)[0][0] if rows else None


def _step_windows(trace: RankTrace, report: RankReport) -> _Windows:
    """Windows and measured ``(duration, exposed, partial)`` of the report's steps."""
    rows = trace.rows_of(steps=True)
    tid = trace.thread_id
    if rows:
        thread = _thread(trace)
        rows = [r for r in rows if tid[r] == thread]
    by_num = {step_number(trace.names[trace.name_id[r]]): r for r in rows}
    windows, measured = [], []
    for s in report.steps:
        row = by_num.get(s.step)
        if row is not None:
            windows.append((trace.start_us[row], trace.end_us[row]))
            measured.append((s.duration_us, s.exposed_us, s.partial))
    if not report.steps:
        windows.append((0.0, report.span_us))
        measured.append((report.span_us, report.exposed_us, False))
    return windows, measured


def _gaps(windows: list[tuple[float, float]],
          compute: iv.Intervals) -> tuple[tuple[float, ...], tuple[float, ...], tuple[int, ...]]:
    """Each window minus compute: the gaps' starts, ends and window index, sorted by end."""
    gaps: list[tuple[float, float, int]] = []
    for k, (lo, hi) in enumerate(windows):
        left = iv.subtract(iv.Intervals([lo], [hi]), compute)
        gaps += zip(left.starts, left.ends, repeat(k))
    gaps.sort(key=itemgetter(1))
    if not gaps:
        return (), (), ()
    s, e, k = zip(*gaps)
    return s, e, k


def _rows_of(trace: RankTrace, role: str) -> list[int]:
    """CPU rows of the names with ``cpu_role == role``, sorted by start."""
    return sorted(trace.rows_of(cpu_roles={role}), key=trace.start_us.__getitem__)


def _pairs(trace: RankTrace, labels: list, role: str) -> dict[int, int]:
    """Label index -> row of ``role`` (``backend``: the op moving the data; ``callsite``: the
    ``c10d::*`` call that issued it), paired in order per kind when the counts agree."""
    rows = _rows_of(trace, role)
    row_kind = [trace.name_classes[trace.name_id[r]].cpu_kind or "other" for r in rows]
    pairs: dict[int, int] = {}
    for kind in {lab.kind for lab in labels}:
        mine = [i for i, lab in enumerate(labels) if lab.kind == kind]
        theirs = [r for r, k in zip(rows, row_kind) if k == kind]
        if len(mine) == len(theirs):
            pairs.update(zip(mine, theirs))
    return pairs


def _data_ops(trace: RankTrace, labels: list, calls: dict[int, int]) -> dict[int, int]:
    """Label index -> the backend op that moved its data, also where the trace holds more backend
    ops of the kind than labels: the emulator's arrival exchange (an all-reduce of issue times on
    a side gloo group, issued just before the data op) is one per collective. gloo runs a group's
    ops on that group's own worker threads in issue order, so the data ops are the ops of a set of
    threads with one op per label whose k-th op starts between the k-th label's call site (the
    call that issued it) and the next one; of the sets that fit, the one whose ops start latest
    (the exchange is issued first)."""
    pairs = _pairs(trace, labels, "backend")
    rows = _rows_of(trace, "backend")
    start, tid = trace.start_us, trace.thread_id
    for kind in {lab.kind for lab in labels}:
        mine = [i for i, lab in enumerate(labels) if lab.kind == kind]
        if mine[0] in pairs or not all(i in calls for i in mine):
            continue
        theirs = [r for r in rows if (trace.name_classes[trace.name_id[r]].cpu_kind or "other") == kind]
        count = Counter(tid[r] for r in theirs)
        threads = sorted(count)
        if len(theirs) <= len(mine) or len(threads) > MAX_BACKEND_THREADS:
            continue
        issued = [start[calls[i]] for i in mine]
        before = issued[1:] + [math.inf]  # a collective's data op starts before the next call issues another
        best: list[int] | None = None
        best_score = -math.inf
        for mask in range(1, 1 << len(threads)):
            chosen = [t for b, t in enumerate(threads) if mask >> b & 1]
            if sum(count[t] for t in chosen) != len(mine):
                continue
            ops = [r for r in theirs if tid[r] in chosen]
            if any(not at <= start[r] < nxt for r, at, nxt in zip(ops, issued, before)):
                continue
            score = sum(start[r] for r in ops)
            if score > best_score:
                best, best_score = ops, score
        if best is not None:
            pairs.update(zip(mine, best))
    return pairs


def _emu_collectives(trace: RankTrace) -> list[_Collective]:
    rows = _rows_of(trace, "emu")
    labels = [parse_emu_label(trace.names[trace.name_id[r]]) for r in rows]
    keep = [i for i, lab in enumerate(labels) if lab is not None]
    rows, labels = [rows[i] for i in keep], [labels[i] for i in keep]  # type: ignore[misc]
    calls = _pairs(trace, labels, "callsite")
    ops = _data_ops(trace, labels, calls)
    out = []
    for i, (row, lab) in enumerate(zip(rows, labels)):
        start, end = trace.start_us[row], trace.end_us[row]
        modeled = lab.modeled_us
        launch = min(start, end - modeled) if modeled is not None else start
        for pairs in (ops, calls):
            if i in pairs:
                launch = min(launch, trace.start_us[pairs[i]])
        real = trace.end_us[ops[i]] if i in ops else math.nan
        # the waiter completes the modeled time itself; the label may close late (a busy helper thread)
        link_end = launch + modeled if modeled is not None else end
        done = max(link_end, real) if not math.isnan(real) else link_end
        nbytes = lab.num_bytes if lab.num_bytes is not None else -1
        out.append((launch, done, real, lab.kind, nbytes, lab.ranks, modeled if modeled is not None else math.nan))
    return out


def _plain_collectives(trace: RankTrace) -> list[_Collective]:
    """Backend ops (CPU) or NCCL kernels (GPU), with bytes and ranks when the trace has them."""
    rows = trace.rows_of(gpu_roles={"gpu_comm"})
    gpu = bool(rows)
    if not gpu:
        rows = _rows_of(trace, "backend")
    out = []
    for row in rows:
        cls = trace.name_classes[trace.name_id[row]]
        kind = trace.comm_kind.get(row) or (cls.kind if gpu else cls.cpu_kind) or "other"
        sizes = trace.comm_bytes.get(row)  # the model's n: all-gather's output, else the input
        nbytes = -1 if sizes is None else sizes[1] if kind == "all_gather" else sizes[0]
        out.append((trace.start_us[row], trace.end_us[row], math.nan, kind, nbytes,
                    trace.comm_ranks.get(row), math.nan))
    return out


def _clock(trace: RankTrace) -> dict[str, float | bool]:
    """The rank's offset to the run's common clock (``baseTimeNanoseconds`` / 1000 + ``ts``, as
    :mod:`cpdpkit.profiler.crossrank` aligns ranks); raw timestamps without it."""
    base = trace.meta.get("baseTimeNanoseconds")
    if isinstance(base, (int, float)) and not isinstance(base, bool) and 0 < base < 1e30:
        return {"clock_us": base / 1000 + trace.origin_us, "wall_clock": True}
    return {"clock_us": trace.origin_us, "wall_clock": False}


def _top_level_compute_ops(trace: RankTrace, thread: int) -> list[int]:
    """The thread's outermost compute ops (``cpu_op`` events of compute names) that contain no
    communication call site or phase, sorted by start."""
    s, e, tid, nid = trace.start_us, trace.end_us, trace.thread_id, trace.name_id
    classes, cats, cat = trace.name_classes, trace.cats, trace.cat_id
    rows = [r for r in range(trace.num_events) if tid[r] == thread and trace.stream[r] == -1]
    rows.sort(key=lambda r: (s[r], -e[r]))
    comm = sorted(s[r] for r in rows if classes[nid[r]].cpu_role in ("callsite", "phase"))
    top: list[int] = []
    end = -math.inf
    for r in rows:
        if s[r] >= end and cats[cat[r]].lower() in ("cpu_op", "operator"):
            end = e[r]
            if classes[nid[r]].cpu_role == "cpu" and bisect_right(comm, e[r]) == bisect_right(comm, s[r] - 1e-9):
                top.append(r)
    return top


def compute_slowdown(trace: RankTrace, thread: int | None, inflight: iv.Intervals) -> float:
    """Compute's time under communication over its time alone (the module docstring's ``s``):
    the training thread's top-level compute ops, per name, against the ``inflight`` intervals."""
    if thread is None or not inflight.starts:
        return 1.0
    s, e, nid = trace.start_us, trace.end_us, trace.name_id
    alone: dict[int, list[float]] = {}
    under: dict[int, list[float]] = {}
    for r in _top_level_compute_ops(trace, thread):
        d = e[r] - s[r]
        if d <= 0:
            continue
        inside = iv.total_us(iv.intersect(iv.Intervals([s[r]], [e[r]]), inflight))
        if inside == 0:
            alone.setdefault(nid[r], []).append(d)
        elif inside >= d / 2:
            under.setdefault(nid[r], []).append(d)
    slow = base = 0.0
    for name, times in under.items():
        mine = alone.get(name, [])
        if len(times) >= MIN_SAMPLES and len(mine) >= MIN_SAMPLES:
            slow += sum(times)
            base += len(times) * median(mine)
    if base <= 0:
        return 1.0
    lo, hi = SLOWDOWN_RANGE
    return min(hi, max(lo, slow / base))


def _segments(windows: list[tuple[float, float]], g0: Sequence[float], g1: Sequence[float],
              gstep: Sequence[int], inflight: iv.Intervals) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per gap, the compute segment before it in its step (from the previous gap's end, or the
    step's start): its length and its part in ``inflight``. Gaps are disjoint, so their order
    by end is their order by start."""
    seg: list[float] = []
    under: list[float] = []
    last_end = [lo for lo, _ in windows]
    for a, b, k in zip(g0, g1, gstep):
        start = last_end[k]
        length = max(0.0, a - start)
        seg.append(length)
        under.append(iv.total_us(iv.intersect(iv.Intervals([start], [a]), inflight)) if length > 0 else 0.0)
        last_end[k] = max(start, b)
    return tuple(seg), tuple(under)


def rank_timeline(trace: RankTrace, report: RankReport) -> RankTimeline:
    """The replay's input for one rank (see the module docstring), from its loaded trace and
    its overlap report (before the cross-rank analysis drops ``report.collectives``)."""
    windows, measured = _step_windows(trace, report)
    compute = report.collectives.compute if report.collectives is not None else iv.EMPTY
    g0, g1, gstep = _gaps(windows, compute)
    colls = _emu_collectives(trace) or _plain_collectives(trace)
    colls.sort(key=lambda c: c[0])
    inflight = iv.merge([c[0] for c in colls], [c[1] for c in colls])
    slowdown = 1.0 if report.mode == "gpu" else compute_slowdown(trace, _thread(trace), inflight)
    seg, seg_under = _segments(windows, g0, g1, gstep, inflight)
    return RankTimeline(
        rank=report.rank,
        steps=tuple(measured),
        gap_start_us=g0,
        gap_end_us=g1,
        gap_step=gstep,
        launch_us=tuple(c[0] for c in colls),
        done_us=tuple(c[1] for c in colls),
        real_end_us=tuple(c[2] for c in colls),
        kind=tuple(c[3] for c in colls),
        num_bytes=tuple(c[4] for c in colls),
        ranks=tuple(tuple(c[5]) if c[5] else None for c in colls),
        modeled_us=tuple(c[6] for c in colls),
        **_clock(trace),
        slowdown=slowdown,
        seg_us=seg,
        seg_under_us=seg_under,
    )


def _durations_us(tl: RankTimeline, topology: Topology, world_size: int) -> list[float]:
    """Modeled duration of each collective in µs; NaN where it cannot be modeled."""
    out = [math.nan] * len(tl.launch_us)
    for i, (kind, nbytes, ranks) in enumerate(zip(tl.kind, tl.num_bytes, tl.ranks)):
        if kind not in COLLECTIVE_OPS or nbytes < 0 or not ranks or max(ranks) >= world_size:
            continue
        try:
            out[i] = topology.group(ranks).time_s(kind, nbytes) * 1e6
        except TopologyError:
            continue
    return out


def _wait_points(tl: RankTimeline, done_us: Sequence[float]) -> tuple[list[int], list[bool]]:
    """Each collective's gap (-1: none) and whether it was waited there."""
    g0, g1 = tl.gap_start_us, tl.gap_end_us
    gaps: list[int] = []
    waited: list[bool] = []
    for launch, done in zip(tl.launch_us, done_us):
        threshold = done - WAIT_SLACK_US
        g = bisect_right(g1, threshold if threshold >= launch else launch)
        g = g if g < len(g1) else -1
        gaps.append(g)
        waited.append(g >= 0 and done >= g0[g])
    return gaps, waited


def _matches(timelines: Sequence[RankTimeline]) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """(timeline, collective) -> the same collective on every rank of the run that has it: the
    k-th collective of one group (its ranks) on each rank, when all agree on the kind."""
    if len({tl.wall_clock for tl in timelines}) > 1:
        return {}  # some ranks without a wall clock: arrivals cannot be compared
    by_key: dict[tuple, list[tuple[int, int]]] = {}
    for t, tl in enumerate(timelines):
        seen: Counter = Counter()
        for c, ranks in enumerate(tl.ranks):
            if ranks is not None and len(ranks) > 1:
                by_key.setdefault((ranks, seen[ranks]), []).append((t, c))
                seen[ranks] += 1
    out: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for members in by_key.values():
        if len(members) > 1 and len({timelines[t].kind[c] for t, c in members}) == 1:
            for m in members:
                out[m] = members
    return out


def _synchronised(timelines: Sequence[RankTimeline], t: int,
                  peers: dict[tuple[int, int], list[tuple[int, int]]]) -> list[float]:
    """Rank ``t``'s measured completions ``M``, each emulated collective matched across ranks
    at least at the group's last arrival plus its modeled link time: the emulator starts the
    link when the last member arrives, so an early rank's collective completed that much later
    than its own launch plus the link time (the rest of its wait is the peer, not resuming)."""
    tl = timelines[t]
    done = list(tl.done_us)
    for c, modeled in enumerate(tl.modeled_us):
        members = peers.get((t, c))
        if members is not None and not math.isnan(modeled):
            last = max(timelines[q].clock_us + timelines[q].launch_us[k] for q, k in members) - tl.clock_us
            done[c] = max(done[c], last + modeled)
    return done


class _Replay:
    """The joint replay of a run's ranks (module docstring); ``change[t]`` per gap of rank ``t``."""

    def __init__(self, timelines: Sequence[RankTimeline], durations: Sequence[Sequence[float]]) -> None:
        self.tl, self.dur = timelines, durations
        self.peers = _matches(timelines)
        self.done = [_synchronised(timelines, t, self.peers) for t in range(len(timelines))]
        self.delta = [0.0] * len(timelines)
        self.launch_new = [[math.nan] * len(tl.launch_us) for tl in timelines]
        self.link_end = [[math.nan] * len(tl.launch_us) for tl in timelines]
        self.free: list[dict] = [{} for _ in timelines]
        self.change = [[0.0] * len(tl.gap_end_us) for tl in timelines]
        self.compute_change = [[0.0] * len(tl.gap_end_us) for tl in timelines]  # the segment before each gap
        self.open: list[list[int]] = [[] for _ in timelines]  # launched collectives perhaps still in flight

    def run(self) -> list[list[float]]:
        events, plans = [], []
        for t, tl in enumerate(self.tl):
            gap, waited = _wait_points(tl, self.done[t])
            due: dict[int, list[int]] = {}
            for c, g in enumerate(gap):
                if g >= 0:
                    due.setdefault(g, []).append(c)
            plans.append((due, waited))
            events += [(tl.clock_us + x, 1, t, c) for c, x in enumerate(tl.launch_us)]
            events += [(tl.clock_us + x, 0, t, g) for g, x in enumerate(tl.gap_end_us)]
        for _, is_launch, t, i in sorted(events):
            if is_launch:
                self._launch(t, i)
            else:
                self._gap_end(t, i, *plans[t])
        return self.change

    def _launch(self, t: int, c: int) -> None:
        tl, d = self.tl[t], self.dur[t][c]
        self.launch_new[t][c] = tl.launch_us[c] + self.delta[t]
        self.open[t].append(c)
        if not math.isnan(d):
            start = max(self.launch_new[t][c], self.free[t].get(tl.ranks[c], -math.inf))
            self.free[t][tl.ranks[c]] = self.link_end[t][c] = start + d

    def _last_arrival_shift(self, t: int, c: int) -> tuple[float, float] | None:
        """(how much later the group's last rank arrives, its new arrival on rank ``t``'s clock)."""
        members = self.peers.get((t, c))
        if members is None:
            return None
        old, new = [], []
        for q, k in members:
            tq = self.tl[q]
            launched = self.launch_new[q][k]
            old.append(tq.clock_us + tq.launch_us[k])
            new.append(tq.clock_us + (launched if not math.isnan(launched) else tq.launch_us[k] + self.delta[q]))
        return max(new) - max(old), max(new) - self.tl[t].clock_us

    def _done(self, t: int, c: int) -> float:
        """Predicted completion of collective ``c`` of rank ``t`` (launched already)."""
        tl, d = self.tl[t], self.dur[t][c]
        own_shift = self.launch_new[t][c] - tl.launch_us[c]
        if math.isnan(d):
            return self.done[t][c] + own_shift
        done, real = self.link_end[t][c], tl.real_end_us[c]
        last = self._last_arrival_shift(t, c)
        if last is not None:  # the link starts when the group's last rank arrives (as in the emulator)
            done = max(done, last[1] + d)
        if not math.isnan(real):  # the real data movement: after the last rank arrives, as long as measured
            return max(done, real + (last[0] if last is not None else own_shift))
        return done

    def _inflight(self, t: int, start: float) -> tuple[list[float], list[float]]:
        """Rank ``t``'s predicted in-flight intervals ``[L', M']`` that end after ``start``, merged."""
        spans, still = [], []
        for c in self.open[t]:
            done = self._done(t, c)
            if done > start:
                spans.append((self.launch_new[t][c], done))
                still.append(c)
        self.open[t] = still  # a later segment starts later
        return iv.merge([a for a, _ in spans], [b for _, b in spans]) if spans else ([], [])

    def _compute(self, t: int, g: int) -> float:
        """Predicted minus measured length of the compute segment before gap ``g`` of rank ``t``:
        its work, ``a + b / s``, done at rate ``1 / s`` in the predicted in-flight intervals."""
        tl = self.tl[t]
        length, under, slow = tl.seg_us[g], tl.seg_under_us[g], tl.slowdown
        start = tl.gap_start_us[g] - length + self.delta[t]
        left = (length - under) + under / slow
        cursor = start
        for p, q in zip(*self._inflight(t, start)):
            if p > cursor:
                step = min(left, p - cursor)
                cursor, left = cursor + step, left - step
            if left <= 0:
                break
            p = max(p, cursor)
            if left * slow <= q - p:
                cursor, left = p + left * slow, 0.0
                break
            cursor, left = q, left - (q - p) / slow
        return cursor + left - start - length

    def _gap_end(self, t: int, g: int, due: dict[int, list[int]], waited: list[bool]) -> None:
        tl = self.tl[t]
        g0, g1 = tl.gap_start_us[g], tl.gap_end_us[g]
        if tl.slowdown != 1.0 and tl.seg_us and tl.seg_us[g] > 0:
            self.compute_change[t][g] = self._compute(t, g)
            self.delta[t] += self.compute_change[t][g]
        x0 = g0 + self.delta[t]
        mine = due.get(g, [])
        end = x0 if any(waited[c] for c in mine) else x0 + (g1 - g0)
        for c in mine:
            done = self._done(t, c)
            end = max(end, done + (g1 - self.done[t][c]) if waited[c] else max(x0, done) + (g1 - g0))
        self.change[t][g] = (end - x0) - (g1 - g0)
        self.delta[t] = end - g1


def replay(timelines: Sequence[RankTimeline], durations_us: Sequence[Sequence[float]]) -> list[list[float]]:
    """Predicted minus measured length of each gap of each rank (the module docstring's rule);
    ``durations_us``: per rank, each collective's new duration, NaN to keep the measured one."""
    return _Replay(timelines, durations_us).run()


def _rank_prediction(tl: RankTimeline, change: Sequence[float],
                     compute_change: Sequence[float]) -> tuple[float, float]:
    """Mean predicted (step time, exposed) over the rank's complete steps."""
    per_step = [0.0] * len(tl.steps)
    per_step_compute = [0.0] * len(tl.steps)
    for k, c, dc in zip(tl.gap_step, change, compute_change):  # summed in gap order
        per_step[k] += c
        per_step_compute[k] += dc
    rows = list(zip(tl.steps, per_step, per_step_compute))
    full = [(d + c + dc, max(0.0, e + c)) for (d, e, partial), c, dc in rows if not partial]
    if not full:
        full = [(d + c + dc, max(0.0, e + c)) for (d, e, _), c, dc in rows]
    if not full:
        return 0.0, 0.0
    return sum(f[0] for f in full) / len(full), sum(f[1] for f in full) / len(full)


def predict_run(timelines: Sequence[RankTimeline], topology: Topology, *, name: str, world_size: int) -> WhatIf:
    """Replay every rank's timeline on ``topology`` (placed for ``world_size``; ``name`` is what
    the user passed) and average the predicted per-step times over ranks."""
    durations = [_durations_us(tl, topology, world_size) for tl in timelines]
    unmodeled = sum(math.isnan(x) for d in durations for x in d)
    steps, exposed = [], []
    done = _Replay(timelines, durations)
    for tl, change, compute_change in zip(timelines, done.run(), done.compute_change):
        s, e = _rank_prediction(tl, change, compute_change)
        steps.append(s)
        exposed.append(e)
    n = max(len(timelines), 1)
    return WhatIf(topology=name, step_time_us=sum(steps) / n, exposed_us=sum(exposed) / n,
                  unmodeled_collectives=unmodeled)
