"""Streaming reconciliation (``fragments=F``): the parameters in F fragments, each reconciled on its own.

Streaming DiLoCo's idea (Douillard et al. 2025; torchft's ``StreamingDiLoCo``): instead of sending the
whole model every K steps, split it into F fragments of about equal bytes and reconcile fragment ``f`` every
K steps at an offset ``⌊f·K/F⌋``, so that about 1/F of a reconciliation crosses the slow link per step, and
(with ``overlap_steps``) each fragment's exchange overlaps the following local steps.

:func:`split_params` cuts the flat layout (its segments end to end) into F contiguous ranges of equal bytes
(to the element): a fragment may cut a parameter in two, so one large layer does not make one fragment
large. :class:`FragmentParameters` is one fragment seen as a :class:`~cpdpkit.sync._flat.SegmentedParameters`:
its segments are element ranges of the whole layout's segments (views into the same flat buffers for a plain
module), with their own anchor and SlowMo momentum, so a :class:`~cpdpkit.sync._reconcile.Reconciler` runs on
it unchanged (its own schedule, outer optimizer state and error-feedback residuals). Its gradient buckets hold
the same pieces of the gradients (:class:`~cpdpkit.sync._grad_buckets.GradientBuckets`' ``ranges``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cpdpkit.errors import ConfigError
from cpdpkit.sync._flat import Segment, SegmentedParameters

__all__ = ["split_params", "check_fragments", "FragmentParameters", "fragments_of"]


def split_params(sizes: Sequence[int], fragments: int) -> list[list[tuple[int, int, int]]]:
    """Fragments of the flat layout: ``sizes`` is ``(numel, itemsize)`` per segment; fragment ``f`` is the
    byte range ``[round(f·T/F), round((f+1)·T/F))`` of the segments laid end to end (T bytes in all), as
    ``(segment, start, stop)`` element ranges (a fragment may cut a parameter, or span segments)."""
    total = sum(n * size for n, size in sizes)
    cuts = [round(f * total / fragments) for f in range(fragments + 1)]
    out: list[list[tuple[int, int, int]]] = [[] for _ in range(fragments)]
    seg_lo = 0
    for si, (n, size) in enumerate(sizes):
        seg_hi = seg_lo + n * size
        for f in range(fragments):
            lo, hi = max(cuts[f], seg_lo), min(cuts[f + 1], seg_hi)
            a = (lo - seg_lo) // size
            b = n if hi == seg_hi else (hi - seg_lo) // size
            if lo < hi and a < b:
                out[f].append((si, a, b))
        seg_lo = seg_hi
    return out


def check_fragments(fragments: int, num_params: int) -> None:
    """More fragments than parameters is refused (one line, before any collective)."""
    if fragments > num_params:
        raise ConfigError(f"fragments={fragments} but the optimizer holds {num_params} parameter(s): pass "
                          f"fragments <= {num_params} (each fragment is about 1/F of the parameters' bytes)")


def fragments_of(flat: SegmentedParameters, fragments: int, *, wrapped: str | None) -> list[SegmentedParameters]:
    """The layout itself, or ``fragments`` slices of it; ``wrapped`` names a model that is not a plain module
    (``"a DDP-wrapped"``, ``"an FSDP2"``, ``"an executor's"``): fragments are refused for it (before any collective)."""
    if fragments == 1:
        return [flat]
    if wrapped is not None:
        raise ConfigError(f"fragments={fragments} with {wrapped} model: streaming fragments need a plain module "
                          "(its gradients in cpdpkit's own buckets); pass the plain module, or fragments=1")
    return list(FragmentParameters.split(flat, fragments))


class FragmentParameters(SegmentedParameters):
    """The parameters of one fragment, as element ranges of ``parent``'s segments (module docstring).

    ``views`` holds ``(segment index, start, stop)`` element ranges of the parent's segments. Each segment
    here lists the parameters it covers with ``shapes`` the 1-D size of the piece it holds and ``starts``
    where that piece begins in the flattened parameter. ``pack()`` slices the parent's pack (live views for a
    plain module: writing them writes the parameters); ``unpack()`` writes the slices back through the parent.
    """

    def __init__(self, parent: SegmentedParameters, views: Sequence[tuple[int, int, int]]) -> None:
        segments, self._views, self.starts = [], list(views), []
        for si, a, b in views:
            ps = parent.segments[si]
            params, shapes, offsets, starts = [], [], [], []
            for p, shape, off in zip(ps.params, ps.shapes, ps.offsets):
                lo, hi = max(off, a), min(off + shape.numel(), b)
                if lo < hi:
                    params.append(p)
                    shapes.append(torch.Size([hi - lo]))
                    offsets.append(lo - a)
                    starts.append(lo - off)
            slices = [(gi, max(lo, a) - a, min(hi, b) - a) for gi, lo, hi in ps.group_slices if lo < b and hi > a]
            segments.append(Segment(dtype=ps.dtype, device=ps.device, params=params, shapes=shapes, offsets=offsets,
                                    numel=b - a, group_slices=slices))
            self.starts.append(starts)
        super().__init__(segments, anchor_dtype=parent.anchor_dtype, stats_slots=0)
        self._parent = parent

    @classmethod
    def split(cls, parent: SegmentedParameters, fragments: int) -> list[FragmentParameters]:
        """``parent``'s parameters in ``fragments`` fragments of about equal bytes (:func:`split_params`)."""
        check_fragments(fragments, sum(len(seg.params) for seg in parent.segments))
        ranges = split_params([(seg.numel, seg.dtype.itemsize) for seg in parent.segments], fragments)
        return [cls(parent, views) for views in ranges]

    def pieces(self) -> list[tuple[torch.Tensor, int, int]]:
        """``(parameter, start, stop)`` in its flattened elements, for every piece this fragment holds, in order."""
        return [(p, start, start + shape.numel()) for seg, starts in zip(self.segments, self.starts)
                for p, shape, start in zip(seg.params, seg.shapes, starts)]

    def pack(self, *, slots: bool = False) -> list[torch.Tensor]:
        values = self._parent.pack()
        return [values[si][a:b] for si, a, b in self._views]

    def snapshot(self, *, slots: bool = False) -> list[torch.Tensor]:
        return [t.clone() for t in self.pack()]

    @torch.no_grad()
    def unpack(self, values: Sequence[torch.Tensor]) -> None:
        current = self._parent.pack()
        for (si, a, b), v in zip(self._views, values, strict=True):
            target = current[si][a:b]
            if v.data_ptr() != target.data_ptr():
                target.copy_(v[: b - a])
        self._parent.unpack(current)

    def ensure_bound(self) -> None:
        self._parent.ensure_bound()
