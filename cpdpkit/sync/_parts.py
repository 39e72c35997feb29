"""The per-fragment dispatch of :class:`~cpdpkit.sync.PeriodicSyncOptimizer`: one :class:`Part` per fragment.

Without ``fragments`` there is one part, the whole model; with ``fragments=F`` (:mod:`cpdpkit.sync._fragments`)
there are F, each with its own :class:`~cpdpkit.sync._reconcile.Reconciler` (schedule, staggered by
:func:`fragment_offset`), gradient buckets and compressed-gradient residuals; :meth:`Parts.build` makes them.
:class:`Parts` answers, per part, the schedule questions the optimizer's step asks (does step ``n`` all-reduce
this part's gradients, does it end with this part's average), and holds the checkpoint's per-fragment layout
(the one part's state at the top level, or each fragment's in ``"fragments"``). It also names the values a
replica check compares (:func:`named_values`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from cpdpkit.sync._flat import SegmentedParameters
from cpdpkit.sync._fragments import FragmentParameters
from cpdpkit.sync._reconcile import Reconciler
from cpdpkit.sync.config import StepKind, SyncConfig

if TYPE_CHECKING:
    from cpdpkit.sync._grad_buckets import GradientBuckets

__all__ = ["Part", "Parts", "fragment_offset", "named_values"]


@dataclass
class Part:
    """One fragment (the whole model without fragments): its parameters, its reconciler, its gradient buckets."""

    flat: SegmentedParameters
    reconciler: Reconciler
    buckets: GradientBuckets | None = None
    # cpdp's compressed gradient residuals (``state()``/``load()``): its buckets', or FSDP2's per-unit ones
    grad_feedback: Any = None

    def gradient_pieces(self) -> tuple[list[torch.Tensor], list[tuple[int, int]]] | None:
        """A fragment's parameters and the element range of each it holds (for its own gradient buckets);
        ``None`` for the whole model."""
        if not isinstance(self.flat, FragmentParameters):
            return None
        pieces = self.flat.pieces()
        return [p for p, _, _ in pieces], [(a, b) for _, a, b in pieces]

    def state_dict(self) -> dict[str, Any]:
        """Its anchor and SlowMo momentum, its reconciler's state, and cpdp's gradient residuals."""
        feedback = self.grad_feedback
        return {**self.flat.slowmo_state(), **self.reconciler.state_dict(),
                "grad_residuals": feedback.state() if feedback is not None else None}

    def load_state_dict(self, own: dict[str, Any], step: int, *, capture: bool | None) -> None:
        """Restore :meth:`state_dict`; ``capture`` (not None): take the anchor now, with a slow momentum when True,
        if the state holds none."""
        self.flat.load_slowmo_state(own)
        if capture is not None and own.get("anchor") is None:
            self.flat.capture_anchor(momentum=capture)
        self.reconciler.load_state_dict(own, step)
        if self.grad_feedback is not None:
            self.grad_feedback.load(own.get("grad_residuals"))


def fragment_offset(f: int, fragments: int, period: int) -> int:
    """Steps by which fragment ``f``'s reconciliations trail fragment 0's: ``⌊f·K/F⌋``."""
    return (f * period) // fragments


class Parts(list[Part]):
    """The optimizer's parts, fragment 0 first, and the schedule questions asked of each (module docstring)."""

    def __init__(self, config: SyncConfig, parts: list[Part]) -> None:
        super().__init__(parts)
        self.config = config

    @classmethod
    def build(cls, config: SyncConfig, flats: Sequence[SegmentedParameters], *,
              buffers: Callable[[], list[torch.Tensor]],
              check: Callable[[SegmentedParameters, int, list[torch.Tensor]], None] | None,
              **reconciler: Any) -> Parts:
        """One part per layout in ``flats`` (the whole model, or its fragments), each with its own
        :class:`~cpdpkit.sync._reconcile.Reconciler` (``reconciler``: its remaining keywords): fragment ``f``
        staggered by :func:`fragment_offset`, the buffers exchanged with fragment 0's only, and ``check(flat,
        step, values)`` (the replica check, or None) after each of its reconciliations."""
        parts = []
        for index, flat in enumerate(flats):
            offset = fragment_offset(index, config.fragments, int(config.period)) if config.fragments > 1 else 0
            on_reconciled = None if check is None else functools.partial(check, flat)
            parts.append(Part(flat, Reconciler(config, flat, buffers=buffers if index == 0 else list, offset=offset,
                                               on_reconciled=on_reconciled, **reconciler)))
        return cls(config, parts)

    @property
    def in_flight(self) -> bool:
        """Whether any part's overlapped reconciliation is launched and not yet applied."""
        return any(part.reconciler.in_flight is not None for part in self)

    def syncs_gradients(self, n: int, part: Part | None = None) -> bool:
        """Whether step ``n`` all-reduces (``part``'s, default fragment 0's) gradients across the group."""
        rec = (part or self[0]).reconciler
        kind = rec.schedule.kind(n)
        if self.config.averages_first and kind not in (StepKind.DDP, StepKind.WARMUP):
            return n == rec.sync_step  # the step after an applied average
        return self.config.kind_syncs_gradients(kind)

    def compresses_gradients(self, n: int, part: Part) -> bool:
        """Whether step ``n``'s gradient sync of ``part`` is compressed: ``cpdp``'s synchronous step with a codec
        (warm-up's all-reduces stay fp32, as DDP's; only the periodic phase's exchanges are compressed)."""
        return (self.config.compression != "none" and self.syncs_gradients(n, part)
                and part.reconciler.schedule.kind(n) not in (StepKind.DDP, StepKind.WARMUP))

    def averages_after(self, n: int, part: Part | None = None) -> bool:
        """Whether step ``n`` ends with a (blocking or launched) average (of ``part``, default fragment 0)."""
        schedule = (part or self[0]).reconciler.schedule
        if self.config.averages_first:
            return n > self.config.warmup_steps and schedule.kind(n + 1) is StepKind.RECONCILE
        return schedule.kind(n) is StepKind.RECONCILE

    def begin_periodic_phase(self) -> None:
        """average-then-step: when the first periodic step is a reconciliation (K = 1), the replicas are
        already at a consensus (the broadcast, or warm-up's all-reduced steps): it is synchronous as it is."""
        first = self.config.warmup_steps + 1
        for rec in (part.reconciler for part in self):
            if self.config.averages_first and rec.schedule.kind(first) is StepKind.RECONCILE:
                rec.schedule.reconciled(first)
                rec.sync_step = first

    def state_dict(self, flat: SegmentedParameters) -> dict[str, Any]:
        """The checkpoint's reconciliation state: the one part's at the top level; with fragments, the whole
        layout's (unused) SlowMo keys at the top level and each fragment's state in ``"fragments"``."""
        if len(self) == 1:
            return {**self[0].state_dict(), "fragments": None}
        return {**flat.slowmo_state(), "fragments": [part.state_dict() for part in self]}

    def load_state_dict(self, own: dict[str, Any], step: int, flat: SegmentedParameters, *,
                        capture: bool | None) -> None:
        """Restore :meth:`state_dict` (``capture``: as :meth:`Part.load_state_dict`)."""
        if len(self) == 1:
            self[0].load_state_dict(own, step, capture=capture)
            return
        flat.load_slowmo_state(own)
        for part, saved in zip(self, own["fragments"], strict=True):
            part.load_state_dict(saved, step, capture=capture)


def named_values(flat: SegmentedParameters, values: list[torch.Tensor],
                 param_names: dict[int, str]) -> list[tuple[str, torch.Tensor]]:
    """``(name, its slice of values)`` per parameter, ``values`` laid out as ``flat``'s segments; a fragment's
    piece of a parameter is named with its element range in the flattened parameter."""
    starts = flat.starts if isinstance(flat, FragmentParameters) else None  # a fragment may hold a piece
    out = []
    for si, (seg, v) in enumerate(zip(flat.segments, values)):
        for j, (p, shape, off) in enumerate(zip(seg.params, seg.shapes, seg.offsets)):
            name = param_names[id(p)]
            if starts is not None and shape.numel() != p.numel():
                name += f"[{starts[si][j]}:{starts[si][j] + shape.numel()}] (flattened)"
            out.append((name, v[off : off + shape.numel()].view(shape)))
    return out
