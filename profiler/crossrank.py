"""Cross-rank analysis, "who waits for whom": match each collective across the ranks of a run
and split every rank's exposed communication into waiting for the last rank and the rest.

A rank that reaches a collective early waits inside it until the last rank of the group
arrives; only then does data move. Per rank (and per kind and ``ProfilerStep#N``) the exposed
time splits into ``skew_us`` (waiting for the last rank to arrive) and
``transfer_us = exposed_us − skew_us`` (moving data, issuing the collective, and collectives
that could not be matched); per run, ``RunSummary.stragglers`` names who arrived last.

**A rank's collectives** (:func:`rank_collectives`, called by ``analyze_trace`` with the rows
the overlap analysis used; send/recv is never matched):

* GPU traces: every NCCL kernel the overlap analysis counted. *Arrival* = the kernel's start on
  its stream (an NCCL kernel starts when its rank reaches the collective and spins until the
  peers arrive); process group and sequence number from its ``Process Group Name`` and ``Seq``
  arguments. Its step is the ``ProfilerStep#N`` in which its CUDA launch ran.
* CPU traces: every backend op (``gloo:*``, ``mpi:*``, ``ucc:*``, on the backend's worker
  thread). *Arrival* = the op's start: the worker starts the collective as soon as the
  training thread has issued it and the worker is free, the moment this rank is ready to
  exchange. The training thread's own call site (``c10d::*``) is issuing, not arriving. The
  process group is the trace's only group (``distributedInfo.pg_config``; none listed: one
  default group). With several groups a gloo op names none; then, if the trace has
  ``cpdpkit::emu::*`` labels (the emulator opens one per collective when it is issued, or
  when its link frees up, and names its ranks, hence its group) with more known groups, the
  labels are the collectives instead, arrival = the label's start. A collective whose group
  stays unknown is not matched. Its step is the one whose window holds the arrival.
* Its extent: from its arrival to its end, or to the end of the last training-thread wait
  the overlap analysis attributed to it if that is later (CPU); all of it is communication in
  the overlap analysis.

**Matching**, within a process group: by ``(Seq, occurrence)`` when every rank's collectives in
that group carry ``Seq``, else by ``(ProfilerStep number, order of arrival within the step)``.
A match counts when every rank of the run with collectives in that group has one and all
agree on the kind.

**Clocks**: a rank's wall clock is ``baseTimeNanoseconds / 1000 + ts`` µs (Kineto writes
``ts`` relative to ``baseTimeNanoseconds``); a trace without it whose timestamps exceed
``WALL_CLOCK_TS_US`` (Unix time after 2001) has wall-clock ``ts`` already. When no rank has a
wall clock (e.g. synthetic traces) the raw timestamps are compared. Some ranks with and some
without a wall clock, or matched arrivals spread by more than ``MAX_CLOCK_OFFSET_US`` (10 s)
at the median collective, are one error naming the run; its per-rank analysis stays, without
the split (``skew_us``/``transfer_us``/``stragglers`` are ``None``).

**The split**, per matched collective with arrivals ``a_r`` on the common clock and
``last = max_r a_r``: rank ``r`` waits for the last rank during its *skew window*
``[a_r, min(last, end of its extent)]``, and its skew there is the exposed part of that
window, ``|window ∖ compute_r|``. For a blocking collective (all of it exposed) that is
``min(exposed, last − a_r)``; a wait hidden under compute (an async collective issued early)
is no skew (on CPU traces, where only the training thread's blocked time is exposed, the
skew is ``|window ∩ blocked_r|``). Per rank ``skew_us = |∪ windows ∖ compute|`` over its matched collectives, so
concurrent collectives are not counted twice and ``skew_us ≤ exposed_us``; the same over the
collectives of one kind (``skew_by_kind``) and of one step (``StepReport.skew_us``, at most the
step's ``exposed_us``). ``transfer_us = exposed_us − skew_us``.

**Stragglers**: a rank is *late* at a collective when it arrives last by more than
``LATE_MARGIN_US`` over the next latest. ``late_count`` counts those collectives,
``late_frac`` is ``late_count`` over the matched collectives the rank took part in, and
``caused_wait_us_per_step`` is the other ranks' skew at them (each collective's
``|window ∖ compute|``), summed over the ranks that waited, each divided by its number of
complete steps (whole trace without step markers).
Ranks never late are left out; the list is worst first (most caused wait).
"""

from __future__ import annotations

import dataclasses
import math
from bisect import bisect_right
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from itertools import compress
from operator import sub
from typing import Any

from cpdpkit.profiler import intervals as iv
from cpdpkit.profiler._record import record
from cpdpkit.profiler._stats import median
from cpdpkit.profiler.report import RankReport, TraceIssue, WaitSplit
from cpdpkit.profiler.trace import RankTrace

__all__ = [
    "RankCollectives",
    "Alignment",
    "rank_collectives",
    "align",
    "cross_rank",
    "MAX_CLOCK_OFFSET_US",
    "LATE_MARGIN_US",
    "WALL_CLOCK_TS_US",
]

# matched arrivals further apart than this at the median collective mean the clocks are off
MAX_CLOCK_OFFSET_US = 10e6
# arriving last by less than this over the next latest rank is a tie, not lateness
LATE_MARGIN_US = 50.0
# timestamps above this many µs are Unix wall-clock times (after 2001-09-09)
WALL_CLOCK_TS_US = 1e15
_CPU_COLLECTIVE_ROLES = ("backend", "emu")  # in order of preference


@record(eq=False)
class RankCollectives:
    """One rank's collectives, sorted by arrival, as the cross-rank match needs them (one
    entry per collective in each tuple).

    ``arrival_us`` and ``extent_end_us`` are on the rank's trace clock (``RankTrace.start_us``);
    the wall clock is ``base_ns / 1000 + origin_us + arrival_us`` when ``wall_clock``. ``pg`` is
    the process group (``None``: unknown, not matched), ``seq`` the ``Seq`` argument (-1: none),
    ``kind`` the collective's kind, ``step`` the ``ProfilerStep`` number (-1: outside every step),
    ``compute`` the rank's compute, ``blocked`` (CPU traces) the training thread's blocked time:
    there only that is exposed.
    """

    wall_clock: bool
    base_ns: int
    origin_us: float
    pg: tuple[str | None, ...]
    seq: tuple[int, ...]
    kind: tuple[str, ...]
    step: tuple[int, ...]
    arrival_us: tuple[float, ...]
    extent_end_us: tuple[float, ...]
    compute: iv.Intervals
    blocked: iv.Intervals | None = None
    comm: iv.Intervals = iv.EMPTY  # all communication the overlap analysis counted (for the timeline)
    steps: tuple[tuple[int, float, float], ...] = ()  # (ProfilerStep number, start_us, end_us)

    def __len__(self) -> int:
        return len(self.arrival_us)


def _clock(trace: RankTrace) -> tuple[bool, int]:
    base = trace.meta.get("baseTimeNanoseconds")
    if isinstance(base, (int, float)) and not isinstance(base, bool) and 0 < base < 1e30:  # finite, positive
        return True, int(base)
    return trace.origin_us > WALL_CLOCK_TS_US, 0


def _picked(trace: RankTrace, rows: Sequence[int], pg_known: Sequence[bool]) -> list[bool]:
    """Which entries of ``rows`` are collectives (see the module docstring)."""
    stream = trace.stream
    on_gpu = [stream[r] != -1 for r in rows]
    if any(on_gpu):
        return on_gpu
    classes, nid = trace.name_classes, trace.name_id
    roles = [classes[nid[r]].cpu_role for r in rows]
    best, best_known = [False] * len(rows), -1
    for role in _CPU_COLLECTIVE_ROLES:
        pick = [x == role for x in roles]
        known = sum(p and k for p, k in zip(pick, pg_known))
        if any(pick) and known == sum(pick):
            return pick
        if known > best_known:
            best, best_known = pick, known
    return best


def _step_numbers(anchor: Iterable[float], steps: Sequence[tuple[int, float, float]]) -> list[int]:
    lo = [s[1] for s in steps]
    out = []
    for a in anchor:
        k = bisect_right(lo, a) - 1
        out.append(steps[k][0] if k >= 0 and a <= steps[k][2] else -1)
    return out


def rank_collectives(
    trace: RankTrace,
    rows: Sequence[int],
    kinds: Sequence[str],
    starts: Sequence[float],
    ends: Sequence[float],
    compute: iv.Intervals,
    *,
    pgs: Sequence[str | None],
    groups: Mapping[str, Any],
    steps: Sequence[tuple[int, float, float]],
    anchor_us: Sequence[float],
    blocked: iv.Intervals | None = None,
    comm: iv.Intervals = iv.EMPTY,
) -> RankCollectives:
    """One rank's collectives from the overlap analysis' comm entries: ``rows`` (trace rows;
    on CPU a collective's row is listed first as itself, then once per wait gap attributed to
    it), their ``kinds``, ``starts``/``ends`` (the intervals counted as communication; GPU
    times already rounded as the overlap analysis rounds them),
    ``compute``, process groups ``pgs``, the trace's ``groups``, its ``steps`` and each entry's
    launch time ``anchor_us``; ``blocked`` and ``comm`` as the overlap analysis computed them."""
    default = None if groups else ""  # no process groups listed: one default group
    pg_all = [p if p is not None else default for p in pgs]
    picked = _picked(trace, rows, [p is not None for p in pg_all]) if len(rows) else []
    # a row's first entry is the collective itself (``own``), later ones its waits, whose
    # ends extend its extent
    own: dict[int, int] = {}
    extent: dict[int, float] = {}
    for i in compress(range(len(picked)), picked):
        r = rows[i]
        if r not in own:
            own[r] = i
            extent[r] = ends[i]
        elif ends[i] > extent[r]:
            extent[r] = ends[i]
    uniq = sorted(own)
    entries = [own[r] for r in uniq]
    order = sorted(range(len(entries)), key=lambda t: starts[entries[t]])
    order = [t for t in order if kinds[entries[t]] != "send_recv"]
    mine = [entries[t] for t in order]
    step = _step_numbers([anchor_us[i] for i in mine], steps)
    wall, base = _clock(trace)
    return RankCollectives(
        wall_clock=wall,
        base_ns=base,
        origin_us=trace.origin_us,
        pg=tuple(pg_all[i] for i in mine),
        seq=tuple(trace.comm_seq.get(uniq[t], -1) for t in order),
        kind=tuple(kinds[i] for i in mine),
        step=tuple(step),
        arrival_us=tuple(starts[i] for i in mine),
        extent_end_us=tuple(extent[uniq[t]] for t in order),
        compute=compute,
        blocked=blocked,
        comm=comm,
        steps=tuple(steps),
    )


@record(eq=False)
class _Matches:
    """Matched collectives as flat entries (one per rank per match, the entries of a match
    next to each other): ``match`` id, rank position, row in that rank's
    :class:`RankCollectives`, and arrival on the common clock."""

    count: int
    match: list[int]
    rank_pos: list[int]
    row: list[int]
    arrival_us: list[float]


def _offsets(ranks: Sequence[RankReport], cols: Sequence[RankCollectives]) -> tuple[list[float], str | None]:
    """Per rank, what to add to its trace clock for the common clock, and the problem if
    some ranks have a wall clock and others not."""
    ref = cols[0]
    offsets = [(c.base_ns - ref.base_ns) / 1000.0 + (c.origin_us - ref.origin_us) for c in cols]
    walls = [c.wall_clock for c in cols]
    if any(walls) and not all(walls):
        bare = [r.rank for r, w in zip(ranks, walls) if not w]
        return offsets, (f"rank(s) {bare} have no wall clock (no baseTimeNanoseconds and relative timestamps) "
                         "while the others do, so the clocks cannot be aligned")
    return offsets, None


def _keys(c: RankCollectives, by_seq: set[str]) -> list[tuple | None]:
    seen: Counter[tuple] = Counter()
    keys: list[tuple | None] = []
    for pg, seq, step in zip(c.pg, c.seq, c.step):
        if pg is None:
            keys.append(None)
            continue
        group = (pg, "seq", seq) if pg in by_seq else (pg, "step", step)
        keys.append((*group, seen[group]))
        seen[group] += 1
    return keys


def _match(cols: Sequence[RankCollectives], offsets: Sequence[float]) -> _Matches:
    pgs = {pg for c in cols for pg in c.pg if pg is not None}
    by_seq = {pg for pg in pgs if all(all(s >= 0 for p, s in zip(c.pg, c.seq) if p == pg) for c in cols)}
    table: dict[tuple, list[tuple[int, int]]] = {}
    members: dict[str, set[int]] = {}
    for i, c in enumerate(cols):
        for j, key in enumerate(_keys(c, by_seq)):
            if key is not None:
                table.setdefault(key, []).append((i, j))
                members.setdefault(key[0], set()).add(i)
    m = _Matches(0, [], [], [], [])
    count = 0
    for key, found in table.items():
        if len(found) < 2 or len(found) != len(members[key[0]]):
            continue
        if len({cols[i].kind[j] for i, j in found}) != 1:
            continue
        for i, j in found:
            m.match.append(count)
            m.rank_pos.append(i)
            m.row.append(j)
            m.arrival_us.append(cols[i].arrival_us[j] + offsets[i])
        count += 1
    return dataclasses.replace(m, count=count)


def _implausible(m: _Matches, ranks: Sequence[RankReport]) -> str | None:
    first = [math.inf] * m.count
    last = [-math.inf] * m.count
    for k, a in zip(m.match, m.arrival_us):
        if a < first[k]:
            first[k] = a
        if a > last[k]:
            last[k] = a
    spread = median([hi - lo for lo, hi in zip(first, last)])
    if spread <= MAX_CLOCK_OFFSET_US:
        return None
    total = [0.0] * m.count
    size = [0] * m.count
    for k, a in zip(m.match, m.arrival_us):  # summed in entry order
        total[k] += a
        size[k] += 1
    mean = [t / n for t, n in zip(total, size)]
    devs: dict[int, list[float]] = {}
    for k, p, a in zip(m.match, m.rank_pos, m.arrival_us):
        devs.setdefault(p, []).append(a - mean[k])
    off = {p: median(devs[p]) for p in sorted(devs)}
    typical = median(off.values())
    ref = min(off, key=lambda p: abs(off[p] - typical))  # the most typical clock (ties: the lowest rank)
    worst = max(off, key=lambda p: abs(off[p] - off[ref]))
    return (f"implausible clock offsets between ranks: matched collectives' arrivals are {spread / 1e6:.1f} s apart "
            f"at the median (bound {MAX_CLOCK_OFFSET_US / 1e6:.0f} s); rank {ranks[worst].rank}'s clock is "
            f"{(off[worst] - off[ref]) / 1e6:+.1f} s off rank {ranks[ref].rank}'s")


def _windows(m: _Matches, cols: Sequence[RankCollectives], offsets: Sequence[float]) -> list[list[float]]:
    """Per rank, the end of each collective's skew window ``[arrival, min(last, extent end)]`` on
    its own clock (the arrival itself when the collective is not matched: an empty window)."""
    last = [-math.inf] * m.count
    for k, a in zip(m.match, m.arrival_us):
        if a > last[k]:
            last[k] = a
    his = [list(c.arrival_us) for c in cols]
    for k, i, j in zip(m.match, m.rank_pos, m.row):
        c = cols[i]
        end = last[k] - offsets[i]
        x = c.extent_end_us[j]
        end = end if end <= x else x
        a = c.arrival_us[j]
        his[i][j] = end if end >= a else a
    return his


def _skew_us(c: RankCollectives, hi: Sequence[float], sel: Iterable[bool] | None = None) -> float:
    """``|∪ skew windows ∖ compute|`` (CPU: ``∩ blocked``) over the collectives ``sel`` (all: ``None``)."""
    lo = c.arrival_us
    if sel is not None:
        sel = list(sel)
        lo, hi = list(compress(lo, sel)), list(compress(hi, sel))
    windows = iv.merge(lo, hi)
    if c.blocked is not None:
        return iv.total_us(iv.intersect(windows, c.blocked))
    return iv.total_us(iv.subtract(windows, c.compute))


def _split(skew: float, exposed: float) -> tuple[float, float]:
    s = min(max(skew, 0.0), exposed)
    return s, max(exposed - s, 0.0)


def _split_rank(r: RankReport, c: RankCollectives, hi: Sequence[float]) -> RankReport:
    by_kind = {kind: WaitSplit(*_split(_skew_us(c, hi, (k == kind for k in c.kind)), t.exposed_us))
               for kind, t in r.by_kind.items()}
    steps = []
    for s in r.steps:
        sk, tr = _split(_skew_us(c, hi, (x == s.step for x in c.step)), s.exposed_us)
        steps.append(dataclasses.replace(s, skew_us=sk, transfer_us=tr))
    total, transfer = _split(_skew_us(c, hi), r.exposed_us)
    return dataclasses.replace(r, skew_us=total, transfer_us=transfer, skew_by_kind=by_kind, steps=tuple(steps),
                               collectives=None)


def _step_weights(r: RankReport, c: RankCollectives) -> list[float]:
    """Per collective: 1 / complete steps when it lies in a complete step (0 outside); 1
    without step markers (whole-trace totals)."""
    full = {s.step for s in r.full_steps}
    if not full:
        return [1.0] * len(c)
    n = len(full)
    return [(1.0 if s in full else 0.0) / n for s in c.step]


def _late(m: _Matches) -> list[int]:
    """Per match, the position of the rank that arrived last by more than ``LATE_MARGIN_US``
    (-1: a tie)."""
    arrival = m.arrival_us
    by_match: list[list[int]] = [[] for _ in range(m.count)]
    for e, k in enumerate(m.match):
        by_match[k].append(e)
    late_pos = [-1] * m.count
    for k, entries in enumerate(by_match):  # every match has two or more entries
        entries.sort(key=arrival.__getitem__)
        latest, second = entries[-1], entries[-2]
        if arrival[latest] - arrival[second] > LATE_MARGIN_US:
            late_pos[k] = m.rank_pos[latest]
    return late_pos


def _stragglers(m: _Matches, skew: Sequence[float], ranks: Sequence[RankReport],
                cols: Sequence[RankCollectives]) -> tuple[dict[str, Any], ...]:
    rank_pos = m.rank_pos
    late_pos = _late(m)
    late_count = [0] * len(ranks)
    for p in late_pos:
        if p >= 0:
            late_count[p] += 1
    weights = [_step_weights(r, c) for r, c in zip(ranks, cols)]
    caused = [0.0] * len(ranks)
    took_part = [0] * len(ranks)
    for k, p, j, sk in zip(m.match, rank_pos, m.row, skew):  # summed in entry order
        took_part[p] += 1
        culprit = late_pos[k]
        if culprit >= 0 and culprit != p:
            caused[culprit] += sk * weights[p][j]
    out = [
        {"rank": ranks[p].rank, "late_count": late_count[p], "late_frac": late_count[p] / took_part[p],
         "caused_wait_us_per_step": caused[p]}
        for p in range(len(ranks)) if late_count[p] > 0
    ]
    out.sort(key=lambda d: (-d["caused_wait_us_per_step"], -d["late_count"], d["rank"]))
    return tuple(out)


@record(eq=False)
class Alignment:
    """The run's ranks on one clock and their matched collectives, as :func:`cross_rank`
    computes them (for :mod:`cpdpkit.profiler.timeline`).

    ``offsets_us[i]``: what to add to rank position ``i``'s trace clock for the common clock
    (rank position 0's trace clock); ``problem``: why the clocks could not be aligned (then the
    offsets are the wall clocks' as far as known and there are no matches). Per match ``k``:
    ``entries[k]`` its ``(rank position, row in that rank's RankCollectives)`` pairs, ``late[k]``
    the straggler's rank position (-1: a tie), ``skew_end_us[i][j]`` the end of rank ``i``'s
    skew window at its collective ``j`` on its own clock."""

    offsets_us: tuple[float, ...]
    problem: str | None
    entries: tuple[tuple[tuple[int, int], ...], ...]
    late: tuple[int, ...]
    skew_end_us: tuple[tuple[float, ...], ...]


def align(ranks: Sequence[RankReport]) -> Alignment | None:
    """The alignment of ``ranks`` (with their ``collectives`` still attached); ``None`` for one
    rank, or ranks without collectives."""
    cols = [r.collectives for r in ranks]
    if len(ranks) < 2 or any(c is None for c in cols):
        return None
    offsets, problem = _offsets(ranks, cols)
    m = _match(cols, offsets)
    problem = problem or (_implausible(m, ranks) if m.count else None)
    if problem is not None or m.count == 0:
        return Alignment(tuple(offsets), problem, (), (), tuple(tuple(c.arrival_us) for c in cols))
    entries: list[list[tuple[int, int]]] = [[] for _ in range(m.count)]
    for k, i, j in zip(m.match, m.rank_pos, m.row):
        entries[k].append((i, j))
    return Alignment(tuple(offsets), None, tuple(map(tuple, entries)), tuple(_late(m)),
                     tuple(map(tuple, _windows(m, cols, offsets))))


def cross_rank(
    ranks: Sequence[RankReport], run_path: str
) -> tuple[tuple[RankReport, ...], tuple[dict[str, Any], ...] | None, list[TraceIssue]]:
    """The run's ranks with the skew/transfer split filled in, its stragglers, and issues.

    Without a split (one rank, repeated rank numbers, no collective matched, or clocks that
    cannot be aligned, the last one named in the issues) the ranks come back unchanged and the
    stragglers are ``None``. The per-collective data is
    dropped from the reports either way.
    """
    cols = [r.collectives for r in ranks]
    plain = tuple(dataclasses.replace(r, collectives=None) for r in ranks)
    if len(ranks) < 2 or any(c is None for c in cols) or len({r.rank for r in ranks}) != len(ranks):
        return plain, None, []
    offsets, problem = _offsets(ranks, cols)
    m = _match(cols, offsets)
    if m.count == 0:
        return plain, None, []
    problem = problem or _implausible(m, ranks)
    if problem is not None:
        return plain, None, [TraceIssue(run_path, f"{run_path}: {problem}; the cross-rank split "
                                                  "(skew_us, transfer_us, stragglers) is left out")]
    his = _windows(m, cols, offsets)
    # each matched collective's own skew, |window ∖ compute|, for who caused it
    own = [iv.measure_in_windows(c.blocked, c.arrival_us, hi) if c.blocked is not None
           else [x - y for x, y in zip(map(sub, hi, c.arrival_us), iv.measure_in_windows(c.compute, c.arrival_us, hi))]
           for c, hi in zip(cols, his)]
    skew = [own[i][j] for i, j in zip(m.rank_pos, m.row)]
    split = tuple(_split_rank(r, c, hi) for r, c, hi in zip(ranks, cols, his))
    return split, _stragglers(m, [x if x >= 0.0 else 0.0 for x in skew], ranks, cols), []
