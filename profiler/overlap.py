"""Exposed and hidden communication of one rank: the analysis behind ``cpdpkit profile``.

Definitions (``|·|`` is total length of merged intervals):

* exposed = ``|comm ∖ compute|`` — communication while the compute timeline does nothing;
* hidden = ``|comm ∩ compute|`` — communication that runs under compute;
* overlap % = hidden / comm × 100 (Holistic Trace Analysis' ``comp_comm_overlap_pctg``).

What is communication and compute depends on the trace (rules per event name in
:mod:`cpdpkit.profiler.classify`):

GPU traces (any event on a GPU stream): comm = NCCL kernels (plus emulated link time,
``cpdpkit::emu::*``), compute = the other non-memory kernels, all streams merged — exactly
HTA's ``get_comm_comp_overlap`` (plus: copies, sets and synchronisation records are never
compute, by name or by category, ``_NOT_COMPUTE_CATS``), including its two details: GPU times are rounded inward
to whole microseconds, and with two or more steps only work launched before the last
``ProfilerStep`` starts is counted (the last step may be cut off; it is reported per step
with ``partial`` set). Per step, a kernel belongs to the ``ProfilerStep#N`` in
which its CUDA launch ran (matched by correlation id), since GPU work lags the CPU.

CPU traces: exposed = the time the *training thread* (the one that holds the
``ProfilerStep#N`` markers; else the thread with most ``cpu_op`` time) is blocked in
communication, and nothing else:

* its collective calls — c10d call sites (``c10d::*``, ``record_param_comms``) and cpdpkit
  communication phases (:mod:`cpdpkit.labels`) — for their whole span (descheduled inside
  one, the thread is still in the call);
* its waits. ``Work.wait()`` leaves no event, so waits are read from the gaps between the
  thread's events: a gap in which a collective completes (a ``gloo:*`` op on gloo's worker
  threads, or ``cpdpkit::emu::*`` modeled link time, ends in it or up to ``WAIT_SLACK_US``
  after it) is a wait from its start until the last such completion plus ``WAIT_SLACK_US``
  (the waiter's wake-up), attributed to the first collective completing in it. The rest of
  the gap — the thread waiting for a core after the collective woke it, or running Python
  after ``wait()`` returned (freeing tensors, say) — is not communication; a trace cannot
  tell those two apart. A wait whose gap ends inside an emulated link (a ``cpdpkit::emu::*``
  event) lasts to the gap's end: the waiter sleeps to the modeled end itself, and the
  emulator's event may close milliseconds later (its Python helper thread waits for the GIL).

**What a trace cannot show** (a limit of the input, not of the rule): the scheduler leaves no
event, so a training thread that is runnable but off the CPU looks like one that is blocked or
computing, whichever events surround it. Descheduled inside a collective call or its wait, it
counts as exposed; descheduled in a gap in which a collective completes (between compute's return
and ``wait()``, say), as a wait; descheduled in a call's Python binding, before its op's event
begins or after it ends (dispatch, the GIL, wrapping the Work), as nothing.
Measured against ``/proc/thread-self/schedstat`` on unpinned jobs (``benchmarks/profiler_cpu_truth.py``,
docs/results.md), that is where the misses are. Telling them apart needs scheduler data in the
capture (context-switch records of the training thread, e.g. ``perf sched`` or
``perf_event_open``), which Kineto traces do not carry.

Compute = the training thread's ``cpu_op`` events that are not communication, plus gaps
between its events shorter than ``IDLE_GAP_US`` that are no wait (Python/dispatch overhead),
minus its call sites and phases (ops nested in one are part of communicating). Longer gaps
are idle: neither compute nor exposed. comm = communication in flight (the ``gloo:*``/emu
spans, any thread's call sites and phases, the waits) while the thread computes or is
blocked, so comm = exposed + hidden: a gloo span's time while the thread is idle (between
steps, descheduled, in Python), or spent queued before gloo's worker picks it up (the span
starts when the worker runs it, pytorch PR 61342), is neither. Per step, intervals are
clipped to the ``ProfilerStep#N`` window. Slices by kind, process group and tier are each
merged on their own, so slices may overlap in time and need not sum to the total.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from itertools import compress, repeat
from operator import and_, eq, itemgetter
from typing import Any

from cpdpkit.profiler import intervals as iv
from cpdpkit.profiler._stats import median
from cpdpkit.profiler.classify import parse_emu_label, step_number
from cpdpkit.profiler.crossrank import rank_collectives
from cpdpkit.profiler.report import CommTotals, RankReport, StepReport
from cpdpkit.profiler.trace import RankTrace

__all__ = ["analyze_trace", "PARTIAL_STEP_FRACTION", "IDLE_GAP_US", "WAIT_SLACK_US"]

_CPU_OP_CATS = frozenset({"cpu_op", "operator"})  # compared lowercased: torch 1.8 wrote "Operator"
# GPU-stream events that are no kernel, whatever their name (categories of torch 1.8 to 2.x)
_NOT_COMPUTE_CATS = frozenset({"gpu_memcpy", "gpu_memset", "memcpy", "memset", "cuda_sync", "gpu_user_annotation"})
_CPU_COMM_ROLES = frozenset({"backend", "emu", "phase", "callsite"})
_TRAINING_COMM_ROLES = frozenset({"phase", "callsite", "backend"})
_INFLIGHT_ROLES = frozenset({"backend", "emu"})
# gaps between the training thread's ops shorter than this are Python/dispatch overhead
# (compute); longer ones are idle: waiting when a collective is in flight
IDLE_GAP_US = 100.0
# a collective that completes this long after the training thread resumed still ended its
# wait (the worker's profiler event closes just after it wakes the waiter); and a wait ends at
# most this long after the last collective completing in it (the waiter's wake-up)
WAIT_SLACK_US = 100.0
# the last step is "partial" (left open by trace_rank at exit) when shorter than this share
# of the median complete step
PARTIAL_STEP_FRACTION = 0.1

_Steps = list[tuple[int, float, float]]  # (ProfilerStep number, start_us, end_us), sorted by start


def _name_flags(trace: RankTrace, attr: str, values: Collection[str]) -> list[bool]:
    return [getattr(c, attr) in values for c in trace.name_classes]


def _cat_flags(trace: RankTrace, cats: frozenset[str]) -> list[bool]:
    return [c.lower() in cats for c in trace.cats]


def _training_thread(trace: RankTrace, step_rows: list[int]) -> int | None:
    tid = trace.thread_id
    if step_rows:
        return Counter(tid[r] for r in step_rows).most_common(1)[0][0]
    is_op, stream = _cat_flags(trace, _CPU_OP_CATS), trace.stream
    rows = [r for r in compress(range(trace.num_events), map(is_op.__getitem__, trace.cat_id)) if stream[r] == -1]
    if not rows:
        return None
    s, e = trace.start_us, trace.end_us
    busy = [0.0] * (max(tid[r] for r in rows) + 1)
    for r in rows:  # summed in row order
        busy[tid[r]] += e[r] - s[r]
    for t, label in trace.thread_names.items():
        if "gloo" in label and t < len(busy):
            busy[t] = -1.0
    return max(range(len(busy)), key=busy.__getitem__)  # the first of equals


def _steps(trace: RankTrace, thread: int | None, step_rows: list[int]) -> _Steps:
    tid, nid, names = trace.thread_id, trace.name_id, trace.names
    rows = step_rows if thread is None else [r for r in step_rows if tid[r] == thread]
    s, e = trace.start_us, trace.end_us
    steps = [(step_number(names[nid[r]]), s[r], e[r]) for r in rows]
    return sorted(steps, key=lambda x: x[1])


def _kinds_of(trace: RankTrace, rows: Sequence[int]) -> list[str]:
    """Each row's collective kind: its ``Collective name`` argument, else by its name."""
    if not rows:
        return []
    gpu_table = [c.kind or "other" for c in trace.name_classes]
    cpu_table = [c.cpu_kind or "other" for c in trace.name_classes]
    nid, stream, comm_kind = trace.name_id, trace.stream, trace.comm_kind
    out = []
    for r in rows:
        kind = comm_kind.get(r)
        if kind is None:
            kind = gpu_table[nid[r]] if stream[r] != -1 else cpu_table[nid[r]]
        out.append(kind)
    return out


def _process_groups(trace: RankTrace) -> dict[str, dict[str, Any]]:
    info = trace.meta.get("distributedInfo")
    config = info.get("pg_config") if isinstance(info, dict) else None
    groups: dict[str, dict[str, Any]] = {}
    if isinstance(config, list):
        for pg in config:
            if isinstance(pg, dict) and isinstance(pg.get("pg_name"), (str, int)):
                ranks = pg.get("ranks")
                groups[str(pg["pg_name"])] = {
                    "desc": pg.get("pg_desc") if isinstance(pg.get("pg_desc"), str) else None,
                    "ranks": [r for r in ranks if type(r) is int] if isinstance(ranks, list) else None,
                }
    return groups


def _labels(trace: RankTrace, rows: Sequence[int], groups: Mapping[str, Mapping[str, Any]]) -> tuple[list, list]:
    """Process group and tier of each comm row (``None`` when unknown)."""
    by_ranks: dict[tuple[int, ...], list[str]] = {}
    for name, pg in groups.items():
        if pg.get("ranks"):
            by_ranks.setdefault(tuple(sorted(pg["ranks"])), []).append(name)
    only = next(iter(groups)) if len(groups) == 1 else None
    pgs: list[str | None] = []
    tiers: list[str | None] = []
    emu_cache: dict[int, Any] = {}
    for row in rows:
        nid = trace.name_id[row]
        pg, tier = trace.pg_name.get(row), None
        if trace.name_classes[nid].cpu_role == "emu" and trace.stream[row] == -1:
            if nid not in emu_cache:
                emu_cache[nid] = parse_emu_label(trace.names[nid])
            label = emu_cache[nid]
            if label is not None:
                tier = label.tier
                match = by_ranks.get(tuple(sorted(label.ranks))) if label.ranks else None
                if pg is None and match and len(match) == 1:
                    pg = match[0]
        pgs.append(pg if pg is not None else only)
        tiers.append(tier)
    return pgs, tiers


def _split(starts: Sequence[float], ends: Sequence[float], compute: iv.Intervals,
           keep: iv.Intervals | None = None) -> tuple[iv.Intervals, iv.Intervals, iv.Intervals]:
    """(comm, exposed, hidden) of the intervals; with ``keep`` (CPU mode: the training thread's
    compute and blocked time) communication outside ``keep`` is dropped, so exposed is what
    the thread was blocked in."""
    comm = iv.merge(starts, ends)
    if keep is not None:
        comm = iv.intersect(comm, keep)
    return comm, iv.subtract(comm, compute), iv.intersect(comm, compute)


def _totals(comm: iv.Intervals, exposed: iv.Intervals, hidden: iv.Intervals) -> CommTotals:
    return CommTotals(iv.total_us(comm), iv.total_us(exposed), iv.total_us(hidden))


def _by_label(labels: Iterable[Any], starts: Iterable[float],
              ends: Iterable[float]) -> dict[Any, tuple[list[float], list[float]]]:
    """The intervals of each label (``None`` left out), sorted by label, in their order."""
    by: dict[Any, tuple[list[float], list[float]]] = {}
    for label, s, e in zip(labels, starts, ends):
        if label is not None:
            got = by.get(label)
            if got is None:
                got = by[label] = ([], [])
            got[0].append(s)
            got[1].append(e)
    return {label: by[label] for label in sorted(by)}


def _grouped(labels: Iterable[Any], starts: Sequence[float], ends: Sequence[float],
             compute: iv.Intervals, keep: iv.Intervals | None = None) -> dict[str, CommTotals]:
    by = _by_label(labels, starts, ends)
    return {str(label): _totals(*_split(s, e, compute, keep)) for label, (s, e) in by.items()}


def _launches(trace: RankTrace) -> dict[int, float]:
    """Correlation id -> CPU start of the first event (by row) with it: the launch of the GPU
    work that carries the same correlation id."""
    rows = trace.launch_rows()
    if len(rows) < 2:
        return {trace.correlation[r]: trace.start_us[r] for r in rows}
    rows.reverse()  # the first row of a correlation id is written last, so it wins
    take = itemgetter(*rows)  # gathers in C
    return dict(zip(take(trace.correlation), take(trace.start_us)))


def _launch_us(trace: RankTrace, rows: Sequence[int], launches: Mapping[int, float]) -> tuple[list[float], list[bool]]:
    """CPU start of the event that launched each row (same correlation id, ``launches``), and
    whether one was found; rows without a launch keep their own start."""
    corr, start = trace.correlation, trace.start_us
    ids = [corr[r] for r in rows]
    return list(map(launches.get, ids, [start[r] for r in rows])), list(map(launches.__contains__, ids))


def _mark_partial(steps: _Steps) -> list[bool]:
    partial = [False] * len(steps)
    if len(steps) >= 2:
        durations = [e - s for _, s, e in steps]
        if durations[-1] < PARTIAL_STEP_FRACTION * median(durations[:-1]):
            partial[-1] = True
    return partial


def _steps_cpu(
    steps: _Steps,
    compute: iv.Intervals,
    sets: Mapping[str | None, tuple[iv.Intervals, iv.Intervals, iv.Intervals]],
    op_starts: list[float],
) -> list[StepReport]:
    lo = [s[1] for s in steps]
    hi = [s[2] for s in steps]
    measured = {key: [iv.measure_in_windows(x, lo, hi) for x in triple] for key, triple in sets.items()}
    compute_us = iv.measure_in_windows(compute, lo, hi)
    out = []
    for k, ((num, start, end), partial) in enumerate(zip(steps, _mark_partial(steps))):
        by_kind = {key: CommTotals(*(m[k] for m in ms)) for key, ms in measured.items() if key and ms[0][k] > 0}
        c, e, h = (m[k] for m in measured[None])
        # a last step in which the training thread starts no op is the one left open at exit
        no_ops = bisect_right(op_starts, end) == bisect_left(op_starts, start)
        empty = k == len(steps) - 1 and len(steps) > 1 and c == 0 and no_ops
        out.append(StepReport(num, end - start, compute_us[k], c, e, h, by_kind, partial or empty))
    return out


def _per_step(step: list[int], num_steps: int, *columns: Sequence[Any]) -> list[list[list[Any]]]:
    """``columns`` split by ``step`` (each entry's step index, -1: none): per step, per column,
    the step's entries in their order."""
    order = sorted(range(len(step)), key=step.__getitem__)  # stable: entries keep their order
    keys = [step[i] for i in order]
    cols = [[c[i] for i in order] for c in columns]
    bounds = [bisect_left(keys, k) for k in range(num_steps + 1)]
    return [[c[lo:hi] for c in cols] for lo, hi in zip(bounds, bounds[1:])]


def _steps_gpu(steps: _Steps, compute: tuple[list[float], list[float], list[int]],
               comm: tuple[list[float], list[float], list[int]], kinds: list[str],
               compute_all: iv.Intervals) -> list[StepReport]:
    """Per step: ``compute`` and ``comm`` are (starts, ends, step indexes) of all compute and
    comm rows (not only HTA's kept ones), ``kinds`` the comm rows' kinds, ``compute_all`` the
    merged compute rows."""
    comm_by = _per_step(comm[2], len(steps), comm[0], comm[1], kinds)
    mine_by = _per_step(compute[2], len(steps), compute[0], compute[1])
    partial = [False] * (len(steps) - 1) + [len(steps) >= 2]
    out = []
    for k, (num, start, end) in enumerate(steps):
        cs, ce, ck = comm_by[k]
        total = _totals(*_split(cs, ce, compute_all))
        by_kind = _grouped(ck, cs, ce, compute_all)
        out.append(StepReport(num, end - start, iv.total_us(iv.merge(*mine_by[k])),
                              total.comm_us, total.exposed_us, total.hidden_us, by_kind, partial[k]))
    return out


def _waits(g0: Sequence[float], g1: Sequence[float],
           done: Sequence[float]) -> tuple[list[bool], list[float], list[int]]:
    """Which of the training thread's gaps ``[g0, g1]`` are waits, where each wait ends, and the
    index in ``done`` (sorted completion times of in-flight collectives) of the first collective
    completing in it (the one the wait is attributed to). A gap is a wait when a collective
    completes in it (or up to ``WAIT_SLACK_US`` after it); the wait lasts until the last such
    completion plus ``WAIT_SLACK_US`` (the waiter's wake-up), at most to the gap's end."""
    if not done:
        return [False] * len(g0), list(g1), [0] * len(g0)
    top = len(done) - 1
    completes: list[bool] = []
    wait_end: list[float] = []
    first: list[int] = []
    for a, b in zip(g0, g1):
        k = bisect_left(done, a)
        if k > top:
            k = top
        late = b + WAIT_SLACK_US
        c = a <= done[k] <= late
        completes.append(c)
        first.append(k)
        if c:
            j = bisect_right(done, late) - 1
            end = done[j if j > 0 else 0] + WAIT_SLACK_US
            end = end if end > a else a
            wait_end.append(end if end < b else b)
        else:
            wait_end.append(b)
    return completes, wait_end, first


_Timeline = tuple[iv.Intervals, iv.Intervals, list[float], list[float], list[int], list[float]]


def _thread_events(trace: RankTrace, thread: int) -> tuple[list[int], list[int], list[int]]:
    """The training thread's ops (``cpu_op`` events of compute names), its communication call
    sites and phases, and its other events (marks), each in row order."""
    rows = compress(range(trace.num_events),
                    map(and_, map(eq, trace.thread_id, repeat(thread)), map(eq, trace.stream, repeat(-1))))
    is_op = _cat_flags(trace, _CPU_OP_CATS)
    compute_name = _name_flags(trace, "cpu_role", {"cpu"})
    comm_name = _name_flags(trace, "cpu_role", _TRAINING_COMM_ROLES)
    nid, cat = trace.name_id, trace.cat_id
    ops: list[int] = []
    comm: list[int] = []
    marks: list[int] = []
    for r in rows:
        n = nid[r]
        if is_op[cat[r]]:
            if compute_name[n]:
                ops.append(r)
        else:
            marks.append(r)
        if comm_name[n]:
            comm.append(r)
    return ops, comm, marks


def _cpu_timeline(trace: RankTrace, thread: int | None, role: Any) -> _Timeline:
    """The training thread's compute, its blocked time (call sites, sync phases and waits),
    its waits as ``(starts, ends, collective_rows)``, and the sorted start times of its ops.

    Compute is the thread's ops plus the short gaps between them (Python and dispatch
    overhead), minus its communication call sites and sync phases. A gap in which a
    collective completes starts with a wait (:func:`_waits`); what is left of it, and any
    other gap, is overhead when shorter than ``IDLE_GAP_US``, else idle (neither compute nor
    blocked)."""
    if thread is None:
        return iv.EMPTY, iv.EMPTY, [], [], [], []
    ops, comm_here, marks = _thread_events(trace, thread)
    s, e = trace.start_us, trace.end_us
    blocked = iv.merge([s[r] for r in comm_here], [e[r] for r in comm_here])
    # the thread's other events (ProfilerStep#N, record_function labels) show it running at
    # their edges: zero-length marks split gaps there, so a wait ends at its step's end
    edges = [s[r] for r in marks] + [e[r] for r in marks]
    ops_s = [s[r] for r in ops]
    active = iv.union(iv.merge(ops_s, [e[r] for r in ops]), blocked, iv.merge(edges, edges))
    wait_s: list[float] = []
    wait_e: list[float] = []
    wait_rows: list[int] = []
    if len(active) > 1:
        g0, g1 = active.ends[:-1], active.starts[1:]
        inflight = sorted(role(_INFLIGHT_ROLES), key=e.__getitem__)
        completes, wait_end, k = _waits(g0, g1, [e[r] for r in inflight])
        # a thread waiting on an emulated collective sleeps to its modeled end itself, while
        # the emulator's event may close milliseconds later (its Python helper thread waits
        # for the GIL): a wait whose gap ends inside an emulated link lasts to the gap's end
        emu = role({"emu"})
        link_s, link_e = iv.merge([s[r] for r in emu], [e[r] for r in emu])
        if link_s:
            for i, (b, c) in enumerate(zip(g1, completes)):
                at = bisect_left(link_s, b) - 1
                if c and at >= 0 and link_e[at] > b:
                    wait_end[i] = b
        # what follows a wait's end in its gap (Python after wait(): freeing tensors, the next
        # call; or the thread descheduled) is a gap of its own: overhead when short, else idle
        over_s: list[float] = []
        over_e: list[float] = []
        for a, b, c, w in zip(g0, g1, completes, wait_end):
            rest = w if c else a
            if b - rest < IDLE_GAP_US and b > rest:
                over_s.append(rest)
                over_e.append(b)
        active = iv.union(active, iv.Intervals(over_s, over_e))
        wait_s = list(compress(g0, completes))
        wait_e = list(compress(wait_end, completes))
        wait_rows = [inflight[j] for j in compress(k, completes)]
    op_starts = sorted(ops_s + [s[r] for r in comm_here])
    blocked = iv.union(blocked, iv.merge(wait_s, wait_e))
    return iv.subtract(active, blocked), blocked, wait_s, wait_e, wait_rows, op_starts


def _gpu_rows(trace: RankTrace, rows: Sequence[int], launches: Mapping[int, float],
             steps: _Steps) -> tuple[list[float], list[float], list[bool], list[int]]:
    """Per row, in one pass: its start and end, GPU events rounded inward to whole
    microseconds (start up, end down) as HTA does for nanosecond-resolution traces, whose
    adjacent kernels on one stream can overlap slightly; whether HTA's filter keeps it (with
    two or more steps: GPU work launched before the last step starts, the last step may be cut
    off by the end of the trace; CPU rows by their start); and the index of the step whose
    window holds its launch (-1: none). The launch is the CPU event with the same correlation
    id (``launches``); a row without one counts from its own (unrounded) start."""
    s, e, stream, corr, o = trace.start_us, trace.end_us, trace.stream, trace.correlation, trace.origin_us
    last = steps[-1][1] if len(steps) >= 2 else None
    step_lo = [x[1] for x in steps]
    step_hi = [x[2] for x in steps]
    starts: list[float] = []
    ends: list[float] = []
    kept: list[bool] = []
    step: list[int] = []
    for r in rows:
        a, b = s[r], e[r]
        launch = launches.get(corr[r])
        found = launch is not None
        if not found:
            launch = a
        if stream[r] != -1:
            # ceil(y) = -(-y // 1.0) and floor(y) = y // 1.0 exactly, in floats
            a = -(-(a + o) // 1.0) - o
            b = (b + o) // 1.0 - o
            if not b >= a:
                b = a
            kept.append(last is None or (found and launch < last))
        else:
            kept.append(last is None or launch < last)
        k = bisect_right(step_lo, launch) - 1
        step.append(k if k >= 0 and launch <= step_hi[k] else -1)
        starts.append(a)
        ends.append(b)
    return starts, ends, kept, step


def _gpu_analysis(trace, steps, gpu_comm, gpu_compute, role, launches):  # type: ignore[no-untyped-def]
    """GPU mode: (label rows, their kinds, comm starts, comm ends, compute, step reports)."""
    all_comm = sorted(gpu_comm + role({"emu"}))
    comm_s, comm_e, comm_kept, comm_step = _gpu_rows(trace, all_comm, launches, steps)
    compute_s, compute_e, compute_kept, compute_step = _gpu_rows(trace, gpu_compute, launches, steps)
    all_kinds = _kinds_of(trace, all_comm)
    compute_all = iv.merge(compute_s, compute_e)
    compute = compute_all if all(compute_kept) else iv.merge(list(compress(compute_s, compute_kept)),
                                                             list(compress(compute_e, compute_kept)))
    step_reports = (
        _steps_gpu(steps, (compute_s, compute_e, compute_step), (comm_s, comm_e, comm_step), all_kinds,
                   compute_all)
        if steps else []
    )
    return (list(compress(all_comm, comm_kept)), list(compress(all_kinds, comm_kept)),
            list(compress(comm_s, comm_kept)), list(compress(comm_e, comm_kept)), compute, step_reports)


def _cpu_analysis(trace, steps, thread, role):  # type: ignore[no-untyped-def]
    """CPU mode: (label rows, their kinds, comm starts, comm ends, compute, blocked, step reports)."""
    compute, blocked, wait_s, wait_e, wait_rows, op_starts = _cpu_timeline(trace, thread, role)
    keep = iv.union(compute, blocked)
    rows = role(_CPU_COMM_ROLES)
    s, e = trace.start_us, trace.end_us
    label_rows = rows + wait_rows
    cs = [s[r] for r in rows] + wait_s
    ce = [e[r] for r in rows] + wait_e
    kinds = _kinds_of(trace, label_rows)
    sets: dict[str | None, Any] = {None: _split(cs, ce, compute, keep)}
    for kind, (ks, ke) in _by_label(kinds, cs, ce).items():
        sets[kind] = _split(ks, ke, compute, keep)
    step_reports = _steps_cpu(steps, compute, sets, op_starts) if steps else []
    return label_rows, kinds, cs, ce, compute, blocked, step_reports


def analyze_trace(trace: RankTrace, *, rank: int | None = None) -> RankReport:
    """Exposed/hidden communication of one rank (see the module docstring for the rules)."""
    gpu_comm = trace.rows_of(gpu_roles={"gpu_comm"})
    gpu_compute = trace.rows_of(gpu_roles={"gpu_compute"})
    not_compute = _cat_flags(trace, _NOT_COMPUTE_CATS)
    if gpu_compute and any(not_compute):
        cat = trace.cat_id
        gpu_compute = [r for r in gpu_compute if not not_compute[cat[r]]]
    mode = "gpu" if gpu_comm or gpu_compute else "cpu"
    role_rows: dict[frozenset[str], list[int]] = {}

    def role(roles: Iterable[str]) -> list[int]:
        """CPU rows whose name has one of the ``cpu_role``s (computed once per set of roles)."""
        key = frozenset(roles)
        if key not in role_rows:
            role_rows[key] = trace.rows_of(cpu_roles=key)
        return role_rows[key]

    step_rows = trace.rows_of(steps=True)
    thread = _training_thread(trace, step_rows)
    steps = _steps(trace, thread, step_rows)
    launches = _launches(trace)
    blocked: iv.Intervals | None = None  # GPU mode: exposed is comm outside compute
    if mode == "gpu":
        rows, kinds, cs, ce, compute, step_reports = _gpu_analysis(trace, steps, gpu_comm, gpu_compute, role,
                                                                   launches)
    else:
        rows, kinds, cs, ce, compute, blocked, step_reports = _cpu_analysis(trace, steps, thread, role)
    keep = None if blocked is None else iv.union(compute, blocked)
    groups = _process_groups(trace)
    pgs, tiers = _labels(trace, rows, groups)
    comm_all, exposed_all, hidden_all = _split(cs, ce, compute, keep)
    total = _totals(comm_all, exposed_all, hidden_all)
    span = max(trace.end_us) if trace.num_events else 0.0  # minus min(start_us), which is 0.0: the origin
    return RankReport(
        rank=rank if rank is not None else (trace.rank if trace.rank is not None else 0),
        path=trace.path,
        mode=mode,
        span_us=span,
        compute_us=iv.total_us(compute),
        comm_us=total.comm_us,
        exposed_us=total.exposed_us,
        hidden_us=total.hidden_us,
        by_kind=_grouped(kinds, cs, ce, compute, keep),
        by_process_group=_grouped(pgs, cs, ce, compute, keep),
        by_tier=_grouped(tiers, cs, ce, compute, keep),
        steps=tuple(step_reports),
        process_groups=groups,
        collectives=rank_collectives(trace, rows, kinds, cs, ce, compute, pgs=pgs, groups=groups, steps=steps,
                                     anchor_us=_launch_us(trace, rows, launches)[0], blocked=blocked,
                                     comm=comm_all),  # for crossrank and the timeline
    )
