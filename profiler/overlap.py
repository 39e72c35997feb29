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

import re
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from cpdpkit.profiler import intervals as iv
from cpdpkit.profiler.classify import parse_emu_label
from cpdpkit.profiler.crossrank import rank_collectives
from cpdpkit.profiler.report import CommTotals, RankReport, StepReport
from cpdpkit.profiler.trace import RankTrace

__all__ = ["analyze_trace", "PARTIAL_STEP_FRACTION", "IDLE_GAP_US", "WAIT_SLACK_US"]

_STEP = re.compile(r"^ProfilerStep#(\d+)$")
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


def _per_name(trace: RankTrace, attr: str, values: Iterable[str]) -> np.ndarray:
    wanted = set(values)
    return np.array([getattr(c, attr) in wanted for c in trace.name_classes], dtype=bool)[trace.name_id]


def _cat_in(trace: RankTrace, cats: frozenset[str]) -> np.ndarray:
    return np.array([c.lower() in cats for c in trace.cats], dtype=bool)[trace.cat_id]


def _is_cpu_op(trace: RankTrace) -> np.ndarray:
    return _cat_in(trace, _CPU_OP_CATS)


def _training_thread(trace: RankTrace, on_cpu: np.ndarray, step_rows: np.ndarray) -> int | None:
    if step_rows.size:
        return int(Counter(trace.thread_id[step_rows].tolist()).most_common(1)[0][0])
    rows = np.flatnonzero(on_cpu & _is_cpu_op(trace))
    if not rows.size:
        return None
    busy = np.bincount(trace.thread_id[rows], weights=trace.end_us[rows] - trace.start_us[rows])
    for tid, label in trace.thread_names.items():
        if "gloo" in label and tid < busy.size:
            busy[tid] = -1.0
    return int(np.argmax(busy))


def _steps(trace: RankTrace, thread: int | None, step_rows: np.ndarray) -> list[tuple[int, float, float]]:
    rows = step_rows if thread is None else step_rows[trace.thread_id[step_rows] == thread]
    steps = [
        (int(_STEP.match(trace.names[trace.name_id[r]]).group(1)), float(trace.start_us[r]), float(trace.end_us[r]))
        for r in rows
    ]
    return sorted(steps, key=lambda s: s[1])


def _kinds_of(trace: RankTrace, rows: np.ndarray) -> np.ndarray:
    if not rows.size:
        return np.empty(0, dtype=object)
    gpu_table = np.array([c.kind or "other" for c in trace.name_classes], dtype=object)
    cpu_table = np.array([c.cpu_kind or "other" for c in trace.name_classes], dtype=object)
    nid = trace.name_id[rows]
    kinds = np.where(trace.stream[rows] != -1, gpu_table[nid], cpu_table[nid])
    for i, row in enumerate(rows.tolist()):
        if row in trace.comm_kind:
            kinds[i] = trace.comm_kind[row]
    return kinds


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


def _labels(trace: RankTrace, rows: np.ndarray, groups: Mapping[str, Mapping[str, Any]]) -> tuple[list, list]:
    """Process group and tier of each comm row (``None`` when unknown)."""
    by_ranks: dict[tuple[int, ...], list[str]] = {}
    for name, pg in groups.items():
        if pg.get("ranks"):
            by_ranks.setdefault(tuple(sorted(pg["ranks"])), []).append(name)
    only = next(iter(groups)) if len(groups) == 1 else None
    pgs: list[str | None] = []
    tiers: list[str | None] = []
    emu_cache: dict[int, Any] = {}
    for row in rows.tolist():
        nid = int(trace.name_id[row])
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


def _split(starts: np.ndarray, ends: np.ndarray, compute: iv.Intervals,
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


def _grouped(labels: Iterable[Any], starts: np.ndarray, ends: np.ndarray,
             compute: iv.Intervals, keep: iv.Intervals | None = None) -> dict[str, CommTotals]:
    labels = np.asarray(list(labels), dtype=object)
    out: dict[str, CommTotals] = {}
    for label in sorted({x for x in labels.tolist() if x is not None}):
        sel = labels == label
        out[str(label)] = _totals(*_split(starts[sel], ends[sel], compute, keep))
    return out


def _launch_us(trace: RankTrace, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """CPU start of the event that launched each row (same correlation id), and whether one
    was found; rows without a launch keep their own start."""
    anchor = trace.start_us[rows].copy()
    found = np.zeros(rows.size, dtype=bool)
    launches = np.flatnonzero((trace.stream == -1) & (trace.correlation >= 0))
    if launches.size and rows.size:
        corr = trace.correlation[launches]
        order = np.argsort(corr, kind="stable")
        corr_sorted, launch_us = corr[order], trace.start_us[launches][order]
        want = trace.correlation[rows]
        pos = np.clip(np.searchsorted(corr_sorted, want), 0, corr_sorted.size - 1)
        found = (want >= 0) & (corr_sorted[pos] == want)
        anchor[found] = launch_us[pos[found]]
    return anchor, found


def _step_index(anchor: np.ndarray, steps: list[tuple[int, float, float]]) -> np.ndarray:
    starts = np.array([s[1] for s in steps])
    ends = np.array([s[2] for s in steps])
    idx = np.searchsorted(starts, anchor, side="right") - 1
    inside = (idx >= 0) & (anchor <= ends[np.clip(idx, 0, None)])
    return np.where(inside, idx, -1)


def _hta_kept(
    trace: RankTrace, rows: np.ndarray, anchor: np.ndarray, found: np.ndarray, steps: list[tuple[int, float, float]]
) -> np.ndarray:
    """HTA's filter: with two or more steps, keep GPU work launched before the last step
    starts (the last step may be cut off by the end of the trace); CPU rows by their start.
    ``anchor``/``found`` are :func:`_launch_us` of ``rows``."""
    if len(steps) < 2:
        return np.ones(rows.size, dtype=bool)
    on_cpu = trace.stream[rows] == -1
    return (found | on_cpu) & (anchor < steps[-1][1])


def _mark_partial(steps: list[tuple[int, float, float]]) -> list[bool]:
    partial = [False] * len(steps)
    if len(steps) >= 2:
        durations = [e - s for _, s, e in steps]
        if durations[-1] < PARTIAL_STEP_FRACTION * float(np.median(durations[:-1])):
            partial[-1] = True
    return partial


def _steps_cpu(
    steps: list[tuple[int, float, float]],
    compute: iv.Intervals,
    sets: Mapping[str | None, tuple[iv.Intervals, iv.Intervals, iv.Intervals]],
    op_starts: np.ndarray,
) -> list[StepReport]:
    lo = np.array([s[1] for s in steps])
    hi = np.array([s[2] for s in steps])
    measured = {key: [iv.measure_in_windows(x, lo, hi) for x in triple] for key, triple in sets.items()}
    compute_us = iv.measure_in_windows(compute, lo, hi)
    out = []
    for k, ((num, start, end), partial) in enumerate(zip(steps, _mark_partial(steps))):
        by_kind = {
            key: CommTotals(*(float(m[k]) for m in ms)) for key, ms in measured.items() if key and ms[0][k] > 0
        }
        c, e, h = (float(m[k]) for m in measured[None])
        # a last step in which the training thread starts no op is the one left open at exit
        no_ops = np.searchsorted(op_starts, end, "right") == np.searchsorted(op_starts, start, "left")
        empty = bool(k == len(steps) - 1 and len(steps) > 1 and c == 0 and no_ops)
        out.append(StepReport(num, end - start, float(compute_us[k]), c, e, h, by_kind, partial or empty))
    return out


def _steps_gpu(
    steps: list[tuple[int, float, float]],
    compute_rows: np.ndarray,
    compute_anchor: np.ndarray,
    comm_rows: np.ndarray,
    comm_anchor: np.ndarray,
    kinds: np.ndarray,
    s_all: np.ndarray,
    e_all: np.ndarray,
) -> list[StepReport]:
    comm_step = _step_index(comm_anchor, steps)
    compute_step = _step_index(compute_anchor, steps)
    compute = iv.merge(s_all[compute_rows], e_all[compute_rows])
    partial = [False] * (len(steps) - 1) + [len(steps) >= 2]
    out = []
    for k, (num, start, end) in enumerate(steps):
        rows = comm_rows[comm_step == k]
        mine = compute_rows[compute_step == k]
        total = _totals(*_split(s_all[rows], e_all[rows], compute))
        by_kind = _grouped(kinds[comm_step == k], s_all[rows], e_all[rows], compute)
        out.append(StepReport(num, end - start, iv.total_us(iv.merge(s_all[mine], e_all[mine])),
                              total.comm_us, total.exposed_us, total.hidden_us, by_kind, partial[k]))
    return out


def _waits(g0: np.ndarray, g1: np.ndarray, done: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Which of the training thread's gaps ``[g0, g1]`` are waits, where each wait ends, and the
    index in ``done`` (sorted completion times of in-flight collectives) of the first collective
    completing in it (the one the wait is attributed to). A gap is a wait when a collective
    completes in it (or up to ``WAIT_SLACK_US`` after it); the wait lasts until the last such
    completion plus ``WAIT_SLACK_US`` (the waiter's wake-up), at most to the gap's end."""
    if not done.size:
        return np.zeros(g0.size, dtype=bool), g1, np.zeros(g0.size, dtype=np.int64)
    k = np.minimum(np.searchsorted(done, g0, side="left"), done.size - 1)
    completes = (done[k] >= g0) & (done[k] <= g1 + WAIT_SLACK_US)
    last = done[np.maximum(np.searchsorted(done, g1 + WAIT_SLACK_US, side="right") - 1, 0)]
    return completes, np.where(completes, np.clip(last + WAIT_SLACK_US, g0, g1), g1), k


def _cpu_timeline(
    trace: RankTrace, thread: int | None, role: Any
) -> tuple[iv.Intervals, iv.Intervals, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The training thread's compute, its blocked time (call sites, sync phases and waits),
    its waits as ``(starts, ends, collective_rows)``, and the sorted start times of its ops.

    Compute is the thread's ops plus the short gaps between them (Python and dispatch
    overhead), minus its communication call sites and sync phases. A gap in which a
    collective completes starts with a wait (:func:`_waits`); what is left of it, and any
    other gap, is overhead when shorter than ``IDLE_GAP_US``, else idle (neither compute nor
    blocked)."""
    none = np.empty(0, dtype=np.float64)
    if thread is None:
        return iv.EMPTY, iv.EMPTY, none, none, np.empty(0, dtype=np.int64), none
    on_thread = (trace.thread_id == thread) & (trace.stream == -1)
    is_op = _is_cpu_op(trace)
    ops = np.flatnonzero(on_thread & is_op & role({"cpu"}))
    comm_here = np.flatnonzero(on_thread & role(_TRAINING_COMM_ROLES))
    s, e = trace.start_us, trace.end_us
    blocked = iv.merge(s[comm_here], e[comm_here])
    # the thread's other events (ProfilerStep#N, record_function labels) show it running at
    # their edges: zero-length marks split gaps there, so a wait ends at its step's end
    marks = np.flatnonzero(on_thread & ~is_op)
    edges = np.concatenate([s[marks], e[marks]])
    active = iv.union(iv.merge(s[ops], e[ops]), blocked, iv.merge(edges, edges))
    wait_s, wait_e, wait_rows = none, none, np.empty(0, dtype=np.int64)
    if len(active) > 1:
        g0, g1 = active.ends[:-1], active.starts[1:]
        inflight = np.flatnonzero(role(_INFLIGHT_ROLES))
        inflight = inflight[np.argsort(e[inflight], kind="stable")]
        completes, wait_end, k = _waits(g0, g1, e[inflight])
        # a thread waiting on an emulated collective sleeps to its modeled end itself, while
        # the emulator's event may close milliseconds later (its Python helper thread waits
        # for the GIL): a wait whose gap ends inside an emulated link lasts to the gap's end
        emu = np.flatnonzero(role({"emu"}))
        links = iv.merge(s[emu], e[emu])
        at = np.searchsorted(links.starts, g1, side="left") - 1
        in_link = (at >= 0) & (links.ends[np.maximum(at, 0)] > g1) if len(links) else np.zeros(g1.size, dtype=bool)
        wait_end = np.where(completes & in_link, g1, wait_end)
        # what follows a wait's end in its gap (Python after wait(): freeing tensors, the next
        # call; or the thread descheduled) is a gap of its own: overhead when short, else idle
        rest = np.where(completes, wait_end, g0)
        overhead = (g1 - rest < IDLE_GAP_US) & (g1 > rest)
        active = iv.union(active, iv.Intervals(rest[overhead], g1[overhead]))
        wait_s, wait_e, wait_rows = g0[completes], wait_end[completes], inflight[k[completes]]
    op_starts = np.sort(np.concatenate([s[ops], s[comm_here]]))
    blocked = iv.union(blocked, iv.merge(wait_s, wait_e))
    return iv.subtract(active, blocked), blocked, wait_s, wait_e, wait_rows, op_starts


def _whole_us(trace: RankTrace, on_gpu: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Round GPU events inward to whole microseconds (start up, end down), as HTA does for
    nanosecond-resolution traces, whose adjacent kernels on one stream can overlap slightly."""
    start, end = trace.start_us.copy(), trace.end_us.copy()
    o = trace.origin_us
    start[on_gpu] = np.ceil(start[on_gpu] + o) - o
    end[on_gpu] = np.maximum(np.floor(end[on_gpu] + o) - o, start[on_gpu])
    return start, end


def _gpu_analysis(trace, steps, on_gpu, gpu_comm, gpu_compute, role):  # type: ignore[no-untyped-def]
    """GPU mode: (label rows, their kinds, comm starts, comm ends, compute, step reports)."""
    s_all, e_all = _whole_us(trace, on_gpu)
    all_comm = np.flatnonzero(gpu_comm | role({"emu"}))
    all_compute = np.flatnonzero(gpu_compute)
    comm_anchor, comm_found = _launch_us(trace, all_comm)
    compute_anchor, compute_found = _launch_us(trace, all_compute)
    all_kinds = _kinds_of(trace, all_comm)
    comm_kept = _hta_kept(trace, all_comm, comm_anchor, comm_found, steps)
    comm_rows = all_comm[comm_kept]
    compute_rows = all_compute[_hta_kept(trace, all_compute, compute_anchor, compute_found, steps)]
    compute = iv.merge(s_all[compute_rows], e_all[compute_rows])
    step_reports = (
        _steps_gpu(steps, all_compute, compute_anchor, all_comm, comm_anchor, all_kinds, s_all, e_all) if steps else []
    )
    return comm_rows, all_kinds[comm_kept], s_all[comm_rows], e_all[comm_rows], compute, step_reports


def _cpu_analysis(trace, steps, thread, role):  # type: ignore[no-untyped-def]
    """CPU mode: (label rows, their kinds, comm starts, comm ends, compute, blocked, step reports)."""
    compute, blocked, wait_s, wait_e, wait_rows, op_starts = _cpu_timeline(trace, thread, role)
    keep = iv.union(compute, blocked)
    rows = np.flatnonzero(role(_CPU_COMM_ROLES))
    label_rows = np.concatenate([rows, wait_rows])
    cs = np.concatenate([trace.start_us[rows], wait_s])
    ce = np.concatenate([trace.end_us[rows], wait_e])
    kinds = _kinds_of(trace, label_rows)
    sets: dict[str | None, Any] = {None: _split(cs, ce, compute, keep)}
    for kind in sorted(set(kinds.tolist())):
        sel = kinds == kind
        sets[kind] = _split(cs[sel], ce[sel], compute, keep)
    step_reports = _steps_cpu(steps, compute, sets, op_starts) if steps else []
    return label_rows, kinds, cs, ce, compute, blocked, step_reports


def analyze_trace(trace: RankTrace, *, rank: int | None = None) -> RankReport:
    """Exposed/hidden communication of one rank (see the module docstring for the rules)."""
    on_gpu = trace.stream != -1
    gpu_comm = on_gpu & _per_name(trace, "gpu_role", {"gpu_comm"})
    gpu_compute = on_gpu & _per_name(trace, "gpu_role", {"gpu_compute"}) & ~_cat_in(trace, _NOT_COMPUTE_CATS)
    mode = "gpu" if (gpu_comm.any() or gpu_compute.any()) else "cpu"

    def role(roles: Iterable[str]) -> np.ndarray:
        return ~on_gpu & _per_name(trace, "cpu_role", roles)

    is_step = np.array([bool(_STEP.match(n)) for n in trace.names], dtype=bool)[trace.name_id]
    step_rows = np.flatnonzero(is_step & ~on_gpu)
    thread = _training_thread(trace, ~on_gpu, step_rows)
    steps = _steps(trace, thread, step_rows)
    blocked: iv.Intervals | None = None  # GPU mode: exposed is comm outside compute
    if mode == "gpu":
        rows, kinds, cs, ce, compute, step_reports = _gpu_analysis(trace, steps, on_gpu, gpu_comm, gpu_compute, role)
    else:
        rows, kinds, cs, ce, compute, blocked, step_reports = _cpu_analysis(trace, steps, thread, role)
    keep = None if blocked is None else iv.union(compute, blocked)
    groups = _process_groups(trace)
    pgs, tiers = _labels(trace, rows, groups)
    total = _totals(*_split(cs, ce, compute, keep))
    span = float(trace.end_us.max() - trace.start_us.min()) if trace.num_events else 0.0
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
                                     anchor_us=_launch_us(trace, rows)[0], blocked=blocked),  # for crossrank
    )
