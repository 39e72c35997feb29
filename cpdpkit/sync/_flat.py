"""The optimizer's parameters as views into one flat buffer per (dtype, device), and SlowMo.

Keeping parameters as views of a contiguous buffer (what torch's ``average_parameters`` and
FSDP's flat parameters also do) lets a reconciliation all-reduce the parameters in place,
with no flatten/unflatten copies, and lets SlowMo run as a few vector operations per
param-group slice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from cpdpkit.errors import ConfigError

__all__ = ["FlatSegment", "FlatParameters"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass
class FlatSegment:
    """Parameters of one dtype and device, laid out contiguously in ``flat``.

    ``group_slices`` holds ``(param_group_index, start, stop)``: each param group's
    parameters of this dtype form one contiguous range (layout follows param-group order).
    ``storage`` is ``flat`` plus, for the first segment only, the slots the period controller
    reduces with the parameters (``flat`` is then a view of its front).
    """

    storage: torch.Tensor
    flat: torch.Tensor
    params: list[torch.Tensor]
    offsets: list[int]
    group_slices: list[tuple[int, int, int]] = field(default_factory=list)
    anchor: torch.Tensor | None = None
    slow_momentum: torch.Tensor | None = None


def _check_param(p: torch.Tensor, where: str) -> None:
    if p.layout is not torch.strided or p.is_sparse:
        raise ConfigError(
            f"{where} has layout {p.layout}: PeriodicSyncOptimizer supports dense (strided) "
            "parameters only"
        )
    if not p.is_floating_point():
        raise ConfigError(f"{where} has dtype {p.dtype}: only floating-point parameters train")


class FlatParameters:
    """Re-binds each parameter's ``.data`` to a slice of a flat buffer (see module docstring)."""

    def __init__(self, param_groups: Sequence[dict], *, anchor_dtype: torch.dtype | None,
                 stats_slots: int = 0) -> None:
        by_key: dict[tuple[torch.dtype, torch.device], list[tuple[int, torch.Tensor]]] = {}
        for gi, group in enumerate(param_groups):
            for pi, p in enumerate(group["params"]):
                _check_param(p, f"parameter {pi} of param group {gi} (shape {tuple(p.shape)})")
                by_key.setdefault((p.dtype, p.device), []).append((gi, p))
        self.anchor_dtype = anchor_dtype
        self.segments: list[FlatSegment] = []
        for (dtype, device), entries in by_key.items():
            numel = sum(p.numel() for _, p in entries)
            extra = stats_slots if not self.segments else 0
            storage = torch.empty(numel + extra, dtype=dtype, device=device)
            seg = FlatSegment(storage, storage[:numel], [], [])
            offset = 0
            for gi, p in entries:
                seg.params.append(p)
                seg.offsets.append(offset)
                if seg.group_slices and seg.group_slices[-1][0] == gi:
                    seg.group_slices[-1] = (gi, seg.group_slices[-1][1], offset + p.numel())
                else:
                    seg.group_slices.append((gi, offset, offset + p.numel()))
                offset += p.numel()
            self.segments.append(seg)
        self.rebind()

    @property
    def flats(self) -> list[torch.Tensor]:
        return [seg.flat for seg in self.segments]

    @property
    def storages(self) -> list[torch.Tensor]:
        """What a reconciliation reduces: the flats, the first with the controller's slots."""
        return [seg.storage for seg in self.segments]

    def stats_slots(self, storages: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """The controller's slots at the end of the first storage (or of a copy of it)."""
        first = (storages or self.storages)[0]
        return first[self.segments[0].flat.numel():]

    @property
    def numel(self) -> int:
        return sum(seg.flat.numel() for seg in self.segments)

    @property
    def nbytes(self) -> int:
        return sum(seg.flat.numel() * seg.flat.element_size() for seg in self.segments)

    def layout(self) -> list[list[int]]:
        """Numels per segment, to check that a checkpoint fits this model."""
        return [[p.numel() for p in seg.params] for seg in self.segments]

    @torch.no_grad()
    def rebind(self) -> None:
        """Copy every parameter into its slot and make ``.data`` a view of it."""
        for seg in self.segments:
            for p, off in zip(seg.params, seg.offsets):
                view = seg.flat[off : off + p.numel()].view_as(p)
                if p.data_ptr() != view.data_ptr():
                    view.copy_(p.data)
                    p.data = view
        self._bound = [(p, p.data_ptr()) for seg in self.segments for p in seg.params]

    def ensure_bound(self) -> None:
        """Re-bind parameters whose ``.data`` was replaced (e.g. ``load_state_dict(assign=True)``)."""
        if any(p.data_ptr() != ptr for p, ptr in self._bound):
            self.rebind()

    def low_precision_params(self) -> list[torch.dtype]:
        return [seg.flat.dtype for seg in self.segments if seg.flat.dtype in _LOW_PRECISION]

    # -- SlowMo ------------------------------------------------------------------------
    @torch.no_grad()
    def capture_anchor(self) -> None:
        """x0 <- current parameters; the slow momentum starts (or stays) at zero."""
        for seg in self.segments:
            dtype = self.anchor_dtype or seg.flat.dtype
            seg.anchor = seg.flat.to(dtype=dtype, copy=True)
            if seg.slow_momentum is None:
                seg.slow_momentum = torch.zeros_like(seg.anchor)

    @torch.no_grad()
    def slowmo_update(self, param_groups: Sequence[dict], *, beta: float, alpha: float,
                      averages: Sequence[torch.Tensor] | None = None) -> None:
        """SlowMo on averaged parameters x̄, per param-group lr γ.

        u <- β·u + (x0 - x̄)/γ;  x0 <- x0 - α·γ·u;  x̄ <- x0.
        ``averages`` hold x̄ per segment (default: the flats themselves, i.e. the parameters);
        they are overwritten with the new x0. A group whose lr is 0 cannot scale by 1/γ: its
        anchor becomes x̄ and u is kept.
        """
        targets = averages if averages is not None else self.flats
        for seg, target in zip(self.segments, targets):
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
                x0.sub_(u, alpha=alpha * gamma)
                xbar.copy_(x0)

    @torch.no_grad()
    def set_anchor(self, values: Sequence[torch.Tensor]) -> None:
        """x0 <- ``values`` (per segment); for ``localsgd`` under ``period="auto"`` the anchor
        is only the divergence's reference: the last reconciled parameters."""
        for seg, v in zip(self.segments, values):
            assert seg.anchor is not None
            seg.anchor.copy_(v[: seg.flat.numel()])

    @torch.no_grad()
    def progress_sq(self, current: Sequence[torch.Tensor] | None = None) -> tuple[float, float]:
        """``(‖x − x0‖², ‖x‖²)`` in float64, summed over segments (``current``: default the flats)."""
        current = current if current is not None else self.flats
        dist_sq, norm_sq = 0.0, 0.0
        for seg, x in zip(self.segments, current):
            assert seg.anchor is not None
            x = x[: seg.flat.numel()].double()
            dist_sq += float(torch.sub(x, seg.anchor.double()).square().sum())
            norm_sq += float(x.square().sum())
        return dist_sq, norm_sq

    def slowmo_state(self) -> dict[str, list[torch.Tensor] | None]:
        if self.segments and self.segments[0].anchor is None:
            return {"anchor": None, "slow_momentum": None}
        return {
            "anchor": [seg.anchor.clone() for seg in self.segments],  # type: ignore[union-attr]
            "slow_momentum": [seg.slow_momentum.clone() for seg in self.segments],  # type: ignore[union-attr]
        }

    @torch.no_grad()
    def load_slowmo_state(self, state: dict[str, list[torch.Tensor] | None]) -> None:
        anchors, moms = state.get("anchor"), state.get("slow_momentum")
        if anchors is None or moms is None:
            for seg in self.segments:
                seg.anchor = seg.slow_momentum = None
            return
        if len(anchors) != len(self.segments) or len(moms) != len(self.segments):
            raise ConfigError(
                f"checkpoint has {len(anchors)} SlowMo segments, this model has "
                f"{len(self.segments)}: load a checkpoint saved with the same model and optimizer"
            )
        for seg, a, u in zip(self.segments, anchors, moms):
            seg.anchor = a.to(device=seg.flat.device, copy=True)
            seg.slow_momentum = u.to(device=seg.flat.device, copy=True)
