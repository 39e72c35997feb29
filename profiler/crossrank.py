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
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cpdpkit.profiler import intervals as iv
from cpdpkit.profiler.report import RankReport, TraceIssue, WaitSplit
from cpdpkit.profiler.trace import RankTrace

__all__ = [
    "RankCollectives",
    "rank_collectives",
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


@dataclass(frozen=True, eq=False)
class RankCollectives:
    """One rank's collectives, sorted by arrival, as the cross-rank match needs them.

    ``arrival_us`` and ``extent_end_us`` are on the rank's trace clock (``RankTrace.start_us``);
    the wall clock is ``base_ns / 1000 + origin_us + arrival_us`` when ``wall_clock``. ``pg`` is
    the process group (``None``: unknown, not matched), ``seq`` the ``Seq`` argument (-1: none),
    ``step`` the ``ProfilerStep`` number (-1: outside every step), ``compute`` the rank's compute,
    ``blocked`` (CPU traces) the training thread's blocked time: there only that is exposed.
    """

    wall_clock: bool
    base_ns: int
    origin_us: float
    pg: tuple[str | None, ...]
    seq: np.ndarray
    kind: np.ndarray
    step: np.ndarray
    arrival_us: np.ndarray
    extent_end_us: np.ndarray
    compute: iv.Intervals
    blocked: iv.Intervals | None = None

    def __len__(self) -> int:
        return int(self.arrival_us.shape[0])


def _clock(trace: RankTrace) -> tuple[bool, int]:
    base = trace.meta.get("baseTimeNanoseconds")
    if isinstance(base, (int, float)) and not isinstance(base, bool) and 0 < base < 1e30:  # finite, positive
        return True, int(base)
    return trace.origin_us > WALL_CLOCK_TS_US, 0


def _picked(trace: RankTrace, rows: np.ndarray, pg_known: np.ndarray) -> np.ndarray:
    """Which entries of ``rows`` are collectives (see the module docstring)."""
    on_gpu = trace.stream[rows] != -1
    if on_gpu.any():
        return on_gpu
    roles = np.array([c.cpu_role for c in trace.name_classes], dtype=object)[trace.name_id[rows]]
    best, best_known = np.zeros(rows.size, dtype=bool), -1
    for role in _CPU_COLLECTIVE_ROLES:
        pick = roles == role
        known = int(np.count_nonzero(pick & pg_known))
        if pick.any() and known == np.count_nonzero(pick):
            return pick
        if known > best_known:
            best, best_known = pick, known
    return best


def _step_numbers(anchor: np.ndarray, steps: Sequence[tuple[int, float, float]]) -> np.ndarray:
    if not steps:
        return np.full(anchor.size, -1, dtype=np.int64)
    nums = np.array([s[0] for s in steps], dtype=np.int64)
    lo = np.array([s[1] for s in steps])
    hi = np.array([s[2] for s in steps])
    idx = np.searchsorted(lo, anchor, side="right") - 1
    inside = (idx >= 0) & (anchor <= hi[np.clip(idx, 0, None)])
    return np.where(inside, nums[np.clip(idx, 0, None)], -1)


def rank_collectives(
    trace: RankTrace,
    rows: np.ndarray,
    kinds: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    compute: iv.Intervals,
    *,
    pgs: Sequence[str | None],
    groups: Mapping[str, Any],
    steps: Sequence[tuple[int, float, float]],
    anchor_us: np.ndarray,
    blocked: iv.Intervals | None = None,
) -> RankCollectives:
    """One rank's collectives from the overlap analysis' comm entries: ``rows`` (trace rows;
    on CPU a collective's row is listed first as itself, then once per wait gap attributed to
    it), their ``kinds``, ``starts``/``ends`` (the intervals counted as communication; GPU
    times already rounded as the overlap analysis rounds them),
    ``compute``, process groups ``pgs``, the trace's ``groups``, its ``steps`` and each entry's
    launch time ``anchor_us``."""
    rows = np.asarray(rows, dtype=np.int64)
    default = None if groups else ""  # no process groups listed: one default group
    pg_all = [p if p is not None else default for p in pgs]
    pg_known = np.array([p is not None for p in pg_all], dtype=bool)
    idx = np.flatnonzero(_picked(trace, rows, pg_known)) if rows.size else np.empty(0, dtype=np.int64)
    # a row's first entry is the collective itself, later ones its waits (np.unique would
    # import numpy.ma, tens of milliseconds, on first use)
    by_row = np.argsort(rows[idx], kind="stable")
    sorted_rows = rows[idx][by_row]
    first = np.ones(sorted_rows.size, dtype=bool)
    first[1:] = sorted_rows[1:] != sorted_rows[:-1]
    uniq, own, waits = sorted_rows[first], idx[by_row[first]], idx[by_row[~first]]
    starts, ends = np.asarray(starts, float), np.asarray(ends, float)
    extent_end = ends[own].copy()
    np.maximum.at(extent_end, np.searchsorted(uniq, rows[waits]), ends[waits])
    pg = [pg_all[i] for i in own.tolist()]
    kind = np.asarray(kinds, dtype=object)[own]
    keep = kind != "send_recv"
    order = np.argsort(starts[own], kind="stable")
    order = order[keep[order]]
    wall, base = _clock(trace)
    seq = np.array([trace.comm_seq.get(r, -1) for r in uniq.tolist()], dtype=np.int64)
    return RankCollectives(
        wall_clock=wall,
        base_ns=base,
        origin_us=trace.origin_us,
        pg=tuple(pg[i] for i in order.tolist()),
        seq=seq[order],
        kind=kind[order],
        step=_step_numbers(np.asarray(anchor_us, float)[own], steps)[order],
        arrival_us=starts[own][order],
        extent_end_us=extent_end[order],
        compute=compute,
        blocked=blocked,
    )


@dataclass(frozen=True, eq=False)
class _Matches:
    """Matched collectives as flat entries: ``match`` id, rank position, row in that rank's
    :class:`RankCollectives`, and arrival on the common clock."""

    count: int
    match: np.ndarray
    rank_pos: np.ndarray
    row: np.ndarray
    arrival_us: np.ndarray


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
    for pg, seq, step in zip(c.pg, c.seq.tolist(), c.step.tolist()):
        if pg is None:
            keys.append(None)
            continue
        group = (pg, "seq", seq) if pg in by_seq else (pg, "step", step)
        keys.append((*group, seen[group]))
        seen[group] += 1
    return keys


def _match(cols: Sequence[RankCollectives], offsets: Sequence[float]) -> _Matches:
    pgs = {pg for c in cols for pg in c.pg if pg is not None}
    by_seq = {pg for pg in pgs if all(all(s >= 0 for p, s in zip(c.pg, c.seq.tolist()) if p == pg) for c in cols)}
    table: dict[tuple, list[tuple[int, int]]] = {}
    members: dict[str, set[int]] = {}
    for i, c in enumerate(cols):
        for j, key in enumerate(_keys(c, by_seq)):
            if key is not None:
                table.setdefault(key, []).append((i, j))
                members.setdefault(key[0], set()).add(i)
    entries: list[tuple[int, int, int]] = []
    count = 0
    for key, found in table.items():
        if len(found) < 2 or len(found) != len(members[key[0]]):
            continue
        if len({cols[i].kind[j] for i, j in found}) != 1:
            continue
        entries.extend((count, i, j) for i, j in found)
        count += 1
    flat = np.array(entries, dtype=np.int64).reshape(-1, 3)
    m, pos, row = flat[:, 0], flat[:, 1], flat[:, 2]
    arrival = np.array([cols[i].arrival_us[j] + offsets[i] for i, j in zip(pos.tolist(), row.tolist())], dtype=float)
    return _Matches(count, m, pos, row, arrival)


def _implausible(m: _Matches, ranks: Sequence[RankReport]) -> str | None:
    first = np.full(m.count, np.inf)
    last = np.full(m.count, -np.inf)
    np.minimum.at(first, m.match, m.arrival_us)
    np.maximum.at(last, m.match, m.arrival_us)
    spread = statistics.median((last - first).tolist())  # np.median imports numpy.ma (slow) on first use
    if spread <= MAX_CLOCK_OFFSET_US:
        return None
    mean = np.bincount(m.match, weights=m.arrival_us, minlength=m.count) / np.bincount(m.match, minlength=m.count)
    dev = m.arrival_us - mean[m.match]
    off = {p: statistics.median(dev[m.rank_pos == p].tolist()) for p in sorted(set(m.rank_pos.tolist()))}
    typical = statistics.median(off.values())
    ref = min(off, key=lambda p: abs(off[p] - typical))  # the most typical clock (ties: the lowest rank)
    worst = max(off, key=lambda p: abs(off[p] - off[ref]))
    return (f"implausible clock offsets between ranks: matched collectives' arrivals are {spread / 1e6:.1f} s apart "
            f"at the median (bound {MAX_CLOCK_OFFSET_US / 1e6:.0f} s); rank {ranks[worst].rank}'s clock is "
            f"{(off[worst] - off[ref]) / 1e6:+.1f} s off rank {ranks[ref].rank}'s")


def _windows(m: _Matches, cols: Sequence[RankCollectives], offsets: Sequence[float]) -> list[np.ndarray]:
    """Per rank, the end of each collective's skew window ``[arrival, min(last, extent end)]`` on
    its own clock (the arrival itself when the collective is not matched: an empty window)."""
    last = np.full(m.count, -np.inf)
    np.maximum.at(last, m.match, m.arrival_us)
    his = []
    for i, c in enumerate(cols):
        sel = m.rank_pos == i
        rows = m.row[sel]
        hi = c.arrival_us.copy()
        hi[rows] = np.maximum(c.arrival_us[rows], np.minimum(last[m.match[sel]] - offsets[i], c.extent_end_us[rows]))
        his.append(hi)
    return his


def _skew_us(c: RankCollectives, hi: np.ndarray, sel: np.ndarray) -> float:
    """``|∪ skew windows ∖ compute|`` (CPU: ``∩ blocked``) over the collectives ``sel``."""
    windows = iv.merge(c.arrival_us[sel], hi[sel])
    if c.blocked is not None:
        return iv.total_us(iv.intersect(windows, c.blocked))
    return iv.total_us(iv.subtract(windows, c.compute))


def _split(skew: float, exposed: float) -> tuple[float, float]:
    s = min(max(skew, 0.0), exposed)
    return s, max(exposed - s, 0.0)


def _split_rank(r: RankReport, c: RankCollectives, hi: np.ndarray) -> RankReport:
    by_kind = {kind: WaitSplit(*_split(_skew_us(c, hi, c.kind == kind), t.exposed_us)) for kind, t in r.by_kind.items()}
    steps = []
    for s in r.steps:
        sk, tr = _split(_skew_us(c, hi, c.step == s.step), s.exposed_us)
        steps.append(dataclasses.replace(s, skew_us=sk, transfer_us=tr))
    total, transfer = _split(_skew_us(c, hi, np.ones(len(c), dtype=bool)), r.exposed_us)
    return dataclasses.replace(r, skew_us=total, transfer_us=transfer, skew_by_kind=by_kind, steps=tuple(steps),
                               collectives=None)


def _step_weights(r: RankReport, c: RankCollectives) -> np.ndarray:
    """Per collective: 1 / complete steps when it lies in a complete step (0 outside); 1
    without step markers (whole-trace totals)."""
    full = {s.step for s in r.full_steps}
    if not full:
        return np.ones(len(c))
    return np.array([s in full for s in c.step.tolist()], dtype=float) / len(full)


def _stragglers(m: _Matches, skew: np.ndarray, ranks: Sequence[RankReport],
                cols: Sequence[RankCollectives]) -> tuple[dict[str, Any], ...]:
    order = np.lexsort((m.arrival_us, m.match))
    ends = np.flatnonzero(np.diff(np.append(m.match[order], m.count)))  # the last entry of each match
    latest, second = order[ends], order[ends - 1]  # every match has two or more entries
    late = (m.arrival_us[latest] - m.arrival_us[second]) > LATE_MARGIN_US
    late_pos = np.full(m.count, -1)
    late_pos[m.match[latest[late]]] = m.rank_pos[latest[late]]
    weights = [_step_weights(r, c) for r, c in zip(ranks, cols)]
    w = np.array([weights[i][j] for i, j in zip(m.rank_pos.tolist(), m.row.tolist())], dtype=float)
    culprit = late_pos[m.match]
    waited = (culprit >= 0) & (culprit != m.rank_pos)
    caused = np.bincount(culprit[waited], weights=(skew * w)[waited], minlength=len(ranks))
    late_count = np.bincount(m.rank_pos[latest[late]], minlength=len(ranks))
    took_part = np.bincount(m.rank_pos, minlength=len(ranks))
    out = [
        {"rank": ranks[p].rank, "late_count": int(late_count[p]), "late_frac": float(late_count[p] / took_part[p]),
         "caused_wait_us_per_step": float(caused[p])}
        for p in range(len(ranks)) if late_count[p] > 0
    ]
    out.sort(key=lambda d: (-d["caused_wait_us_per_step"], -d["late_count"], d["rank"]))
    return tuple(out)


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
           else (hi - c.arrival_us) - iv.measure_in_windows(c.compute, c.arrival_us, hi) for c, hi in zip(cols, his)]
    skew = np.array([own[i][j] for i, j in zip(m.rank_pos.tolist(), m.row.tolist())], dtype=float)
    split = tuple(_split_rank(r, c, hi) for r, c, hi in zip(ranks, cols, his))
    return split, _stragglers(m, np.maximum(skew, 0.0), ranks, cols), []
