"""A reconciliation's parameter average, blocking or overlapped, and what the controller measures.

Blocking (``overlap_steps == 0``): the parameters are averaged in place inside the
reconciliation's ``step()``, then SlowMo's outer update (``slowmo``, ``cpdp``), then the buffer
and optimizer-state policies.

Overlapped (``overlap_steps = τ >= 1``): at reconciliation step ``n`` the parameters ``x_n``
(and the buffers) are copied and their average launched asynchronously; training goes on. At
step ``a = min(n + τ, next reconciliation)``, after that step's inner update, the average ``x̄_n``
is waited for and applied, keeping the local progress made meanwhile:

    x̃ = x̄_n                                   (localsgd)
    u ← β·u + (x0 − x̄_n)/γ;  x0 ← x0 − α·γ·u;  x̃ = x0   (slowmo, cpdp: SlowMo against the anchor
                                                          of that reconciliation)
    x ← x̃ + (x − x_n)

Buffers follow the same rule (``b ← b̃ + (b − b_n)``, ``b̃`` their average or the first rank's);
``optimizer_state="reset"`` clears the state when the result is applied. ``cpdp``'s gradient
all-reduce is not delayed: the reconciliation's own inner step consumes it (launched from
backward hooks, it overlaps backward as DDP's does). With ``period="auto"`` the controller's
three numbers ride in the same all-reduce (:mod:`cpdpkit.sync.period_control`).

``cpdp_order="average-then-step"`` (:mod:`cpdpkit.sync.config`): the average runs at the end of
step ``n - 1`` (blocking) or is launched there (τ >= 1); the schedule marks ``n`` as the
reconciliation, and :attr:`Reconciler.sync_step` names the step that then all-reduces its gradients:
``n`` when blocking, ``a + 1`` when the late average is applied at the end of step ``a``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import record_function

from cpdpkit.labels import SYNC
from cpdpkit.sync._codec import ErrorFeedback
from cpdpkit.sync._comm import Communicator
from cpdpkit.sync._flat import SegmentedParameters
from cpdpkit.sync._outer import OuterStep
from cpdpkit.sync._state_policies import flatten_by_dtype, sync_buffers, sync_optimizer_state, write_back
from cpdpkit.sync.config import SyncConfig
from cpdpkit.sync.period_control import PeriodDecision, PeriodSchedule, decide_period, divergence

__all__ = ["Reconciler", "STATS_SLOTS"]

STATS_SLOTS = 3  # exposed seconds, compute seconds per step, ‖x − x0‖²


@dataclass
class _BufferExchange:
    """Buffers launched with an overlapped average: per group ``(tensors, sent, launched, op)``."""

    groups: list[tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, str]] = field(default_factory=list)

    @classmethod
    def plan(cls, buffers: Sequence[torch.Tensor], policy: str) -> _BufferExchange:
        out = cls()
        if policy == "local" or not buffers:
            return out
        by_op: list[tuple[list[torch.Tensor], str]] = []
        if policy == "broadcast":
            by_op.append((list(buffers), "broadcast"))
        else:
            by_op.append(([b for b in buffers if b.is_floating_point()], "average"))
            by_op.append(([b for b in buffers if not b.is_floating_point()], "broadcast"))
        for tensors, op in by_op:
            for flat, ts in flatten_by_dtype(tensors):
                out.groups.append((ts, flat, flat.clone(), op))
        return out

    def launch(self, comm: Communicator, cap_bytes: int) -> list[dist.Work]:
        works = []
        for _, sent, _, op in self.groups:
            launch = comm.average_async if op == "average" else comm.broadcast_async
            works += launch([sent], cap_bytes)
        return works

    @torch.no_grad()
    def apply(self) -> None:
        for tensors, sent, launched, _ in self.groups:
            current = torch.cat([t.reshape(-1) for t in tensors])
            write_back(torch.add(sent, torch.sub(current, launched)), tensors)


@dataclass
class _InFlight:
    """An overlapped reconciliation: ``sent`` becomes the means once ``works`` are done."""

    launch_step: int
    apply_step: int
    measured_period: int  # steps the controller's numbers cover (period="auto")
    sent: list[torch.Tensor]
    launched: list[torch.Tensor]
    buffers: _BufferExchange
    works: list[dist.Work]
    gathered: list[torch.Tensor] | None = None  # compressed: every rank's codes, decoded into sent once waited


class Reconciler:
    """Runs reconciliations for :class:`~cpdpkit.sync.PeriodicSyncOptimizer` (module docstring).

    ``blocked_s`` returns the optimizer's total blocked seconds so far (the controller's ``S``).
    With ``fragments``, one Reconciler runs per fragment (``flat`` is that fragment, ``offset`` its
    stagger, ``buffers`` empty but for fragment 0's). ``on_reconciled(step, values)``, if given, sees
    each reconciliation's result (per flat segment, after SlowMo's update; the same on every rank)
    before it is applied: the replica check.
    """

    def __init__(self, config: SyncConfig, flat: SegmentedParameters, *, slow: Communicator,
                 world: Communicator, optimizer: torch.optim.Optimizer, params: list[torch.Tensor],
                 buffers: Callable[[], list[torch.Tensor]], blocked_s: Callable[[], float],
                 on_reconciled: Callable[[int, list[torch.Tensor]], None] | None = None, offset: int = 0) -> None:
        self.config, self._flat, self._slow, self._world = config, flat, slow, world
        self._optim, self._params, self._buffers, self._blocked_s = optimizer, params, buffers, blocked_s
        self._on_reconciled = on_reconciled
        self.schedule = PeriodSchedule(config, offset)  # offset: a fragment's stagger (cpdpkit.sync._fragments)
        self.decisions: list[PeriodDecision] = []
        self.in_flight: _InFlight | None = None
        # average-then-step: the schedule's reconciliation is the step after the average's
        self._ahead = 1 if config.averages_first else 0
        self.sync_step: int | None = None  # average-then-step: the step whose gradients are all-reduced
        self.outer = OuterStep(config, flat)
        self.feedback = (ErrorFeedback(config.compression, [seg.numel for seg in flat.segments])
                         if config.compression != "none" else None)
        self.mark(0)

    # -- measuring (period="auto") ---------------------------------------------------------
    def mark(self, step: int) -> None:
        """Start the controller's next measurement: now, at ``step``."""
        self._mark = (step, time.perf_counter(), self._blocked_s())

    def _write_measurement(self, step: int, slots: torch.Tensor) -> int:
        """This rank's ``S``, ``C`` and ``‖x − x0‖²`` into ``slots``; the steps they cover.

        The mark then moves to ``step``."""
        mark_step, mark_t, mark_blocked = self._mark
        exposed = self._blocked_s() - mark_blocked
        steps = max(1, step - mark_step)
        compute = max(0.0, (time.perf_counter() - mark_t) - exposed) / steps
        progress_sq, _ = self._flat.progress_sq()
        slots.copy_(torch.tensor([exposed, compute, progress_sq], dtype=torch.float64))
        self.mark(step)
        return steps

    def _decide(self, step: int, measured_period: int, reduced: Sequence[torch.Tensor]) -> None:
        exposed, compute, mean_progress_sq = (float(v) for v in self._flat.stats_slots(reduced))
        progress_of_average_sq, average_sq = self._flat.progress_sq(reduced)
        decision = decide_period(
            self.config, step=step, period=measured_period, exposed_s=exposed,
            compute_s_per_step=compute,
            divergence=divergence(mean_progress_sq, progress_of_average_sq, average_sq),
            previous=self.decisions[-1] if self.decisions else None,
        )
        with record_function(SYNC.PERIOD_DECISION.label + decision.label_details):
            self.decisions.append(decision)
            self.schedule.decided(decision.period)

    # -- blocking ------------------------------------------------------------------------------
    @torch.no_grad()
    def reconcile_blocking(self, n: int) -> None:
        cfg = self.config
        self._flat.ensure_bound()
        values = self._flat.pack(slots=cfg.auto)  # the parameters themselves, or a packed copy of the shards
        if cfg.auto:
            measured = self._write_measurement(n, self._flat.stats_slots(values))
        with self._slow.blocking(SYNC.PARAM_AVERAGE):
            if self.feedback is None:
                self._slow.average_(values, cfg.bucket_cap_bytes)
            else:
                self._compressed_average_(self._flat.fronts(values))
        if cfg.auto:
            self._decide(n, measured, values)
        averages = self._flat.fronts(values)
        self._outer_update(averages)
        if self._on_reconciled is not None:
            self._on_reconciled(n, averages)
        self._flat.unpack(values)
        sync_buffers(self._world, self._buffers(), cfg.buffers, cfg.bucket_cap_bytes)
        sync_optimizer_state(self._slow, self._optim, self._params, cfg.optimizer_state,
                             cfg.bucket_cap_bytes)
        self.schedule.reconciled(n + self._ahead)
        self.sync_step = n + 1

    def _compressed_average_(self, fronts: list[torch.Tensor]) -> None:
        """``fronts`` (this rank's parameters, per segment) become ``x0 − mean_j decode(code_j)``: each
        rank's pseudo-gradient ``x0 − x`` plus its residual, encoded, all-gathered as bytes, decoded in
        rank order (:mod:`cpdpkit.sync._codec`)."""
        gathered, works = self._launch_codes(fronts)
        for work in works:
            self._slow.wait(work)
        self._decode_mean_(fronts, gathered)

    def _launch_codes(self, fronts: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[dist.Work]]:
        """Encode ``x0 − x + r`` per segment and launch the all-gathers of every rank's codes."""
        assert self.feedback is not None
        anchors = [seg.anchor for seg in self._flat.segments]
        codes = self.feedback.encode([torch.sub(x0, x.to(x0.dtype)) for x0, x in zip(anchors, fronts)])
        gathered = [torch.empty(self._slow.size * c.numel(), dtype=torch.uint8) for c in codes]
        return gathered, [self._slow.all_gather_async(out, c) for out, c in zip(gathered, codes)]

    def _decode_mean_(self, fronts: list[torch.Tensor], gathered: list[torch.Tensor]) -> None:
        """``fronts`` ← ``x0 − mean_j decode(code_j)`` (the anchor of this reconciliation)."""
        assert self.feedback is not None
        for x, seg, mean in zip(fronts, self._flat.segments, self.feedback.mean_of(gathered, self._slow.size)):
            x.copy_(torch.sub(seg.anchor, mean.to(seg.anchor.dtype)))  # type: ignore[arg-type]

    def _outer_update(self, averages: list[torch.Tensor]) -> None:
        """The outer step on ``averages`` (they become x0), or for localsgd-auto the new reference."""
        cfg = self.config
        if cfg.uses_slowmo:
            with record_function(SYNC.SLOWMO_UPDATE.label):  # local arithmetic, not communication
                self.outer.update(self._optim.param_groups, averages)
        elif cfg.auto or self.feedback is not None:  # the next compressed payload's reference too
            self._flat.set_anchor(averages)

    # -- overlapped ----------------------------------------------------------------------------
    @torch.no_grad()
    def launch(self, n: int) -> None:
        """Copy the parameters and buffers and launch their average (step ``n`` reconciles)."""
        cfg = self.config
        self.apply(n)  # at most one in flight: a result still pending is applied first
        self._flat.ensure_bound()
        sent = self._flat.snapshot(slots=cfg.auto)
        launched = [f.clone() for f in self._flat.fronts(sent)]
        measured = self._write_measurement(n, self._flat.stats_slots(sent)) if cfg.auto else 0
        buffers = _BufferExchange.plan(self._buffers(), cfg.buffers)
        gathered = None
        with record_function(SYNC.PARAM_AVERAGE_LAUNCH.label):  # the launch only: it runs on
            if self.feedback is None:
                works = self._slow.average_async(sent, cfg.bucket_cap_bytes)
            else:
                gathered, works = self._launch_codes(self._flat.fronts(sent))
            works += buffers.launch(self._world, cfg.bucket_cap_bytes)
        self.in_flight = _InFlight(n, n + cfg.overlap_steps, measured, sent, launched, buffers, works, gathered)
        self.schedule.reconciled(n + self._ahead)

    def wait(self) -> None:
        """Wait for the average in flight (it stays pending until :meth:`apply`)."""
        flight = self.in_flight
        if flight is None or not flight.works:
            return
        with self._slow.blocking(SYNC.PARAM_AVERAGE_WAIT):
            for work in flight.works:
                self._slow.wait(work)
        flight.works = []
        if flight.gathered is not None:  # compressed: the codes become the average now
            self._decode_mean_(self._flat.fronts(flight.sent), flight.gathered)
            flight.gathered = None

    @torch.no_grad()
    def apply(self, n: int, *, force: bool = True) -> None:
        """Apply the average in flight (``force=False``: only if it is due at step ``n``)."""
        flight = self.in_flight
        if flight is None or (not force and n < flight.apply_step):
            return
        self.wait()
        if self.config.auto:
            self._decide(flight.launch_step, flight.measured_period, flight.sent)
        self._outer_update(flight.sent)
        if self._on_reconciled is not None:
            self._on_reconciled(flight.launch_step, flight.sent)
        self._flat.ensure_bound()
        current = self._flat.pack()
        for flat, reconciled, launched in zip(current, flight.sent, flight.launched):
            flat.copy_(torch.add(reconciled[: flat.numel()], torch.sub(flat, launched)))
        self._flat.unpack(current)
        flight.buffers.apply()
        if self.config.optimizer_state == "reset":
            self._optim.state.clear()
        self.in_flight = None
        self.sync_step = n + 1

    # -- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The schedule, the decisions and a reconciliation in flight (waited for first)."""
        self.wait()
        flight = self.in_flight
        pending = None
        if flight is not None:
            pending = {
                "launch_step": flight.launch_step, "apply_step": flight.apply_step,
                "measured_period": flight.measured_period,
                "sent": [t.clone() for t in flight.sent], "launched": [t.clone() for t in flight.launched],
                "buffers": [[sent.clone(), launched.clone()] for _, sent, launched, _ in flight.buffers.groups],
            }
        return {"schedule": self.schedule.state_dict(), "sync_step": self.sync_step, "outer": self.outer.state_dict(),
                "decisions": [d.to_dict() for d in self.decisions], "in_flight": pending,
                "residuals": None if self.feedback is None else self.feedback.state()}

    def load_state_dict(self, own: dict[str, Any], step: int) -> None:
        self.schedule.load_state_dict(own.get("schedule"), step)
        self.decisions = [PeriodDecision.from_dict(d) for d in own.get("decisions", [])]
        self.outer.load_state_dict(own.get("outer"))
        if self.feedback is not None:
            self.feedback.load(own.get("residuals"))
        sync_step = own.get("sync_step")
        self.sync_step = None if sync_step is None else int(sync_step)
        pending = own.get("in_flight")
        self.in_flight = None
        if pending is not None:
            buffers = _BufferExchange.plan(self._buffers(), self.config.buffers)
            buffers.groups = [(ts, sent.clone(), launched.clone(), op) for (ts, _, _, op), (sent, launched)
                              in zip(buffers.groups, pending["buffers"], strict=True)]
            self.in_flight = _InFlight(int(pending["launch_step"]), int(pending["apply_step"]),
                                       int(pending["measured_period"]),
                                       [t.clone() for t in pending["sent"]],
                                       [t.clone() for t in pending["launched"]], buffers, [])
        self.mark(step)
