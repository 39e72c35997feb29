"""The optimizer's parameters as segments of flat vectors, and SlowMo on them.

A *segment* holds the parameters of one dtype and device, laid out one after another in one
flat vector; a reconciliation averages whole segments and runs SlowMo as a few vector operations
per param-group slice. Two layouts share that arithmetic (:class:`SegmentedParameters`):

* :class:`FlatParameters` (plain and DDP modules): each parameter's ``.data`` is re-bound to a
  view of one contiguous buffer per segment (what torch's ``average_parameters`` and FSDP's flat
  parameters also do), so a reconciliation all-reduces the parameters in place, with no copies.
* :class:`~cpdpkit.sync._sharded.ShardedParameters` (FSDP2 modules): the segment is this rank's
  local shards, packed into a buffer for a reconciliation and unpacked after it (FSDP2 owns the
  shards' storage), and SlowMo's anchor and momentum are shard-sized.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from cpdpkit.errors import ConfigError

__all__ = ["Segment", "SegmentedParameters", "FlatParameters", "build_segments"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass(kw_only=True)
class Segment:
    """Parameters of one dtype and device, at ``offsets`` in one flat vector of ``numel`` elements.

    ``shapes`` are the shapes the flat vector holds (a sharded parameter's local shape).
    ``group_slices`` holds ``(param_group_index, start, stop)``: each param group's parameters of
    this dtype form one contiguous range (layout follows param-group order). ``storage`` and
    ``flat`` exist for :class:`FlatParameters` only: ``storage`` is ``flat`` plus, for the first
    segment, the slots the period controller reduces with the parameters.
    """

    dtype: torch.dtype
    device: torch.device
    params: list[torch.Tensor] = field(default_factory=list)
    shapes: list[torch.Size] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    numel: int = 0
    group_slices: list[tuple[int, int, int]] = field(default_factory=list)
    anchor: torch.Tensor | None = None
    slow_momentum: torch.Tensor | None = None
    storage: torch.Tensor | None = None
    flat: torch.Tensor | None = None


def _check_param(p: torch.Tensor, where: str) -> None:
    if p.layout is not torch.strided or p.is_sparse:
        raise ConfigError(
            f"{where} has layout {p.layout}: PeriodicSyncOptimizer supports dense (strided) "
            "parameters only"
        )
    if not p.is_floating_point():
        raise ConfigError(f"{where} has dtype {p.dtype}: only floating-point parameters train")


def build_segments(param_groups: Sequence[dict], shape_of: Callable[[torch.Tensor], torch.Size]) -> list[Segment]:
    """One segment per (dtype, device), in param-group order; ``shape_of(p)`` is what p contributes."""
    by_key: dict[tuple[torch.dtype, torch.device], Segment] = {}
    for gi, group in enumerate(param_groups):
        for pi, p in enumerate(group["params"]):
            _check_param(p, f"parameter {pi} of param group {gi} (shape {tuple(p.shape)})")
            seg = by_key.setdefault((p.dtype, p.device), Segment(dtype=p.dtype, device=p.device))
            shape = shape_of(p)
            n = shape.numel()
            seg.params.append(p)
            seg.shapes.append(shape)
            seg.offsets.append(seg.numel)
            if seg.group_slices and seg.group_slices[-1][0] == gi:
                seg.group_slices[-1] = (gi, seg.group_slices[-1][1], seg.numel + n)
            else:
                seg.group_slices.append((gi, seg.numel, seg.numel + n))
            seg.numel += n
    return list(by_key.values())


class SegmentedParameters:
    """SlowMo and the bookkeeping both layouts share; subclasses say where the values live.

    ``pack(slots=...)`` returns one flat tensor per segment holding the parameters' current values
    (for ``slots=True`` the first one ends with the controller's slots); ``unpack(values)`` writes
    such tensors back into the parameters. ``snapshot`` is a ``pack`` the caller owns.
    """

    segments: list[Segment]

    def __init__(self, segments: list[Segment], *, anchor_dtype: torch.dtype | None, stats_slots: int) -> None:
        self.segments = segments
        self.anchor_dtype = anchor_dtype
        self.num_slots = stats_slots

    # -- where the values live (subclasses) ---------------------------------------------------
    def pack(self, *, slots: bool = False) -> list[torch.Tensor]:
        raise NotImplementedError

    def unpack(self, values: Sequence[torch.Tensor]) -> None:
        raise NotImplementedError

    def snapshot(self, *, slots: bool = False) -> list[torch.Tensor]:
        raise NotImplementedError

    def ensure_bound(self) -> None:
        """Re-attach parameters whose storage was replaced since the last call (if the layout needs it)."""

    # -- bookkeeping ------------------------------------------------------------------------------
    def fronts(self, values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each packed tensor without the controller's slots (views)."""
        return [v[: seg.numel] for seg, v in zip(self.segments, values)]

    def stats_slots(self, values: Sequence[torch.Tensor]) -> torch.Tensor:
        """The controller's slots at the end of the first packed tensor (packed with ``slots=True``)."""
        return values[0][self.segments[0].numel:]

    def _extra(self, i: int, slots: bool) -> int:
        return self.num_slots if slots and i == 0 else 0

    @property
    def numel(self) -> int:
        return sum(seg.numel for seg in self.segments)

    @property
    def nbytes(self) -> int:
        return sum(seg.numel * seg.dtype.itemsize for seg in self.segments)

    def layout(self) -> list[list[int]]:
        """Numels per segment, to check that a checkpoint fits this model."""
        return [[shape.numel() for shape in seg.shapes] for seg in self.segments]

    def low_precision_params(self) -> list[torch.dtype]:
        return [seg.dtype for seg in self.segments if seg.dtype in _LOW_PRECISION]

    # -- SlowMo ------------------------------------------------------------------------------------
    @torch.no_grad()
    def capture_anchor(self, *, momentum: bool = True) -> None:
        """x0 <- current parameters; the slow momentum starts (or stays) at zero. ``momentum=False``
        (another outer optimizer, or ``localsgd``'s controller reference): no slow momentum is allocated."""
        for seg, values in zip(self.segments, self.pack()):
            seg.anchor = values.to(dtype=self.anchor_dtype or seg.dtype, copy=True)
            if momentum and seg.slow_momentum is None:
                seg.slow_momentum = torch.zeros_like(seg.anchor)

    @torch.no_grad()
    def slowmo_update(self, param_groups: Sequence[dict], *, beta: float, alpha: float,
                      averages: Sequence[torch.Tensor]) -> None:
        """SlowMo on averaged parameters x̄ (one tensor per segment), per param-group lr γ.

        u <- β·u + (x0 - x̄)/γ;  x0 <- x0 - α·γ·u;  x̄ <- x0. ``averages`` are overwritten with
        the new x0. With β = 0 and α = 1 (SlowMo off) x0 <- x̄ exactly, as the formula says in
        exact arithmetic. A group whose lr is 0 cannot scale by 1/γ: its anchor becomes x̄ and
        u is kept.
        """
        identity = beta == 0.0 and alpha == 1.0
        for seg, target in zip(self.segments, averages):
            assert seg.anchor is not None and seg.slow_momentum is not None
            for gi, start, stop in seg.group_slices:
                gamma = float(param_groups[gi]["lr"])
                x0 = seg.anchor[start:stop]
                u = seg.slow_momentum[start:stop]
                xbar = target[start:stop]
                if gamma == 0.0:
                    x0.copy_(xbar)
                    continue
                delta = torch.sub(x0, xbar.to(x0.dtype))
                delta.div_(gamma)
                u.mul_(beta).add_(delta)
                if identity:
                    x0.copy_(xbar)
                    continue
                x0.sub_(u, alpha=alpha * gamma)
                xbar.copy_(x0)

    @torch.no_grad()
    def set_anchor(self, values: Sequence[torch.Tensor]) -> None:
        """x0 <- ``values`` (per segment); for ``localsgd`` under ``period="auto"`` the anchor
        is only the divergence's reference: the last reconciled parameters."""
        for seg, v in zip(self.segments, values):
            assert seg.anchor is not None
            seg.anchor.copy_(v[: seg.numel])

    @torch.no_grad()
    def progress_sq(self, current: Sequence[torch.Tensor] | None = None) -> tuple[float, float]:
        """``(‖x − x0‖², ‖x‖²)`` in float64, summed over segments (``current``: default the parameters)."""
        current = current if current is not None else self.pack()
        dist_sq, norm_sq = 0.0, 0.0
        for seg, x in zip(self.segments, current):
            assert seg.anchor is not None
            x = x[: seg.numel].double()
            dist_sq += float(torch.sub(x, seg.anchor.double()).square().sum())
            norm_sq += float(x.square().sum())
        return dist_sq, norm_sq

    def slowmo_state(self) -> dict[str, list[torch.Tensor] | None]:
        if self.segments and self.segments[0].anchor is None:
            return {"anchor": None, "slow_momentum": None}
        moms = [seg.slow_momentum for seg in self.segments]
        return {
            "anchor": [seg.anchor.clone() for seg in self.segments],  # type: ignore[union-attr]
            "slow_momentum": None if any(u is None for u in moms) else [u.clone() for u in moms],  # type: ignore[union-attr]
        }

    def slowmo_bytes(self) -> int:
        """Bytes SlowMo's anchor and slow momentum take on this rank (0 before they exist)."""
        return sum(t.numel() * t.element_size() for seg in self.segments
                   for t in (seg.anchor, seg.slow_momentum) if t is not None)

    @torch.no_grad()
    def load_slowmo_state(self, state: dict[str, list[torch.Tensor] | None]) -> None:
        anchors, moms = state.get("anchor"), state.get("slow_momentum")
        if anchors is None:
            for seg in self.segments:
                seg.anchor = seg.slow_momentum = None
            return
        if moms is None:  # saved without a slow momentum (capture_anchor(momentum=False))
            moms = [None] * len(self.segments)
        if len(anchors) != len(self.segments) or len(moms) != len(self.segments):
            raise ConfigError(
                f"checkpoint has {len(anchors)} SlowMo segments, this model has "
                f"{len(self.segments)}: load a checkpoint saved with the same model and optimizer"
            )
        for seg, a, u in zip(self.segments, anchors, moms):
            seg.anchor = a.to(device=seg.device, copy=True)
            seg.slow_momentum = None if u is None else u.to(device=seg.device, copy=True)


class FlatParameters(SegmentedParameters):
    """Re-binds each parameter's ``.data`` to a slice of a flat buffer (see module docstring)."""

    def __init__(self, param_groups: Sequence[dict], *, anchor_dtype: torch.dtype | None,
                 stats_slots: int = 0) -> None:
        super().__init__(build_segments(param_groups, lambda p: p.shape), anchor_dtype=anchor_dtype,
                         stats_slots=stats_slots)
        for i, seg in enumerate(self.segments):
            seg.storage = torch.empty(seg.numel + self._extra(i, True), dtype=seg.dtype, device=seg.device)
            seg.flat = seg.storage[: seg.numel]
        self.rebind()

    @property
    def flats(self) -> list[torch.Tensor]:
        return [seg.flat for seg in self.segments]  # type: ignore[misc]

    def pack(self, *, slots: bool = False) -> list[torch.Tensor]:
        """The live buffers themselves (writing them writes the parameters)."""
        return [seg.storage if slots else seg.flat for seg in self.segments]  # type: ignore[misc]

    def snapshot(self, *, slots: bool = False) -> list[torch.Tensor]:
        return [t.clone() for t in self.pack(slots=slots)]

    @torch.no_grad()
    def unpack(self, values: Sequence[torch.Tensor]) -> None:
        for seg, v in zip(self.segments, values):
            if v.data_ptr() != seg.flat.data_ptr():  # type: ignore[union-attr]
                seg.flat.copy_(v[: seg.numel])  # type: ignore[union-attr]

    @torch.no_grad()
    def rebind(self) -> None:
        """Copy every parameter into its slot and make ``.data`` a view of it."""
        for seg in self.segments:
            for p, off in zip(seg.params, seg.offsets):
                view = seg.flat[off : off + p.numel()].view_as(p)  # type: ignore[index]
                if p.data_ptr() != view.data_ptr():
                    view.copy_(p.data)
                    p.data = view
        self._bound = [(p, p.data_ptr()) for seg in self.segments for p in seg.params]

    def ensure_bound(self) -> None:
        """Re-bind parameters whose ``.data`` was replaced (e.g. ``load_state_dict(assign=True)``)."""
        if any(p.data_ptr() != ptr for p, ptr in self._bound):
            self.rebind()
